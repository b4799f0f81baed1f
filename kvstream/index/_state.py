"""A `PrefixIndex` saved to bytes and loaded back (`dump` / `load`).

The file is one msgpack map, versioned:

    {"format": "kvstream.prefix-index", "version": 1,
     "block_size": 16, "root": <the hash root: seed and block size must match>,
     "tiers": ["GPU", "CPU", ...], "counts": {...},
     "streams": [{"origin", "rank", "epoch", "retired", "next_seq", "stale",
                  "stale_reason", "block_size", "last_seen_age",
                  "keys", "owns", "masks",       # per held block: engine key, own hash,
                                                   # tiers held (bit t = tiers[t])
                  "spans", "dups", "recent_keys", "recent_owns", "orphans",
                  "partial"}, ...],                # partial: [[engine key, own, tokens]]
     "lru": [[stream position, engine key], ...]}   # with max_blocks, oldest first

`keys`, `owns`, `recent_*` are uint64 little-endian arrays and `masks`
uint16: a million blocks take about 18 MB. A dump is taken between two batches
(the index is fed from one task), so it holds, per stream, exactly the batches
before its `next_seq`: a subscriber resumes each stream from there.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final

import msgspec
import numpy as np

from kvstream.errors import ConfigError

if TYPE_CHECKING:
    from kvstream.index._prefix import PrefixIndex

__all__ = ["FORMAT", "VERSION", "dump_index", "load_index"]

FORMAT: Final = "kvstream.prefix-index"
VERSION: Final = 1

_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder().decode


def _u64(values: Any, n: int) -> bytes:
    return np.fromiter(values, dtype="<u8", count=n).tobytes()


def dump_index(index: PrefixIndex) -> bytes:
    """The index's whole state as bytes (see the module doc)."""
    now = index._clock()
    width = index._width
    ntiers = len(index._tiers)
    nodes = index._nodes
    positions: dict[int, int] = {}
    streams = []
    for position, state in enumerate(index._streams.values()):
        positions[state.slot] = position
        slot = state.slot
        spans = state.spans
        keys = []
        owns = []
        masks = []
        span_rows = []
        for key, own in state.blocks.items():
            span = spans.get(key) if spans else None
            if span is not None:
                span_rows.append(
                    [key, span, [_mask(nodes.get(o, 0), slot, width, ntiers) for o in span]]
                )
                continue
            keys.append(key)
            owns.append(own)
            masks.append(_mask(nodes.get(own, 0), slot, width, ntiers))
        recent_spans = [[k, spans[k]] for k in state.recent if spans and k in spans]
        streams.append(
            {
                "origin": state.name,
                "rank": state.rank,
                "epoch": state.epoch,
                "retired": list(state.retired),
                "next_seq": state.next_seq,
                "stale": state.stale,
                "stale_reason": state.stale_reason,
                "block_size": state.block_size,
                "last_seen_age": max(0.0, now - state.last_seen),
                "keys": _u64(keys, len(keys)),
                "owns": _u64(owns, len(owns)),
                "masks": np.array(masks, dtype="<u2").tobytes(),
                "spans": span_rows,
                "recent_spans": recent_spans,
                "dups": [[d & ((1 << 60) - 1), d >> 60, n] for d, n in state.dups.items()],
                "recent_keys": _u64(state.recent.keys(), len(state.recent)),
                "recent_owns": _u64(state.recent.values(), len(state.recent)),
                "orphans": [[key, o.parent, o.values, o.tiers] for key, o in state.orphans.items()],
                "partial": [[key, prev, tokens] for key, (prev, tokens) in state.partial.items()],
            }
        )
    lru = index._lru
    return _encode(
        {
            "format": FORMAT,
            "version": VERSION,
            "block_size": index.block_size,
            "root": index._hasher.root,
            "tiers": list(index._tiers),
            "counts": dict(index._counts),
            "streams": streams,
            "lru": []
            if lru is None
            else [[positions[tag >> 60], tag & ((1 << 60) - 1)] for tag in lru],
        }
    )


def _mask(v: int, slot: int, width: int, ntiers: int) -> int:
    m = 0
    for t in range(ntiers):
        if v >> (t * width + slot) & 1:
            m |= 1 << t
    return m


