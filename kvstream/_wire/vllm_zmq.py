"""vLLM's ZMQ KV-event wire: every rule both ends need, in one place, without I/O.

The ZMQ sink (publisher) and the ZMQ subscriber (ingest) both build and read
their frames here, so a rule of the wire is written once. This module imports
no ZMQ: it deals in frames (`bytes`) and endpoints (`str`).

Live stream, one multipart message per batch:

    [topic, seq (8 bytes, big-endian, unsigned), payload (msgpack batch)]

Replay, on its own ROUTER endpoint. A DEALER sends `[b"", start_seq]`; the
ROUTER sees `[identity, b"", start_seq]` and answers every buffered batch with
`seq >= start_seq`, oldest first, then an end marker:

    [identity, b"", topic, seq, payload]        layout "topic" (vLLM v0.26+, TensorRT-LLM)
    [identity, b"", seq, payload]               layout "legacy" (older vLLM, SGLang)
    [identity, b"", b"", ff*8, b""]             end marker, layout "topic"
    [identity, b"", ff*8, b""]                  end marker, layout "legacy"

The DEALER receives the same frames without the identity.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal, NamedTuple, TypeAlias, get_args

from kvstream.errors import ConfigError, DecodeError, shorten

__all__ = [
    "DEFAULT_BUFFER_STEPS",
    "DEFAULT_ENDPOINT",
    "DEFAULT_HWM",
    "DEFAULT_MAX_QUEUE_SIZE",
    "END_SEQ",
    "KVEventsConfig",
    "LiveMessage",
    "ReplayBatch",
    "ReplayLayout",
    "endpoint_from_parts",
    "live_frames",
    "llm_d_topic",
    "normalize_endpoint",
    "offset_endpoint",
    "pack_seq",
    "parse_kv_events_config",
    "parse_live",
    "parse_llm_d_topic",
    "parse_replay_reply",
    "parse_replay_request",
    "replay_end",
    "replay_reply",
    "replay_request",
    "should_bind",
    "unpack_seq",
]

#: vLLM's defaults (`--kv-events-config`).
DEFAULT_ENDPOINT: Final = "tcp://*:5557"
DEFAULT_HWM: Final = 100_000
DEFAULT_BUFFER_STEPS: Final = 10_000
DEFAULT_MAX_QUEUE_SIZE: Final = 100_000

#: The sequence frame that ends a replay.
END_SEQ: Final = b"\xff" * 8
_SEQ_LIMIT: Final = 1 << 64
_END_VALUE: Final = _SEQ_LIMIT - 1

ReplayLayout: TypeAlias = Literal["topic", "legacy"]
REPLAY_LAYOUTS: Final[tuple[str, ...]] = get_args(ReplayLayout)


# -- sequence numbers ---------------------------------------------------------------------


def pack_seq(seq: int) -> bytes:
    """The 8-byte, big-endian, unsigned sequence frame of `seq`."""
    if type(seq) is not int or not 0 <= seq < _END_VALUE:
        raise ValueError(f"seq: expected an int in [0, 2**64 - 1), got {seq!r}")
    return seq.to_bytes(8, "big")


def unpack_seq(frame: bytes, where: str = "seq frame") -> int:
    """The sequence number in an 8-byte frame; `DecodeError` for any other length."""
    if len(frame) != 8:
        raise DecodeError(f"{where}: expected 8 bytes (big-endian), got {len(frame)} bytes")
    return int.from_bytes(frame, "big")


# -- the live stream ------------------------------------------------------------------------


class LiveMessage(NamedTuple):
    """One live message: `[topic, seq, payload]`."""

    topic: bytes
    seq: int
    payload: bytes


def live_frames(topic: bytes, seq_frame: bytes, payload: bytes) -> list[bytes]:
    """The frames of one live message (`seq_frame` from `pack_seq()`)."""
    return [topic, seq_frame, payload]


def parse_live(frames: Sequence[bytes]) -> LiveMessage:
    """Read one live message; [`DecodeError`][kvstream.errors.DecodeError] names what is wrong."""
    if len(frames) != 3:
        raise DecodeError(
            f"live message: expected 3 frames [topic, seq, payload], got {len(frames)}"
        )
    topic, seq_frame, payload = frames
    seq = unpack_seq(seq_frame, "live message: seq frame")
    if seq == _END_VALUE:
        raise DecodeError("live message: seq frame is the replay end marker ff*8")
    return LiveMessage(bytes(topic), seq, bytes(payload))


# -- replay ---------------------------------------------------------------------------------


def replay_request(start_seq: int) -> list[bytes]:
    """What a DEALER sends to ask for every buffered batch with `seq >= start_seq`."""
    return [b"", pack_seq(start_seq)]


def parse_replay_request(frames: Sequence[bytes]) -> tuple[bytes, int]:
    """`(identity, start_seq)` of a request as a ROUTER receives it."""
    if len(frames) != 3:
        raise DecodeError(
            f"replay request: expected 3 frames [identity, b'', start_seq], got {len(frames)}"
        )
    identity, delimiter, seq_frame = frames
    if len(delimiter) != 0:
        raise DecodeError(
            f"replay request: expected an empty delimiter frame, got {len(delimiter)} bytes"
        )
    return bytes(identity), unpack_seq(seq_frame, "replay request: start_seq")


def replay_reply(
    identity: bytes, topic: bytes, seq_frame: bytes, payload: bytes, layout: ReplayLayout
) -> list[bytes]:
    """One replayed batch, as the ROUTER sends it."""
    if layout == "topic":
        return [identity, b"", topic, seq_frame, payload]
    return [identity, b"", seq_frame, payload]


def replay_end(identity: bytes, layout: ReplayLayout) -> list[bytes]:
    """The end marker that closes a replay."""
    if layout == "topic":
        return [identity, b"", b"", END_SEQ, b""]
    return [identity, b"", END_SEQ, b""]


class ReplayBatch(NamedTuple):
    """One replayed batch as a DEALER receives it. `topic` is None in the legacy layout."""

    topic: bytes | None
    seq: int
    payload: bytes


def parse_replay_reply(frames: Sequence[bytes]) -> ReplayBatch | None:
    """Read one replay message (DEALER side, either layout); None for the end marker."""
    n = len(frames)
    if n not in (3, 4):
        raise DecodeError(
            "replay reply: expected [b'', topic, seq, payload] or [b'', seq, payload], "
            f"got {n} frames"
        )
    if len(frames[0]) != 0:
        raise DecodeError(
            f"replay reply: expected an empty delimiter frame first, got {len(frames[0])} bytes"
        )
    topic = bytes(frames[1]) if n == 4 else None
    seq = unpack_seq(frames[-2], "replay reply: seq frame")
    if seq == _END_VALUE:
        return None
    return ReplayBatch(topic, seq, bytes(frames[-1]))


# -- topics ---------------------------------------------------------------------------------


def llm_d_topic(pod_id: str, model: str) -> str:
    """llm-d's topic `kv@<pod-id>@<model>`; refuses parts that are empty or hold `@`."""
    for name, part in (("pod_id", pod_id), ("model", model)):
        if type(part) is not str or not part:
            raise ConfigError(f"llm-d topic: {name}: expected a non-empty str, got {part!r}")
        if "@" in part:
            raise ConfigError(
                f"llm-d topic: {name}: expected no '@' (llm-d splits the topic on '@' "
                f"into exactly 3 parts), got {part!r}"
            )
    return f"kv@{pod_id}@{model}"


