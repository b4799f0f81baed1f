"""URLs shown in messages, logs and names never carry their secrets (SECURITY.md)."""

from __future__ import annotations

import pytest

from kvstream import MemorySink, Scheduler
from kvstream.config import open_sink, open_subscriber, parse_url, redact_url
from kvstream.consumers.file import FileSubscriber
from kvstream.errors import ConfigError
from kvstream.relay import Relay


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://user:s3cret@127.0.0.1:6379/kv", "redis://***@127.0.0.1:6379/kv"),
        ("redis://:s3cret@127.0.0.1:6379", "redis://***@127.0.0.1:6379"),
        (
            "nats://s3cret@[::1]:4222/kv.events?stream=KV",
            "nats://***@[::1]:4222/kv.events?stream=KV",
        ),
        ("tcp://127.0.0.1:5600?token=s3cret&policy=x", "tcp://127.0.0.1:5600?token=***&policy=x"),
        ("tcp://h:1?Password=s3cret&secret=s3cret", "tcp://h:1?Password=***&secret=***"),
        # Nothing secret: unchanged, including an @ in a path or a stream name.
        ("redis://127.0.0.1:6379/kv@prod?maxlen=5", "redis://127.0.0.1:6379/kv@prod?maxlen=5"),
        ("file:/var/kv@1.jsonl", "file:/var/kv@1.jsonl"),
        ("tcp://h:1?token_env=KV_TOKEN", "tcp://h:1?token_env=KV_TOKEN"),
        ("tcp://h:1?token=", "tcp://h:1?token="),
        ("engine-0", "engine-0"),
    ],
)
def test_redact_url(url: str, shown: str) -> None:
    assert redact_url(url) == shown
    assert parse_url(url).shown == shown


@pytest.mark.parametrize(
    ("url", "named"),
    [
        ("redis://user:s3cret@127.0.0.1:6379/kv?maxlen=0", "option maxlen"),
        ("redis://user:s3cret@127.0.0.1:99999/kv", "port: expected a number 0-65535"),
        ("nats://s3cret@127.0.0.1:4222/kv?bogus=1", "unknown option(s): bogus"),
        ("nats://u:s3cret@127.0.0.1:4222?storage=tape", "option storage"),
        ("tcp://127.0.0.1:5600?token=s3cret&policy=never", "option policy"),
        ("tcp://127.0.0.1:5600?token=s3cret", "option token: a secret in a URL"),
        ("zmq+tcp://u:s3cret@127.0.0.1?x", "malformed query string"),
        ("nosuch://u:s3cret@127.0.0.1:1/x", "nosuch"),
    ],
)
def test_configuration_errors_never_show_a_secret(url: str, named: str) -> None:
    for build in (open_sink, open_subscriber):
        with pytest.raises(ConfigError) as caught:
            build(url)
        text = str(caught.value)
        assert "s3cret" not in text
        assert "127.0.0.1" in text  # the URL is still named
    with pytest.raises(ConfigError) as caught:
        open_sink(url)
    assert named in str(caught.value)


async def test_a_relay_shows_its_upstreams_without_their_secrets(tmp_path: object) -> None:
    sub = FileSubscriber(f"{tmp_path}/none.jsonl")
    async with Scheduler(sinks=[MemorySink()], origin="relay") as scheduler:
        relay = Relay(scheduler, [sub], names=["redis://u:s3cret@127.0.0.1:6379/kv"])
        assert relay.names == ["redis://***@127.0.0.1:6379/kv"]
