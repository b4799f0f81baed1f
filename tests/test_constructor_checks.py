"""Every constructor refuses a wrong argument at once, with a ConfigError naming it.

A value of the wrong type used to be taken as it was and to fail later, far from
its cause (a close timeout of "5" broke the close), or never (a str `follow`
read as True). Each row passes one wrong value and checks the message names the
field and the value.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest

from kvstream import FileSink, MemorySink, PrefixIndex, Scheduler
from kvstream.config import open_sink
from kvstream.consumers.file import FileSubscriber
from kvstream.consumers.nats import NatsSubscriber
from kvstream.consumers.redis import RedisSubscriber
from kvstream.consumers.socket import SocketSubscriber
from kvstream.consumers.zmq import ZmqPublisher, ZmqSubscriber
from kvstream.errors import ConfigError
from kvstream.sinks.nats import NatsSink
from kvstream.sinks.redis import RedisSink
from kvstream.sinks.socket import SocketSink
from kvstream.sinks.zmq import ZmqSink

PUB = ZmqPublisher(endpoint="tcp://127.0.0.1:5557")

CASES: list[tuple[Callable[..., Any], dict[str, Any], str]] = [
    (Scheduler, {"close_timeout": "5"}, "Scheduler.close_timeout: expected seconds >= 0, got '5'"),
    (Scheduler, {"tick_interval": True}, "Scheduler.tick_interval: expected seconds > 0, got True"),
    (Scheduler, {"epoch": 7}, "Scheduler.epoch: expected a non-empty str, got 7"),
    (Scheduler, {"clock": 3.0}, "Scheduler.clock: expected a callable, got 3.0"),
    (Scheduler, {"ticker": [1, 2]}, "Scheduler.ticker: expected an async iterable"),
    (MemorySink, {"delay": -1}, "MemorySink.delay: expected seconds >= 0, got -1"),
    (FileSink, {"path": 3}, "FileSink.path: expected a str or a path, got 3"),
    (FileSink, {"path": "x", "clock": "now"}, "FileSink.clock: expected a callable, got 'now'"),
    (FileSink, {"path": "x", "rotate_seconds": True}, "rotate_seconds: expected seconds > 0"),
    (PrefixIndex, {"block_size": 16, "default_weight": math.nan}, "default_weight"),
    (PrefixIndex, {"block_size": 16, "lookup_table": "no"}, "lookup_table: expected True or"),
    (PrefixIndex, {"block_size": 16, "clock": 1}, "PrefixIndex.clock: expected a callable"),
    (SocketSink, {"port": 0, "host": 1}, "SocketSink.host: expected a str, got 1"),
    (SocketSink, {"port": 0, "ssl_context": "tls"}, "SocketSink.ssl_context: expected an ssl"),
    (SocketSink, {"port": 0, "snapshot_provider": 5}, "snapshot_provider: expected a callable"),
    (SocketSink, {"port": 0, "hello_timeout": True}, "hello_timeout: expected seconds > 0"),
    (SocketSink, {"port": 0, "heartbeat": "1"}, "SocketSink.heartbeat: expected seconds > 0"),
    (ZmqSink, {"bind": "yes"}, "ZmqSink: bind: expected True, False or None, got 'yes'"),
    (ZmqSink, {"context": object()}, "ZmqSink: context: expected a zmq.Context"),
    (ZmqSink, {"model": 3}, "model: expected a non-empty str, got 3"),
    (ZmqSink, {"linger": True}, "ZmqSink: linger: expected seconds >= 0, got True"),
    (NatsSink, {"url": 5}, "NatsSink.url: expected a non-empty str, got 5"),
    (NatsSink, {"stream": 5}, "stream: expected a non-empty str, got 5"),
    (NatsSink, {"create": "false"}, "create: expected True or False, got 'false'"),
    (NatsSink, {"max_age": "1d"}, "max_age: expected seconds >= 0, got '1d'"),
    (NatsSink, {"max_msgs": 0}, "max_msgs: expected an int >= 1, got 0"),
    (NatsSink, {"ack_timeout": -1}, "ack_timeout: expected seconds > 0, got -1"),
    (NatsSink, {"snapshot_stream": 5}, "snapshot_stream: expected a stream name"),
    (NatsSink, {"heartbeat": "2"}, "heartbeat: expected seconds > 0, got '2'"),
    (NatsSink, {"snapshot_every": 0}, "snapshot_every: expected an int >= 1, got 0"),
    (RedisSink, {"stream": 5}, "stream: expected a key name, got 5"),
    (RedisSink, {"db": -1}, "db: expected an int >= 0, got -1"),
    (RedisSink, {"connect_timeout": "5"}, "connect_timeout: expected seconds > 0, got '5'"),
    (RedisSink, {"dedup_scan": True}, "dedup_scan: expected an int >= 1, got True"),
    (RedisSink, {"retry_connect": "no"}, "retry_connect: expected True or False, got 'no'"),
    (NatsSink, {"retry_connect": 0}, "retry_connect: expected True or False, got 0"),
    (SocketSubscriber, {"port": 1, "host": 2}, "SocketSubscriber.host: expected a str, got 2"),
    (SocketSubscriber, {"port": 1, "reconnect": "no"}, "reconnect: expected True or False"),
    (SocketSubscriber, {"port": 1, "ssl_context": 1}, "ssl_context: expected an ssl.SSLContext"),
    (SocketSubscriber, {"port": 1, "on_liveness": 1}, "on_liveness: expected a callable"),
    (SocketSubscriber, {"port": 1, "connect_timeout": "9"}, "connect_timeout: expected seconds"),
    (FileSubscriber, {"path": 1}, "FileSubscriber.path: expected a str or a path, got 1"),
    (FileSubscriber, {"path": "x", "follow": "no"}, "follow: expected True or False, got 'no'"),
    (FileSubscriber, {"path": "x", "poll_interval": 0}, "poll_interval: expected seconds > 0"),
    (FileSubscriber, {"path": "x", "codec": "json"}, "FileSubscriber.codec: expected a JsonCodec"),
    (NatsSubscriber, {"stream": 5}, "stream: expected a non-empty str, got 5"),
    (NatsSubscriber, {"ack_wait": "30"}, "ack_wait: expected seconds > 0, got '30'"),
    (NatsSubscriber, {"poll_interval": "1"}, "poll_interval: expected seconds > 0, got '1'"),
    (RedisSubscriber, {"group": 5}, "group: expected a name, got 5"),
    (RedisSubscriber, {"start": 0}, "start: expected 0, $ or an entry id"),
    (RedisSubscriber, {"block": "1"}, "block: expected seconds > 0, got '1'"),
    (RedisSubscriber, {"db": "0"}, "db: expected an int >= 0, got '0'"),
    (ZmqSubscriber, {"publishers": "tcp://h:1"}, "publishers: expected a ZmqPublisher or a list"),
    (ZmqSubscriber, {"publishers": [PUB, 3]}, "publishers: expected a ZmqPublisher or a list"),
    (ZmqSubscriber, {"publishers": PUB, "poll_interval": 0}, "poll_interval: expected seconds"),
    (ZmqSubscriber, {"publishers": PUB, "hwm": -1}, "ZmqSubscriber.hwm: expected an int >= 0"),
    (ZmqSubscriber, {"publishers": PUB, "heartbeats": 1}, "heartbeats: expected True or False"),
    (ZmqSubscriber, {"publishers": PUB, "codec": "msgpack"}, "codec: expected a MsgpackCodec"),
    (ZmqSubscriber, {"publishers": PUB, "replay_timeout": "5"}, "replay_timeout: expected"),
]


@pytest.mark.parametrize(
    ("make", "kwargs", "named"),
    CASES,
    ids=[f"{make.__name__}-{next(iter(kw))}-{i}" for i, (make, kw, _) in enumerate(CASES)],
)
def test_a_wrong_argument_is_a_config_error_naming_it(
    make: Callable[..., Any], kwargs: dict[str, Any], named: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        make(**kwargs)
    assert named in str(caught.value)


def test_the_defaults_and_the_usual_values_are_taken() -> None:
    Scheduler(close_timeout=math.inf, tick_interval=0.5, epoch="e", clock=lambda: 0.0)
    MemorySink(delay=0)
    PrefixIndex(block_size=16, lookup_table=False, default_weight=0)
    SocketSubscriber(port=1, host="", snapshots=False, connect_timeout=math.inf)
    ZmqSubscriber([PUB], hwm=0, heartbeats=True, on_liveness=print)
    NatsSink(create=True, max_age=60, max_msgs=10, duplicate_window=120, heartbeat=1)
    open_sink("nats://127.0.0.1:4222/kv?max_age=0&duplicate_window=0")  # NATS's own 0s
    RedisSink(db=0, dedup_scan=1)
    RedisSubscriber(start="0", db=1, block=0.5)
