"""Engine blocks of a size that divides the index's (many:1) are gathered into index blocks."""

from __future__ import annotations

import random
from collections.abc import Sequence
from itertools import pairwise
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from kvstream import PrefixIndex
from kvstream.events import BlockRemoved, BlockStored, EventBatch, KVCacheEvent

S = 8  # the index's block size


class Feed:
    def __init__(self, index: PrefixIndex) -> None:
        self.index = index
        self.seq = 0

    def __call__(self, *events: KVCacheEvent) -> None:
        self.index.apply(
            EventBatch(seq=self.seq, ts=0.0, events=list(events), origin="a", epoch="e")
        )
        self.seq += 1


def stores(
    tokens: Sequence[int],
    size: int,
    cuts: Sequence[int],
    first_hash: int,
    lora: str | None = None,
    vllm_lora_keys: bool = False,
) -> list[BlockStored]:
    """`tokens` as engine blocks of `size`, hashes from `first_hash`, one event per run
    between `cuts` (in engine blocks), each chained on the previous one."""
    n = len(tokens) // size
    bounds = sorted({0, n, *(c for c in cuts if 0 < c < n)})
    out = []
    for a, b in pairwise(bounds):
        out.append(
            BlockStored(
                block_hashes=list(range(first_hash + a, first_hash + b)),
                parent_block_hash=None if a == 0 else first_hash + a - 1,
                token_ids=list(tokens[a * size : b * size]),
                block_size=size,
                lora_name=lora,
                extra_keys=[[lora]] * (b - a) if vllm_lora_keys and lora else None,
            )
        )
    return out


def answers(index: PrefixIndex, prompts: list[list[int]], lora: str | None) -> list[Any]:
    return [index.match(p, lora) for p in prompts]


