"""Load: a million seeded events through one scheduler into every local sink, policy block.

Each sink's consumer checks every sequence number once, in order, and every
event equal to the one regenerated from the seed (nothing is held in memory to
compare against). The 10-million-event run of the same pipeline is
``benchmarks/reliability_load.py``.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import anyio
import pytest

from kvstream import FileSink, MemorySink, QueueSink, Scheduler
from kvstream.consumers.file import FileSubscriber
from kvstream.events import EventBatch
from kvstream.testing import SeededEvents, StreamVerifier, VerificationError

#: About a million events (the brief's CI size); override with KVSTREAM_LOAD_EVENTS.
EVENTS = int(os.environ.get("KVSTREAM_LOAD_EVENTS", "1000000"))
PER_BATCH = 100
SEED = 20260601


@pytest.mark.slow
async def test_a_million_events_reach_every_local_sink_exactly_once_in_order() -> None:
    stream = SeededEvents(SEED)
    folder = tempfile.mkdtemp(dir="/tmp", prefix="kvs-load-")
    path = Path(folder) / "load.jsonl"
    file_sink = FileSink(path, policy="block", max_bytes=8 << 20)
    memory = MemorySink(policy="block", max_batches=256)
    queue = QueueSink(policy="block", max_batches=256)
    from_memory = StreamVerifier(stream, origin="load", events_per_batch=PER_BATCH)
    from_queue = StreamVerifier(stream, origin="load", events_per_batch=PER_BATCH)
    from_file = StreamVerifier(stream, origin="load", events_per_batch=PER_BATCH)

    async def consume_queue() -> None:
        async with queue.receive_stream as batches_in:
            async for batch in batches_in:
                from_queue.check(batch)

    def consume_memory() -> None:
        # No await between reading and clearing: nothing is appended meanwhile.
        from_memory.check_all(memory.batches)
        memory.batches.clear()

    batches = EVENTS // PER_BATCH
    async with anyio.create_task_group() as tg:
        tg.start_soon(consume_queue)
        async with Scheduler(sinks=[file_sink, memory, queue], origin="load") as scheduler:
            for n, chunk in enumerate(stream.chunks(batches * PER_BATCH, PER_BATCH)):
                scheduler.emit(chunk)
                batch = await scheduler.tick()
                assert batch is not None
                assert batch.seq == n
                if n % 64 == 0:
                    consume_memory()
            report = await scheduler.aclose(timeout=60)
            stats = {s.name: s for s in scheduler.statistics().sinks}
        consume_memory()

    assert report.complete, report
    for sink in (file_sink, memory, queue):
        st = stats[sink.name]
        assert (st.batches_in, st.batches_out, st.batches_dropped) == (batches, batches, 0), st
        assert st.events_out == batches * PER_BATCH
        assert st.send_errors == 0

    async with FileSubscriber(path) as sub:
        async for item in sub:
            assert isinstance(item, EventBatch), item  # a Gap would fail here
            from_file.check(item)
    assert sub.bad_lines == 0

    for verifier in (from_memory, from_queue, from_file):
        assert verifier.batches == batches
        assert verifier.events == batches * PER_BATCH
        assert verifier.gaps == 0
    path.unlink()
    os.rmdir(folder)


def test_the_verifier_catches_loss_duplication_reordering_and_corruption() -> None:
    """The check above can fail: every kind of damage is caught."""
    stream = SeededEvents(SEED)
    assert stream.events(0, 50) == SeededEvents(SEED).events(0, 50)  # regenerated, equal
    assert stream.events(0, 50) != SeededEvents(SEED + 1).events(0, 50)

    def batch(seq: int, *, events: list[Any] | None = None, epoch: str = "e") -> EventBatch:
        made = stream.events(seq * 4, seq * 4 + 4) if events is None else events
        return EventBatch(seq=seq, ts=0.0, events=made, origin="load", epoch=epoch)

    damaged = {
        "lost": [batch(0), batch(2)],
        "duplicated": [batch(0), batch(1), batch(1)],
        "reordered": [batch(1), batch(0)],
        "corrupted": [batch(0, events=stream.events(4, 8))],
        "short": [batch(0, events=stream.events(0, 3)), batch(1)],
        "restarted": [batch(0), batch(1, epoch="other")],
    }
    for name, batches in damaged.items():
        verifier = StreamVerifier(stream, origin="load")
        try:
            verifier.check_all(batches)
        except VerificationError:
            continue
        pytest.fail(f"{name}: not caught")
    # With a known batch size, a gap is counted instead (what a drop policy leaves).
    counting = StreamVerifier(stream, origin="load", events_per_batch=4)
    counting.check_all([batch(0), batch(3), batch(4)])
    assert (counting.gaps, counting.missing_batches, counting.missing_events) == (1, 2, 8)
