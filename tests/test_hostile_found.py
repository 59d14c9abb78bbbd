"""Files found next to a checkpoint are held to the rule of the file the user named.

A TF checkpoint's index, data shards and ``checkpoint`` state file, a safetensors set's index
and shards, the ``model.safetensors`` of a folder, a multi-process checkpoint's parts and a
managed directory's checkpoints and state file are found by name, not named by the user. Each
must be a regular file opened without blocking (a FIFO never hangs a command) and may be a
symbolic link only inside the checkpoint's folder (``parallelvars._fileio.open_input``): a link
out is refused before anything of its target is read, so neither its bytes nor a checksum of
them reach the output. A link inside the folder reads as the file itself.

Each case runs every entry point (``open_checkpoint`` with every component read, ``convert``,
``Checkpoint.restore``, the CLI's ``inspect``, ``verify`` and ``convert``) in a subprocess
under a time limit, so a hang is a failed test, never a stuck suite.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import crc32c
import numpy as np
import pytest

import parallelvars as pv
from parallelvars import formats
from parallelvars.checkpoint import manager
from parallelvars.errors import (
    CorruptCheckpointError,
    ForeignReferenceError,
    NotACheckpointError,
)

pytestmark = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="POSIX FIFOs and links")

ROOT = Path(__file__).resolve().parent.parent
SECRET = b"TOP-SECRET-BYTES" * 4  # 64 bytes: 16 float32, four 4-byte "tensors"
TIMEOUT = 90  # seconds for every entry point of one case; each takes a few

# Every entry point on one path; one line per entry point: OK, REFUSED <class> <message>,
# EXIT <code> <stderr> for the CLI, or PROBLEM for anything else.
_RUNNER = r"""
import contextlib, io, os, sys
import numpy as np
import parallelvars as pv
from parallelvars import formats
from parallelvars.cli import main
from parallelvars.errors import ParallelVarsError
path, scratch = sys.argv[1], sys.argv[2]

def entry(name, fn):
    try:
        fn()
        print("OK", name)
    except ParallelVarsError as exc:
        print("REFUSED", name, type(exc).__name__, exc)
    except BaseException as exc:
        print("PROBLEM", name, type(exc).__name__, exc)

def read_all():
    with formats.open_checkpoint(path) as view:
        for key in view:
            for i in range(view[key].num_components):
                np.asarray(view[key].component(i)).tobytes()

entry("open", read_all)
entry("convert", lambda: formats.convert(path, os.path.join(scratch, "out.npz")))
entry("restore", lambda: pv.Checkpoint(model=pv.Module()).restore(path))
for argv in (["inspect", path], ["verify", path], ["convert", path, os.path.join(scratch, "cli.npz")]):
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()) as out, contextlib.redirect_stderr(err):
        code = main(["-q", *argv])
    print("EXIT", argv[0], code, (err.getvalue() + out.getvalue()).replace("\n", " "))
