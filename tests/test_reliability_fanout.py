"""Fan-out: subscribers cut off for falling behind resume from the ring and miss nothing.

Runs `benchmarks/reliability_fanout.py` small: five subscribers in another
process, one of them slow, and a per-subscriber bound so small that the sink
disconnects them (`slow="disconnect"`) while the producer runs ahead. Every
subscriber must still receive every batch, once, in order, the checked one
with every event as the seed regenerates it, and the producer must end with
the files it started with.
"""

from __future__ import annotations

import pytest
from benchmark_scripts import load_script

fanout = load_script("reliability_fanout")


@pytest.mark.slow
async def test_subscribers_disconnected_for_being_slow_resume_and_miss_nothing() -> None:
    # A first, small run: the event loop's own lasting files (uvloop opens /dev/null
    # once, at its first child process) are open before the files are counted.
    await fanout.produce(subscribers=1, batches=10, per_batch=5, slow=0, subscriber_bytes=16384)
    result = await fanout.produce(
        subscribers=5, batches=1000, per_batch=50, slow=1, subscriber_bytes=16384, timeout=120
    )
    subs = result["subscribers"]
    assert len(subs) == 5
    assert [s["batches"] for s in subs] == [1000] * 5
    assert [(s["gaps"], s["out_of_order"], s["wrong"]) for s in subs] == [(0, 0, 0)] * 5
    assert result["slow_disconnects"] >= 1  # the bound was hit: resuming was exercised
    assert result["connections_refused"] == 0
    assert result["open_files_after"] == result["open_files_before"]
