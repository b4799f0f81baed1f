"""Sources: async iterables of events, and adapters for vLLM-style connectors."""

from kvstream.sources._base import (
    AsyncSource,
    PolledConnector,
    SourceHandle,
    SourceStatistics,
    TakeEventsConnector,
    from_take_events,
)

__all__ = [
    "AsyncSource",
    "PolledConnector",
    "SourceHandle",
    "SourceStatistics",
    "TakeEventsConnector",
    "from_take_events",
]
