"""The snapshot envelope, the snapshot schedule, heartbeats and the URL options (no server)."""

from __future__ import annotations

import pytest

from kvstream import AllBlocksCleared, BlockStored, EventBatch, KVCacheEvent
from kvstream._wire.broker import (
    SNAPSHOT_PART_BLOCKS,
    Heartbeat,
    PayloadDecoder,
    SinkSnapshots,
    SnapshotInfo,
    read_envelope,
    read_envelope_info,
    snapshot_envelope,
    snapshot_key,
    snapshot_parts,
    snapshot_subjects,
)
from kvstream.config import open_sink, open_subscriber
from kvstream.errors import ConfigError, DecodeError
from kvstream.state import SnapshotSchedule, StateKeeper


def _keeper(blocks: int) -> StateKeeper:
    k = StateKeeper()
    events: list[KVCacheEvent] = [
        BlockStored(
            block_hashes=list(range(i, i + 100)),
            parent_block_hash=None,
            token_ids=[1] * 100,
            block_size=1,
        )
        for i in range(0, blocks, 100)
    ]
    k.apply(EventBatch(seq=0, ts=2.0, events=events, origin="o", epoch="e"))
    return k


def _info(**kw: object) -> SnapshotInfo:
    fields: dict[str, object] = {
        "origin": "o",
        "epoch": "e",
        "resume_seq": 1,
        "position": "7",
        "where": "kv.events.o",
        "blocks": 0,
        "ts": 2.0,
    }
    fields.update(kw)
    return SnapshotInfo(**fields)  # type: ignore[arg-type]


def test_an_envelope_round_trips_in_parts_of_bounded_size() -> None:
    k = _keeper(3 * SNAPSHOT_PART_BLOCKS)
    head = k.snapshot_header("o")
    parts = list(snapshot_parts(head, k.snapshot_events("o")))
    assert len(parts) == 3
    data = snapshot_envelope(_info(blocks=head.blocks), parts)
    info, views = read_envelope(data, "here")
    assert info.parts == tuple(len(p) for p in parts)
    assert (info.origin, info.resume_seq, info.position, info.blocks) == ("o", 1, "7", head.blocks)
    decoder = PayloadDecoder()
    events = [e for v in views for e in decoder.decode(bytes(v), ("o", "e", 0), "json").events]
    assert events == k.snapshot("o").events


@pytest.mark.parametrize(
    ("data", "problem"),
    [
        (b"garbage", "not a kvstream snapshot"),
        (b"KVSNAP1\n{", "without its info line"),
        (b"KVSNAP1\n[1]\n", "not a snapshot record"),
        (b'KVSNAP1\n{"origin": 1}\n', "not a snapshot record"),
    ],
)
def test_bad_envelopes_are_decode_errors(data: bytes, problem: str) -> None:
    with pytest.raises(DecodeError, match=problem):
        read_envelope(data, "here")


def test_a_truncated_envelope_is_refused() -> None:
    k = _keeper(10)
    data = snapshot_envelope(_info(), list(snapshot_parts(k.snapshot("o"))))
    with pytest.raises(DecodeError, match="truncated"):
        read_envelope(data[:-3], "here")
    bad = data.replace(b'"resume_seq":1', b'"resume_seq":0')
    with pytest.raises(DecodeError, match="wrong type"):
        read_envelope(bad, "here")


def test_snapshot_subjects_are_unique_per_origin() -> None:
    # "a.b" and "a_b" share an event subject token, never a snapshot subject.
    assert snapshot_key("a.b") != snapshot_key("a_b")
    head, part = snapshot_subjects("node-1.example:0")
    assert head.startswith("kv.snapshot.node-1_example_0-")
    assert head.endswith(".head")
    assert part.endswith(".part")


def test_the_schedule_is_due_at_each_epoch_start_every_n_batches_and_after_t_seconds() -> None:
    now = [0.0]
    sched = SnapshotSchedule(3, 10.0, clock=lambda: now[0])

    def b(seq: int, epoch: str = "e") -> EventBatch:
        return EventBatch(seq=seq, ts=0.0, events=[], origin="o", epoch=epoch)

    assert sched.due(b(0))
    sched.taken("o", "e")
    assert [sched.due(b(i)) for i in (1, 2, 3)] == [False, False, True]
    sched.taken("o", "e")
    now[0] = 10.0
    assert sched.due(b(4))
    sched.taken("o", "e")
    assert sched.due(b(0, "f"))  # a new epoch: at once
    with pytest.raises(ConfigError, match="snapshot_every: expected an int >= 1"):
        SnapshotSchedule(0, None, clock=lambda: 0.0)
    with pytest.raises(ConfigError, match="snapshot_interval: expected seconds > 0"):
        SnapshotSchedule(None, -1.0, clock=lambda: 0.0)


