"""`mypy --strict` on a user's program sees kvstream's types after the documented install.

The README's install for working on kvstream is
`pip install -e '.[test]' --config-settings editable_mode=strict` (CI's too). The strict
editable mode installs links to the package, `py.typed` included, where type checkers find
them; the default editable mode hides the package behind an import hook that mypy cannot
follow. This test runs mypy as a user would: on a file outside the checkout, without
PYTHONPATH, against the installed `kvstream-events`.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from docs_blocks import ROOT

USER_PROGRAM = """\
import anyio

from kvstream import BlockStored, MemorySink, Scheduler


async def main() -> int:
    sink = MemorySink()
    async with Scheduler(sinks=[sink], origin="engine-0") as kv:
        kv.emit(BlockStored(block_hashes=[1], parent_block_hash=None, token_ids=[], block_size=16))
        batch = await kv.tick()
    reveal_type(batch)
    return len(sink.batches)


print(anyio.run(main))
"""


def test_py_typed_is_package_data() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "py.typed" in config["tool"]["setuptools"]["package-data"]["kvstream"]
    assert (ROOT / "kvstream" / "py.typed").exists()


def test_mypy_strict_sees_kvstream_types_from_outside_the_checkout(tmp_path: Path) -> None:
    # (The checkout's own kvstream_events.egg-info is a distribution too: look for the
    # installed one, which records where it was installed from.)
    installed = [
        d
        for d in metadata.distributions(name="kvstream-events")
        if ROOT.as_uri() in (d.read_text("direct_url.json") or "")
    ]
    if not installed:
        pytest.skip(f"kvstream-events is not installed from {ROOT} (the README's install does)")
    program = tmp_path / "user_program.py"
    program.write_text(USER_PROGRAM)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MYPYPATH")}
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--no-incremental", str(program)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert 'Revealed type is "kvstream.events.EventBatch | None"' in done.stdout, done.stdout
