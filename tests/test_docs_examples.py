"""Every code block of README.md and docs/ that claims to run, run as pasted.

Each python block runs as a file, each bash block as a script (``set -eu -o
pipefail``), each console block's ``$`` lines likewise, in a new directory
(an ``examples`` link to the checkout's examples/ in it), one directory per
page so a block can read what an earlier block of its page wrote. Fixed ports
in a block (``127.0.0.1:5600``, ``*:5557``) are mapped to free ones, the same
port to the same free port throughout the block. ``pip install`` lines are not
run (the test command installed the package already); they are checked to
name this distribution and extras it has. See ``docs_blocks.py`` for the
directives that mark a block not run, with its reason.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Final

import pytest
from docs_blocks import ROOT, RUNNABLE, Block, blocks, map_ports, pages

#: Pages other work is rewriting now; their blocks join this test once it lands.
PENDING: Final = frozenset(
    {"docs/benchmarks.md", "docs/prefix-index.md", "docs/vllm-wire.md", "docs/design.md"}
)
TIMEOUT: Final = 90.0


def _pages() -> list[Path]:
    return [p for p in pages() if str(p.relative_to(ROOT)) not in PENDING]


def _all_blocks() -> list[Block]:
    return [b for p in _pages() for b in blocks(p) if b.language in RUNNABLE]


def _to_run() -> list[Block]:
    return [
        b
        for b in _all_blocks()
        if not b.includes_a_file
        and b.not_run_reason is None
        and not b.directive.startswith("vllm-path")
    ]


def _extras() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return set(project["optional-dependencies"])


def check_install_line(line: str, where: str) -> None:
    """A ``pip install`` line names this checkout or kvstream-events, with real extras."""
    segment = next(s for s in line.split("#", 1)[0].split("&&") if "pip install" in s)
    words = shlex.split(segment)
    targets = [w for w in words[words.index("install") + 1 :] if not w.startswith("-")]
    targets = [t for t in targets if "editable_mode" not in t]
    assert targets, f"{where}: {line!r} installs nothing"
    for target in targets:
        m = re.fullmatch(r"(?P<name>\.|kvstream-events)(\[(?P<extras>[\w,]+)\])?", target)
        assert m, f"{where}: {line!r}: install . or kvstream-events, not {target!r}"
        unknown = set((m["extras"] or "").split(",")) - _extras() - {""}
        assert not unknown, f"{where}: {line!r}: no such extra {sorted(unknown)}"


def _script(block: Block) -> str:
    lines = block.code.splitlines()
    if block.language == "console":
        lines = [line[2:] for line in lines if line.startswith("$ ")]
    kept: list[str] = []
    for line in lines:
        if re.search(r"\bpip install\b", line):
            check_install_line(line, block.where)
            continue
        kept.append(line)
    return "\n".join(kept) + "\n"


def _run(args: list[str], cwd: Path, where: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.pop("NO_COLOR", None)
    proc = subprocess.Popen(
        args,
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # what a block leaves in the background is ended with it
    )
    try:
        out, err = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{where}: still running after {TIMEOUT:.0f} s\n{out[-2000:]}\n{err[-2000:]}")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    return subprocess.CompletedProcess(args, proc.returncode, out, err)


@pytest.fixture(scope="module")
def page_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[Path, Path]:
    dirs: dict[Path, Path] = {}
    for page in _pages():
        d = tmp_path_factory.mktemp(page.stem)
        (d / "examples").symlink_to(ROOT / "examples")
        dirs[page] = d
    return dirs


@pytest.mark.parametrize("block", _to_run(), ids=lambda b: b.where)
def test_block_runs_as_pasted(block: Block, page_dirs: dict[Path, Path]) -> None:
    cwd = page_dirs[block.path]
    if block.setup:
        done = _run(["bash", "-euo", "pipefail", "-c", block.setup], cwd, block.where)
        assert done.returncode == 0, f"{block.where}: setup failed\n{done.stderr}"
    if block.language == "python":
        script = cwd / f"block_{block.line}.py"
        script.write_text(map_ports(block.code))
        done = _run([sys.executable, str(script)], cwd, block.where)
    else:
        done = _run(["bash", "-euo", "pipefail", "-c", map_ports(_script(block))], cwd, block.where)
    assert done.returncode == 0, (
        f"{block.where} exited {done.returncode}\n--- stdout\n{done.stdout[-3000:]}"
        f"\n--- stderr\n{done.stderr[-3000:]}"
    )
    assert "Traceback" not in done.stderr, done.stderr


def test_every_block_not_run_says_why() -> None:
    marked = [b for b in _all_blocks() if b.not_run_reason is not None]
    for b in marked:
        assert len(b.not_run_reason or "") > 10, f"{b.where}: a block not run must say why"
    # Few: most of what the docs show runs here.
    assert len(marked) <= len(_all_blocks()) // 2, [b.where for b in marked]


def test_install_lines_everywhere_name_real_extras() -> None:
    for page in pages():
        for b in blocks(page):
            for line in b.code.splitlines():
                if re.search(r"\bpip install\b", line) and b.language in RUNNABLE:
                    check_install_line(line.removeprefix("$ "), b.where)


def test_the_readme_test_command_is_what_ci_runs() -> None:
    first = blocks(ROOT / "README.md")[0].code.splitlines()
    assert first[0].startswith("python -m pip install . && kvstream demo")
    install, test = (part.split("#", 1)[0].strip() for part in first[1].split("&&"))
    assert test == "python -m pytest"
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert ci[-1] == test  # CI's last command is the README's test command
    ci_install = next(line for line in ci if line.startswith("python -m pip install --quiet -e"))
    # The same editable mode and at least the README's extras.
    assert "--config-settings editable_mode=strict" in install
    assert "--config-settings editable_mode=strict" in ci_install
    assert "'.[test," in ci_install
    assert "'.[test]'" in install