@settings(max_examples=60, deadline=None, database=None)
@given(
    size=st.sampled_from([1, 2, 4]),
    chains=st.integers(1, 4),
    seed=st.integers(0, 2**16),
    lora=st.sampled_from([None, "L"]),
)
def test_divided_blocks_answer_as_blocks_of_the_index_size(
    size: int, chains: int, seed: int, lora: str | None
) -> None:
    rng = random.Random(seed)
    divided = PrefixIndex(block_size=S)
    whole = PrefixIndex(block_size=S)
    feed_divided, feed_whole = Feed(divided), Feed(whole)
    prompts = []
    base: list[int] = []
    for c in range(chains):
        # Chains share a prefix (of any length, not only whole index blocks) half the time.
        shared = base[: rng.randrange(len(base) + 1)] if base and rng.random() < 0.5 else []
        tokens = shared + [rng.randrange(2**32) for _ in range(rng.randrange(1, 6) * S)]
        tokens = tokens[: len(tokens) // S * S]
        base = tokens
        n = len(tokens) // size
        cuts = [rng.randrange(1, n + 1) for _ in range(rng.randrange(4))]
        feed_divided(*stores(tokens, size, cuts, 1000 * c, lora, vllm_lora_keys=c % 2 == 1))
        feed_whole(*stores(tokens, S, [], 1000 * c, lora))
        prompts += [tokens, tokens[: rng.randrange(len(tokens) + 1)], tokens + [1] * S]
    assert answers(divided, prompts, lora) == answers(whole, prompts, lora)
    assert set(divided._nodes) == set(whole._nodes)
    stats = divided.statistics()
    assert stats.divided_blocks == stats.blocks_stored > 0
    assert stats.wrong_block_size == stats.unaligned_blocks == 0
    assert stats.origins["a"].block_size == size


def test_the_engine_block_that_fills_an_index_block_stands_for_it() -> None:
    tokens = list(range(100, 124))  # three index blocks, six engine blocks of 4
    index = PrefixIndex(block_size=S)
    feed = Feed(index)
    feed(*stores(tokens, 4, [3], 1))  # engine hashes 1..6; 2, 4, 6 fill index blocks
    assert index.match(tokens)[0].tiers == {"GPU": 3}
    feed(
        BlockStored(
            block_hashes=[2, 3, 4], parent_block_hash=1, token_ids=[], block_size=0, medium="CPU"
        )
    )  # placeholders: 3 is inside an index block, not counted
    assert index.match(tokens)[0].tiers == {"GPU": 3, "CPU": 2}
    feed(BlockRemoved(block_hashes=[5], medium="GPU"))  # inside the last index block
    assert index.match(tokens)[0].tiers == {"GPU": 3, "CPU": 2}
    feed(BlockRemoved(block_hashes=[6], medium="GPU"))  # the one that filled it
    assert index.match(tokens)[0].tiers == {"GPU": 2, "CPU": 2}
    feed(BlockRemoved(block_hashes=[4], medium="GPU"))
    assert index.match(tokens)[0].tiers == {"GPU": 1, "CPU": 2}
    stats = index.statistics()
    assert stats.unknown_placeholders == stats.unknown_removals == 0
    assert stats.origins["a"].by_medium == {"GPU": 1, "CPU": 2}
    # Stored again after its removal (from memory of removed blocks): held again.
    feed(BlockStored(block_hashes=[4], parent_block_hash=3, token_ids=tokens[12:16], block_size=4))
    assert index.match(tokens)[0].tiers == {"GPU": 2, "CPU": 2}


def test_divided_blocks_that_cannot_be_placed_are_counted_by_reason() -> None:
    index = PrefixIndex(block_size=S)
    feed = Feed(index)
    tokens = list(range(16))
    # The parent was never seen: where its tokens start in an index block is unknown.
    feed(BlockStored(block_hashes=[7, 8], parent_block_hash=99, token_ids=tokens[:8], block_size=4))
    # Extra keys besides the adapter: which index block they salt is not defined.
    feed(
        BlockStored(
            block_hashes=[1, 2],
            parent_block_hash=None,
            token_ids=tokens[:8],
            block_size=4,
            extra_keys=[["mm-hash"], None],
        )
    )
    # A size neither a multiple nor a divisor.
    feed(BlockStored(block_hashes=[3], parent_block_hash=None, token_ids=tokens[:3], block_size=3))
    stats = index.statistics()
    assert (stats.unaligned_blocks, stats.unmapped_extra_keys, stats.wrong_block_size) == (2, 2, 1)
    assert stats.divided_blocks == 0
    assert index.match(tokens) == []
    assert stats.distinct_blocks == 0


def test_divided_blocks_with_wide_tokens_and_a_new_epoch() -> None:
    tokens = [2**40 + i for i in range(8)] + list(range(8))
    divided = PrefixIndex(block_size=S)
    whole = PrefixIndex(block_size=S)
    Feed(divided)(*stores(tokens, 2, [1, 5], 1))
    Feed(whole)(*stores(tokens, S, [], 1))
    assert divided.match(tokens) == whole.match(tokens)
    assert divided.match(tokens)[0].blocks == 2
    divided.apply(EventBatch(seq=0, ts=0.0, events=[], origin="a", epoch="e2"))  # restarted
    assert divided.match(tokens) == []
    assert divided.statistics().memory_bytes > 0


def test_a_dump_keeps_engine_blocks_inside_index_blocks() -> None:
    tokens = list(range(100, 124))
    index = PrefixIndex(block_size=S)
    feed = Feed(index)
    feed(*stores(tokens[:12], 4, [], 1))  # engine blocks 1, 2, 3: 3 ends mid index block
    loaded = PrefixIndex(block_size=S)
    loaded.load(index.dump())
    before, after = index.statistics(), loaded.statistics()
    assert after.origins["a"].by_medium == before.origins["a"].by_medium == {"GPU": 1}
    assert after.divided_blocks == before.divided_blocks == 3
    for target in (index, loaded):  # the child of 3 completes the second index block
        target.apply(
            EventBatch(
                seq=1, ts=0.0, origin="a", epoch="e", events=[*stores(tokens, 4, [3], 1)[1:]]
            )
        )
    assert loaded.match(tokens) == index.match(tokens)
    assert loaded.match(tokens)[0].blocks == 3
