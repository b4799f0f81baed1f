"""`kvstream --config FILE`: defaults for every option of every command, from TOML.

The file has the global options at the top and one table per command; keys are
the long option names, with `-` or `_`:

    log-level = "INFO"

    [demo]
    steps = 0
    rate = 50
    sink = ["-", "file:kv.jsonl?rotate_bytes=64MiB&keep=10"]
    metrics = "127.0.0.1:9464"

The command line wins over the file: an option given there replaces the file's
value (for repeatable options such as `--sink` too). Values are checked like
the command line checks them; an unknown table or key is an error that lists
what is known. Positional arguments (a file to read ...) are not taken from the
file.
"""

from __future__ import annotations

import argparse
import tomllib
from collections.abc import Mapping
from typing import Any

from kvstream._cli.argtypes import EXPECTED
from kvstream.errors import ConfigError

__all__ = ["ConfigList", "apply_config", "finish_args", "load_config"]


def load_config(path: str) -> dict[str, Any]:
    """Read a TOML file; any problem is a [`ConfigError`][kvstream.errors.ConfigError] naming it."""
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as exc:
        raise ConfigError(f"--config {path}: cannot read it: {exc.strerror or exc}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"--config {path}: not valid TOML: {exc}") from exc


class ConfigList(list[Any]):
    """A repeatable option's default from the file; remembers how many items it had.

    argparse appends command-line values to a copy of the default (and copying
    keeps this type), so `finish_args()` can keep only what the command
    line gave when it gave anything.
    """

    from_file: int = 0


def _actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    # argparse has no public accessor for a parser's actions.
    return list(parser._actions)


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in _actions(parser):
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _convert_one(action: argparse.Action, value: Any, where: str) -> Any:
    kind = action.type
    if isinstance(value, dict | list):
        raise ConfigError(f"{where}: expected a single value, got {value!r}")
    if kind is None:
        if type(value) is not str:
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        converted: Any = value
    elif kind is int:
        if type(value) is int:
            converted = value
        elif type(value) is str:
            try:
                converted = int(value)
            except ValueError:
                raise ConfigError(f"{where}: expected an integer, got {value!r}") from None
        else:
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
    elif kind is float:
        if type(value) in (int, float):
            converted = float(value)
        elif type(value) is str:
            try:
                converted = float(value)
            except ValueError:
                raise ConfigError(f"{where}: expected a number, got {value!r}") from None
        else:
            raise ConfigError(f"{where}: expected a number, got {value!r}")
    else:
        if type(value) is bool:
            raise ConfigError(f"{where}: expected {EXPECTED.get(kind, 'a value')}, got {value!r}")
        try:
            converted = kind(str(value))  # type: ignore[operator]
        except argparse.ArgumentTypeError as exc:  # its message names the value
            raise ConfigError(f"{where}: {exc}") from None
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"{where}: {exc}, got {value!r}") from None
    if action.choices is not None and converted not in action.choices:
        known = ", ".join(map(str, action.choices))
        raise ConfigError(f"{where}: expected one of {known}, got {value!r}")
    return converted


def _convert(action: argparse.Action, value: Any, where: str) -> Any:
    if isinstance(action, argparse._StoreTrueAction | argparse._StoreFalseAction):
        if type(value) is not bool:
            raise ConfigError(f"{where}: expected true or false, got {value!r}")
        return value if isinstance(action, argparse._StoreTrueAction) else not value
    if isinstance(action, argparse._CountAction):
        if type(value) is not int or value < 0:
            raise ConfigError(f"{where}: expected a count >= 0, got {value!r}")
        return value
    if isinstance(action, argparse._AppendAction | argparse._ExtendAction):
        items = value if isinstance(value, list) else [value]
        result = ConfigList(_convert_one(action, v, f"{where}[{i}]") for i, v in enumerate(items))
        result.from_file = len(result)
        return result
    if action.nargs in ("+", "*") or isinstance(action.nargs, int):
        items = value if isinstance(value, list) else [value]
        return [_convert_one(action, v, f"{where}[{i}]") for i, v in enumerate(items)]
    if isinstance(action, argparse._StoreAction):
        return _convert_one(action, value, where)
    raise ConfigError(f"{where}: this option cannot be set in a config file")


def _apply_table(
    parser: argparse.ArgumentParser, table: Mapping[str, Any], where: str, *, top: bool
) -> None:
    by_name: dict[str, argparse.Action] = {}
    for action in _actions(parser):
        if isinstance(action, argparse._HelpAction | argparse._VersionAction):
            continue
        if isinstance(action, argparse._SubParsersAction):
            continue
        for option in action.option_strings:
            if option.startswith("--"):
                by_name[option[2:]] = action
                by_name[option[2:].replace("-", "_")] = action
        if action.option_strings:
            by_name.setdefault(action.dest, action)
    positionals = {a.dest for a in _actions(parser) if not a.option_strings}
    commands = _subcommands(parser)
    defaults: dict[str, Any] = {}
    for key, value in table.items():
        if key in commands and isinstance(value, dict):
            inner = f"{where} [{key}]" if top else f"{where[:-1]}.{key}]"
            _apply_table(commands[key], value, inner, top=False)
            continue
        here = f"{where} {key}"
        if key == "config":
            raise ConfigError(f"{here}: a config file cannot name another one")
        found = by_name.get(key)
        if found is None:
            if key.replace("-", "_") in positionals:
                raise ConfigError(
                    f"{here}: {key} is a positional argument; give it on the command line"
                )
            if isinstance(value, dict):
                known_tables = ", ".join(f"[{c}]" for c in commands) or "none"
                raise ConfigError(f"{here}: unknown command table; known: {known_tables}")
            known = ", ".join(sorted({a.option_strings[-1].lstrip("-") for a in by_name.values()}))
            raise ConfigError(f"{here}: unknown option; known: {known or 'none'}")
        defaults[found.dest] = _convert(found, value, here)
    if defaults:
        parser.set_defaults(**defaults)


def apply_config(parser: argparse.ArgumentParser, config: Mapping[str, Any], path: str) -> None:
    """Make the file's values the defaults of `parser` and its subcommands."""
    _apply_table(parser, config, f"--config {path}:", top=True)


def finish_args(args: argparse.Namespace) -> None:
    """Resolve repeatable options: the command line's items replace the file's."""
    for name, value in vars(args).items():
        if isinstance(value, ConfigList):
            given = value[value.from_file :]
            setattr(args, name, list(given) if given else list(value))
