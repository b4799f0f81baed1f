"""KV cache events and the batch that carries them.

The three event types mirror vLLM's (`vllm/distributed/kv_events.py`) field for
field, so nothing is renamed at the wire, plus what vLLM's "KV events from
connectors" proposal added and its review dropped: every field is keyword-only and
every event has a `metadata` mapping (JSON-safe, `str` keys).

Events are immutable `msgspec.Struct` values. They are validated when they are
made, at about the cost of serializing them: the bulk checks (every token id and
hash an integer in range) run in C through `array`, and everything else is a
handful of type checks.

They are also laid out as vLLM's map events are (the same fields in the same
order, `metadata` last, fields at their default left out), so the msgpack and
JSON codecs encode them as they are, without a wire struct per event. vLLM
writes `lora_id`, `medium` and `lora_name` even when null, and msgspec leaves a
field out only while it equals its default: those fields default to msgspec's
`UNSET`, which the constructor turns into None (the signature shows `UNSET`;
the attribute reads None).
"""

from __future__ import annotations

import math
import operator
from array import array
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Final, TypeAlias

import msgspec
from msgspec.structs import force_setattr

from kvstream.errors import InvalidEventError, InvalidEventTypeError, shorten

__all__ = [
    "MEDIA",
    "WIRE_KEY",
    "AllBlocksCleared",
    "BlockHash",
    "BlockRemoved",
    "BlockStored",
    "EventBatch",
    "KVCacheEvent",
    "validate_metadata",
]

#: A block hash: an integer in `[-2**63, 2**64)` (vLLM's default is the low 64
#: bits of a sha256 digest; SGLang's is signed) or raw digest bytes.
BlockHash: TypeAlias = int | bytes

#: Storage tiers vLLM names in `medium`. Other strings are allowed.
MEDIA: Final = ("GPU", "CPU", "CPU_PINNED", "DISK", "EXTERNAL", "STORAGE")

#: The `metadata` key under which fields of a foreign dialect travel (SGLang's
#: `cache_salt` and `session_id`, a raw `medium` spelling, EAGLE token
#: pairs, fields a later vLLM adds): kvstream's codecs write them back where the
#: target dialect has them. See `kvstream.codecs._dialects`.
WIRE_KEY: Final = "wire"

_HASH_MIN: Final = -(2**63)
_HASH_LIMIT: Final = 2**64
_MAX_DEPTH: Final = 32


def _fail_type(event: str, field: str, value: object, expected: str) -> InvalidEventTypeError:
    return InvalidEventTypeError(
        f"{event}.{field}: expected {expected}, got {shorten(value)} ({type(value).__name__})"
    )


def _fail_value(event: str, field: str, value: object, expected: str) -> InvalidEventError:
    return InvalidEventError(f"{event}.{field}: expected {expected}, got {shorten(value)}")


def _check_hash(event: str, field: str, h: object) -> None:
    if type(h) is int:
        if not _HASH_MIN <= h < _HASH_LIMIT:
            raise _fail_value(event, field, h, "an integer in [-2**63, 2**64)")
    elif type(h) is not bytes:
        raise _fail_type(event, field, h, "an int in [-2**63, 2**64) or bytes")


_INT_ONLY: Final = frozenset((int,))
_INT_LIST: Final = list[int]
_STRICT_CONVERT: Final = msgspec.convert


def _checked_hashes(event: str, hashes: object) -> list[BlockHash]:
    """Validate `block_hashes`; returns the list to store (the caller's list if it is one)."""
    if type(hashes) is not list:
        if not isinstance(hashes, Sequence) or isinstance(hashes, str | bytes):
            raise _fail_type(event, "block_hashes", hashes, "a list of block hashes")
        hashes = list(hashes)
    try:
        # Fast path, in C: every hash a non-negative integer below 2**64.
        array("Q", hashes)
    except (TypeError, OverflowError):
        for i, h in enumerate(hashes):
            _check_hash(event, f"block_hashes[{i}]", h)
    else:
        # array() accepts anything with __index__ (bool, numpy ints): insist on int.
        for i, h in enumerate(hashes):
            if type(h) is not int:
                raise _fail_type(event, f"block_hashes[{i}]", h, "an int or bytes")
    return hashes


