"""The encode side of the codecs: the fast paths write exactly the bytes of the plain ones.

``JsonCodec.encode`` writes through msgspec structs; its lines must be the bytes
orjson writes for ``batch_to_dict`` (what every earlier version wrote), for every
valid batch, both hash encodings.
"""

from __future__ import annotations

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from strategies import batches

from kvstream import BlockRemoved, BlockStored, EventBatch, JsonCodec
from kvstream.codecs.json import json_default


def reference(codec: JsonCodec, batch: EventBatch) -> bytes:
    return orjson.dumps(
        codec.batch_to_dict(batch), default=json_default, option=orjson.OPT_APPEND_NEWLINE
    )


@pytest.mark.parametrize("decimal", [False, True])
@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(batch=batches)
def test_json_lines_are_the_bytes_of_the_dict_path(decimal: bool, batch: EventBatch) -> None:
    codec = JsonCodec(hashes_as_strings=decimal)
    assert codec.encode(batch) == reference(codec, batch)
    assert codec.encode_screened(batch) == (codec.encode(batch), ())


@pytest.mark.parametrize("ts", [1e16, -1e16, 1.5e300, 1767225600.125, 0.0, -0.0, 1e-7, 5e-324])
def test_floats_are_written_as_orjson_writes_them(ts: float) -> None:
    codec = JsonCodec()
    event = BlockStored(
        block_hashes=[1, 2**64 - 1],
        parent_block_hash=b"\x01\x02",
        token_ids=[],
        block_size=0,
        extra_keys=[[1e20, b"\xff"], None],
        metadata={"big": 1e22, "small": 1e-9, "n": [2**63, -(2**63)]},
    )
    removed = BlockRemoved(block_hashes=[b"\xaa", 3], metadata={"x": 1.5e17})
    batch = EventBatch(seq=3, ts=ts, events=[event, removed], origin="o", epoch="e")
    assert codec.encode(batch) == reference(codec, batch)
    assert codec.decode(codec.encode(batch)) == batch


def test_decode_keyed_checks_the_name_the_transport_gives() -> None:
    codec = JsonCodec()
    batch = EventBatch(
        seq=4, ts=1.0, events=[BlockRemoved(block_hashes=[1])], origin="o", epoch="e"
    )
    data = codec.encode(batch)
    assert codec.decode_keyed(data, seq=4, origin="o", epoch="e") == batch
    with pytest.raises(ValueError, match="names batch o/e/5"):
        codec.decode_keyed(data, seq=5, origin="o", epoch="e")