def parse_llm_d_topic(topic: str) -> tuple[str, str]:
    """`(pod_id, model)` of an llm-d topic; `DecodeError` unless it has that form."""
    parts = topic.split("@")
    if len(parts) != 3 or parts[0] != "kv" or not parts[1] or not parts[2]:
        raise DecodeError(f"topic: expected kv@<pod-id>@<model>, got {shorten(topic)}")
    return parts[1], parts[2]


# -- endpoints ------------------------------------------------------------------------------

_ZMQ_TRANSPORTS: Final = ("tcp://", "ipc://", "inproc://")


def should_bind(endpoint: str) -> bool:
    """vLLM's publisher rule: bind for `*`, `::`, `ipc://` and `inproc://`, else connect.

    So a central consumer can bind and every engine connect to it.
    """
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def normalize_endpoint(text: str, what: str = "endpoint") -> str:
    """A ZMQ endpoint from `tcp://...`/`ipc://...`/`inproc://...` or `zmq+tcp://...`."""
    if type(text) is not str or not text:
        raise ConfigError(f"{what}: expected a ZMQ endpoint like tcp://HOST:PORT, got {text!r}")
    endpoint = text[4:] if text.startswith("zmq+") else text
    if not endpoint.startswith(_ZMQ_TRANSPORTS):
        raise ConfigError(
            f"{what}: expected a ZMQ endpoint (tcp://HOST:PORT, ipc://PATH or inproc://NAME), "
            f"got {text!r}"
        )
    if endpoint.startswith("tcp://") and not re.search(r":(\d+|\*)$", endpoint):
        raise ConfigError(f"{what}: expected tcp://HOST:PORT with a port, got {text!r}")
    return endpoint


def endpoint_from_parts(scheme: str, address: str, path: str, raw: str) -> str:
    """The ZMQ endpoint of a kvstream URL (`zmq+tcp://H:P` or `zmq+ipc://PATH`)."""
    if scheme == "zmq+tcp":
        if not re.search(r":\d+$", address):
            raise ConfigError(f"{raw}: expected zmq+tcp://HOST:PORT with a port")
        return f"tcp://{address}"
    if scheme == "zmq+ipc":
        if not path:
            raise ConfigError(f"{raw}: expected zmq+ipc://PATH")
        return f"ipc://{path}"
    raise ConfigError(f"{raw}: expected a zmq+tcp:// or zmq+ipc:// URL, got scheme {scheme!r}")