def test_a_sink_keeper_over_its_bound_stops_snapshots_until_a_clear(
    caplog: pytest.LogCaptureFixture,
) -> None:
    snaps = SinkSnapshots("here", every=1, interval=None, max_bytes=5_000, clock=lambda: 0.0)
    big = BlockStored(
        block_hashes=list(range(100)), parent_block_hash=None, token_ids=[], block_size=0
    )
    assert snaps.delivered(EventBatch(seq=0, ts=0.0, events=[big], origin="o", epoch="e"), "1")
    assert "passes max_bytes=5000" in caplog.text
    assert snaps.take("o") is None
    assert "cannot publish a snapshot" in caplog.text
    clear = EventBatch(seq=1, ts=0.0, events=[AllBlocksCleared()], origin="o", epoch="e")
    snaps.delivered(clear, "2")
    taken = snaps.take("o")
    assert taken is not None
    assert (taken[0].resume_seq, taken[1]) == (2, "2")


def test_heartbeats_round_trip_and_refuse_bad_records() -> None:
    hb = Heartbeat("o", "e", 4, 0.5, 9)
    assert Heartbeat.from_json(hb.to_json()) == hb
    with pytest.raises(DecodeError, match="not a heartbeat"):
        Heartbeat.from_json(b"{")
    with pytest.raises(DecodeError, match="wrong type"):
        Heartbeat.from_json(b'{"origin": "o", "epoch": "e", "seq": 1, "interval": 0}')


def test_url_options_configure_snapshots_and_heartbeats() -> None:
    sink = open_sink(
        "nats://127.0.0.1:4333?snapshot_every=10&snapshot_interval=5&snapshot_max_bytes=1000"
        "&heartbeat=2&snapshot_stream=SNAPS"
    )
    snaps = sink.snapshots  # type: ignore[attr-defined]
    assert (snaps.schedule.every, snaps.schedule.interval, snaps.keeper.max_bytes) == (10, 5, 1000)
    assert (sink.heartbeat, sink.snapshot_stream) == (2.0, "SNAPS")  # type: ignore[attr-defined]
    rsink = open_sink("redis://127.0.0.1:6390/s?snapshot_interval=1")
    assert rsink.snapshots is not None  # type: ignore[attr-defined]
    assert open_sink("redis://127.0.0.1:6390/s").snapshots is None  # type: ignore[attr-defined]
    with pytest.raises(ConfigError, match="heartbeat: expected a number >= 0, got '-1'"):
        open_sink("redis://127.0.0.1:6390/s?heartbeat=-1")
    with pytest.raises(ConfigError, match=r"heartbeat: expected seconds > 0, got 0\.0"):
        open_sink("redis://127.0.0.1:6390/s?heartbeat=0")
    with pytest.raises(ConfigError, match="snapshot_stream"):
        open_sink("nats://127.0.0.1:4333?snapshot_every=1&snapshot_stream=a.b")
    sub = open_subscriber("nats://127.0.0.1:4333?heartbeats=true")
    assert sub.heartbeats  # type: ignore[attr-defined]
    assert sub.snapshots  # type: ignore[attr-defined]
    assert not open_subscriber("nats://127.0.0.1:4333?from_seq=0").snapshots  # type: ignore[attr-defined]
    assert not open_subscriber("redis://127.0.0.1:6390/s?snapshots=false").snapshots  # type: ignore[attr-defined]
    with pytest.raises(ConfigError, match="durable consumer"):
        open_subscriber("nats://127.0.0.1:4333?durable=me&snapshots=true")
    with pytest.raises(ConfigError, match="a group"):
        open_subscriber("redis://127.0.0.1:6390/s?group=g&snapshots=true")


def test_the_info_is_read_from_the_first_bytes_of_an_envelope() -> None:
    data = snapshot_envelope(_info(), list(snapshot_parts(_keeper(10).snapshot("o"))))
    info = read_envelope_info(data[:200], "here")
    assert info is not None
    assert (info.origin, info.position) == ("o", "7")
    assert read_envelope_info(data[:12], "here") is None  # the line is not complete yet
    with pytest.raises(DecodeError, match="not a kvstream snapshot"):
        read_envelope_info(b"xx", "here")