def _token_value(event: str, where: str, t: object) -> int:
    """One token id as an `int`: numpy and other integer types are converted, bool refused."""
    if type(t) is int:
        value: int = t
    elif type(t) is bool or isinstance(t, float | str | bytes):
        raise _fail_type(event, where, t, "an int")
    else:
        try:
            value = operator.index(t)  # type: ignore[arg-type]  # numpy integers and the like
        except TypeError:
            raise _fail_type(event, where, t, "an int") from None
    if not 0 <= value < _HASH_LIMIT:
        raise _fail_value(event, where, t, "a non-negative integer below 2**64")
    return value


def _is_pair(t: object) -> bool:
    return (type(t) is list or type(t) is tuple) and len(t) == 2


def _flatten_pairs(
    event: str, pairs: list[Any], metadata: dict[str, Any] | None
) -> tuple[list[int], dict[str, Any]]:
    """SGLang's EAGLE pages: `token_ids` as `(token, next token)` pairs.

    The event keeps the tokens (the first of each pair), which is what every
    reader of `token_ids` expects; the second elements go to
    `metadata["wire"]`, so the pairs can be written back exactly: only the
    last pair's `next` when the pairs chain (`pair[i][1] == pair[i+1][0]`,
    the EAGLE bigram form), every second element when they do not.
    """
    firsts: list[int] = []
    seconds: list[int] = []
    for i, pair in enumerate(pairs):
        if not _is_pair(pair):
            raise _fail_type(event, f"token_ids[{i}]", pair, "a (token, next) pair like the others")
        firsts.append(_token_value(event, f"token_ids[{i}][0]", pair[0]))
        seconds.append(_token_value(event, f"token_ids[{i}][1]", pair[1]))
    wire: dict[str, Any]
    if firsts[1:] == seconds[:-1]:
        wire = {"token_pairs_next": seconds[-1]}
    else:
        wire = {"token_pairs_second": seconds}
    return firsts, with_wire(metadata, wire, event)


def with_wire(metadata: object, wire: Mapping[str, Any], event: str = "event") -> dict[str, Any]:
    """`metadata` (copied) with `wire`'s entries merged into `metadata["wire"]`."""
    if metadata is not None and not isinstance(metadata, Mapping):
        raise _fail_type(event, "metadata", metadata, "a str-keyed mapping or None")
    meta = dict(metadata) if metadata else {}
    old = meta.get(WIRE_KEY)
    if old is not None and not isinstance(old, Mapping):
        raise _fail_type(event, f"metadata.{WIRE_KEY}", old, "a str-keyed mapping or None")
    merged = dict(old) if old else {}
    merged.update(wire)
    meta[WIRE_KEY] = merged
    return meta


def _checked_tokens(event: str, tokens: object) -> list[int]:
    """Validate `token_ids` element by element; returns the list to store.

    The caller has already tried the fast path (`array.fromlist` plus a type
    scan, both in C); this is the slow path that names the bad element, or
    converts integer types that are not `int` (numpy) into `int`.
    """
    if type(tokens) is not list:
        if not isinstance(tokens, Sequence) or isinstance(tokens, str | bytes):
            raise _fail_type(event, "token_ids", tokens, "a list of int")
        tokens = list(tokens)
    items: list[Any] = tokens
    if items and _INT_ONLY.issuperset(map(type, items)):
        try:
            array("Q").fromlist(items)
        except OverflowError:
            pass  # named below
        else:
            return items
    return [_token_value(event, f"token_ids[{i}]", t) for i, t in enumerate(items)]


def _as_token_list(event: str, tokens: object) -> list[Any]:
    """`token_ids` given as another sequence (a tuple), as a list."""
    if not isinstance(tokens, Sequence) or isinstance(tokens, str | bytes):
        raise _fail_type(event, "token_ids", tokens, "a list of int")
    return list(tokens)