def offset_endpoint(endpoint: str, data_parallel_rank: int | None) -> str:
    """The endpoint of one data-parallel rank, as vLLM derives it.

    TCP: the port plus the rank. `inproc://` and `ipc://`: `_dp<rank>`
    appended to the name (rank 0 keeps the endpoint as given).
    """
    if not data_parallel_rank:
        return endpoint
    if endpoint.startswith("tcp://"):
        head, _, port = endpoint.rpartition(":")
        if not port.isdigit():
            raise ConfigError(
                f"endpoint: cannot offset {endpoint!r} by data-parallel rank "
                f"{data_parallel_rank}: the port is not a number"
            )
        return f"{head}:{int(port) + data_parallel_rank}"
    return f"{endpoint}_dp{data_parallel_rank}"


# -- vLLM's --kv-events-config --------------------------------------------------------------


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's `--kv-events-config` (`KVEventsConfig`), as users already write it."""

    enable_kv_cache_events: bool = True
    publisher: str = "zmq"
    endpoint: str = DEFAULT_ENDPOINT
    replay_endpoint: str | None = None
    buffer_steps: int = DEFAULT_BUFFER_STEPS
    hwm: int = DEFAULT_HWM
    max_queue_size: int = DEFAULT_MAX_QUEUE_SIZE
    topic: str = ""

    @property
    def enabled(self) -> bool:
        """False when the config turns publishing off (`null` publisher or disabled)."""
        return self.enable_kv_cache_events and self.publisher != "null"

    def sink_settings(self, data_parallel_rank: int | None = None) -> dict[str, Any]:
        """Keyword arguments for `ZmqSink` (endpoints offset by the rank, as vLLM does).

        `max_queue_size` bounds the sink's outbox in batches, as it bounds
        vLLM's publisher queue.
        """
        replay = self.replay_endpoint
        return {
            "endpoint": offset_endpoint(self.endpoint, data_parallel_rank),
            "replay_endpoint": None
            if replay is None
            else offset_endpoint(replay, data_parallel_rank),
            "topic": self.topic,
            "hwm": self.hwm,
            "buffer_steps": self.buffer_steps,
            "max_batches": self.max_queue_size,
        }


_CONFIG_TYPES: Final[dict[str, tuple[type, ...]]] = {
    "enable_kv_cache_events": (bool,),
    "publisher": (str,),
    "endpoint": (str,),
    "replay_endpoint": (str, type(None)),
    "buffer_steps": (int,),
    "hwm": (int,),
    "max_queue_size": (int,),
    "topic": (str,),
}


def parse_kv_events_config(config: str | Mapping[str, Any]) -> KVEventsConfig:
    """Parse vLLM's `--kv-events-config` (JSON text or a mapping).

    Keys are vLLM's; an unknown key, a wrong type or a bad endpoint is a
    `ConfigError` naming it. `enable_kv_cache_events` defaults to true
    here (giving the option is the intent to publish); `false` or
    `"publisher": "null"` makes `KVEventsConfig.enabled` false.
    """
    if isinstance(config, str):
        try:
            loaded = json.loads(config)
        except ValueError as exc:
            raise ConfigError(
                f"--kv-events-config: expected JSON, got {config!r:.80} ({exc})"
            ) from None
    else:
        loaded = config
    if not isinstance(loaded, Mapping):
        raise ConfigError(f"--kv-events-config: expected a JSON object, got {shorten(loaded)}")
    values: dict[str, Any] = {}
    for key, value in loaded.items():
        types = _CONFIG_TYPES.get(key)
        if types is None:
            raise ConfigError(
                f"--kv-events-config: unknown key {key!r}; expected some of "
                f"{', '.join(_CONFIG_TYPES)}"
            )
        if type(value) not in types:
            expected = " or ".join("null" if t is type(None) else t.__name__ for t in types)
            raise ConfigError(
                f"--kv-events-config: {key}: expected {expected}, got {shorten(value)}"
            )
        values[key] = value
    publisher = values.get("publisher", "zmq")
    if publisher not in ("zmq", "null"):
        raise ConfigError(
            f"--kv-events-config: publisher: expected 'zmq' or 'null', got {publisher!r}"
        )
    for key in ("buffer_steps", "max_queue_size"):
        if key in values and values[key] < 1:
            raise ConfigError(f"--kv-events-config: {key}: expected >= 1, got {values[key]}")
    if "hwm" in values and values["hwm"] < 0:
        raise ConfigError(
            f"--kv-events-config: hwm: expected >= 0 (0: no limit), got {values['hwm']}"
        )
    if "endpoint" in values:
        values["endpoint"] = normalize_endpoint(values["endpoint"], "--kv-events-config: endpoint")
    if values.get("replay_endpoint") is not None:
        values["replay_endpoint"] = normalize_endpoint(
            values["replay_endpoint"], "--kv-events-config: replay_endpoint"
        )
    return KVEventsConfig(**values)
