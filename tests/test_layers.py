"""Nothing below `kvstream.config` imports it: URLs become objects in config alone."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import kvstream

ROOT = Path(kvstream.__file__).parent
#: The packages below config: they build nothing from URLs and look nothing up by name.
BELOW_CONFIG = (
    "_backoff.py",
    "_burst_log.py",
    "_dispatch.py",
    "_wire",
    "codecs",
    "consumers",
    "events.py",
    "lifetime.py",
    "scheduler.py",
    "sinks",
    "sources",
    "state.py",
)


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module is not None:
            names.add(node.module)
    return names


def _modules() -> list[Path]:
    out: list[Path] = []
    for part in BELOW_CONFIG:
        target = ROOT / part
        out.extend(sorted(target.rglob("*.py")) if target.is_dir() else [target])
    return out


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_a_module_below_config_does_not_import_it(path: Path) -> None:
    found = {name for name in _imports(path) if name.split(".")[:2] == ["kvstream", "config"]}
    assert not found, f"{path.relative_to(ROOT)} imports {sorted(found)}"


def test_the_check_sees_an_import_inside_a_function(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from kvstream.config import make_codec\n")
    assert "kvstream.config" in _imports(module)
