"""Sink URLs to sinks: the built-in factories of the `kvstream.sinks` registry entries.

Each factory takes the URL split once (`ParsedURL`), the options not yet
taken (`Options`: it takes the ones it knows) and `common` (policy, limits,
codec and name for the sink's constructor). A transport module is imported
only when its scheme is used, so a missing extra names its install command.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvstream.config._codecs import json_codec, msgpack_codec
from kvstream.config._endpoints import client_url, snapshot_options, token_from_options
from kvstream.errors import ConfigError

if TYPE_CHECKING:
    from kvstream.config import Options, ParsedURL
    from kvstream.sinks.base import Sink
    from kvstream.sinks.socket import SocketSink

__all__ = ["file_sink", "memory_sink", "nats_sink", "redis_sink", "socket_sink", "zmq_sink"]


def file_sink(parsed: ParsedURL, opts: Options, common: dict[str, Any]) -> Sink:
    """`file:PATH` / `file://PATH` / a bare path / `-` -> a `FileSink`."""
    from kvstream.sinks.file import FileSink

    if not parsed.path:
        raise ConfigError(f"{parsed.shown}: expected a file path (file:PATH, or - for stdout)")
    if "codec" not in common and "hash_strings" in opts:
        common["codec"] = json_codec(opts)
    rotation: dict[str, Any] = {
        "rotate_seconds": opts.pop_float("rotate_seconds"),
        "keep": opts.pop_int("keep"),
    }
    if "rotate_bytes" in opts:
        rotation["rotate_bytes"] = opts.pop_size("rotate_bytes", 0)
    if "inline" in opts:
        rotation["inline"] = opts.pop_bool("inline", True)
    try:
        return FileSink(parsed.path, **rotation, **common)
    except ConfigError as exc:
        raise ConfigError(f"{parsed.shown}: {exc}") from None


def memory_sink(parsed: ParsedURL, opts: Options, common: dict[str, Any]) -> Sink:
    """`memory:` -> a `MemorySink` (`delay=` seconds per write)."""
    from kvstream.sinks.memory import MemorySink

    common.setdefault("codec", None)
    return MemorySink(delay=opts.pop_float("delay", 0.0) or 0.0, **common)


def socket_sink(parsed: ParsedURL, opts: Options, common: dict[str, Any]) -> SocketSink:
    """`tcp://HOST:PORT` / `unix:PATH` -> a `SocketSink`."""
    from kvstream._wire.socket_security import server_ssl_context
    from kvstream.sinks.socket import (
        DEFAULT_MAX_PENDING_HELLOS,
        DEFAULT_RING_BYTES,
        DEFAULT_SUBSCRIBER_BYTES,
        SocketSink,
    )
    from kvstream.sinks.socket._fanout import SLOW_POLICIES

    where = parsed.shown.partition("?")[0]
    token = token_from_options(opts, where)
    cert = opts.pop_str("tls_cert")
    key = opts.pop_str("tls_key")
    if key is not None and cert is None:
        raise ConfigError(f"{where}: option tls_key needs tls_cert")
    ssl_context = server_ssl_context(cert, key, where=where) if cert is not None else None
    ring_bytes = opts.pop_size("ring_bytes", DEFAULT_RING_BYTES)
    subscriber_bytes = (
        opts.pop_size("subscriber_bytes", DEFAULT_SUBSCRIBER_BYTES)
        if "subscriber_bytes" in opts
        else None
    )
    kwargs: dict[str, Any] = {
        "token": token,
        "ssl_context": ssl_context,
        "ring_bytes": ring_bytes,
        "subscriber_bytes": subscriber_bytes,
        "slow": opts.pop_choice("slow", SLOW_POLICIES, "disconnect"),
        "max_subscribers": opts.pop_int("max_subscribers", 64, minimum=1),
        "max_pending_hellos": opts.pop_int(
            "max_pending_hellos", DEFAULT_MAX_PENDING_HELLOS, minimum=1
        ),
        "hello_timeout": opts.pop_float("hello_timeout", 10.0),
        "snapshot_timeout": opts.pop_float("snapshot_timeout", 5.0),
        "heartbeat": opts.pop_float("heartbeat"),
    }
    if parsed.scheme == "unix":
        if not parsed.path:
            raise ConfigError(f"{where}: expected unix:PATH (or unix:///absolute/path)")
        return SocketSink(path=parsed.path, **kwargs, **common)
    if parsed.port is None or parsed.path:
        raise ConfigError(f"{where}: expected tcp://HOST:PORT (port 0 picks a free port)")
    return SocketSink(host=parsed.host or None, port=parsed.port, **kwargs, **common)


def zmq_sink(parsed: ParsedURL, opts: Options, common: dict[str, Any]) -> Sink:
    """`zmq+tcp://HOST:PORT?replay=...` / `zmq+ipc://PATH?...` -> a `ZmqSink`."""
    from kvstream._wire.vllm_zmq import (
        DEFAULT_BUFFER_STEPS,
        DEFAULT_HWM,
        REPLAY_LAYOUTS,
        endpoint_from_parts,
        normalize_endpoint,
    )
    from kvstream.sinks.zmq import DEFAULT_REPLAY_HWM, DEFAULT_REPLAY_MAX_BYTES, ZmqSink
    from kvstream.state import DEFAULT_MAX_BYTES

    endpoint = endpoint_from_parts(parsed.scheme, parsed.address, parsed.path, parsed.shown)
    replay = opts.pop_str("replay")
    kwargs: dict[str, Any] = {
        "replay_endpoint": None
        if replay is None
        else normalize_endpoint(replay, f"{parsed.shown}: replay"),
        "topic": opts.pop_str("topic", "", allow_empty=True) or "",
        "model": opts.pop_str("model"),
        "hwm": opts.pop_int("hwm", DEFAULT_HWM, minimum=0),
        "buffer_steps": opts.pop_int("buffer_steps", DEFAULT_BUFFER_STEPS, minimum=1),
        "replay_max_bytes": opts.pop_size("replay_max_bytes", DEFAULT_REPLAY_MAX_BYTES),
        "replay_layout": opts.pop_choice("replay_layout", REPLAY_LAYOUTS, "topic"),
        "replay_timeout": opts.pop_float("replay_timeout", 30.0),
        "replay_hwm": opts.pop_int("replay_hwm", DEFAULT_REPLAY_HWM, minimum=0),
    }
    snapshot = opts.pop_str("snapshot")
    if snapshot is not None:
        kwargs["snapshot_endpoint"] = normalize_endpoint(snapshot, f"{parsed.shown}: snapshot")
    kwargs["snapshot_max_bytes"] = opts.pop_size("snapshot_max_bytes", DEFAULT_MAX_BYTES)
    heartbeat = opts.pop_float("heartbeat")
    if heartbeat is not None:
        kwargs["heartbeat"] = heartbeat
    if "bind" in opts:
        kwargs["bind"] = opts.pop_bool("bind")
    if "codec" not in common:
        common["codec"] = msgpack_codec(opts)
    return ZmqSink(endpoint, **kwargs, **common)


def nats_sink(parsed: ParsedURL, opts: Options, common: dict[str, Any]) -> Sink:
    """`nats://[USER:PASSWORD@]HOST:PORT[/SUBJECT]?stream=...&create=true` -> a `NatsSink`."""
    from kvstream._wire.broker import DEFAULT_SNAPSHOT_STREAM
    from kvstream.sinks.nats import NatsSink

    storage = opts.pop_str("storage")
    if storage is not None and storage not in ("file", "memory"):
        raise ConfigError(
            f"{parsed.shown}: option storage: expected file or memory, got {storage!r}"
        )
    return NatsSink(
        client_url(parsed.raw, parsed.scheme, 4222),
        snapshot_stream=opts.pop_str("snapshot_stream") or DEFAULT_SNAPSHOT_STREAM,
        **snapshot_options(opts),
        subject=parsed.path or None,
        stream=opts.pop_str("stream") or None,
        create=opts.pop_bool("create"),
        storage=storage,  # type: ignore[arg-type]
        max_age=opts.pop_float("max_age"),
        max_msgs=opts.pop_int("max_msgs", minimum=1),
        duplicate_window=opts.pop_float("duplicate_window"),
        ack_timeout=opts.pop_float("ack_timeout", 5.0) or 5.0,
        connect_timeout=opts.pop_float("connect_timeout", 5.0) or 5.0,
        retry_connect=opts.pop_bool("retry_connect", True),
        **common,
    )


def redis_sink(parsed: ParsedURL, opts: Options, common: dict[str, Any]) -> Sink:
    """`redis://[[USER]:PASSWORD@]HOST:PORT[/STREAM]?maxlen=N&db=0` -> a `RedisSink`."""
    from kvstream._wire.broker import DEFAULT_REDIS_STREAM
    from kvstream.sinks.redis import RedisSink

    return RedisSink(
        client_url(parsed.raw, parsed.scheme, 6379),
        stream=parsed.path or DEFAULT_REDIS_STREAM,
        maxlen=opts.pop_int("maxlen", minimum=1),
        db=opts.pop_int("db", 0) or 0,
        connect_timeout=opts.pop_float("connect_timeout", 5.0) or 5.0,
        retry_connect=opts.pop_bool("retry_connect", True),
        dedup_scan=opts.pop_int("dedup_scan", 100_000, minimum=1) or 100_000,
        **snapshot_options(opts),
        **common,
    )
