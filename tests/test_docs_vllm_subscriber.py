"""kvstream's ZMQ sink, read by a subscriber shaped like the one in vLLM's docs.

vLLM documents a subscriber (`examples/online_serving/kv_events_subscriber.py`): msgspec
structs copied from vLLM, a SUB socket subscribed to the topic `kv-events` reading
`[topic, seq, payload]`, and on a gap a REQ socket sending the 8-byte start sequence to the
replay endpoint and reading the reply. The subscriber below is written to that shape (not
copied), in two versions: the one of vLLM v0.25 and earlier (events decoded as tagged
arrays, replay replies `[seq, payload]`) and one for v0.26 and later (events as tagged maps,
replay replies with the topic frame). Each reads the sink configured with the options
docs/sinks/zmq.md gives for its release, and the old one fails on the defaults exactly as
users saw it fail.
"""

from __future__ import annotations

from typing import Any

import anyio
import anyio.to_thread
import msgspec
import pytest
from docs_blocks import free_port
from msgspec.msgpack import Decoder

import kvstream as kvs
from kvstream.config import open_sink

zmq = pytest.importorskip("zmq")

TOPIC = "kv-events"
TIMEOUT_MS = 20_000


# -- the subscriber, of the example's shape ----------------------------------------------


class OldBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]


class OldEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """vLLM v0.25 and earlier: every event a tagged array."""


class OldBlockStored(OldEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class OldBlockRemoved(OldEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None


class OldAllBlocksCleared(OldEvent, tag="AllBlocksCleared"):
    pass


class OldEventBatch(OldBatch):
    events: list[OldBlockStored | OldBlockRemoved | OldAllBlocksCleared]


class NewEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """vLLM v0.26 and later: every event a map tagged by its "type"."""


class NewBlockStored(NewEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None


class NewBlockRemoved(NewEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None = None


class NewAllBlocksCleared(NewEvent, tag="AllBlocksCleared"):
    pass


class NewEventBatch(OldBatch):
    events: list[NewBlockStored | NewBlockRemoved | NewAllBlocksCleared]


def subscribe_like_the_example(
    endpoint: str, replay: str, *, legacy: bool, count: int, ready: Any
) -> tuple[list[tuple[int, Any]], tuple[int, Any]]:
    """Read ``count`` live batches, then replay from the second one, as the example does.

    Returns the live ``(seq, batch)`` pairs and the first replayed pair. Raises what
    the decoder raises on a payload it cannot read.
    """
    decoder = Decoder(type=OldEventBatch if legacy else NewEventBatch)
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    replay_socket = context.socket(zmq.REQ)
    try:
        sub.connect(endpoint)
        sub.setsockopt_string(zmq.SUBSCRIBE, TOPIC)
        replay_socket.connect(replay)
        ready()
        live: list[tuple[int, Any]] = []
        while len(live) < count:
            if not sub.poll(TIMEOUT_MS):
                raise TimeoutError("no live message")
            _topic, seq_bytes, payload = sub.recv_multipart()
            live.append((int.from_bytes(seq_bytes, "big"), decoder.decode(payload)))
        # The example's gap branch: ask for the batches after the last one it had.
        start = live[0][0] + 1
        replay_socket.send(start.to_bytes(8, "big"))
        if not replay_socket.poll(TIMEOUT_MS):
            raise TimeoutError("no replay reply")
        frames = replay_socket.recv_multipart()
        if legacy:
            seq_bytes, payload = frames  # [seq, payload]: no topic frame
        else:
            _topic, seq_bytes, payload = frames
        return live, (int.from_bytes(seq_bytes, "big"), decoder.decode(payload))
    finally:
        sub.close(linger=0)
        replay_socket.close(linger=0)
        context.term()


# -- kvstream's side --------------------------------------------------------------------

EMITTED = [
    [
        kvs.BlockStored(
            block_hashes=[11, 12],
            parent_block_hash=None,
            token_ids=list(range(8)),
            block_size=4,
            medium="GPU",
        )
    ],
    [kvs.BlockRemoved(block_hashes=[12], medium="GPU")],
    [kvs.AllBlocksCleared()],
    [
        kvs.BlockStored(
            block_hashes=[21], parent_block_hash=11, token_ids=[7] * 4, block_size=4, medium="CPU"
        )
    ],
]


async def publish_and_read(options: str, *, legacy: bool) -> tuple[list[Any], Any]:
    port, replay_port = free_port(), free_port()
    # The URL docs/sinks/zmq.md gives, on loopback (bind=1: the sink binds, as with '*').
    url = (
        f"zmq+tcp://127.0.0.1:{port}?bind=1&replay=tcp://127.0.0.1:{replay_port}"
        f"&topic={TOPIC}{options}"
    )
    sink: Any = open_sink(url)
    async with (
        kvs.Scheduler(sinks=[sink], origin="engine-0") as kv,
        anyio.create_task_group() as tg,
    ):
        result: dict[str, Any] = {}

        async def read() -> None:
            try:
                result["value"] = await anyio.to_thread.run_sync(
                    lambda: subscribe_like_the_example(
                        f"tcp://127.0.0.1:{port}",
                        f"tcp://127.0.0.1:{replay_port}",
                        legacy=legacy,
                        count=len(EMITTED),
                        ready=lambda: None,
                    )
                )
            except Exception as exc:
                result["error"] = exc

        tg.start_soon(read)
        with anyio.fail_after(20):
            await sink.wait_subscribed()
        for events in EMITTED:
            kv.emit(*events)  # type: ignore[misc]
            await kv.tick()
    if "error" in result:
        raise result["error"]
    live, replayed = result["value"]
    return live, replayed


def assert_read_back(live: list[tuple[int, Any]], replayed: tuple[int, Any]) -> None:
    assert [seq for seq, _ in live] == [0, 1, 2, 3]
    first = live[0][1].events[0]
    assert type(first).__struct_config__.tag == "BlockStored"
    assert (first.block_hashes, first.parent_block_hash, first.token_ids) == (
        [11, 12],
        None,
        list(range(8)),
    )
    assert (first.block_size, first.medium) == (4, "GPU")
    kinds = [type(batch.events[0]).__struct_config__.tag for _, batch in live]
    assert kinds == ["BlockStored", "BlockRemoved", "AllBlocksCleared", "BlockStored"]
    assert live[3][1].events[0].parent_block_hash == 11
    seq, batch = replayed
    assert seq == 1
    assert type(batch.events[0]).__struct_config__.tag == "BlockRemoved"
    assert batch.events[0].block_hashes == [12]


async def test_a_subscriber_for_vllm_v025_and_earlier_reads_the_documented_options() -> None:
    live, replayed = await publish_and_read("&profile=positional&replay_layout=legacy", legacy=True)
    assert_read_back(live, replayed)


async def test_a_subscriber_for_vllm_v026_and_later_reads_the_defaults() -> None:
    live, replayed = await publish_and_read("", legacy=False)
    assert_read_back(live, replayed)


async def test_the_old_subscriber_cannot_read_the_defaults() -> None:
    # What users of the older example saw before choosing the options: every message fails.
    with pytest.raises(msgspec.ValidationError, match="Expected `array`, got `object`"):
        await publish_and_read("", legacy=True)
