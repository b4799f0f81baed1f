"""URLs become objects in one place: parsing, options, sizes, and errors that name what is wrong."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvstream import ConfigError, FileSink, JsonCodec, MemorySink
from kvstream.config import (
    Options,
    make_codec,
    open_sink,
    open_subscriber,
    parse_size,
    parse_url,
)
from kvstream.consumers import FileSubscriber


@pytest.mark.parametrize(
    ("url", "scheme", "path"),
    [
        ("-", "file", "-"),
        ("file:/tmp/events.jsonl", "file", "/tmp/events.jsonl"),
        ("file:///tmp/events.jsonl", "file", "/tmp/events.jsonl"),
        ("file://relative/events.jsonl", "file", "relative/events.jsonl"),
        ("file:relative.jsonl", "file", "relative.jsonl"),
        ("events.jsonl", "file", "events.jsonl"),
        ("./out/events.jsonl", "file", "./out/events.jsonl"),
        ("/data/run:3/events.jsonl", "file", "/data/run:3/events.jsonl"),
        ("file:with%20space.jsonl", "file", "with space.jsonl"),
        ("memory:", "memory", ""),
        ("unix:/tmp/kv.sock", "unix", "/tmp/kv.sock"),
        ("unix:///tmp/kv.sock", "unix", "/tmp/kv.sock"),
    ],
)
def test_paths_and_schemes(url: str, scheme: str, path: str) -> None:
    parsed = parse_url(url)
    assert (parsed.scheme, parsed.path, parsed.raw) == (scheme, path, url)
    assert parsed.options == {}


def test_network_addresses_and_options() -> None:
    parsed = parse_url("tcp://127.0.0.1:5555?policy=drop_oldest&max_bytes=1MiB")
    assert (parsed.scheme, parsed.host, parsed.port) == ("tcp", "127.0.0.1", 5555)
    assert parsed.address == "127.0.0.1:5555"
    assert parsed.options == {"policy": "drop_oldest", "max_bytes": "1MiB"}
    v6 = parse_url("TCP://[::1]:7000")
    assert (v6.scheme, v6.host, v6.port, v6.address) == ("tcp", "::1", 7000, "[::1]:7000")
    assert parse_url("-?policy=drop_newest").options == {"policy": "drop_newest"}


@pytest.mark.parametrize(
    ("url", "named"),
    [
        ("", "non-empty"),
        ("   ", "non-empty"),
        ("tcp://host:99999", "port: expected a number 0-65535, got '99999'"),
        ("tcp://host:http", "port: expected a number 0-65535, got 'http'"),
        ("zmq+tcp://user:pw@[::1]:x1", "port: expected a number 0-65535, got 'x1'"),
        ("file:x?=&&", "malformed query"),
    ],
)
def test_malformed_urls(url: str, named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        parse_url(url)


def test_parse_url_refuses_what_is_not_a_string() -> None:
    with pytest.raises(ConfigError, match="URL"):
        parse_url(None)  # type: ignore[arg-type]


# -- sinks ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("form", ["file:{}", "file://{}", "{}"])
def test_file_sink_urls(form: str, tmp_path: Path) -> None:
    path = str(tmp_path / "events.jsonl")
    sink = open_sink(form.format(path))
    assert isinstance(sink, FileSink)
    assert sink.path == path
    assert sink.codec == JsonCodec()
    assert sink.policy == "block"


def test_dash_is_standard_output() -> None:
    sink = open_sink("-")
    assert isinstance(sink, FileSink)
    assert sink.path == "-"


def test_common_options_every_sink_takes() -> None:
    sink = open_sink("memory:?policy=drop_oldest&max_bytes=64MiB&max_batches=10&name=m&delay=0.5")
    assert isinstance(sink, MemorySink)
    assert (sink.policy, sink.max_bytes, sink.max_batches, sink.name) == (
        "drop_oldest",
        64 * 1024 * 1024,
        10,
        "m",
    )
    assert sink.delay == 0.5
    assert sink.codec is None


@pytest.mark.parametrize(
    "url", ["file:x.jsonl?hash_strings=1", "file:x.jsonl?codec=json&hash_strings=true"]
)
def test_codec_options(url: str) -> None:
    assert open_sink(url).codec == JsonCodec(hashes_as_strings=True)


def test_urls_can_share_codec_instances() -> None:
    codecs: dict[str, Any] = {}
    a = open_sink("file:a.jsonl?codec=json", codecs=codecs)
    b = open_sink("file:b.jsonl?codec=json", codecs=codecs)
    c = open_sink("file:c.jsonl?codec=json&hash_strings=1", codecs=codecs)
    assert a.codec is b.codec
    assert c.codec is not a.codec
    assert len(codecs) == 2


@pytest.mark.parametrize(
    ("url", "named"),
    [
        # unknown scheme: named, with the known ones
        ("bogus://host", "unknown scheme 'bogus'; expected one of: "),
        # unknown options: each named
        ("file:x.jsonl?bogus=1&also=2", "unknown option(s): also, bogus"),
        ("memory:?hash_strings=1", "unknown option(s): hash_strings"),
        # bad values: the option, the value and what was expected
        (
            "file:x.jsonl?policy=nope",
            "option policy: expected one of block, drop_oldest, drop_newest, got 'nope'",
        ),
        ("file:x.jsonl?max_bytes=lots", "option max_bytes: expected a size like"),
        ("file:x.jsonl?max_bytes=0", "option max_bytes: expected a positive size, got '0'"),
        ("file:x.jsonl?max_bytes=-5", "option max_bytes"),
        ("file:x.jsonl?max_batches=0", "option max_batches: expected >= 1, got 0"),
        ("file:x.jsonl?max_batches=many", "option max_batches: expected an integer, got 'many'"),
        (
            "file:x.jsonl?hash_strings=maybe",
            "option hash_strings: expected true or false, got 'maybe'",
        ),
        ("file:x.jsonl?codec=bogus", "option codec: unknown codec 'bogus'"),
        ("memory:?delay=-1", "option delay: expected a number >= 0, got '-1'"),
        ("memory:?delay=nan", "option delay"),
        ("file:", "expected a file path"),
    ],
)
def test_bad_sink_urls_are_named(url: str, named: str) -> None:
    with pytest.raises(ConfigError) as info:
        open_sink(url)
    assert named in str(info.value)
    if "bogus://" not in url and "codec=bogus" not in url:
        assert str(info.value).startswith(url)


# -- sizes --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("123", 123),
        ("64MiB", 64 * 2**20),
        ("64mib", 64 * 2**20),
        (" 8 KiB ", 8192),
        ("1.5KiB", 1536),
        ("64MB", 64_000_000),
        ("64M", 64_000_000),
        ("2k", 2000),
        ("1GiB", 2**30),
        ("1TiB", 2**40),
        ("10b", 10),
    ],
)
def test_sizes(text: str, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "-1", "0", "0.5", "1XB", "64 i", "inf", "1e3", "MiB"])
def test_bad_sizes_name_the_value(text: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_size(text, "option max_bytes")
    assert "option max_bytes" in str(info.value)
    assert repr(text) in str(info.value)


# -- subscribers, codecs, options, extras ----------------------------------------------------


def test_file_subscriber_urls(tmp_path: Path) -> None:
    path = str(tmp_path / "events.jsonl")
    sub = open_subscriber(f"file:{path}?follow=true&from_seq=3")
    assert isinstance(sub, FileSubscriber)
    assert (sub.path, sub.follow, sub.from_seq) == (path, True, 3)
    plain = open_subscriber(path)
    assert isinstance(plain, FileSubscriber)
    assert (plain.follow, plain.from_seq) == (False, None)
    with pytest.raises(ConfigError, match="standard input"):
        open_subscriber("-")
    with pytest.raises(ConfigError, match="unknown option"):
        open_subscriber(f"file:{path}?bogus=1")


def test_make_codec() -> None:
    assert make_codec("json") == JsonCodec()
    assert make_codec("json", Options("u", {"hash_strings": "yes"})) == JsonCodec(
        hashes_as_strings=True
    )
    with pytest.raises(ConfigError, match="unknown codec 'nope'"):
        make_codec("nope")


@pytest.mark.parametrize(
    "url",
    [
        "file:x.jsonl?name=",
        "file:x.jsonl?codec=",
        "redis://127.0.0.1:6379/kv?group=",
        "redis://127.0.0.1:6379/kv?start=",
        "nats://127.0.0.1:4222?durable=",
        "nats://127.0.0.1:4222?stream=",
        "zmq+tcp://127.0.0.1:5557?origin=",
        "zmq+tcp://127.0.0.1:5557?replay=",
        "tcp://127.0.0.1:5600?token_env=",
    ],
)
def test_an_empty_option_is_refused_not_taken_for_its_default(url: str) -> None:
    """`?group=` (a template variable left unset) used to read as no group at all: a plain
    reader instead of a group member, with nothing said."""
    key = url.rpartition("?")[2].rstrip("=")
    with pytest.raises(ConfigError) as info:
        (open_sink if url.startswith("file:") else open_subscriber)(url)
    assert str(info.value).startswith(url.partition("?")[0])
    assert f"option {key}: expected a value, got an empty one" in str(info.value)


def test_an_empty_zmq_topic_is_the_topic_vllm_uses() -> None:
    # Taken, not refused, on either end (the sink is not opened: nothing binds).
    assert open_subscriber("zmq+tcp://127.0.0.1:5557?topic=") is not None
    assert open_sink("zmq+tcp://127.0.0.1:5557?topic=").topic == ""  # type: ignore[attr-defined]
    opts = Options("u", {"t": ""})
    assert opts.pop_str("t", "x", allow_empty=True) == ""


def test_options_are_taken_one_by_one_and_leftovers_refused() -> None:
    opts = Options("u", {"a": "1", "b": "2.5", "c": "off", "d": "4KiB", "e": "x"})
    assert "a" in opts
    assert opts.pop_int("a") == 1
    assert "a" not in opts
    assert opts.pop_float("b") == 2.5
    assert opts.pop_bool("c", default=True) is False
    assert opts.pop_size("d", 1) == 4096
    assert opts.pop_int("missing", 7) == 7
    assert opts.pop_choice("e", ("x", "y"), "y") == "x"
    opts.finish()
    leftover = Options("u", {"z": "1"})
    with pytest.raises(ConfigError, match="unknown option"):
        leftover.finish()
