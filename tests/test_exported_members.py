"""The public API: ``kvstream.__all__`` is sorted, importable, and holds the core names.

New exports are welcome (the test checks a minimum, not an exact list); a
misspelt, missing or unsorted one is not.
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