def load_index(index: PrefixIndex, data: bytes) -> None:
    """Load `data` (from `dump_index()`) into `index`, which must be empty
    and have the same block size and seed."""
    if index._streams or index._nodes:
        raise ConfigError("PrefixIndex.load: expected an empty index (load before feeding it)")
    try:
        doc = _decode(data)
    except msgspec.DecodeError as exc:
        raise ConfigError(f"index state: format: expected a {FORMAT} file, {exc}") from None
    if type(doc) is not dict or doc.get("format") != FORMAT:
        raise ConfigError(f"index state: format: expected {FORMAT!r}, got {_get(doc, 'format')!r}")
    if doc.get("version") != VERSION:
        raise ConfigError(
            f"index state: version: expected {VERSION}, got {doc.get('version')!r} "
            "(written by another kvstream version)"
        )
    if doc.get("block_size") != index.block_size:
        raise ConfigError(
            f"index state: block_size: the file has {doc.get('block_size')!r}, "
            f"this index {index.block_size}"
        )
    if doc.get("root") != index._hasher.root:
        raise ConfigError(
            "index state: seed: the file was written by an index with another seed "
            "(its hashes would not match this index's)"
        )
    try:
        _load(index, doc)
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        index.__init__(  # type: ignore[misc]
            block_size=index.block_size,
            seed=index.seed,
            keep_removed=index.keep_removed,
            max_orphans=index.max_orphans,
            tier_weights=index.tier_weights,
            default_weight=index.default_weight,
            ttl=index.ttl,
            max_blocks=index.max_blocks,
            clock=index._clock,
            lookup_table=index._table is not None,
        )
        raise ConfigError(f"index state: malformed file ({type(exc).__name__}: {exc})") from None


def _get(doc: Any, key: str) -> Any:
    return doc.get(key) if type(doc) is dict else None


def _load(index: PrefixIndex, doc: dict[str, Any]) -> None:
    from kvstream.index._prefix import _Orphan

    tiers = [index._tier(name) for name in doc["tiers"]]
    index._table_stale = True
    for name, n in doc["counts"].items():
        if name in index._counts:
            index._counts[name] = int(n)
    now = index._clock()
    nodes = index._nodes
    by_position = []
    for row in doc["streams"]:
        state = index._add_stream((row["origin"], row["rank"]), now - row["last_seen_age"])
        by_position.append(state)
        state.epoch = row["epoch"]
        state.retired = list(row["retired"])
        state.next_seq = int(row["next_seq"])
        if row["stale"]:
            index._set_stale(state, row["stale_reason"] or "stale when saved")
        state.block_size = int(row["block_size"])
        bits = state.bits
        held = state.held
        keys = np.frombuffer(row["keys"], dtype="<u8").tolist()
        owns = np.frombuffer(row["owns"], dtype="<u8").tolist()
        masks = np.frombuffer(row["masks"], dtype="<u2").tolist()
        if not len(keys) == len(owns) == len(masks):
            raise ValueError("keys, owns and masks differ in length")
        blocks = state.blocks
        for key, own, mask in zip(keys, owns, masks, strict=True):
            blocks[key] = own
            _set(nodes, own, mask, tiers, bits, held, index._canon)
        for key, span, span_masks in row["spans"]:
            blocks[key] = span[-1]
            state.spans[key] = list(span)
            for own, mask in zip(span, span_masks, strict=True):
                _set(nodes, own, mask, tiers, bits, held, index._canon)
        for key, span in row["recent_spans"]:
            state.spans[key] = list(span)
        for own, t, n in row["dups"]:
            state.dups[own | tiers[t] << 60] = n
        recent_keys = np.frombuffer(row["recent_keys"], dtype="<u8").tolist()
        recent_owns = np.frombuffer(row["recent_owns"], dtype="<u8").tolist()
        state.recent.update(zip(recent_keys, recent_owns, strict=True))
        for key, parent, values, orphan_tiers in row["orphans"]:
            orphan = _Orphan(parent, list(values), tiers[orphan_tiers[0]])
            orphan.tiers = [tiers[t] for t in orphan_tiers]
            state.orphans[key] = orphan
            state.waiting.setdefault(parent, []).append(key)
        for key, prev, tokens in row.get("partial", ()):  # absent from older files
            state.partial[key] = (int(prev), [int(t) for t in tokens])
    if index._lru is not None:
        for position, key in doc["lru"]:
            index._lru[by_position[position].slot << 60 | key] = None
        if not doc["lru"]:  # saved without a bound: take the file's order
            for state in by_position:
                for key in state.blocks:
                    index._lru[state.slot << 60 | key] = None
        if len(index._lru) > index.max_blocks:  # type: ignore[operator]
            index._evict()


def _set(
    nodes: dict[int, int],
    own: int,
    mask: int,
    tiers: list[int],
    bits: list[int],
    held: list[int],
    canon: dict[int, int],
) -> None:
    v = nodes.get(own, 0)
    t = 0
    while mask:
        if mask & 1:
            v |= bits[tiers[t]]
            held[tiers[t]] += 1
        mask >>= 1
        t += 1
    nodes[own] = canon.setdefault(v, v)
