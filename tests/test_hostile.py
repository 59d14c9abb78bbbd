"""Hostile non-HDF5 inputs: every size checked against the file, JSON within caps, linear loops,
no reference followed out of a checkpoint's directory, failed writes as our errors, and one
error boundary (only ``ParallelVarsError`` escapes; the CLI never exits 3 on a crafted file).

The crafted files come from tools/fuzz_readers.py (``CRAFTED``). Memory and time are bounded
in subprocesses (``RLIMIT_AS`` over the interpreter's own footprint, generous timeouts), never
by timing assertions.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import fuzz_readers
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from parallelvars.errors import (
    CheckpointWriteError,
    CorruptCheckpointError,
    ForeignReferenceError,
    LimitExceededError,
    ParallelVarsError,
    TruncatedFileError,
)
from parallelvars.formats import ArrayEntry, open_checkpoint, write_checkpoint
from parallelvars.formats.testing import tf_bundle as _bundle
from parallelvars.testing import MAX_JSON_DEPTH, json_depth, load_json

ROOT = Path(__file__).resolve().parent.parent

CRAFTED = fuzz_readers.CRAFTED


def limited(
    code: str, *, budget_mb: int, timeout: float, **kw: Any
) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter whose address space may grow by ``budget_mb`` over
    what it holds once the library is imported, killed after ``timeout`` seconds."""
    prologue = textwrap.dedent(
        f"""
        import resource
        import numpy, h5py, parallelvars, parallelvars.formats, parallelvars.cli
        from parallelvars.formats import tf, npz, safetensors
        with open("/proc/self/status") as f:
            vm = next(int(l.split()[1]) for l in f if l.startswith("VmSize:")) * 1024
        resource.setrlimit(resource.RLIMIT_AS, (vm + {budget_mb} * 2**20,) * 2)
        """
    )
    return subprocess.run(
        [sys.executable, "-c", prologue + textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=str(ROOT),
        **kw,
    )


def cli_limited(argv: list[str], *, budget_mb: int = 256, timeout: float = 120) -> tuple[int, str]:
    code = f"""
        from parallelvars.cli import main
        code = main({argv!r})
        print("EXIT", code)
    """
    res = limited(code, budget_mb=budget_mb, timeout=timeout)
    lines = [line for line in res.stdout.splitlines() if line.startswith("EXIT ")]
    assert lines, (res.returncode, res.stdout[-2000:], res.stderr[-2000:])
    return int(lines[-1].split()[1]), res.stderr + res.stdout


# --------------------------------------------------------------------------------------- npz


def test_npz_lying_directory_is_refused_before_any_allocation(tmp_path: Path) -> None:
    path = CRAFTED["npz-lying-directory"](str(tmp_path))
    assert os.path.getsize(path) < 400  # a few hundred bytes claiming 64 GiB
    with pytest.raises(LimitExceededError, match="claims more bytes") as info:
        open_checkpoint(path)
    assert info.value.file == path and info.value.variable == "w.npy"
    for cmd, want in (("inspect", 2), ("verify", 1)):  # verify reports a damaged file with 1
        code, err = cli_limited([cmd, path], budget_mb=128)
        assert code == want and "claims more bytes" in err, err


def test_npz_honest_zip_bomb_reads_in_bounded_memory(tmp_path: Path) -> None:
    path = fuzz_readers.craft_npz_zip_bomb(str(tmp_path), size=64 << 20)
    assert os.path.getsize(path) < 1 << 20
    code, err = cli_limited(["verify", path], budget_mb=384, timeout=180)
    assert code == 0, err


def test_npz_huge_npy_header_is_refused(tmp_path: Path) -> None:
    path = CRAFTED["npz-huge-npy-header"](str(tmp_path))
    with pytest.raises(CorruptCheckpointError, match=r"\.npy header too large") as info:
        open_checkpoint(path)
    assert info.value.variable == "w"


# --------------------------------------------------------------------------------------- JSON

DEEP = [
    "npz-deep-json",
    "safetensors-deep-json",
    "safetensors-deep-metadata",
    "safetensors-index-deep-json",
    "tf-deep-metadata",
    "hdf5-deep-graph",
]


@pytest.mark.parametrize("name", DEEP)
def test_deep_json_is_our_error_naming_the_file(name: str, tmp_path: Path) -> None:
    path = CRAFTED[name](str(tmp_path))
    if name == "hdf5-deep-graph":
        from parallelvars.checkpoint.h5io import H5Reader

        opener: Any = H5Reader
    else:
        opener = open_checkpoint
    with pytest.raises(LimitExceededError, match="nests too deeply") as info:
        opener(path).close()
    assert info.value.file is not None and os.path.basename(info.value.file) in {
        os.path.basename(path),
        "ckpt.index",
        "model.safetensors.index.json",
    }
    assert f"<= {MAX_JSON_DEPTH} levels" in str(info.value)


def test_json_cap_on_size(tmp_path: Path) -> None:
    with pytest.raises(LimitExceededError, match="too large"):
        load_json(b"[" + b"1," * 600 + b"1]", file="f.json", max_bytes=1000)
    assert load_json(b'{"a": [1, 2]}', file="f.json") == {"a": [1, 2]}
    with pytest.raises(CorruptCheckpointError, match="not UTF-8"):
        load_json(b'"\xff"', file="f.json")


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(alphabet='[]{}"\\ab\n'),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(st.text(alphabet='[]{}"\\k'), inner, max_size=3)
    ),
    max_leaves=20,
)


