"""The public API: `kvstream.__all__` is exactly the pinned list, sorted and importable.

Adding a name to the top-level API is a decision: it is made here, in `EXPORTS`,
and nothing else reaches `kvstream`'s namespace (no helper an implementation
imported, such as `version`).
"""

from __future__ import annotations

import subprocess
import sys

import kvstream

CORE = {
    # events
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EventBatch",
    "KVCacheEvent",
    # the pipeline
    "Scheduler",
    "every",
    "from_take_events",
    "run_in_thread",
    "ThreadsafeHandle",
    # codecs and sinks
    "Codec",
    "JsonCodec",
    "Sink",
    "MemorySink",
    "QueueSink",
    "FileSink",
    # errors
    "KVStreamError",
    "InvalidEventError",
    "InvalidEventTypeError",
    "DecodeError",
    "ConfigError",
    "ClosedError",
    "MissingDependencyError",
    "TransportError",
    "__version__",
}


#: The top-level API, exactly.
EXPORTS = [
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


def test_all_is_exactly_the_pinned_api() -> None:
    assert kvstream.__all__ == EXPORTS


def test_nothing_else_public_reaches_the_namespace() -> None:
    # Submodules appear as attributes once imported; any other public name is a leak.
    public = {
        name
        for name, value in vars(kvstream).items()
        if not name.startswith("_") and type(value).__name__ != "module"
    }
    assert sorted(public - set(EXPORTS)) == []


def test_all_is_sorted_and_unique() -> None:
    assert kvstream.__all__ == sorted(kvstream.__all__)
    assert len(set(kvstream.__all__)) == len(kvstream.__all__)


def test_the_core_names_are_exported() -> None:
    assert sorted(CORE - set(kvstream.__all__)) == []


def test_every_exported_name_is_importable() -> None:
    for name in kvstream.__all__:
        assert getattr(kvstream, name, None) is not None, name
    namespace: dict[str, object] = {}
    exec("from kvstream import *", namespace)
    assert sorted(set(namespace) - {"__builtins__"}) == sorted(kvstream.__all__)


def test_exported_errors_share_the_root() -> None:
    for name in kvstream.__all__:
        obj = getattr(kvstream, name)
        if isinstance(obj, type) and issubclass(obj, Exception):
            assert issubclass(obj, kvstream.KVStreamError), name


def test_importing_the_package_pulls_in_no_optional_integration() -> None:
    code = (
        "import sys, kvstream\n"
        "print(','.join(m for m in ('zmq', 'nats', 'redis', 'prometheus_client') "
        "if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.strip() == ""
