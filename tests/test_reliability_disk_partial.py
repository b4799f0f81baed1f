"""After a full disk, space that returns a little at a time is used as it returns.

Before, the file sink's retry after `ENOSPC` was one all-or-nothing write of
every batch it held: with less room than all of them (175 batches waiting,
94 KB free) it wrote nothing, ever, until enough room came back for all at
once. Now the whole batches that fit stay written, the torn rest is cut off,
and the retry writes only what is left. On a real tmpfs (`KVSTREAM_TEST_MOUNT=1`,
as root; the fixture is `tests/test_reliability_faults.py`'s).
"""

from __future__ import annotations

import os
from contextlib import aclosing
from pathlib import Path

import pytest
from servers import wait_until
from test_reliability_faults import FAST_RETRY, DiskProducer, _caught_up, _fill, tiny_disk

from kvstream import FileSink, JsonCodec, Scheduler
from kvstream.consumers.base import Gap
from kvstream.consumers.file import FileSubscriber
from kvstream.testing import SeededEvents, StreamVerifier

pytestmark = pytest.mark.usefixtures("no_leaked_tasks")

__all__ = ["tiny_disk"]  # the fixture, used by name

PER_BATCH = 4


def _lines(path: Path) -> int:
    return path.read_bytes().count(b"\n")


async def test_space_that_partly_returns_takes_the_whole_batches_that_fit(
    tiny_disk: Path,
) -> None:
    stream = SeededEvents(9)
    path = tiny_disk / "events.jsonl"
    sink = FileSink(path, policy="block", max_batches=400, name="disk", **FAST_RETRY)
    async with Scheduler(sinks=[sink], origin="eng") as scheduler:
        producer = DiskProducer(scheduler, stream, PER_BATCH)
        await producer.produce(5)
        await wait_until(lambda: _caught_up(sink))
        ballast = _fill(tiny_disk)
        await producer.until_unhealthy(sink)
        await producer.produce(150)  # far more than the room that comes back below
        held = sink.statistics().queued_batches
        on_disk = _lines(path)
        assert held > 100

        # A little room returns: 32 KiB of the ballast, far less than what waits.
        os.truncate(ballast, ballast.stat().st_size - 32 * 1024)
        # What fits is written: 32 KiB holds more than 16 lines of about 1 KB; before,
        # the all-or-nothing retry of everything waiting wrote none of them.
        await wait_until(lambda: _lines(path) >= on_disk + 16)
        st = sink.statistics()
        # Still more to write than fits. (Not `healthy`: the hop in flight when room
        # returned may have gone out whole, marking the sink healthy until the next
        # hop meets the full disk again.)
        assert st.batches_out < st.batches_in
        # Whole lines only: every line in the file decodes, none was torn.
        assert path.read_bytes().endswith(b"\n")
        JsonCodec().decode_lines(path.read_bytes())

        ballast.unlink()  # the rest of the room returns
        await wait_until(lambda: _caught_up(sink))
        await producer.produce(5)
        report = await scheduler.aclose(timeout=10)
    seq = producer.seq

    assert report.complete
    st = sink.statistics()
    assert (st.batches_in, st.batches_out, st.batches_dropped) == (seq, seq, 0)
    # Every batch once, in order, nothing torn, nothing repeated.
    seen = StreamVerifier(stream, origin="eng", events_per_batch=PER_BATCH)
    async with FileSubscriber(path) as sub, aclosing(aiter(sub)) as items:  # type: ignore[type-var]
        async for item in items:
            assert not isinstance(item, Gap), item
            seen.check(item)
    assert sub.bad_lines == 0
    assert (seen.batches, seen.gaps) == (seq, 0)
