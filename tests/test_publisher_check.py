"""How much of a step of vLLM's own structs the drop-in checks on vLLM's wire (`check`).

vLLM's structs go out as they are (encoded as vLLM encodes them) once the check
passes; a step that fails it, or that msgspec cannot write, is converted event by
event, the bad events refused by name and the others published.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
import vllm_wire as vllm
import zmq

from kvstream.codecs.msgpack import MsgpackCodec
from kvstream.errors import ConfigError
from kvstream.publisher import EventPublisher


def hashes(events: Sequence[Any]) -> list[int]:
    """The first block hash of every event (each a BlockStored here)."""
    return [e.block_hashes[0] for e in events]


def stored(i: int, **changes: Any) -> vllm.BlockStored:
    fields: dict[str, Any] = {
        "block_hashes": [i * 16 + b for b in range(4)],
        "parent_block_hash": None,
        "token_ids": list(range(i, i + 16)),
        "block_size": 4,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    }
    fields.update(changes)
    return vllm.BlockStored(**fields)


class Wire:
    """A publisher on an inproc vLLM wire and a SUB reading its payloads."""

    def __init__(self, check: str) -> None:
        endpoint = f"inproc://check-{time.monotonic_ns()}"
        self.pub = EventPublisher.from_kv_events_config(
            {"endpoint": endpoint}, check=check, origin="engine"
        )
        self.sub: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(endpoint)
        sink: Any = self.pub.scheduler.sinks[0]
        deadline = time.monotonic() + 10
        while sink.statistics().subscriptions < 1:
            assert time.monotonic() < deadline, "never subscribed"
            time.sleep(0.005)

    def payload(self) -> bytes:
        assert self.sub.poll(5000), "nothing published"
        _topic, _seq, payload = self.sub.recv_multipart()
        return bytes(payload)

    def close(self) -> None:
        self.pub.shutdown()
        self.sub.close(linger=0)


@pytest.fixture(params=["sample", "all"])
def wire(request: pytest.FixtureRequest) -> Iterator[Wire]:
    w = Wire(request.param)
    try:
        yield w
    finally:
        w.close()


def test_a_valid_step_goes_out_as_vllm_encodes_it(wire: Wire) -> None:
    step = [stored(i) for i in range(8)]
    wire.pub.publish(step)
    payload = wire.payload()
    assert hashes(vllm.decoder.decode(payload).events) == hashes(step)
    assert wire.pub.statistics().events_refused == 0


@pytest.mark.parametrize("where", [0, 7])
def test_a_wrong_field_in_the_first_or_last_event_is_refused_by_name(
    wire: Wire, where: int, caplog: pytest.LogCaptureFixture
) -> None:
    step = [stored(i) for i in range(8)]
    step[where] = stored(where, block_size="4")
    wire.pub.publish(step)
    got = vllm.decoder.decode(wire.payload()).events
    assert hashes(got) == [i * 16 for i in range(8) if i != where]
    assert wire.pub.statistics().events_refused == 1
    assert "block_size" in caplog.text


def test_a_value_msgspec_cannot_write_anywhere_is_refused_the_rest_published(
    wire: Wire, caplog: pytest.LogCaptureFixture
) -> None:
    step = [stored(i) for i in range(8)]
    step[3] = stored(3, lora_name=object())  # the sample does not look at event 3
    wire.pub.publish(step)
    got = vllm.decoder.decode(wire.payload()).events
    assert hashes(got) == [i * 16 for i in range(8) if i != 3]
    # Refused on the loop ("all") or while encoding ("sample": counted by the sink).
    sink = wire.pub.scheduler.sinks[0]
    deadline = time.monotonic() + 10
    while sink.statistics().batches_out < 1:
        assert time.monotonic() < deadline, "the sink never counted the batch"
        time.sleep(0.005)
    refused = sink.statistics().events_refused + wire.pub.statistics().events_refused
    assert refused == 1
    assert "lora_name" in caplog.text


def test_check_all_refuses_a_writable_wrong_type_in_the_middle() -> None:
    w = Wire("all")
    try:
        step = [stored(i) for i in range(8)]
        step[3] = stored(3, medium=7)
        w.pub.publish(step)
        got = vllm.decoder.decode(w.payload()).events
        assert hashes(got) == [i * 16 for i in range(8) if i != 3]
        assert w.pub.statistics().events_refused == 1
    finally:
        w.close()


def test_check_sample_sends_a_writable_wrong_type_in_the_middle_as_vllm_would() -> None:
    # The documented trade: it goes out as vLLM's publisher would send it, and
    # kvstream's consumers refuse that one event (vLLM's typed decoder, the batch).
    w = Wire("sample")
    try:
        step = [stored(i) for i in range(8)]
        step[3] = stored(3, medium=7)
        w.pub.publish(step)
        payload = w.payload()
        codec = MsgpackCodec()
        batch = codec.decode(payload)
        assert hashes(batch.events) == [i * 16 for i in range(8) if i != 3]
        assert codec.events_refused == 1
    finally:
        w.close()


def test_check_takes_only_its_names() -> None:
    with pytest.raises(ConfigError, match=r"check.*sample, all.*'some'"):
        EventPublisher([], check="some")  # type: ignore[arg-type]