def _depth(value: Any) -> int:
    if isinstance(value, list):
        return 1 + max((_depth(v) for v in value), default=0)
    if isinstance(value, dict):
        return 1 + max((_depth(v) for v in value.values()), default=0)
    return 0


# hypothesis' check that `extend` uses its argument misfires now and then on this strategy
# (it plainly does); the warning is an error under filterwarnings = error.
@pytest.mark.filterwarnings("ignore:.*can't actually recurse")
@settings(max_examples=200, deadline=None)
@given(json_values)
def test_json_depth_matches_the_parsed_document(value: Any) -> None:
    raw = json.dumps(value, ensure_ascii=False).encode("utf-8")
    assert json_depth(raw) == _depth(value)


# -------------------------------------------------------------------------------- safetensors


def test_safetensors_lying_offsets_overlap_and_short_header(tmp_path: Path) -> None:
    with pytest.raises(TruncatedFileError, match="ends before the tensor's data") as info:
        open_checkpoint(CRAFTED["safetensors-lying-offsets"](str(tmp_path)))
    assert info.value.variable == "w"
    with pytest.raises(CorruptCheckpointError, match="overlaps"):
        open_checkpoint(CRAFTED["safetensors-overlap"](str(tmp_path)))
    with pytest.raises(TruncatedFileError, match="ends inside the safetensors JSON header"):
        open_checkpoint(CRAFTED["safetensors-header-past-end"](str(tmp_path)))


def _inspect_large_header(tmp_path: Path, tensors: int, budget_mb: int, timeout: float) -> None:
    path = fuzz_readers.craft_safetensors_large_header(str(tmp_path), tensors)
    code, err = cli_limited(["--json", "inspect", path], budget_mb=budget_mb, timeout=timeout)
    assert code == 0, err


@pytest.mark.slow
def test_safetensors_large_legal_header_inspects_in_bounded_memory(tmp_path: Path) -> None:
    # ~17 MB of header, 200,000 tensors: a real 100k-tensor model's header is 10-20 MB.
    _inspect_large_header(tmp_path, 200_000, budget_mb=1024, timeout=300)


@pytest.mark.slow
def test_safetensors_90mb_header_inspects_in_bounded_memory(tmp_path: Path) -> None:
    _inspect_large_header(tmp_path, 1_000_000, budget_mb=4096, timeout=600)


# ----------------------------------------------------------------------------------- TF bundle