def _checked_token_count(event: str, n_tokens: int, size: int, n_hashes: int) -> None:
    """The rule for how many tokens a `BlockStored` carries, from what engines send.

    * `block_size == 0`: vLLM's placeholder form, no tokens.
    * Otherwise the tokens are whole blocks (`len(token_ids) % block_size == 0`)
      and there are at least as many blocks of tokens as hashes. vLLM's block
      pool skips null blocks (sliding-window and Mamba groups) when it collects
      the hashes but keeps every block's tokens, so a group with skipped blocks
      sends fewer hashes than token blocks, possibly none. The skipped blocks
      are the leading ones (outside the sliding window; Mamba's align-mode
      padding), so the hashes belong to the last `len(block_hashes)` blocks
      of tokens. A partial last page (SGLang) is one block with
      `block_size = len(token_ids)`.
    """
    if size == 0:
        if n_tokens:
            raise InvalidEventError(
                f"{event}.token_ids: expected no tokens with block_size 0 (the "
                f"placeholder form) = 0 tokens, got {n_tokens}"
            )
        return
    blocks, partial = divmod(n_tokens, size)
    if partial or blocks < n_hashes:
        raise InvalidEventError(
            f"{event}.token_ids: expected whole blocks of block_size tokens, at least "
            f"one block per hash: block_size * len(block_hashes) = {size} * {n_hashes} = "
            f"{size * n_hashes} tokens or more in multiples of {size} (engines that skip "
            f"null blocks send more token blocks than hashes; or none, with block_size 0), "
            f"got {n_tokens}"
        )


def _opt_int(event: str, field: str, value: object, *, minimum: int = _HASH_MIN) -> None:
    if value is not None:
        if type(value) is not int:
            raise _fail_type(event, field, value, "an int or None")
        if not minimum <= value < _HASH_LIMIT:  # every wire format caps ints at 64 bits
            shown = "-2**63" if minimum == _HASH_MIN else str(minimum)
            raise _fail_value(event, field, value, f"an integer in [{shown}, 2**64) or None")


def _opt_str(event: str, field: str, value: object) -> None:
    if value is not None:
        if type(value) is not str:
            raise _fail_type(event, field, value, "a str or None")
        if not value.isascii():
            _check_utf8(event, field, value)


