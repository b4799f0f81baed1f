"""What users read is in one style, says what it should, and installs the right package.

* Docstrings (and `#:` attribute comments, which the API page shows) and the docs pages are
  Markdown: a literal reST role (`:class:`...``), a double backquote or a reST literal-block
  marker (a paragraph ending in `::`) would render as is on the site and in `--help`.
* Every install hint names this distribution, `kvstream-events`: the package index's
  `kvstream` is an unrelated project.
* No project-internal language ("the issue", "as their issues land") where users read.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Final

import pytest
from docs_blocks import ROOT, pages

from kvstream._cli.main import COMMANDS

ROLE: Final = re.compile(
    r":(?:py:)?(?:class|func|meth|attr|mod|exc|data|obj|const|term|ref|doc|any):`"
)
DOUBLE: Final = re.compile(r"``[^`\n]+``")
LITERAL_MARKER: Final = re.compile(r"(?m)(^|\S)::\s*$")
OLD_INSTALL: Final = re.compile(r"pip install ['\"]?kvstream\[")
INTERNAL: Final = re.compile(r"(?i)\b(the issue|issue item|as their issues land|issues land)\b")
FENCE: Final = re.compile(r"^\s*(```|~~~)")

#: User-facing text that other work is rewriting now (the lead removes entries as it lands).
INTERNAL_LANGUAGE_PENDING: Final = frozenset({"docs/benchmarks.md", "kvstream/_bench"})


def python_files() -> list[Path]:
    return sorted((ROOT / "kvstream").rglob("*.py"))


def docstrings(path: Path) -> Iterator[tuple[int, str]]:
    """(line, text) of every docstring and `#:` comment in a module."""
    source = path.read_text(encoding="utf-8")
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            doc = ast.get_docstring(node, clean=False)
            if doc is not None:
                yield (node.body[0].lineno, doc)
    for number, line in enumerate(source.splitlines(), 1):
        if line.lstrip().startswith("#:"):
            yield (number, line.lstrip()[2:])


def prose(path: Path) -> Iterator[tuple[int, str]]:
    """(line, text) of a Markdown page outside code blocks, inline code removed."""
    fenced = False
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced and not line.lstrip().startswith(":::"):
            yield (number, line)


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def test_no_rest_markup_in_docstrings() -> None:
    found = [
        f"{rel(path)}:{line}: {m.group(0)!r}"
        for path in python_files()
        for line, text in docstrings(path)
        for m in [*ROLE.finditer(text), *DOUBLE.finditer(text), *LITERAL_MARKER.finditer(text)]
    ]
    assert not found, "reST markup renders as is in Markdown:\n" + "\n".join(found[:50])


def test_no_rest_markup_in_the_docs() -> None:
    found = [
        f"{rel(page)}:{number}: {line.strip()[:80]}"
        for page in pages()
        for number, line in prose(page)
        if ROLE.search(line) or DOUBLE.search(line)
    ]
    assert not found, "\n".join(found)


def help_texts() -> Iterator[tuple[str, str]]:
    yield ("kvstream --help", _help([]))
    for module in COMMANDS:
        name = module.rsplit(".", 1)[-1]
        yield (f"kvstream {name} --help", _help([name]))


def _help(args: list[str]) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "kvstream", *args, "--help"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    return done.stdout


@pytest.fixture(scope="module")
def helps() -> list[tuple[str, str]]:
    return list(help_texts())


def test_no_rest_markup_in_help(helps: list[tuple[str, str]]) -> None:
    for command, text in helps:
        assert not ROLE.search(text), (command, ROLE.search(text))
        assert not DOUBLE.search(text), (command, DOUBLE.search(text))


def test_every_install_hint_names_kvstream_events() -> None:
    files = [*python_files(), *pages(), *sorted((ROOT / "examples").glob("*.py"))]
    found = [
        f"{rel(path)}:{number}"
        for path in files
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if OLD_INSTALL.search(line)
    ]
    assert not found, "pip install 'kvstream[...]' installs an unrelated package: " + str(found)
    from kvstream.errors import MissingDependencyError

    err = MissingDependencyError.for_extra("pyzmq", "zmq", ImportError("zmq"))
    assert "pip install 'kvstream-events[zmq]'" in str(err)


def test_no_project_internal_language_where_users_read(helps: list[tuple[str, str]]) -> None:
    def pending(path: Path) -> bool:
        return any(rel(path).startswith(p) for p in INTERNAL_LANGUAGE_PENDING)

    found = [
        f"{rel(page)}:{number}"
        for page in pages()
        if not pending(page)
        for number, line in prose(page)
        if INTERNAL.search(line)
    ]
    found += [
        f"{rel(path)}:{line}"
        for path in python_files()
        if not pending(path)
        for line, text in docstrings(path)
        if INTERNAL.search(text)
    ]
    found += [command for command, text in helps if INTERNAL.search(text)]
    assert not found, found
