"""`from_seq`: one rule for where a reader starts, per origin, with `"*"` for the others."""

from __future__ import annotations

from pathlib import Path

import pytest

import kvstream
from kvstream._wire.from_seq import check_from_seq, start_seq
from kvstream.codecs.json import JsonCodec
from kvstream.consumers.file import FileSubscriber
from kvstream.errors import ConfigError
from kvstream.events import BlockRemoved, EventBatch


def test_start_seq_per_origin_with_a_default() -> None:
    assert start_seq(None, "a") is None
    assert start_seq(5, "a") == 5
    assert start_seq({"a": 3, "*": 7}, "a") == 3
    assert start_seq({"a": 3, "*": 7}, "b") == 7
    assert start_seq({"a": 3}, "b") is None
    assert start_seq({"a": 0, "*": 7}, "a") == 0  # 0 is a seq, not "unset"


@pytest.mark.parametrize(
    ("value", "named"),
    [
        (-1, "expected an int >= 0, got -1"),
        (True, "expected an int >= 0, {origin: seq >= 0} or None, got True"),
        ("3", "expected an int >= 0, {origin: seq >= 0} or None, got '3'"),
        ({"a": -2}, "got entry 'a': -2"),
        ({"": 1}, "got entry '': 1"),
        ({"a": 1.5}, "got entry 'a': 1.5"),
    ],
)
def test_bad_from_seq_names_the_owner_the_field_and_the_value(value: object, named: str) -> None:
    with pytest.raises(ConfigError) as info:
        check_from_seq(value, "tcp://h:1")
    assert str(info.value).startswith("tcp://h:1: from_seq: expected")
    assert named in str(info.value)


def test_every_subscriber_refuses_a_bad_from_seq(tmp_path: Path) -> None:
    for url in (f"file:{tmp_path / 'x.jsonl'}", "tcp://127.0.0.1:1", "zmq+tcp://127.0.0.1:1"):
        with pytest.raises(ConfigError, match=r"from_seq: expected .*got entry 'a': -1"):
            kvstream.subscribe(url, from_seq={"a": -1})


async def test_a_file_reads_each_origin_from_its_own_seq(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    codec = JsonCodec()
    lines = [
        codec.encode(
            EventBatch(
                seq=seq,
                ts=0.0,
                events=[BlockRemoved(block_hashes=[seq])],
                origin=origin,
                epoch="e",
            )
        )
        for seq in range(4)
        for origin in ("a", "b")
    ]
    path.write_bytes(b"".join(lines))
    async with FileSubscriber(path, from_seq={"a": 2, "*": 1}) as sub:
        got = [(item.origin, item.seq) async for item in sub if isinstance(item, EventBatch)]
    assert got == [("b", 1), ("a", 2), ("b", 2), ("a", 3), ("b", 3)]
