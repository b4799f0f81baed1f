"""Sinks: where sealed batches go. The contract and its machinery are in `base`."""

from kvstream.sinks.base import DeliveryReport, OverflowPolicy, Sink, SinkStatistics
from kvstream.sinks.file import FileSink
from kvstream.sinks.memory import MemorySink, QueueSink

__all__ = [
    "DeliveryReport",
    "FileSink",
    "MemorySink",
    "OverflowPolicy",
    "QueueSink",
    "Sink",
    "SinkStatistics",
]