def _count_pairwise(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls = [0]
    original = _bundle._overlap

    def counting(*args: Any) -> bool:
        calls[0] += 1
        return original(*args)

    monkeypatch.setattr(_bundle, "_overlap", counting)
    return calls


def test_tf_many_slices_open_without_pairwise_checks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    prefix = CRAFTED["tf-many-slices"](str(tmp_path))
    calls = _count_pairwise(monkeypatch)
    with open_checkpoint(prefix) as view:
        (entry,) = view.values()
        assert entry.num_components == 8000 and entry.nbytes == 8000 * 2 * 4
        assert entry.component(7999)[0, 0] == 7999
    assert calls[0] == 0  # the overlap check sorted the slices instead of comparing pairs
    code = subprocess.run(
        [sys.executable, "-m", "parallelvars", "-q", "inspect", prefix],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=str(ROOT),
    )
    assert code.returncode == 0, code.stderr


def _grid_bundle(prefix: str, n: int, overlap: bool) -> None:
    with _bundle.BundleWriter(prefix) as w:
        for i in range(n):
            for j in range(n):
                start = (i, 1) if not (overlap and i == j == n - 1) else (i - 1, 2)
                w.add_slice(
                    b"v",
                    (n + 1 if overlap else n, n),
                    (start, (j, 1)),
                    np.zeros((start[1], 1), np.float32),
                )
        if overlap:
            for j in range(n):
                w.add_slice(b"v", (n + 1, n), ((n, 1), (j, 1)), np.zeros((1, 1), np.float32))


def test_tf_slices_along_two_axes_checked_on_a_grid(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = _count_pairwise(monkeypatch)
    _grid_bundle(str(tmp_path / "ok"), 40, overlap=False)
    with open_checkpoint(str(tmp_path / "ok")) as view:
        assert next(iter(view.values())).value().shape == (40, 40)
    assert calls[0] == 0


specs_2d = st.lists(
    st.tuples(st.integers(0, 5), st.integers(0, 3), st.integers(0, 5), st.integers(0, 3)),
    min_size=0,
    max_size=8,
)


@settings(max_examples=300, deadline=None)
@given(specs_2d, st.booleans())
def test_find_overlap_agrees_with_pairwise(
    boxes: list[tuple[int, int, int, int]], full_cols: bool
) -> None:
    shape = (8, 8)
    specs = [((a, n), (0, None) if full_cols else (b, m)) for a, n, b, m in boxes]
    nonempty = [
        k for k, (_, n, _, m) in enumerate(boxes) if n and (m or full_cols)
    ]  # empty: no overlap
    brute = any(
        _bundle._overlap(specs[i], specs[j], shape) for i in nonempty for j in nonempty if j < i
    )
    found = _bundle.find_overlap(specs, shape)
    assert (found is not None) == brute
    if found is not None:
        j, i = found
        assert j < i and _bundle._overlap(specs[i], specs[j], shape)


@pytest.mark.slow  # CLI subprocesses; CI runs it (.ci/run, -m slow)
@pytest.mark.parametrize("how", ["dotdot", "absolute"])
def test_tf_state_file_outside_its_directory_needs_the_flag(how: str, tmp_path: Path) -> None:
    directory = CRAFTED[f"tf-state-{how}"](str(tmp_path))
    with pytest.raises(ForeignReferenceError, match="outside its directory") as info:
        open_checkpoint(directory)
    assert info.value.file == os.path.join(directory, "checkpoint")
    with open_checkpoint(directory, follow_state_outside=True) as view:
        assert list(view) == ["w"]
    code, err = cli_limited(["inspect", directory])
    assert code == 2 and "--follow-state-outside" in err, err
    code, err = cli_limited(["inspect", "--follow-state-outside", directory])
    assert code == 0, err
    code, err = cli_limited(
        ["convert", "--follow-state-outside", directory, str(tmp_path / f"{how}.npz")]
    )
    assert code == 0, err


def test_tf_state_file_inside_its_directory_is_followed(tmp_path: Path) -> None:
    with _bundle.BundleWriter(str(tmp_path / "ckpt-1")) as w:
        w.add(b"w/.ATTRIBUTES/VARIABLE_VALUE", np.ones(2))
    (tmp_path / "checkpoint").write_text(f'model_checkpoint_path: "{tmp_path / "ckpt-1"}"\n')
    with open_checkpoint(str(tmp_path)) as view:
        assert list(view) == ["w"]


# ---------------------------------------------------------------------------------- writing


def _entries(n: int) -> dict[str, ArrayEntry]:
    return {"w": ArrayEntry("w", [np.arange(n, dtype=np.float32)])}


@pytest.mark.parametrize("suffix", [".safetensors", ".npz", ".index"])
def test_file_size_limit_is_a_write_error_and_keeps_the_old_file(
    suffix: str, tmp_path: Path
) -> None:
    path = str(tmp_path / f"out{suffix}")
    if suffix == ".index":  # a TF bundle: the prefix names it
        path = str(tmp_path / "out")
        write_checkpoint(path, _entries(4), format="tf", update_state=False)
        path_files = sorted(p.name for p in tmp_path.iterdir())
        before = (tmp_path / "out.index").read_bytes()
    else:
        write_checkpoint(path, _entries(4))
        path_files = [f"out{suffix}"]
        before = Path(path).read_bytes()
    code = f"""
        import errno, resource, signal
        import numpy as np
        from parallelvars.errors import CheckpointWriteError
        from parallelvars.formats import ArrayEntry, write_checkpoint
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
        try:
            write_checkpoint({path!r}, {{"w": ArrayEntry("w", [np.zeros(1 << 20, np.float32)])}},
                             **({{"format": "tf", "update_state": False}} if {suffix == ".index"} else {{}}))
        except CheckpointWriteError as exc:
            assert isinstance(exc, OSError) and exc.errno == errno.EFBIG, exc
            assert exc.filename == {path!r} and {path!r} in str(exc), exc
            print("REFUSED", exc)
    """
    res = limited(code, budget_mb=512, timeout=120)
    assert "REFUSED" in res.stdout, res.stderr[-2000:]
    assert (
        tmp_path / ("out.index" if suffix == ".index" else f"out{suffix}")
    ).read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == path_files  # no temporary left


def test_disk_full_is_a_write_error_and_keeps_the_old_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = str(tmp_path / "out.safetensors")
    write_checkpoint(path, _entries(4))
    before = Path(path).read_bytes()

    def full(*args: Any) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "pwrite", full)
    with pytest.raises(CheckpointWriteError, match="No space left") as info:
        write_checkpoint(path, _entries(1000))
    assert info.value.errno == errno.ENOSPC and info.value.file == path
    assert isinstance(info.value, OSError) and isinstance(info.value, ParallelVarsError)
    assert Path(path).read_bytes() == before


def test_permission_errors_keep_their_type(tmp_path: Path) -> None:
    err = PermissionError(errno.EACCES, "Permission denied")
    from parallelvars.testing import write_error

    assert write_error(err, "x") is err
    # errno comes from the exception (or the OSError it was raised from), never its text
    text_only = OSError("Can't write data (errno = 28, error message = 'No space')")
    assert write_error(text_only, "x") is text_only
    try:
        try:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        except OSError as cause:
            raise OSError("Can't write data") from cause
    except OSError as chained:
        mapped = write_error(chained, "x")
    assert isinstance(mapped, CheckpointWriteError) and mapped.errno == errno.ENOSPC


# ------------------------------------------------------------------------------ object graph


def test_object_graph_of_the_wrong_shape_is_corrupt(tmp_path: Path) -> None:
    import parallelvars as pv

    path = CRAFTED["hdf5-bad-graph"](str(tmp_path))
    with pytest.raises(CorruptCheckpointError, match="object graph is malformed"):
        pv.Checkpoint(model=pv.Module()).restore(path)


# ------------------------------------------------------------------------------------ sweep

#: Crafted inputs scaled down for the sweep (the full sizes have their own tests above).
_SMALL = {
    "npz-zip-bomb": lambda d: fuzz_readers.craft_npz_zip_bomb(d, size=8 << 20),
    "safetensors-large-header": lambda d: fuzz_readers.craft_safetensors_large_header(d, 2000),
    "tf-many-slices": lambda d: fuzz_readers.craft_tf_many_slices(d, 500),
}


def _corpus(tmp_path: Path) -> list[str]:
    """The fuzz corpus: a few reproducible mutations of the sample in every format."""
    out = []
    for fmt in fuzz_readers.available_formats():
        d = tmp_path / f"fuzz-{fmt}"
        d.mkdir()
        clean = fuzz_readers.write_sample(fmt, str(d))
        files = fuzz_readers.checkpoint_files(clean)
        originals = [Path(f).read_bytes() for f in files]
        for k, m in enumerate(
            fuzz_readers.random_mutations(fuzz_readers.sample_sizes(clean), 3, seed=16)
        ):
            target = d / f"m{k}"
            target.mkdir()
            base = str(target / os.path.basename(clean))
            copies = fuzz_readers.copy_checkpoint(clean, base)
            i = m.target % len(copies)
            Path(copies[i]).write_bytes(m.apply(originals[i]))
            out.append(base)
    return out


@pytest.mark.slow  # hundreds of crafted files through every reader; CI runs it (.ci/run, -m slow)
def test_sweep_only_our_errors_escape_and_the_cli_never_exits_3(tmp_path: Path) -> None:
    inputs = []
    for name, maker in CRAFTED.items():
        d = tmp_path / name
        d.mkdir()
        inputs.append((name, _SMALL.get(name, maker)(str(d))))
    inputs += [(f"fuzz {p}", p) for p in _corpus(tmp_path)]
    problems = []
    for name, path in inputs:
        scratch = tmp_path / "scratch"
        scratch.mkdir(exist_ok=True)
        problems += [f"{name}: {p}" for p in fuzz_readers.sweep(path, str(scratch))]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("command", ["inspect", "verify", "convert"])
def test_a_fifo_given_to_the_cli_is_refused_without_blocking(tmp_path: Path, command: str) -> None:
    """Format detection reads a file's first bytes; a FIFO there would block forever."""
    fifo = tmp_path / "pipe.safetensors"
    os.mkfifo(fifo)
    argv = [command, str(fifo)] + ([str(tmp_path / "out.h5")] if command == "convert" else [])
    proc = subprocess.run(
        [sys.executable, "-m", "parallelvars", *argv],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert proc.returncode == 2, proc.stderr
    assert "FIFO" in proc.stderr and "pipe.safetensors" in proc.stderr
    assert not (tmp_path / "out.h5").exists()


@pytest.mark.parametrize(
    ("value", "integer", "index"),
    [(3, True, True), (0, True, True), (-1, True, False), (np.int64(5), True, True),
     (np.uint8(0), True, True), (np.int32(-2), True, False), (True, False, False),
     (np.bool_(True), False, False), (2.0, False, False), ("1", False, False), (None, False, False)],
)  # fmt: skip
def test_integer_checks_on_decoded_values(value: object, integer: bool, index: bool) -> None:
    from parallelvars.testing import is_index, is_int

    assert (is_int(value), is_index(value)) == (integer, index)
