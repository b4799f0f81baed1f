"""The numpy copy of the index's nodes agrees with the dict it mirrors."""

from __future__ import annotations

import random

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstream import PrefixIndex
from kvstream.events import BlockStored, EventBatch, KVCacheEvent
from kvstream.index._table import NodeTable


@settings(max_examples=60, deadline=None, database=None)
@given(
    ops=st.lists(
        st.tuples(
            # keys crowded on few home slots: long runs, claims racing for one slot
            st.integers(0, 60).map(lambda i: (i % 7) * 4096 + (i // 7) * (1 << 40)),
            st.integers(0, 2**64 - 1),
        ),
        max_size=300,
    ),
    batch=st.integers(1, 50),
)
def test_the_table_mirrors_a_dict(ops: list[tuple[int, int]], batch: int) -> None:
    table = NodeTable()
    nodes: dict[int, int] = {}
    probes = sorted({k for k, _ in ops} | {12345, 4096 * 3 + 1})
    for start in range(0, len(ops), batch):
        for key, value in ops[start : start + batch]:
            if value % 5 == 0:
                nodes.pop(key, None)  # a node no stream holds any more
            else:
                nodes[key] = value
            table.dirty[key] = None
        assert table.sync(nodes)
        got = table.lookup(np.array(probes, dtype=np.uint64)).tolist()
        assert got == [nodes.get(k, 0) for k in probes]
    table.rebuild(nodes)
    got = table.lookup(np.array(probes, dtype=np.uint64)).tolist()
    assert got == [nodes.get(k, 0) for k in probes]


def test_holders_wider_than_64_bits_fall_back_to_the_dict() -> None:
    index = PrefixIndex(block_size=4)
    n = 130  # long enough a prompt for the table to be used
    tokens = list(range(100, 100 + 4 * n))
    media = ["GPU", "CPU", "DISK", "EXTERNAL", "STORAGE"]
    for i in range(20):  # 20 streams (width 32) x 5 tiers: 160 bits of holders
        events: list[KVCacheEvent] = [
            BlockStored(
                block_hashes=list(range(1, n + 1)),
                parent_block_hash=None,
                token_ids=tokens if m == "GPU" else [],
                block_size=4 if m == "GPU" else 0,
                medium=m,
            )
            for m in media
        ]
        index.apply(EventBatch(seq=0, ts=0.0, events=events, origin=f"e{i:02d}", epoch="x"))
        matches = index.match(tokens)
        assert [m.origin for m in matches] == [f"e{j:02d}" for j in range(i + 1)]
        assert all(m.blocks == n and m.tiers == dict.fromkeys(media, n) for m in matches)
        assert (index._table is None) == (i >= 8)  # past 8 streams: width 16 x 5 tiers > 64
    assert index.match(tokens[:8])[0].blocks == 2


def test_a_large_index_answers_the_same_through_the_table() -> None:
    rng = random.Random(5)
    index = PrefixIndex(block_size=4)
    prompts = []
    for s in range(300):
        tokens = [rng.randrange(1000) for _ in range(4 * 150)]  # 150 blocks: the table is used
        prompts.append(tokens)
        index.apply(
            EventBatch(
                seq=0,
                ts=0.0,
                origin=f"o{s % 7}",
                epoch=f"e{s}",
                data_parallel_rank=s % 2,
                events=[
                    BlockStored(
                        block_hashes=list(range(s * 1000, s * 1000 + 150)),
                        parent_block_hash=None,
                        token_ids=tokens,
                        block_size=4,
                    )
                ],
            )
        )
    with_table = [index.match(p) for p in prompts]
    plain = PrefixIndex(block_size=4, lookup_table=False)  # the dict path
    plain.load(index.dump())
    assert [plain.match(p) for p in prompts] == with_table
    assert any(m for m in with_table)
    assert index._table is not None
