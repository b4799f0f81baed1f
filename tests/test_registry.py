"""Schemes and codecs come from one registry: built-ins, passed-in factories, installed plug-ins."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from kvstream import ConfigError, FileSink, JsonCodec, MemorySink, MissingDependencyError
from kvstream.config import Options, ParsedURL, Registry, make_codec, open_sink, open_subscriber
from kvstream.config._registry import _Entry
from kvstream.sinks.base import Sink

REPO = Path(__file__).resolve().parent.parent

# A plug-in distribution as pip would install it: a module and a .dist-info with
# entry points. Its sink appends each batch to a file; its subscriber reads kvstream's
# own JSON lines back through FileSubscriber.
PLUGIN = textwrap.dedent(
    '''
    """A third-party transport for kvstream, found through entry points."""
    from typing import Any

    from kvstream.consumers import FileSubscriber
    from kvstream.sinks.base import Sink


    class AppendSink(Sink):
        def __init__(self, path: str, copies: int, **options: Any) -> None:
            super().__init__(**options)
            self.path = path
            self.copies = copies

        async def write(self, data: bytes, batch: Any) -> None:
            with open(self.path, "ab") as f:
                f.write(data * self.copies)


    def sink_from_url(parsed, opts, common):
        copies = opts.pop_int("copies", 1, minimum=1)
        common.setdefault("codec", None)
        if common["codec"] is None:
            from kvstream.codecs.json import JsonCodec
            common["codec"] = JsonCodec()
        return AppendSink(parsed.path, copies, **common)


    def subscriber_from_url(parsed, opts, kwargs):
        return FileSubscriber(parsed.path, follow=False, **kwargs)
    '''
)

ENTRY_POINTS = textwrap.dedent(
    """
    [kvstream.sinks]
    append = kvs_test_plugin:sink_from_url
    file = kvs_test_plugin:sink_from_url

    [kvstream.subscribers]
    append = kvs_test_plugin:subscriber_from_url
    """
)


def install_plugin(
    root: Path,
    module: str = PLUGIN,
    entry_points: str = ENTRY_POINTS,
    name: str = "kvs_test_plugin",
) -> Path:
    (root / f"{name}.py").write_text(module)
    entry_points = entry_points.replace("kvs_test_plugin:", f"{name}:")
    info = root / "kvs_test_plugin-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: kvs-test-plugin\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(entry_points)
    return root


def test_builtin_names_and_unknown_scheme_error() -> None:
    registry = Registry.builtin()
    assert {"file", "memory", "tcp", "unix", "zmq+tcp", "nats", "redis"} <= set(
        registry.names("sink")
    )
    assert registry.names("codec") == ("json", "msgpack")
    assert registry.provider("sink", "file") == "kvstream"
    with pytest.raises(
        ConfigError, match=r"carrier://x: unknown scheme 'carrier'; expected one of: file, memory"
    ):
        open_sink("carrier://x", registry=registry)
    with pytest.raises(
        ConfigError, match=r"option codec: unknown codec 'yaml'; expected one of: json, msgpack"
    ):
        open_sink("file:/tmp/x.jsonl?codec=yaml", registry=registry)


def test_a_passed_in_factory_adds_a_scheme_and_takes_its_options(tmp_path: Path) -> None:
    made: list[dict[str, Any]] = []

    def factory(parsed: ParsedURL, opts: Options, common: dict[str, Any]) -> Sink:
        made.append({"path": parsed.path, "delay": opts.pop_float("delay", 0.0), **common})
        common.setdefault("codec", None)
        return MemorySink(**common)

    base = Registry.builtin()
    registry = base.with_sink("mem2", factory).with_codec("json2", lambda opts: JsonCodec())
    sink = open_sink("mem2:/here?delay=0.5&policy=drop_newest&codec=json2", registry=registry)
    assert isinstance(sink, MemorySink)
    assert made[0]["path"] == "/here"
    assert made[0]["delay"] == 0.5
    assert made[0]["policy"] == "drop_newest"
    assert registry.provider("sink", "mem2") == "registered"
    # The registry it came from is unchanged.
    assert "mem2" not in base.names("sink")
    with pytest.raises(ConfigError, match=r"unknown option\(s\): colour"):
        open_sink("mem2:/here?colour=blue", registry=registry)
    with pytest.raises(
        ConfigError, match=r"sink name: expected lower-case letters.*got 'Bad Name'"
    ):
        base.with_sink("Bad Name", factory)
    with pytest.raises(ConfigError, match=r"sink 'x': expected a callable factory, got int"):
        base.with_sink("x", 3)  # type: ignore[arg-type]
    assert isinstance(make_codec("json2", registry=registry), JsonCodec)


def test_a_missing_extra_names_the_install_command() -> None:
    entry = _Entry("kvstream_no_such_module:factory", "zmq")
    with pytest.raises(MissingDependencyError, match=r"pip install 'kvstream-events\[zmq\]'"):
        entry.load("sink", "fancy")


def test_an_installed_plugin_adds_schemes_but_cannot_take_a_builtin(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.syspath_prepend(str(install_plugin(tmp_path)))
    caplog.set_level(logging.WARNING, logger="kvstream.config")
    registry = Registry.default()
    assert registry.provider("sink", "append") == "kvs-test-plugin"
    assert registry.provider("subscriber", "append") == "kvs-test-plugin"
    # "file" stays kvstream's own, and the plug-in's claim is reported.
    assert registry.provider("sink", "file") == "kvstream"
    assert isinstance(open_sink(f"file:{tmp_path / 'a.jsonl'}"), FileSink)
    assert any("'file' from kvs-test-plugin is ignored" in r.getMessage() for r in caplog.records)
    sink = open_sink(f"append:{tmp_path / 'out.jsonl'}?copies=2")
    assert type(sink).__name__ == "AppendSink"
    sub = open_subscriber(f"append:{tmp_path / 'out.jsonl'}")
    assert type(sub).__name__ == "FileSubscriber"


def test_a_broken_plugin_is_named_and_breaks_nothing_else(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    install_plugin(
        tmp_path, module="import kvs_dependency_that_is_not_there\n", name="kvs_broken_plugin"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(
        ConfigError, match=r"sink 'append' from kvs-test-plugin: cannot import kvs_broken_plugin"
    ):
        open_sink(f"append:{tmp_path / 'x'}")
    assert isinstance(open_sink(f"file:{tmp_path / 'ok.jsonl'}"), FileSink)


def test_the_cli_uses_an_installed_plugin_end_to_end(tmp_path: Path) -> None:
    (tmp_path / "site").mkdir()
    plugin_root = install_plugin(tmp_path / "site")
    out = tmp_path / "events.jsonl"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(plugin_root), str(REPO)])}
    demo = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvstream",
            "demo",
            "--steps",
            "20",
            "--rate",
            "0",
            "--sink",
            f"append:{out}?copies=1",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert demo.returncode == 0, demo.stderr
    lines = out.read_bytes().splitlines()
    assert len(lines) == 20
    tail = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvstream",
            "tail",
            "--format",
            "json",
            "--no-follow",
            f"append:{out}",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert tail.returncode == 0, tail.stderr
    assert len(tail.stdout.splitlines()) == 20


def test_bench_measures_a_plugin_sink_url(tmp_path: Path) -> None:
    (tmp_path / "site").mkdir()
    plugin_root = install_plugin(tmp_path / "site")
    out = tmp_path / "bench.jsonl"
    report = tmp_path / "report.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(plugin_root), str(REPO)])}
    bench = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvstream",
            "bench",
            "--tiny",
            "--no-progress",
            "--only",
            "sinks",
            "--sink",
            f"append:{out}",
            "--json",
            str(report),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert bench.returncode == 0, bench.stderr
    data = json.loads(report.read_text())
    rows = [r for b in data["results"] for r in b["rows"] if r["case"] == f"append:{out}"]
    assert rows
    assert rows[0]["events_per_s"] > 0
    assert out.stat().st_size > 0


def test_a_codec_named_on_the_wire_comes_from_the_one_table() -> None:
    # The socket protocol's welcome and the brokers' codec header name codecs the
    # way URLs do: same names, same refusal. Built by hand a reader knows kvstream's
    # own codecs; through a URL it is given the registry's lookup (make_codec).
    from kvstream._wire.broker import PayloadDecoder
    from kvstream._wire.socket_protocol import ProtocolError, codec_by_name
    from kvstream.codecs.msgpack import MsgpackCodec
    from kvstream.errors import DecodeError

    assert isinstance(codec_by_name("msgpack"), MsgpackCodec)
    assert isinstance(PayloadDecoder().codec("msgpack"), MsgpackCodec)
    with pytest.raises(ProtocolError, match=r"welcome\.codec: unknown codec 'zstd'.*json, msgpack"):
        codec_by_name("zstd")
    with pytest.raises(DecodeError, match=r"unknown codec 'zstd'.*json, msgpack"):
        PayloadDecoder().codec("zstd")
    zstd = Registry.builtin().with_codec("zstd", lambda opts: MsgpackCodec())
    via_registry = PayloadDecoder(codecs=lambda name: make_codec(name, registry=zstd))
    assert isinstance(via_registry.codec("zstd"), MsgpackCodec)
    assert isinstance(
        codec_by_name("zstd", lambda name: make_codec(name, registry=zstd)), MsgpackCodec
    )
