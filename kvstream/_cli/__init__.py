"""The `kvstream` command line. The only place that starts an event loop.

Helpers other commands share are re-exported here:
`zmq_sink_from_kv_events_config()` and `add_kv_events_config_option()`
(vLLM's `--kv-events-config` JSON as a ZMQ sink).
"""

from kvstream._cli.kv_events import add_kv_events_config_option, zmq_sink_from_kv_events_config

__all__ = ["add_kv_events_config_option", "zmq_sink_from_kv_events_config"]
