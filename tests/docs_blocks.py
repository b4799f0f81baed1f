"""The code blocks of README.md and docs/, as the docs tests read them.

A fenced block whose language is python, bash, sh or console claims to run. The
line before it (blank lines aside) may hold a directive, visible in the source:

* ``<!-- docs-test: not run (REASON) -->``: not executed here; the reason says
  why (a GPU, a server, a command that runs until Ctrl-C) and, where one does,
  which test covers it instead;
* ``<!-- docs-test: setup `COMMAND` -->``: run ``COMMAND`` (bash) first, in the
  same directory, e.g. to make the file the block reads;
* ``<!-- docs-test: vllm-path ... -->``: run by ``tests/test_docs_vllm_path.py``.

Blocks that include an example file (``--8<--``) are skipped: the examples
themselves run in ``tests/test_examples.py``.
"""

from __future__ import annotations

import re
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Final

ROOT: Final = Path(__file__).resolve().parents[1]

RUNNABLE: Final = frozenset({"python", "bash", "sh", "console"})

_FENCE: Final = re.compile(r"^(?P<indent>\s*)(?P<fence>```+|~~~+)\s*(?P<info>.*)$")
_DIRECTIVE: Final = re.compile(r"^\s*<!--\s*docs-test:\s*(?P<body>.*?)\s*-->\s*$")


@dataclass(frozen=True)
class Block:
    path: Path
    #: 1-based line of the opening fence
    line: int
    language: str
    code: str
    #: the directive before the block, or ""
    directive: str

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"

    @property
    def includes_a_file(self) -> bool:
        return self.code.lstrip().startswith("--8<--")

    @property
    def not_run_reason(self) -> str | None:
        m = re.fullmatch(r"not run\s*\((?P<why>.*)\)", self.directive)
        if m:
            return m["why"].strip()
        return "" if self.directive.startswith("not run") else None

    @property
    def setup(self) -> str | None:
        m = re.fullmatch(r"setup\s*`(?P<cmd>[^`]+)`", self.directive)
        return m["cmd"] if m else None


def _language(info: str) -> str:
    info = info.strip()
    if info.startswith("{"):
        classes = re.findall(r"\.([\w-]+)", info)
        return classes[0] if classes else ""
    return info.split()[0] if info else ""


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def blocks(path: Path) -> list[Block]:
    lines = path.read_text(encoding="utf-8").splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, indent = m["fence"], len(m["indent"])
        j = i + 1
        while j < len(lines) and not lines[j].strip().startswith(fence):
            j += 1
        body = "\n".join(line[indent:] for line in lines[i + 1 : j])
        k = i - 1
        while k >= 0 and not lines[k].strip():
            k -= 1
        d = _DIRECTIVE.match(lines[k]) if k >= 0 else None
        found.append(Block(path, i + 1, _language(m["info"]), body + "\n", d["body"] if d else ""))
        i = j + 1
    return found


_PORT: Final = re.compile(
    r"(?P<host>127\.0\.0\.1:|localhost:|\*:|port=|--port )(?P<port>[4-9]\d{3})\b"
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def map_ports(code: str, ports: dict[str, int] | None = None) -> str:
    """``code`` with each fixed port (``127.0.0.1:5600``, ``*:5557``, ``port=5600``)
    replaced by a free one, the same port by the same free port; ``ports`` collects them."""
    mapping: dict[str, int] = {} if ports is None else ports

    def swap(m: re.Match[str]) -> str:
        port = mapping.setdefault(m["port"], free_port())
        return f"{m['host']}{port}"

    return _PORT.sub(swap, code)


def commands(code: str) -> list[str]:
    """The commands of a bash block: continuation lines joined, comments dropped."""
    joined = re.sub(r"\\\n\s*", " ", code)
    out = []
    for line in joined.splitlines():
        line = re.sub(r"\s+#.*$", "", line).strip()
        if line and not line.startswith("#"):
            out.append(line)
    return out
