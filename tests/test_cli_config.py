"""The CLI's polish: --config TOML, help with examples, one-line errors, progress."""

from __future__ import annotations

import io
from pathlib import Path

import anyio
import pytest

from kvstream import JsonCodec, __version__
from kvstream._cli.longrun import Progress
from kvstream._cli.main import COMMANDS, build_parser, main


def write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


def test_config_gives_defaults_and_the_command_line_wins(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    config = write(
        tmp_path / "kv.toml",
        f"""
log-level = "ERROR"

[demo]
steps = 12
rate = 0
seed = 3
block_size = 16        # '-' or '_' both work
sink = ["file:{a}"]
""",
    )
    assert main(["--config", config, "demo"]) == 0
    assert len(JsonCodec().decode_lines(a.read_bytes())) == 12
    # A repeatable option given on the command line replaces the file's list.
    assert main(["--config", config, "demo", "--steps", "4", "--sink", f"file:{b}"]) == 0
    assert len(JsonCodec().decode_lines(b.read_bytes())) == 4
    assert len(JsonCodec().decode_lines(a.read_bytes())) == 12
    capsys.readouterr()


def test_config_values_are_parsed_into_the_namespace(tmp_path: Path) -> None:
    config = write(tmp_path / "kv.toml", '[demo]\nrate = 5\nsink = "-"\nmetrics = ":0"\n')
    from kvstream._cli.configfile import apply_config, finish_args, load_config

    parser = build_parser()
    apply_config(parser, load_config(config), config)
    args = parser.parse_args(["demo"])
    finish_args(args)
    assert args.rate == 5.0
    assert isinstance(args.rate, float)
    assert args.sink == ["-"]
    assert args.metrics == ":0"
    assert args.steps == 1000  # untouched default


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[demo]\nstepz = 1\n", "[demo] stepz: unknown option; known: block-size"),
        ('[demo]\nsteps = "many"\n', "[demo] steps: expected an integer >= 0, got 'many'"),
        ("[demo]\nrate = true\n", "[demo] rate: expected a number >= 0, got True"),
        ("[demo]\nsink = [1]\n", "[demo] sink[0]: expected a string, got 1"),
        ("[dem]\nsteps = 1\n", "dem: unknown command table; known: "),
        ('log-level = "LOUD"\n', "log-level: expected one of DEBUG, INFO, WARNING, ERROR"),
        ('[verify]\npath = "x"\n', "path is a positional argument"),
        ("[demo\n", "not valid TOML"),
    ],
)
def test_config_mistakes_are_one_line_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, message: str
) -> None:
    config = write(tmp_path / "bad.toml", text)
    assert main(["--config", config, "demo", "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith(f"kvstream: error: --config {config}:")
    assert message in err


def test_a_missing_config_file_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--config", "/nonexistent/kv.toml", "demo"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvstream: error: --config /nonexistent/kv.toml: cannot read it: ")
    assert err.endswith("No such file or directory\n")


def test_every_command_has_help_with_examples(capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser()
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args(["--help"])
    assert exit_info.value.code == 0
    top = capsys.readouterr().out
    assert "--config FILE" in top
    assert "--log-level" in top
    assert "--version" in top
    names = [name.rsplit(".", 1)[1] for name in COMMANDS]
    for name in names:
        assert name in top
        with pytest.raises(SystemExit):
            parser.parse_args([name, "--help"])
        text = capsys.readouterr().out
        assert "example" in text.lower(), f"kvstream {name} --help shows no example"
        assert f"kvstream {name}" in text


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"kvstream {__version__}"


def test_errors_inside_task_groups_are_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The sink cannot open: the error surfaces from the scheduler's task group.
    missing = tmp_path / "no" / "such" / "dir" / "x.jsonl"
    assert main(["demo", "--steps", "1", "--sink", f"file:{missing}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("kvstream demo: error: ")
    assert "Traceback" not in "\n".join(err)


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


async def test_progress_line_only_on_a_terminal() -> None:
    shown = Terminal()
    count = 0

    def render() -> str:
        return f"{count} batches"

    progress = Progress("demo", render, stream=shown, interval=0.01)
    assert progress.enabled
    async with anyio.create_task_group() as tg:
        tg.start_soon(progress.run)
        with anyio.fail_after(10):
            while "\r" not in shown.getvalue():
                count += 1
                await anyio.sleep(0.01)
        tg.cancel_scope.cancel()
    text = shown.getvalue()
    assert text.startswith("\rkvstream demo: ")
    assert " batches\x1b[K" in text
    assert text.endswith("\r\x1b[K")  # erased before the summary

    quiet = io.StringIO()  # not a terminal: nothing is written, run() returns at once
    progress = Progress("demo", render, stream=quiet, interval=0.01)
    assert not progress.enabled
    with anyio.fail_after(5):
        await progress.run()
    progress.show()
    progress.clear()
    assert quiet.getvalue() == ""