def _check_utf8(event: str, field: str, value: str) -> None:
    """Refuse strings no codec can write (lone surrogates); ASCII skips this."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise _fail_value(event, field, value, "text encodable as UTF-8") from None


def _json_safe(event: str, where: str, value: object, depth: int) -> Any:
    """Return `value` as plain JSON data (tuples become lists), or raise."""
    t = type(value)
    if t is str:
        if not value.isascii():  # type: ignore[attr-defined]
            _check_utf8(event, where, value)  # type: ignore[arg-type]
        return value
    if value is None or t is bool:
        return value
    if t is int:
        if not _HASH_MIN <= value < _HASH_LIMIT:  # type: ignore[operator]
            raise _fail_value(event, where, value, "an integer in [-2**63, 2**64)")
        return value
    if t is float:
        if not math.isfinite(value):  # type: ignore[arg-type]
            raise _fail_value(event, where, value, "a finite number (no NaN or infinity)")
        return value
    if depth >= _MAX_DEPTH:
        raise _fail_value(event, where, "...", f"nesting at most {_MAX_DEPTH} deep")
    if t is list or t is tuple:
        items: list[Any] = value  # type: ignore[assignment]
        return [_json_safe(event, f"{where}[{i}]", v, depth + 1) for i, v in enumerate(items)]
    if isinstance(value, Mapping):
        out: dict[str, Any] = {}
        for k, v in value.items():
            if type(k) is not str:
                raise _fail_type(event, f"{where} key", k, "str keys")
            if not k.isascii():
                _check_utf8(event, f"{where} key", k)
            out[k] = _json_safe(event, f"{where}.{k}", v, depth + 1)
        return out
    raise _fail_type(event, where, value, "JSON data (None, bool, int, float, str, list, dict)")


def validate_metadata(metadata: object, event: str = "event") -> dict[str, Any] | None:
    """Check that `metadata` is JSON-safe and return it as a plain dict.

    Keys must be `str`; values None, bool, int (in `[-2**63, 2**64)`), finite
    float, str, list/tuple or str-keyed mapping, nested at most 32 deep. Tuples
    become lists, so an event equals itself after a round trip.
    """
    if metadata is None:
        return None
    if not isinstance(metadata, Mapping):
        raise _fail_type(event, "metadata", metadata, "a str-keyed mapping or None")
    return _json_safe(event, "metadata", metadata, 0)  # type: ignore[no-any-return]


def _extra_value(event: str, where: str, value: object, depth: int) -> Any:
    t = type(value)
    if t is str and not value.isascii():  # type: ignore[attr-defined]
        _check_utf8(event, where, value)  # type: ignore[arg-type]
    if value is None or t is str or t is bytes or t is bool:
        return value
    if t is int:
        if not _HASH_MIN <= value < _HASH_LIMIT:  # type: ignore[operator]
            raise _fail_value(event, where, value, "an integer in [-2**63, 2**64)")
        return value
    if t is float:
        if not math.isfinite(value):  # type: ignore[arg-type]
            raise _fail_value(event, where, value, "a finite number")
        return value
    if (t is list or t is tuple) and depth < _MAX_DEPTH:
        items: list[Any] = value  # type: ignore[assignment]
        return [_extra_value(event, f"{where}[{i}]", v, depth + 1) for i, v in enumerate(items)]
    raise _fail_type(event, where, value, "None, str, int, float, bytes or a list of them")


def _checked_extra_keys(event: str, extra: object, n_blocks: int) -> list[Any] | None:
    if extra is None:
        return None
    if not isinstance(extra, list | tuple):
        raise _fail_type(event, "extra_keys", extra, "a list (one entry per block) or None")
    if len(extra) != n_blocks:
        raise _fail_value(
            event, "extra_keys", extra, f"one entry per block ({n_blocks}), got {len(extra)}"
        )
    out: list[Any] = []
    for i, entry in enumerate(extra):
        if entry is None:
            out.append(None)
        elif type(entry) is list or type(entry) is tuple:
            out.append(_extra_value(event, f"extra_keys[{i}]", entry, 1))
        else:
            raise _fail_type(event, f"extra_keys[{i}]", entry, "a list or None")
    return out


#: The default of the fields vLLM's wire always carries, even when null (a
#: `BlockStored`'s `lora_id`, `medium` and `lora_name`, a `BlockRemoved`'s
#: `medium`): msgspec's UNSET, which `__post_init__` turns into None (see the
#: module doc).
_WRITTEN_NONE: Any = msgspec.UNSET


class KVCacheEvent(
    msgspec.Struct,
    kw_only=True,
    frozen=True,
    gc=False,
    tag_field="type",
    tag=True,
    forbid_unknown_fields=True,  # decoders must see a foreign field (kept in metadata)
):
    """Base of the three KV cache events. Every event also has `metadata`."""

    #: The tiers an event is about; `None` means every tier (AllBlocksCleared).
    type_name: ClassVar[str]

    def __post_init__(self) -> None:
        # Only the three concrete events exist on the wire; each overrides this.
        raise InvalidEventTypeError(
            f"{type(self).__name__}: expected a BlockStored, BlockRemoved or AllBlocksCleared "
            "(KVCacheEvent is only their base)"
        )


class BlockStored(KVCacheEvent, kw_only=True, frozen=True, gc=False, omit_defaults=True):
    """Blocks entered a tier (`medium`), chained on `parent_block_hash`.

    `token_ids` holds `block_size` tokens per block, or is empty with
    `block_size == 0` (vLLM's placeholder form, used by offloading connectors).
    `lora_id`, `medium` and `lora_name` default to None (their signature
    shows msgspec's `UNSET`, which the constructor turns into None: see the
    module doc on encoding).
    """

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = _WRITTEN_NONE
    medium: str | None = _WRITTEN_NONE
    lora_name: str | None = _WRITTEN_NONE
    extra_keys: list[list[Any] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    metadata: dict[str, Any] | None = None

    type_name: ClassVar[str] = "BlockStored"

    def __post_init__(self) -> None:
        # The hot path of every engine step: bulk checks in C, the rest inline.
        name = "BlockStored"
        unset = _WRITTEN_NONE
        if self.lora_id is unset:
            force_setattr(self, "lora_id", None)
        if self.lora_name is unset:
            force_setattr(self, "lora_name", None)
        if self.medium is unset:
            force_setattr(self, "medium", None)
        hashes = self.block_hashes
        if type(hashes) is list and hashes:
            try:
                # In C: every hash an integer in [0, 2**64). fromlist() is the
                # fastest bulk conversion array offers (the constructor iterates).
                array("Q").fromlist(hashes)  # type: ignore[arg-type]
            except (TypeError, OverflowError):
                _checked_hashes(name, hashes)  # negative or bytes hashes, or an error
            else:
                if not _INT_ONLY.issuperset(map(type, hashes)):  # bool, numpy ints
                    _checked_hashes(name, hashes)
        else:
            hashes = _checked_hashes(name, hashes)
            force_setattr(self, "block_hashes", hashes)
        tokens = self.token_ids
        if type(tokens) is not list:
            tokens = _as_token_list(name, tokens)
            force_setattr(self, "token_ids", tokens)
        if tokens:
            # Two passes in C: every token an integer in [0, 2**64) (fromlist), and
            # every one exactly an int (msgspec's strict conversion refuses the bool
            # and numpy ints that fromlist lets through). About 3x what serializing
            # the list costs, a third of a Python-level type scan (docs/vllm-wire.md).
            try:
                array("Q").fromlist(tokens)
                _STRICT_CONVERT(tokens, _INT_LIST)
            except (TypeError, OverflowError):
                if _is_pair(tokens[0]):  # SGLang's EAGLE (token, next) pairs
                    tokens, meta = _flatten_pairs(name, tokens, self.metadata)
                    force_setattr(self, "metadata", meta)
                else:
                    tokens = _checked_tokens(name, tokens)  # raises, naming the token
                force_setattr(self, "token_ids", tokens)
            except msgspec.ValidationError:
                tokens = _checked_tokens(name, tokens)  # numpy ints become int; bool refused
                force_setattr(self, "token_ids", tokens)
        size = self.block_size
        if type(size) is not int:
            raise _fail_type(name, "block_size", size, "an int >= 0")
        if not 0 <= size < _HASH_LIMIT:
            raise _fail_value(name, "block_size", size, "an int >= 0 (below 2**64)")
        n_tokens = len(tokens)
        if n_tokens != size * len(hashes):
            _checked_token_count(name, n_tokens, size, len(hashes))
        parent = self.parent_block_hash
        if parent is not None and (
            type(parent) is not int or not _HASH_MIN <= parent < _HASH_LIMIT
        ):
            _check_hash(name, "parent_block_hash", parent)
        medium = self.medium
        if medium is not None and (type(medium) is not str or not medium.isascii()):
            _opt_str(name, "medium", medium)
        if self.lora_id is not None or self.lora_name is not None:
            _opt_int(name, "lora_id", self.lora_id)
            _opt_str(name, "lora_name", self.lora_name)
        if (
            self.extra_keys is not None
            or self.group_idx is not None
            or self.kv_cache_spec_kind is not None
            or self.kv_cache_spec_sliding_window is not None
            or self.locality is not None
        ):
            # vLLM sets these on every event (extra_keys all None, group 0, a kind):
            # the common values are checked inline, anything else in full.
            extra = self.extra_keys
            if extra is not None and not (
                type(extra) is list and len(extra) == len(hashes) == extra.count(None)
            ):
                force_setattr(self, "extra_keys", _checked_extra_keys(name, extra, len(hashes)))
            group = self.group_idx
            if group is not None and (type(group) is not int or not 0 <= group < _HASH_LIMIT):
                _opt_int(name, "group_idx", group, minimum=0)
            kind = self.kv_cache_spec_kind
            if kind is not None and (type(kind) is not str or not kind.isascii()):
                _opt_str(name, "kv_cache_spec_kind", kind)
            _opt_int(name, "kv_cache_spec_sliding_window", self.kv_cache_spec_sliding_window)
            _opt_str(name, "locality", self.locality)
        if self.metadata is not None:
            force_setattr(self, "metadata", validate_metadata(self.metadata, name))


class BlockRemoved(KVCacheEvent, kw_only=True, frozen=True, gc=False, omit_defaults=True):
    """Blocks left a tier (`medium`; None when not given, see `BlockStored`)."""

    block_hashes: list[BlockHash]
    medium: str | None = _WRITTEN_NONE
    group_idx: int | None = None
    locality: str | None = None
    metadata: dict[str, Any] | None = None

    type_name: ClassVar[str] = "BlockRemoved"

    def __post_init__(self) -> None:
        name = "BlockRemoved"
        if self.medium is _WRITTEN_NONE:
            force_setattr(self, "medium", None)
        hashes = _checked_hashes(name, self.block_hashes)
        if hashes is not self.block_hashes:
            force_setattr(self, "block_hashes", hashes)
        _opt_str(name, "medium", self.medium)
        _opt_int(name, "group_idx", self.group_idx, minimum=0)
        _opt_str(name, "locality", self.locality)
        if self.metadata is not None:
            force_setattr(self, "metadata", validate_metadata(self.metadata, self.type_name))


class AllBlocksCleared(KVCacheEvent, kw_only=True, frozen=True, gc=False, omit_defaults=True):
    """The engine's cache was reset. vLLM gives it no tier: consumers clear every tier."""

    metadata: dict[str, Any] | None = None

    type_name: ClassVar[str] = "AllBlocksCleared"

    def __post_init__(self) -> None:
        if self.metadata is not None:
            force_setattr(self, "metadata", validate_metadata(self.metadata, self.type_name))


#: Every concrete event type, by its wire tag.
EVENT_TYPES: Final[dict[str, type[BlockStored | BlockRemoved | AllBlocksCleared]]] = {
    "BlockStored": BlockStored,
    "BlockRemoved": BlockRemoved,
    "AllBlocksCleared": AllBlocksCleared,
}

AnyEvent: TypeAlias = BlockStored | BlockRemoved | AllBlocksCleared


class EventBatch:
    """The events of one origin sealed by one tick.

    `(origin, epoch, seq)` names a batch for ever: `seq` counts batches from 0
    within an epoch, and a new `epoch` (drawn when a scheduler starts) tells
    consumers that the producer restarted.

    A batch is a frozen value: its attributes cannot be rebound, and nothing is
    cached on it (encodings live in the sinks' encoding group). `events` is the
    list the batch was sealed with; treat it as read-only.
    """

    __slots__ = ("data_parallel_rank", "epoch", "events", "origin", "seq", "ts")

    seq: int
    ts: float
    events: list[KVCacheEvent]
    data_parallel_rank: int | None
    origin: str
    epoch: str

    def __init__(
        self,
        *,
        seq: int,
        ts: float,
        events: list[KVCacheEvent],
        data_parallel_rank: int | None = None,
        origin: str = "",
        epoch: str = "",
    ) -> None:
        if type(seq) is not int or seq < 0:
            raise InvalidEventError(f"EventBatch.seq: expected an int >= 0, got {shorten(seq)}")
        if type(ts) is not float:
            if type(ts) is int:
                ts = float(ts) if -(2**1000) < ts < 2**1000 else math.inf  # refused below
            else:
                raise InvalidEventTypeError(
                    f"EventBatch.ts: expected a float (wall-clock seconds), got {shorten(ts)}"
                )
        if not math.isfinite(ts):  # JSON has no NaN or infinity: it could not be read back
            raise InvalidEventError(f"EventBatch.ts: expected a finite float, got {shorten(ts)}")
        if type(events) is not list:
            if not isinstance(events, Sequence):
                raise InvalidEventTypeError(
                    f"EventBatch.events: expected a list of events, got {type(events).__name__}"
                )
            events = list(events)
        if data_parallel_rank is not None and type(data_parallel_rank) is not int:
            raise InvalidEventTypeError(
                "EventBatch.data_parallel_rank: expected an int or None, "
                f"got {shorten(data_parallel_rank)}"
            )
        if type(origin) is not str:
            raise InvalidEventTypeError(f"EventBatch.origin: expected a str, got {shorten(origin)}")
        if type(epoch) is not str:
            raise InvalidEventTypeError(f"EventBatch.epoch: expected a str, got {shorten(epoch)}")
        _SET_SEQ(self, seq)
        _SET_TS(self, ts)
        _SET_EVENTS(self, events)
        _SET_RANK(self, data_parallel_rank)
        _SET_ORIGIN(self, origin)
        _SET_EPOCH(self, epoch)

    @classmethod
    def _trusted(
        cls,
        seq: int,
        ts: float,
        events: list[KVCacheEvent],
        data_parallel_rank: int | None,
        origin: str,
        epoch: str,
    ) -> EventBatch:
        """Build without checks: for the scheduler, whose inputs are already valid."""
        self = cls.__new__(cls)
        _SET_SEQ(self, seq)
        _SET_TS(self, ts)
        _SET_EVENTS(self, events)
        _SET_RANK(self, data_parallel_rank)
        _SET_ORIGIN(self, origin)
        _SET_EPOCH(self, epoch)
        return self

    def __setattr__(self, name: str, value: object) -> None:
        if name in EventBatch.__slots__:
            raise AttributeError(f"EventBatch is frozen: cannot set {name!r} (use replace())")
        object.__setattr__(self, name, value)  # a subclass's own fields

    def __delattr__(self, name: str) -> None:
        if name in EventBatch.__slots__:
            raise AttributeError(f"EventBatch is frozen: cannot delete {name!r}")
        object.__delattr__(self, name)

    def replace(self, **changes: Any) -> EventBatch:
        """A copy of this batch with `changes` applied (validated as a new batch)."""
        fields: dict[str, Any] = {
            "seq": self.seq,
            "ts": self.ts,
            "events": self.events,
            "data_parallel_rank": self.data_parallel_rank,
            "origin": self.origin,
            "epoch": self.epoch,
        }
        unknown = changes.keys() - fields.keys()
        if unknown:
            raise TypeError(f"EventBatch.replace: unknown field(s) {sorted(unknown)!r}")
        fields.update(changes)
        return EventBatch(**fields)

    @property
    def key(self) -> tuple[str, str, int]:
        """`(origin, epoch, seq)`: the batch's name for ever."""
        return (self.origin, self.epoch, self.seq)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, EventBatch):
            return NotImplemented
        return (
            self.seq == other.seq
            and self.ts == other.ts
            and self.origin == other.origin
            and self.epoch == other.epoch
            and self.data_parallel_rank == other.data_parallel_rank
            and self.events == other.events
        )

    __hash__ = None  # type: ignore[assignment]

    def __len__(self) -> int:
        return len(self.events)

    def __repr__(self) -> str:
        return (
            f"EventBatch(origin={self.origin!r}, epoch={self.epoch!r}, seq={self.seq}, "
            f"ts={self.ts!r}, data_parallel_rank={self.data_parallel_rank!r}, "
            f"events=<{len(self.events)} events>)"
        )


# The slots' own setters: EventBatch refuses attribute assignment, so it is built
# through these (faster than object.__setattr__).
_SET_SEQ: Final = EventBatch.__dict__["seq"].__set__
_SET_TS: Final = EventBatch.__dict__["ts"].__set__
_SET_EVENTS: Final = EventBatch.__dict__["events"].__set__
_SET_RANK: Final = EventBatch.__dict__["data_parallel_rank"].__set__
_SET_ORIGIN: Final = EventBatch.__dict__["origin"].__set__
_SET_EPOCH: Final = EventBatch.__dict__["epoch"].__set__
