"""kvstream: KV cache events for LLM serving, as a standalone asyncio library.

This module only re-exports the public API; see the submodules for the code.
"""

from importlib import metadata as _metadata

from kvstream._threadsafe import ThreadsafeHandle, run_in_thread
from kvstream.codecs import Codec, JsonCodec, MsgpackCodec
from kvstream.config import subscribe
from kvstream.errors import (
    ClosedError,
    ConfigError,
    DecodeError,
    InvalidEventError,
    InvalidEventTypeError,
    KVStreamError,
    MissingDependencyError,
    TransportError,
)
from kvstream.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVCacheEvent,
)
from kvstream.index import PrefixIndex, PrefixMatch
from kvstream.publisher import EventPublisher
from kvstream.scheduler import CloseReport, Scheduler, SchedulerStatistics, every
from kvstream.sinks import (
    DeliveryReport,
    FileSink,
    MemorySink,
    QueueSink,
    Sink,
    SinkStatistics,
)
from kvstream.sources import SourceHandle, SourceStatistics, from_take_events

try:
    __version__ = _metadata.version("kvstream-events")
except _metadata.PackageNotFoundError:  # pragma: no cover - running from a source tree
    __version__ = "0.0.0"

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "CloseReport",
    "ClosedError",
    "Codec",
    "ConfigError",
    "DecodeError",
    "DeliveryReport",
    "EventBatch",
    "EventPublisher",
    "FileSink",
    "InvalidEventError",
    "InvalidEventTypeError",
    "JsonCodec",
    "KVCacheEvent",
    "KVStreamError",
    "MemorySink",
    "MissingDependencyError",
    "MsgpackCodec",
    "PrefixIndex",
    "PrefixMatch",
    "QueueSink",
    "Scheduler",
    "SchedulerStatistics",
    "Sink",
    "SinkStatistics",
    "SourceHandle",
    "SourceStatistics",
    "ThreadsafeHandle",
    "TransportError",
    "__version__",
    "every",
    "from_take_events",
    "run_in_thread",
    "subscribe",
]
