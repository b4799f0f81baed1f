"""vLLM's `--kv-events-config` on kvstream's command line.

Any command that publishes can accept the JSON users already give vLLM:

    add_kv_events_config_option(parser)
    ...
    sink = zmq_sink_from_kv_events_config(args.kv_events_config)   # None if it is off

The parsing rules live in `kvstream._wire.vllm_zmq`; the sink is a
[`ZmqSink`][kvstream.sinks.zmq.ZmqSink] bound or connected by vLLM's rule, with
the ring, high-water mark and topic the config names.
"""

from __future__ import annotations

import argparse
import logging
from typing import TYPE_CHECKING, Any

from kvstream._wire.vllm_zmq import parse_kv_events_config

if TYPE_CHECKING:
    from kvstream.sinks.zmq import ZmqSink

__all__ = ["add_kv_events_config_option", "zmq_sink_from_kv_events_config"]

log = logging.getLogger("kvstream.cli")


def add_kv_events_config_option(parser: argparse.ArgumentParser) -> None:
    """Add `--kv-events-config JSON` to a subcommand's parser."""
    parser.add_argument(
        "--kv-events-config",
        metavar="JSON",
        default=None,
        help="also publish on vLLM's ZMQ wire, configured as vLLM's --kv-events-config "
        '(e.g. \'{"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}\')',
    )


def zmq_sink_from_kv_events_config(
    text: str | None, *, data_parallel_rank: int | None = None, **options: Any
) -> ZmqSink | None:
    """The ZMQ sink a `--kv-events-config` JSON string describes.

    Returns None when `text` is None or the config turns publishing off
    (`"enable_kv_cache_events": false` or `"publisher": "null"`). Raises
    [`ConfigError`][kvstream.errors.ConfigError] naming a bad key or value, and
    [`MissingDependencyError`][kvstream.errors.MissingDependencyError] without pyzmq.
    """
    if text is None:
        return None
    config = parse_kv_events_config(text)
    if not config.enabled:
        log.info("--kv-events-config: publishing is off; no ZMQ sink")
        return None
    from kvstream.sinks.zmq import ZmqSink

    return ZmqSink.from_kv_events_config(config, data_parallel_rank=data_parallel_rank, **options)
