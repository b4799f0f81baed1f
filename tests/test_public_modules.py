"""Which modules are kvstream's API: exactly the pinned list; everything else is private.

A module whose dotted path has a segment starting with `_` is an implementation
detail (`kvstream.sinks._encoding`, `kvstream._wire.http`): it may change in any
release. Making a module public is a decision made here, in `PUBLIC`.
"""

from __future__ import annotations

import importlib
import pkgutil

import kvstream

PUBLIC = {
    "kvstream",
    # the pipeline and its values
    "kvstream.events",
    "kvstream.errors",
    "kvstream.scheduler",
    "kvstream.lifetime",
    "kvstream.sources",
    "kvstream.media",
    # codecs: the contract and the two codecs
    "kvstream.codecs",
    "kvstream.codecs.base",
    "kvstream.codecs.json",
    "kvstream.codecs.msgpack",
    # sinks: the contract, each transport, file rotation
    "kvstream.sinks",
    "kvstream.sinks.base",
    "kvstream.sinks.file",
    "kvstream.sinks.memory",
    "kvstream.sinks.nats",
    "kvstream.sinks.redis",
    "kvstream.sinks.rotation",
    "kvstream.sinks.socket",
    "kvstream.sinks.zmq",
    # consumers: the contract and each transport's subscriber
    "kvstream.consumers",
    "kvstream.consumers.base",
    "kvstream.consumers.file",
    "kvstream.consumers.nats",
    "kvstream.consumers.redis",
    "kvstream.consumers.socket",
    "kvstream.consumers.zmq",
    # what is built on the pipeline
    "kvstream.config",
    "kvstream.index",
    "kvstream.metrics",
    "kvstream.publisher",
    "kvstream.relay",
    "kvstream.state",
    "kvstream.sim",
    "kvstream.testing",
}


def _public_modules() -> set[str]:
    found = {"kvstream"}
    for info in pkgutil.walk_packages(kvstream.__path__, "kvstream."):
        if not any(part.startswith("_") for part in info.name.split(".")[1:]):
            found.add(info.name)
    return found


def test_the_public_modules_are_exactly_the_pinned_list() -> None:
    found = _public_modules()
    assert found - PUBLIC == set(), "new public module(s): add to PUBLIC or make private"
    assert PUBLIC - found == set(), "pinned public module(s) missing"


def test_every_public_module_declares_its_names_and_they_import() -> None:
    for name in sorted(PUBLIC):
        module = importlib.import_module(name)
        exported = getattr(module, "__all__", None)
        assert isinstance(exported, list), f"{name} has no __all__ list"
        missing = [n for n in exported if not hasattr(module, n)]
        assert not missing, f"{name}.__all__ names what it lacks: {missing}"
