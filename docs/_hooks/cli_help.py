"""MkDocs hook: the CLI reference shows the real `--help` of every command.

`<!-- kvstream-help -->` in a page becomes `kvstream --help`;
`<!-- kvstream-help demo -->` becomes `kvstream demo --help`; and
`<!-- kvstream-help-all -->` becomes a section per command listed in
`kvstream._cli.main.COMMANDS`, so a new command is documented the moment it
is registered, and no help text in the docs can go stale.
"""

from __future__ import annotations

import os
import re
from typing import Any

_ONE = re.compile(r"<!-- kvstream-help(?: ([a-z][a-z0-9-]*))? -->")
_ALL = "<!-- kvstream-help-all -->"


def _parser() -> Any:
    os.environ["COLUMNS"] = "100"  # argparse wraps help to the terminal's width
    from kvstream._cli.main import build_parser

    return build_parser()


def _subcommands(parser: Any) -> dict[str, Any]:
    from kvstream._cli.configfile import _subcommands

    return _subcommands(parser)


def _block(text: str) -> str:
    return "```text\n" + text.rstrip() + "\n```"


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    if "<!-- kvstream-help" not in markdown:
        return markdown
    parser = _parser()
    commands = _subcommands(parser)

    def one(match: re.Match[str]) -> str:
        name = match.group(1)
        if name is None:
            return _block(parser.format_help())
        if name not in commands:
            raise ValueError(f"{page.file.src_path}: no kvstream command {name!r}")
        return _block(commands[name].format_help())

    if _ALL in markdown:
        sections = []
        for name, sub in commands.items():
            sections.append(f"## `kvstream {name}`\n\n{_block(sub.format_help())}\n")
        markdown = markdown.replace(_ALL, "\n".join(sections))
    return _ONE.sub(one, markdown)
