"""The command's wiring: help, usage errors, the error table, --debug, --json, progress, scripts."""

from __future__ import annotations

import io
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

import numpy as np
import pytest
from _cli_support import write_sample

from parallelvars import errors
from parallelvars.checkpoint.entry import MAX_COMPONENTS
from parallelvars.cli import COMMANDS, build_parser, main
from parallelvars.cli.testing import EXIT_INTERNAL, EXIT_USAGE, Output, UsageError, classify
from parallelvars.errors import InvalidArgumentError
from parallelvars.formats.testing import jsonable, parse_size


@pytest.fixture(autouse=True)
def _no_debug_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PARALLELVARS_DEBUG", raising=False)


def _one_line_error(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


# --- help -------------------------------------------------------------------------------------


def test_help_lists_every_command_with_examples_and_exit_codes(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["--help"]) == 0
    text = capsys.readouterr().out
    for name in COMMANDS:
        assert f"\n    {name} " in text
    assert "examples:" in text and "exit codes:" in text and "PARALLELVARS_DEBUG" in text


@pytest.mark.parametrize("command", COMMANDS)
def test_each_subcommand_help_has_examples(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([command, "--help"]) == 0
    text = capsys.readouterr().out
    assert text.startswith(f"usage: parallelvars {command}")
    assert "examples:" in text
    assert f"parallelvars {command} " in text.split("examples:")[1]
    assert "--json" in text and "--quiet" in text and "--debug" in text


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == "parallelvars 0.1.0"


# --- usage errors: exit 2, one line ------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        ([], "required: COMMAND"),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
        (["inspect"], "required: CKPT"),
        (["inspect", "x.h5", "--bogus"], "unrecognized arguments: --bogus"),
        (["inspect", "x.h5", "--from", "pickle"], "argument --from: invalid choice: 'pickle'"),
        (["diff", "a", "b", "--rtol", "-1"], "argument --rtol: expected a finite number >= 0"),
        (["diff", "a", "b", "--atol", "nan"], "argument --atol: expected a finite number >= 0"),
        (["extract", "c", "n"], "required: -o/--output"),
        (["extract", "c", "n", "-o", "o.npy", "--component", "-1"], "argument --component"),
        (["convert", "a", "b", "--components", "some"], "argument --components: invalid choice"),
        (
            ["convert", "a", "b", "--max-shard-size", "5XB"],
            "argument --max-shard-size: expected a size",
        ),
        (["reshard", "a", "b"], "required: --devices"),
    ],
)
def test_usage_errors_are_one_line_with_exit_2(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    line = _one_line_error(captured.err)
    assert line.startswith("parallelvars")
    assert needle in line
    assert "--help" in line


@pytest.mark.parametrize("devices", ["0", "-2", "two", "1.5", ""])
def test_bad_devices_value(
    devices: str, capsys: pytest.CaptureFixture[str], tmp_path: pathlib.Path
) -> None:
    assert (
        main(["reshard", str(tmp_path / "a.h5"), str(tmp_path / "b.h5"), "--devices", devices]) == 2
    )
    line = _one_line_error(capsys.readouterr().err)
    assert line.startswith(
        "parallelvars reshard: error: argument --devices: expected a positive integer"
    )
    assert repr(devices) in line


def test_devices_beyond_the_components_a_variable_can_have(
    capsys: pytest.CaptureFixture[str], tmp_path: pathlib.Path
) -> None:
    src, dst = tmp_path / "a.npz", tmp_path / "b.npz"
    np.savez(src, w=np.ones(2, np.float32))
    assert main(["reshard", str(src), str(dst), "--devices", str(MAX_COMPONENTS + 1)]) == 2
    line = _one_line_error(capsys.readouterr().err)
    assert f"up to {MAX_COMPONENTS}" in line and repr(str(MAX_COMPONENTS + 1)) in line
    assert not dst.exists()


# --- input errors: exit 2, one line, traceback only with --debug ---------------------------------


def test_missing_file(capsys: pytest.CaptureFixture[str], tmp_path: pathlib.Path) -> None:
    missing = tmp_path / "nothere.h5"
    assert main(["inspect", str(missing)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert _one_line_error(captured.err).startswith(f"parallelvars: error: {missing}: no such ")


def test_not_a_checkpoint(capsys: pytest.CaptureFixture[str], tmp_path: pathlib.Path) -> None:
    junk = tmp_path / "notes.txt"
    junk.write_text("these are not tensors\n")
    assert main(["inspect", str(junk)]) == 2
    line = _one_line_error(capsys.readouterr().err)
    assert line.startswith(f"parallelvars: error: {junk}: not a checkpoint of any known format")


@pytest.mark.parametrize("how", ["flag", "flag-first", "env"])
def test_debug_shows_the_traceback(
    how: str,
    capsys: pytest.CaptureFixture[str],
    tmp_path: pathlib.Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    missing = str(tmp_path / "nothere.h5")
    argv = {"flag": ["inspect", missing, "--debug"], "flag-first": ["--debug", "inspect", missing],
            "env": ["inspect", missing]}[how]  # fmt: skip
    if how == "env":
        monkeypatch.setenv("PARALLELVARS_DEBUG", "1")
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err
    assert "CheckpointNotFoundError" in err
    assert err.strip().splitlines()[-1].startswith(f"parallelvars: error: {missing}: no such ")


def test_unexpected_exception_is_an_internal_error(
    capsys: pytest.CaptureFixture[str],
    tmp_path: pathlib.Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import parallelvars.cli.inspect as inspect_cmd

    def broken(*args: object) -> None:
        raise ZeroDivisionError("division by zero")

    monkeypatch.setattr(inspect_cmd, "Rows", broken)
    path = write_sample(tmp_path / "run.h5")
    assert main(["inspect", path]) == EXIT_INTERNAL
    line = _one_line_error(capsys.readouterr().err)
    assert line == (
        "parallelvars: error: internal error: ZeroDivisionError: division by zero "
        "(rerun with --debug for the traceback)"
    )
    assert main(["inspect", path, "--debug"]) == EXIT_INTERNAL
    assert "in broken" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("exc", "code", "message"),
    [
        (FileNotFoundError(2, "No such file or directory", "a.h5"), 2, "a.h5: no such file or directory"),
        (PermissionError(13, "Permission denied", "/x"), 2, "/x: permission denied"),
        (errors.TruncatedFileError("cut", file="f.h5"), 2, "f.h5: cut"),
        (errors.MissingVariableError("no such variable", file="f", variable="w"), 2,
         "f: variable 'w': no such variable"),
        (errors.DeviceCountError("cannot redistribute", variable="rng", expected=2, found=3), 2,
         "variable 'rng': cannot redistribute (expected 2, found 3)"),
        (ValueError("unknown format 'x'"), 2, "unknown format 'x'"),
        (UsageError("multi\nline"), 2, "multi\nline"),
        (KeyboardInterrupt(), 130, "interrupted"),
        (KeyError("k"), EXIT_INTERNAL, "internal error: KeyError: 'k' (rerun with --debug for the traceback)"),
        (RuntimeError("bug"), EXIT_INTERNAL, "internal error: RuntimeError: bug (rerun with --debug for the traceback)"),
    ],
)  # fmt: skip
def test_error_table(exc: BaseException, code: int, message: str) -> None:
    assert classify(exc) == (code, message)


def test_error_output_is_folded_onto_one_line() -> None:
    err = io.StringIO()
    Output(stderr=err).error("first\n  second\n")
    assert err.getvalue() == "parallelvars: error: first; second\n"


# --- sizes ---------------------------------------------------------------------------------------


# One grammar for the library's max_shard_size and the CLI's --max-shard-size: every spelling
# either of the two former parsers took is still taken, with the same answer.
@pytest.mark.parametrize(
    ("text", "size"),
    [("5GB", 5 * 10**9), ("500MB", 500 * 10**6), ("100KiB", 102400), ("1.5GiB", 3 * 2**29),
     ("4096", 4096), ("1kb", 1000), ("2 MiB", 2 * 2**20), ("7B", 7), ("1TB", 10**12), (".5KiB", 512),
     ("1e9", 10**9), ("2.5e3KB", 2_500_000), (" 3 gib ", 3 * 2**30), ("1.5MB", 1_500_000),
     ("1.9", 1), ("18446744073709551617", 2**64 + 1)],
)  # fmt: skip
def test_parse_size(text: str, size: int) -> None:
    assert parse_size(text) == size
    args = build_parser().parse_args(
        ["convert", "a.h5", "b.safetensors", f"--max-shard-size={text}"]
    )
    assert args.max_shard_size == size


@pytest.mark.parametrize(
    "text",
    ["", "GB", "5XB", "5 G", "-1MB", "0", "0.1B", "1.2.3MB", "1e", "inf", "nan", "1e400", "5 G B"],
)
def test_parse_size_rejects(text: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(InvalidArgumentError, match="size"):
        parse_size(text)
    assert main(["convert", "a.h5", "b.safetensors", f"--max-shard-size={text}"]) == EXIT_USAGE
    assert "error: argument --max-shard-size: " in capsys.readouterr().err


def test_parse_size_takes_positive_ints_only() -> None:
    assert parse_size(100) == 100
    for bad in (0, -5, True):
        with pytest.raises(InvalidArgumentError):
            parse_size(bad)


def test_max_shard_size_help_and_errors_name_the_grammar(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["convert", "a.h5", "b.safetensors", "--max-shard-size", "5 G"]) == 2
    err = capsys.readouterr().err
    assert "--max-shard-size" in err and "5GB, 500MB, 100KiB" in err


# --- the output sink ---------------------------------------------------------------------------


def test_json_is_strict_and_handles_numpy() -> None:
    data = {"a": np.float32(1.5), "b": (1, 2), "c": float("nan"), "d": -np.inf, "e": np.dtype("int8"),
            "f": b"\xffx", "g": np.arange(2), "h": {"nested": np.bool_(True)}, "i": pathlib.Path("p")}  # fmt: skip
    out = io.StringIO()
    Output(json_mode=True, stdout=out).emit(data, "unused")
    assert json.loads(out.getvalue()) == {
        "a": 1.5, "b": [1, 2], "c": "nan", "d": "-inf", "e": "int8", "f": "\\xffx", "g": [0, 1],
        "h": {"nested": True}, "i": "p",
    }  # fmt: skip
    assert jsonable(float("inf")) == "inf"


@pytest.mark.parametrize("where", ["after", "before"])
def test_json_flag_before_or_after_the_command(
    where: str, capsys: pytest.CaptureFixture[str], tmp_path: pathlib.Path
) -> None:
    path = write_sample(tmp_path / "run.h5")
    argv = ["inspect", path, "--json"] if where == "after" else ["--json", "inspect", path]
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["format"] == "hdf5"


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize(
    ("tty", "quiet", "drawn"), [(True, False, True), (True, True, False), (False, False, False)]
)
def test_progress_only_on_a_terminal_and_not_quiet(
    tty: bool, quiet: bool, drawn: bool, tmp_path: pathlib.Path,
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    path = write_sample(tmp_path / "run.h5")
    stderr = _Terminal() if tty else io.StringIO()
    monkeypatch.setattr(sys, "stderr", stderr)
    assert main(["diff", path, path, *(["--quiet"] if quiet else [])]) == 0
    assert ("compare" in stderr.getvalue() and "%" in stderr.getvalue()) == drawn
    assert "no differences" in capsys.readouterr().out  # the result itself is never silenced
    if not drawn:
        assert stderr.getvalue() == ""


# --- real processes ------------------------------------------------------------------------------


def _script() -> str:
    """The installed console script: next to this interpreter (a venv), else on PATH."""
    name = "parallelvars.exe" if os.name == "nt" else "parallelvars"
    beside = pathlib.Path(sys.executable).parent / name
    found = str(beside) if beside.exists() else shutil.which("parallelvars")
    assert found, (
        f"the parallelvars console script is not installed (looked next to {sys.executable})"
    )
    return found


def _run(argv: list[str]) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "PARALLELVARS_DEBUG"}
    # Run outside the source tree: `python -m` puts the working directory first on sys.path,
    # and the tree's parallelvars/ folder lacks the formats/ and cli/ subpackages that the
    # installed package maps in.
    return subprocess.run(
        argv,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
        cwd=tempfile.gettempdir(),
    )


def test_console_script_inspect(tmp_path: pathlib.Path) -> None:
    path = write_sample(tmp_path / "run.h5", step=3)
    proc = _run([_script(), "inspect", path, "--json"])
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""  # not a terminal: no progress bar
    doc = json.loads(proc.stdout)
    assert (doc["format"], doc["num_variables"], doc["metadata"]["step"]) == ("hdf5", 9, 3)
    proc = _run([_script(), "inspect", path])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"{path}: hdf5, 9 variables, 15 components")


def test_console_script_help() -> None:
    proc = _run([_script(), "--help"])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: parallelvars")
    assert "examples:" in proc.stdout


def test_python_dash_m(tmp_path: pathlib.Path) -> None:
    proc = _run([sys.executable, "-m", "parallelvars", "--version"])
    assert (proc.returncode, proc.stdout.strip()) == (0, "parallelvars 0.1.0")
    path = write_sample(tmp_path / "run.h5")
    proc = _run([sys.executable, "-m", "parallelvars", "verify", path])
    assert (proc.returncode, proc.stdout, proc.stderr) == (
        0, f"OK: {path} (hdf5, 9 variables, 15 components, 214 B checked)\n", "",
    )  # fmt: skip
    missing = tmp_path / "nothere.h5"
    proc = _run([sys.executable, "-m", "parallelvars", "verify", str(missing)])
    assert proc.returncode == EXIT_USAGE
    assert proc.stdout == ""
    assert proc.stderr.startswith(f"parallelvars: error: {missing}: no such ")
    assert proc.stderr.count("\n") == 1 and proc.stderr.endswith("\n")


def test_version_imports_neither_the_library_nor_the_formats() -> None:
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from parallelvars.cli import main\n"
        "assert main(['--version']) == 0\n"
        "heavy = ('h5py', 'parallelvars.variables', 'parallelvars.checkpoint', 'parallelvars.formats')\n"
        "print(sorted(m for m in sys.modules if m.startswith(heavy)))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    version, loaded = proc.stdout.splitlines()
    assert version.startswith("parallelvars ")
    assert loaded == "[]"


def test_version_after_a_subcommand_is_still_an_error(capsys) -> None:
    from parallelvars.cli import main

    assert main(["inspect", "--version"]) == 2


def test_reader_options_belong_to_their_command(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # --follow-state-outside is one command's option: a main() without it, called in the same
    # process (here in the middle of the first command, after it parsed its arguments and
    # before it opened its file), neither gets it nor takes it from the first.
    import fuzz_readers

    from parallelvars.cli.testing import cli_common as _common

    directory = fuzz_readers.CRAFTED["tf-state-dotdot"](str(tmp_path))
    detect = _common.detect_format
    nested: list[int] = []

    def detect_then_run_another(path: str) -> str:
        if not nested:
            nested.append(-1)
            nested[0] = main(["inspect", directory])
        return detect(path)

    monkeypatch.setattr(_common, "detect_format", detect_then_run_another)
    assert main(["inspect", "--follow-state-outside", directory]) == 0
    assert nested == [EXIT_USAGE]
    assert "--follow-state-outside" in capsys.readouterr().err
    assert main(["inspect", directory]) == EXIT_USAGE
    assert main(["inspect", "--follow-state-outside", directory]) == 0
