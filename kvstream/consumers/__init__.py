"""Consumers: read batches back, check continuity, keep a prefix index."""

from kvstream.consumers.base import Continuity, Gap, SequenceTracker, Subscriber, SubscriberItem
from kvstream.consumers.file import FileSubscriber

__all__ = [
    "Continuity",
    "FileSubscriber",
    "Gap",
    "SequenceTracker",
    "Subscriber",
    "SubscriberItem",
]
