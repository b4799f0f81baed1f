"""FileSubscriber releases its file on close, even under an iteration left suspended."""

from __future__ import annotations

import os
from pathlib import Path

import anyio
import pytest

from kvstream import BlockStored, EventBatch, JsonCodec
from kvstream.consumers import FileSubscriber
from kvstream.errors import TransportError


def _open_fds_on(path: Path) -> int:
    fds = Path("/proc/self/fd")
    count = 0
    for fd in fds.iterdir():
        try:
            if os.readlink(fd) == str(path):
                count += 1
        except OSError:
            continue
    return count


async def test_aclose_closes_the_file_of_a_suspended_iteration(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    codec = JsonCodec()
    event = BlockStored(block_hashes=[1], parent_block_hash=None, token_ids=[1, 2], block_size=2)
    path.write_bytes(
        b"".join(
            codec.encode(EventBatch(seq=seq, ts=0.0, events=[event], origin="o", epoch="e"))
            for seq in range(3)
        )
    )
    sub = FileSubscriber(path, follow=True)
    async with sub:
        iterator = aiter(sub)
        first = await anext(iterator)
        assert isinstance(first, EventBatch)
        assert first.seq == 0
        assert _open_fds_on(path) == 1
    # Left suspended after one item, the iteration was closed with the subscriber.
    assert _open_fds_on(path) == 0


async def test_a_followed_path_that_becomes_unreadable_is_a_transport_error(
    tmp_path: Path,
) -> None:
    # Replaced by a directory: reopening it raised Python's own IsADirectoryError.
    path = tmp_path / "events.jsonl"
    event = BlockStored(block_hashes=[1], parent_block_hash=None, token_ids=[1, 2], block_size=2)
    path.write_bytes(
        JsonCodec().encode(EventBatch(seq=0, ts=0.0, events=[event], origin="o", epoch="e"))
    )
    async with FileSubscriber(path, follow=True, poll_interval=0.01) as sub:
        iterator = aiter(sub)
        assert isinstance(await anext(iterator), EventBatch)
        path.rename(tmp_path / "events.old")
        path.mkdir()
        with anyio.fail_after(10), pytest.raises(TransportError, match=r"cannot read .*events"):
            await anext(iterator)