"""


def run_all(path: str | Path, scratch: Path) -> list[str]:
    """Every entry point on ``path`` in a bounded subprocess; their outcome lines."""
    scratch.mkdir(exist_ok=True)
    proc = subprocess.run(
        [sys.executable, "-c", _RUNNER, str(path), str(scratch)],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,  # a FIFO opened blocking would hang here
        cwd=str(ROOT),
        env=dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1"),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [
        ln
        for ln in proc.stdout.splitlines()
        if ln.split(" ", 1)[0] in {"OK", "REFUSED", "EXIT", "PROBLEM"}
    ]
    assert len(lines) == 6, proc.stdout[-3000:] + proc.stderr[-3000:]
    return lines


def _applicable(lines: list[str]) -> list[str]:
    """``lines`` less a restore of a safetensors folder: ``Checkpoint.restore`` reads a file
    or a TF directory, and refuses other folders whatever is in them."""
    return [
        ln for ln in lines if not ln.startswith("REFUSED restore") or "is a directory" not in ln
    ]


def assert_refused(lines: list[str], *, because: str | tuple[str, ...]) -> None:
    """Every entry point refused the input with our error saying ``because`` (one of)."""
    reasons = (because,) if isinstance(because, str) else because
    text = "\n".join(lines)
    lines = _applicable(lines)
    assert "PROBLEM" not in text and "Traceback" not in text, text
    for line in lines:
        if line.startswith("EXIT"):
            code = int(line.split()[2])
            assert code in (1, 2), text  # verify 1 (damaged), the others 2; never 0 or 3
        else:
            assert line.startswith("REFUSED"), text
        assert any(reason in line for reason in reasons), text
    assert SECRET.decode() not in text
    for k in range(0, len(SECRET), 4):  # no checksum of a foreign byte
        crc = crc32c.crc32c(SECRET[k : k + 4])
        assert f"{crc:08x}" not in text.lower() and f"{crc:#x}" not in text.lower(), text


def assert_read(lines: list[str]) -> None:
    text = "\n".join(lines)
    for line in _applicable(lines):
        assert line.startswith("OK") or line.split()[:3] in (
            ["EXIT", "inspect", "0"],
            ["EXIT", "verify", "0"],
            ["EXIT", "convert", "0"],
        ), text


# ------------------------------------------------------------------------------ layouts


def _entries() -> dict[str, formats.ArrayEntry]:
    # 4-byte tensors: a CRC-32C per tensor would give the bytes of a foreign file back.
    return {
        f"w{i}": formats.ArrayEntry(f"w{i}", [np.array([i + 0.5], np.float32)]) for i in range(8)
    }


def layout(kind: str, d: Path) -> tuple[Path, list[str]]:
    """A checkpoint of ``kind`` in the new folder ``d``: (the path a user names, the files
    found next to it, relative to ``d``)."""
    d.mkdir()
    if kind == "tf-prefix":
        formats.write_checkpoint(str(d / "ckpt-1"), _entries(), format="tf", update_state=False)
        return d / "ckpt-1", ["ckpt-1.index", "ckpt-1.data-00000-of-00001"]
    if kind == "tf-folder":
        formats.write_checkpoint(str(d / "ckpt-1"), _entries(), format="tf")
        return d, ["checkpoint", "ckpt-1.index", "ckpt-1.data-00000-of-00001"]
    if kind in ("st-folder", "st-index"):
        index = formats.write_checkpoint(
            str(d) + "/", _entries(), format="safetensors", max_shard_size=16
        )
        shards = sorted(n for n in os.listdir(d) if n.endswith(".safetensors"))
        if kind == "st-index":
            return Path(index), shards[:1] + shards[-1:]
        return d, [os.path.basename(index), shards[0], shards[-1]]
    if kind == "st-single":
        formats.write_checkpoint(str(d / "model.safetensors"), _entries())
        return d, ["model.safetensors"]
    raise AssertionError(kind)


KINDS = ["tf-prefix", "tf-folder", "st-folder", "st-index", "st-single"]


def mutate(d: Path, name: str, how: str, outside: Path) -> None:
    """Put ``how`` in the place of the found file ``d/name``."""
    target = d / name
    if how == "fifo":
        target.unlink()
        os.mkfifo(target)
    elif how == "link-out":  # a faithful copy outside: following it would read silently
        outside.mkdir(exist_ok=True)
        away = outside / name
        shutil.move(str(target), away)
        target.symlink_to(away)
    elif how == "link-secret":
        outside.mkdir(exist_ok=True)
        (outside / "secret").write_bytes(SECRET)
        target.unlink()
        target.symlink_to(outside / "secret")
    elif how == "link-in":  # the file itself under another name in the folder
        moved = d / f"moved-{name}"
        target.rename(moved)
        target.symlink_to(moved.name)
    elif how == "dir":
        target.unlink()
        target.mkdir()
    else:
        raise AssertionError(how)


#: What the refusal says. A TF index linked out is refused as the state file's checkpoint
#: outside its directory when a state file leads to it.
_OUT = ("symbolic link out of the checkpoint's folder", "names a checkpoint outside its directory")
BECAUSE = {"fifo": "FIFO", "link-out": _OUT, "link-secret": _OUT, "dir": "a directory"}


# ------------------------------------------------------------------- the defects, one each


def test_a_symlinked_tf_data_shard_is_refused_before_a_checksum_of_it(tmp_path: Path) -> None:
    path, _ = layout("tf-prefix", tmp_path / "ckpt")
    mutate(tmp_path / "ckpt", "ckpt-1.data-00000-of-00001", "link-secret", tmp_path / "away")
    with pytest.raises(ForeignReferenceError, match="symbolic link out") as info:
        formats.open_checkpoint(str(path))
    assert info.value.file == f"{path}.data-00000-of-00001"
    assert_refused(run_all(path, tmp_path / "s"), because=BECAUSE["link-secret"])


def test_a_symlinked_safetensors_shard_is_not_copied(tmp_path: Path) -> None:
    path, found = layout("st-folder", tmp_path / "set")
    mutate(tmp_path / "set", found[1], "link-out", tmp_path / "away")
    with pytest.raises(ForeignReferenceError, match="symbolic link out"):
        formats.convert(str(path), str(tmp_path / "copy.npz"))
    assert not (tmp_path / "copy.npz").exists()


@pytest.mark.parametrize(
    ("kind", "name"),
    [
        ("tf-prefix", "ckpt-1.index"),
        ("tf-folder", "checkpoint"),
        ("st-folder", "model.safetensors.index.json"),
    ],
)
def test_a_fifo_found_next_to_a_checkpoint_never_hangs(
    kind: str, name: str, tmp_path: Path
) -> None:
    path, _ = layout(kind, tmp_path / "c")
    mutate(tmp_path / "c", name, "fifo", tmp_path / "away")
    assert_refused(run_all(path, tmp_path / "s"), because="FIFO")


def test_a_link_inside_the_folder_reads_as_the_file(tmp_path: Path) -> None:
    path, found = layout("st-folder", tmp_path / "set")
    mutate(tmp_path / "set", found[1], "link-in", tmp_path / "away")
    with formats.open_checkpoint(str(path)) as view:
        assert float(view["w0"].value()[0]) == 0.5


# ------------------------------------------------------------------------------ the sweep


@pytest.mark.slow  # some 60 cases, each every entry point in a subprocess; CI runs it
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("how", ["fifo", "link-out", "link-secret", "dir", "link-in"])
def test_sweep_every_found_file_of_every_format(kind: str, how: str, tmp_path: Path) -> None:
    _, found = layout(kind, tmp_path / "probe")
    for k, name in enumerate(found):
        d = tmp_path / f"case{k}"
        path, _ = layout(kind, d)
        mutate(d, name, how, tmp_path / f"away{k}")
        lines = run_all(path, tmp_path / f"scratch{k}")
        if how == "link-in":
            assert_read(lines)
        elif how == "dir" and name == "checkpoint" and kind == "tf-folder":
            # a folder named like the state file: the state file is absent, and the directory's
            # only index is read (as TensorFlow does)
            assert_read(lines)
        else:
            assert_refused(lines, because=BECAUSE[how])


def test_a_managed_directory_never_takes_a_checkpoint_linked_from_outside(tmp_path: Path) -> None:
    v = pv.Variable(np.zeros(4, np.float32), name="w")
    ckpt = pv.Checkpoint(w=v)
    d = tmp_path / "run"
    with pv.CheckpointManager(ckpt, d, max_to_keep=None) as mgr:
        mgr.save()
    elsewhere = tmp_path / "other.h5"
    v.assign(np.full(4, 7, np.float32))
    ckpt.write(str(elsewhere))
    (d / "ckpt-9.h5").symlink_to(elsewhere)  # newer by number, linked from outside
    (d / "ckpt-8.h5").symlink_to("ckpt-1.h5")  # inside: a checkpoint of the directory
    assert pv.latest_checkpoint(d) == str(d / "ckpt-8.h5")
    os.unlink(d / manager.STATE_FILE)
    os.mkfifo(d / manager.STATE_FILE)  # a FIFO state file: untrusted, never blocking
    assert pv.latest_checkpoint(d) == str(d / "ckpt-8.h5")


def test_a_multi_process_part_may_link_only_inside_its_folder(tmp_path: Path) -> None:
    from parallelvars.testing import h5policy as _h5policy

    parts = tmp_path / "a.h5.parts"
    parts.mkdir()
    (parts / "real.h5").write_bytes(b"x")
    (parts / "rank-00000-of-00001.h5").symlink_to("real.h5")
    link = (b"a.h5.parts/rank-00000-of-00001.h5", b"/x")
    got = _h5policy.part_file(str(tmp_path / "a.h5"), link, "w")
    assert got == str(parts / "rank-00000-of-00001.h5")
    os.unlink(parts / "rank-00000-of-00001.h5")
    (parts / "rank-00000-of-00001.h5").symlink_to(tmp_path / "elsewhere.h5")
    (tmp_path / "elsewhere.h5").write_bytes(b"x")
    with pytest.raises(ForeignReferenceError, match="symbolic link out"):
        _h5policy.part_file(str(tmp_path / "a.h5"), link, "w")


# ------------------------------------------------------------------------------ the rule


def test_the_rule_named_versus_found(tmp_path: Path) -> None:
    from parallelvars.testing import open_input

    real = tmp_path / "real.bin"
    real.write_bytes(b"abc")
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "link").symlink_to(real)
    os.close(open_input(str(folder / "link")))  # named: the user chose the link
    with pytest.raises(ForeignReferenceError):
        open_input(str(folder / "link"), within=str(folder))  # found: a link out
    os.mkfifo(folder / "pipe")
    with pytest.raises(NotACheckpointError, match="FIFO"):
        open_input(str(folder / "pipe"))
    with pytest.raises(CorruptCheckpointError, match="FIFO"):
        open_input(str(folder / "pipe"), within=str(folder))
    (folder / "loop").symlink_to("loop")
    with pytest.raises(CorruptCheckpointError, match="loop"):
        open_input(str(folder / "loop"), within=str(folder))


def test_a_hugging_face_cache_snapshot_opens_where_it_lies(tmp_path: Path) -> None:
    """huggingface_hub's cache: snapshots/<revision>/ files link into the repository's
    blobs/; the repository folder is the checkpoint's folder."""
    from parallelvars.testing import checkpoint_root

    repo = tmp_path / "hub" / "models--org--name"
    snap = repo / "snapshots" / "0123abcd"
    snap.mkdir(parents=True)
    (repo / "blobs").mkdir()
    built, found = layout("st-folder", tmp_path / "built")
    for name in found:
        blob = repo / "blobs" / f"blob-{name}"
        shutil.copy(built / name, blob)
        (snap / name).symlink_to(os.path.relpath(blob, snap))
    assert checkpoint_root(str(snap)) == os.path.realpath(repo)
    with formats.open_checkpoint(str(snap)) as view:
        assert float(view["w7"].value()[0]) == 7.5
    # not a cache: a folder named "snapshots" elsewhere keeps the folder's own bounds
    plain = tmp_path / "plain" / "snapshots" / "r"
    plain.mkdir(parents=True)
    assert checkpoint_root(str(plain)) == os.path.realpath(plain)
