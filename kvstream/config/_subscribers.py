"""Source URLs to subscribers: the built-in factories of the `kvstream.subscribers` entries.

Each factory takes the URL split once (`ParsedURL`), the options not yet
taken (`Options`) and the caller's keyword arguments (`from_seq=`,
`follow=`, ...); where both give a value, the URL's wins unless said
otherwise. A transport module is imported only when its scheme is used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvstream._wire.from_seq import check_from_seq, start_seq
from kvstream.config import make_codec
from kvstream.config._endpoints import client_url, token_from_options
from kvstream.errors import ConfigError

if TYPE_CHECKING:
    from kvstream.config import Options, ParsedURL
    from kvstream.consumers.base import Subscriber
    from kvstream.consumers.socket import SocketSubscriber

__all__ = [
    "broker_options",
    "file_subscriber",
    "nats_subscriber",
    "redis_subscriber",
    "socket_subscriber",
    "zmq_subscriber",
]


def file_subscriber(parsed: ParsedURL, opts: Options, kwargs: dict[str, Any]) -> Subscriber:
    """`file:PATH?follow=true&from_seq=N` -> a `FileSubscriber`."""
    from kvstream.consumers.file import FileSubscriber

    if parsed.path == "-":
        raise ConfigError("reading from standard input is not supported; name a file")
    follow = opts.pop_bool("follow", kwargs.pop("follow", False))
    from_seq = opts.pop_int("from_seq", None)
    if from_seq is not None:
        kwargs["from_seq"] = from_seq
    return FileSubscriber(parsed.path, follow=follow, **kwargs)


def socket_subscriber(parsed: ParsedURL, opts: Options, kwargs: dict[str, Any]) -> SocketSubscriber:
    """`tcp://HOST:PORT` / `unix:PATH` -> a `SocketSubscriber`."""
    from kvstream._wire.socket_protocol import DEFAULT_MAX_MESSAGE_BYTES
    from kvstream._wire.socket_security import client_ssl_context
    from kvstream.consumers.socket import SocketSubscriber

    where = parsed.shown.partition("?")[0]
    kwargs.setdefault("codecs", make_codec)  # the one table of names, plug-ins included
    token = token_from_options(opts, where)
    if token is not None:
        kwargs.setdefault("token", token)
    ca = opts.pop_str("tls_ca")
    use_tls = opts.pop_bool("tls", ca is not None)
    if use_tls and "ssl_context" not in kwargs:
        kwargs["ssl_context"] = client_ssl_context(ca, where=where)
    hostname = opts.pop_str("tls_hostname")
    if hostname is not None:
        kwargs.setdefault("tls_hostname", hostname)
    from_seq = opts.pop_int("from_seq")
    if from_seq is not None:
        kwargs.setdefault("from_seq", from_seq)
    kwargs.setdefault("reconnect", opts.pop_bool("reconnect", True))
    if "snapshots" in opts:
        kwargs.setdefault("snapshots", opts.pop_bool("snapshots"))
    kwargs["heartbeats"] = opts.pop_bool("heartbeats", kwargs.pop("heartbeats", False))
    for key in ("retry_max", "connect_timeout"):
        value = opts.pop_float(key)
        if value is not None:
            kwargs.setdefault(key, value)
    if "max_message_bytes" in opts:
        kwargs.setdefault(
            "max_message_bytes", opts.pop_size("max_message_bytes", DEFAULT_MAX_MESSAGE_BYTES)
        )
    if "follow" in kwargs:
        raise ConfigError(f"{where}: follow= is for files; a socket subscriber always follows")
    if parsed.scheme == "unix":
        if not parsed.path:
            raise ConfigError(f"{where}: expected unix:PATH")
        return SocketSubscriber(path=parsed.path, **kwargs)
    if not parsed.port or parsed.path:
        raise ConfigError(f"{where}: expected tcp://HOST:PORT")
    return SocketSubscriber(host=parsed.host or None, port=parsed.port, **kwargs)


def zmq_subscriber(parsed: ParsedURL, opts: Options, kwargs: dict[str, Any]) -> Subscriber:
    """`zmq+tcp://HOST:PORT?replay=tcp://HOST:PORT2&origin=NAME&topic=...&from_seq=N`.

    A ZMQ publisher is one origin, so a per-origin `from_seq` is looked up
    for that origin (`"*"` covering it when it is not named).
    """
    from kvstream._wire.vllm_zmq import DEFAULT_HWM, endpoint_from_parts, normalize_endpoint
    from kvstream.codecs._dialects import DIALECTS
    from kvstream.codecs.msgpack import MsgpackCodec
    from kvstream.consumers.zmq import (
        DEFAULT_MAX_MESSAGE_BYTES,
        DEFAULT_MAX_REORDER,
        DEFAULT_REPLAY_TIMEOUT,
        JOINS,
        ZmqPublisher,
        ZmqSubscriber,
        default_origin,
    )
    from kvstream.media import MEDIA_POLICIES

    endpoint = endpoint_from_parts(parsed.scheme, parsed.address, parsed.path, parsed.shown)
    replay = opts.pop_str("replay")
    snapshot = opts.pop_str("snapshot")
    bind = opts.pop_bool("bind") if "bind" in opts else None
    origin = opts.pop_str("origin")
    wanted = check_from_seq(kwargs.pop("from_seq", None), parsed.shown.partition("?")[0])
    spec = ZmqPublisher(
        endpoint,
        replay_endpoint=None
        if replay is None
        else normalize_endpoint(replay, f"{parsed.shown}: replay"),
        origin=origin,
        topic=opts.pop_str("topic", "", allow_empty=True) or "",
        from_seq=opts.pop_int("from_seq", start_seq(wanted, origin or default_origin(endpoint))),
        bind=bind,
        join=opts.pop_choice("join", JOINS, "start"),  # type: ignore[arg-type]
        snapshot_endpoint=None
        if snapshot is None
        else normalize_endpoint(snapshot, f"{parsed.shown}: snapshot"),
    )
    kwargs.pop("follow", None)  # a live stream is always followed
    codec = None
    if any(k in opts for k in ("dialect", "media")):
        codec = MsgpackCodec(
            dialect=opts.pop_choice("dialect", DIALECTS, "auto"),  # type: ignore[arg-type]
            media=opts.pop_choice("media", MEDIA_POLICIES, "keep"),  # type: ignore[arg-type]
        )
    return ZmqSubscriber(
        spec,
        codec=codec,
        replay_timeout=opts.pop_float("replay_timeout", DEFAULT_REPLAY_TIMEOUT)
        or DEFAULT_REPLAY_TIMEOUT,
        max_reorder=opts.pop_int("max_reorder", DEFAULT_MAX_REORDER, minimum=1)
        or DEFAULT_MAX_REORDER,
        hwm=opts.pop_int("hwm", DEFAULT_HWM, minimum=0) or 0,
        max_message_bytes=opts.pop_size("max_message_bytes", DEFAULT_MAX_MESSAGE_BYTES),
        heartbeats=opts.pop_bool("heartbeats", bool(kwargs.pop("heartbeats", False))),
        **kwargs,
    )


def broker_options(opts: Options, kwargs: dict[str, Any]) -> dict[str, Any]:
    """`kwargs` with the URL options every broker subscriber takes.

    `codec` (and that codec's own options), `follow`, `from_seq`,
    `connect_timeout`, `snapshots` and `heartbeats`; a URL's value wins over
    the caller's.
    """
    kwargs.setdefault("codecs", make_codec)  # the one table of names, plug-ins included
    codec_name = opts.pop_str("codec")
    if codec_name is not None:
        kwargs["codec"] = make_codec(codec_name, opts)
    kwargs["follow"] = opts.pop_bool("follow", kwargs.pop("follow", True))
    kwargs["from_seq"] = opts.pop_int("from_seq", kwargs.pop("from_seq", None))
    timeout = opts.pop_float("connect_timeout", kwargs.pop("connect_timeout", 5.0))
    kwargs["connect_timeout"] = timeout or 5.0
    if "snapshots" in opts:
        kwargs["snapshots"] = opts.pop_bool("snapshots")
    kwargs["heartbeats"] = opts.pop_bool("heartbeats", kwargs.pop("heartbeats", False))
    return kwargs


def nats_subscriber(parsed: ParsedURL, opts: Options, kwargs: dict[str, Any]) -> Subscriber:
    """`nats://HOST:PORT[/SUBJECT]?durable=NAME&stream=...&deliver=...` -> a `NatsSubscriber`."""
    from kvstream._wire.broker import DEFAULT_SNAPSHOT_STREAM
    from kvstream.consumers.nats import DELIVER, NatsSubscriber

    broker_options(opts, kwargs)
    deliver = opts.pop_str("deliver")
    if deliver is not None and deliver not in DELIVER:
        raise ConfigError(
            f"{parsed.shown}: option deliver: expected one of {', '.join(DELIVER)}, got {deliver!r}"
        )
    return NatsSubscriber(
        client_url(parsed.raw, parsed.scheme, 4222),
        subject=parsed.path or None,
        stream=opts.pop_str("stream") or None,
        durable=opts.pop_str("durable") or None,
        deliver=deliver,  # type: ignore[arg-type]
        fetch_batch=opts.pop_int("fetch_batch", 256, minimum=1) or 256,
        poll_interval=opts.pop_float("poll_interval", 1.0) or 1.0,
        ack_wait=opts.pop_float("ack_wait", 30.0) or 30.0,
        snapshot_stream=opts.pop_str("snapshot_stream") or DEFAULT_SNAPSHOT_STREAM,
        **kwargs,
    )


def redis_subscriber(parsed: ParsedURL, opts: Options, kwargs: dict[str, Any]) -> Subscriber:
    """`redis://HOST:PORT[/STREAM]?group=NAME&consumer=NAME&start=ID` -> a `RedisSubscriber`."""
    from kvstream._wire.broker import DEFAULT_REDIS_STREAM
    from kvstream.consumers.redis import RedisSubscriber

    broker_options(opts, kwargs)
    return RedisSubscriber(
        client_url(parsed.raw, parsed.scheme, 6379),
        stream=parsed.path or DEFAULT_REDIS_STREAM,
        group=opts.pop_str("group") or None,
        consumer=opts.pop_str("consumer") or None,
        start=opts.pop_str("start") or None,
        count=opts.pop_int("count", 256, minimum=1) or 256,
        block=opts.pop_float("block", 1.0) or 1.0,
        db=opts.pop_int("db", 0) or 0,
        **kwargs,
    )
