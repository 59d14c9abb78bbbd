"""Hostile HDF5 files stay inside their file (the indirection policy, docs/FORMAT.md).

Each crafted file uses one HDF5 indirection (external storage, a virtual dataset, an external
or soft link) or a resource bomb. The readers run in a subprocess under an address-space limit
and a time limit, and must refuse the file with our documented error, without any foreign byte
(or a checksum of one) reaching their output.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import crc32c
import h5py
import numpy as np
import pytest
from _columns_support import strip_columns, write_columns

import parallelvars as pv
from parallelvars.checkpoint.h5io import INDEX_DATASET, H5Reader
from parallelvars.checkpoint.h5io.layout import COLUMNS_DATASET
from parallelvars.errors import CorruptCheckpointError
from parallelvars.testing import h5policy as _h5policy
from parallelvars.testing import write_json as _write_json

ROOT = Path(__file__).resolve().parent.parent
SECRET = b"TOP-SECRET-BYTES"  # 16 bytes: 4 float32
LIMIT_AS = 2 << 30  # bytes of address space for a reader
TIMEOUT = 60  # seconds; every case here takes about one

# Runs one reader operation; prints REFUSED/ACCEPTED and what the operation produced. In a
# subprocess (bounded) the _LIMIT part runs first.
_LIMIT = r"""
import os, resource, sys
limit = int(sys.argv[1])
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
op, args = sys.argv[2], sys.argv[3:]
"""
_RUNNER = r"""
import sys
import numpy as np
import parallelvars as pv
from parallelvars.errors import ParallelVarsError
try:
    if op == "reader":
        from parallelvars.checkpoint.h5io import H5Reader
        with H5Reader(args[0]) as r:
            problems = r.verify_all()
            values = [r[k].value().tobytes() for k in r]
        print("ACCEPTED", problems, values)
    elif op == "restore":
        v = pv.Variable(np.zeros(int(args[1]), np.float32), name="w")
        pv.Checkpoint(w=v).restore(args[0])
        print("ACCEPTED", np.asarray(v).tobytes())
    elif op == "cli":
        from parallelvars.cli import main
        code = main(args)
        print("EXIT", code)
    elif op == "open":
        from parallelvars import formats
        view = formats.open_checkpoint(args[0], format=args[1])
        print("ACCEPTED", {k: view[k].value().tobytes() for k in view})
    elif op == "convert":
        from parallelvars import formats
        formats.convert(args[0], args[1], from_format=args[2], to_format="npz")
        with open(args[1], "rb") as fh:
            print("ACCEPTED", fh.read())
    else:
        raise SystemExit(f"unknown op {op}")
except ParallelVarsError as exc:
    print("REFUSED", type(exc).__name__, exc)
"""


def run(op: str, *args: str | os.PathLike[str], bounded: bool = False) -> str:
    """Run ``op``; its output (stdout and stderr). ``bounded``: in a subprocess under an
    address-space limit and a time limit, for the files whose refusal is about resources (a
    bomb, a FIFO, a cycle: a defect there would exhaust or hang the test process); else in
    this process (a refusal of indirection is a check before any read: a defect there shows
    as ACCEPTED with the foreign bytes, which the assertions catch)."""
    if not bounded:
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            exec(_RUNNER, {"op": op, "args": [str(a) for a in args], "__name__": "_runner"})
        return out.getvalue() + err.getvalue()
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-c", _LIMIT + _RUNNER, str(LIMIT_AS), op, *map(str, args)],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        env=env,
        cwd=str(ROOT),
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    return out


def assert_refused(out: str, *, secret: bytes = SECRET) -> None:
    assert "REFUSED" in out or ("EXIT" in out and "EXIT 0" not in out), out
    assert "Traceback" not in out, out
    assert secret.decode() not in out, out
    assert f"{crc32c.crc32c(secret):#010x}" not in out, out  # no checksum of foreign bytes


# ----------------------------------------------------------------------------- crafting
def native(tmp: Path, name: str = "a.h5", n: int = 4) -> tuple[Path, str]:
    """A one-variable native checkpoint; (its path, the variable's path in the file)."""
    path = tmp / name
    v = pv.Variable(np.arange(n, dtype=np.float32), name="w")
    pv.Checkpoint(w=v).write(path)
    with H5Reader(path) as r:
        (var,) = [k for k in r if k != "save_counter"]
    return path, var


def replace_primary(
    path: Path, var: str, make, *, shape: tuple[int, ...] = (4,), index: bool = True
) -> None:
    """Replace ``var``'s component by ``make(group, 'primary')``; the index then holds no data
    offset (so a reader must go through HDF5) and the declared ``shape``."""
    with h5py.File(path, "r+") as f:
        grp = f[var]
        del grp["primary"]
        make(grp, "primary")
        doc = json.loads(f[INDEX_DATASET][()])
        del f[INDEX_DATASET]
        if index:
            doc[var]["offsets"] = [None]
            doc[var]["shape"] = list(shape)
            doc[var]["crc32c"] = [0]
            _write_json(f, INDEX_DATASET, doc)
            grp.attrs["shape"] = np.asarray(
                shape, np.int64
            )  # consistent, as an attacker would make it
        else:
            f.attrs["parallelvars_documents"] = np.array([b"_parallelvars/object_graph"])
            del f[COLUMNS_DATASET]
            grp.attrs["shape"] = np.asarray(shape, np.int64)
    if index:
        write_columns(str(path))  # the columns say what the index says


@pytest.fixture()
def secret(tmp_path: Path) -> Path:
    p = tmp_path / "secret.txt"
    p.write_bytes(SECRET)
    return p


@pytest.fixture()
def other(tmp_path: Path) -> Path:
    """Another user's HDF5 file, with the secret as a float32 dataset ``/x`` and ``/g/primary``."""
    p = tmp_path / "other.h5"
    with h5py.File(p, "w") as f:
        f["x"] = np.frombuffer(SECRET, np.float32)
        f["g/primary"] = np.frombuffer(SECRET, np.float32)
    return p


def external_storage(target: Path | str, nbytes: int = 16):
    def make(grp: h5py.Group, name: str) -> None:
        grp.create_dataset(
            name, shape=(nbytes // 4,), dtype=np.float32, external=[(str(target), 0, nbytes)]
        )

    return make


def virtual(target: Path, source: str = "x"):
    def make(grp: h5py.Group, name: str) -> None:
        layout = h5py.VirtualLayout(shape=(4,), dtype=np.float32)
        layout[:] = h5py.VirtualSource(str(target), source, shape=(4,))
        grp.create_virtual_dataset(name, layout)

    return make


def link(filename: str, obj: str = "/x"):
    def make(grp: h5py.Group, name: str) -> None:
        grp[name] = h5py.ExternalLink(filename, obj)

    return make


# ----------------------------------------------------------------------------- native reader
@pytest.mark.parametrize("index", [True, False], ids=["index", "no-index"])
def test_external_storage_on_a_foreign_file_is_refused(tmp_path, secret, index):
    path, var = native(tmp_path)
    replace_primary(path, var, external_storage(secret), index=index)
    for op in (("reader", path), ("restore", path, 4)):
        out = run(*op)
        assert_refused(out)
        assert "external storage" in out and str(secret) in out and var in out, out


def test_verify_prints_no_checksum_of_foreign_bytes(tmp_path, secret):
    path, var = native(tmp_path)
    replace_primary(path, var, external_storage(secret))
    out = run("cli", "verify", path)
    assert_refused(out)
    assert "external storage" in out


def test_external_storage_on_dev_zero_declaring_gibs_is_refused_small_and_fast(tmp_path):
    path, var = native(tmp_path)
    nbytes = 3 << 30
    replace_primary(path, var, external_storage("/dev/zero", nbytes), shape=(nbytes // 4,))
    assert path.stat().st_size < 64 << 10
    for op in (
        ("reader", path),
        ("cli", "verify", path),
        ("cli", "extract", path, var, "-o", tmp_path / "x.npy"),
    ):
        out = run(*op, bounded=True)
        assert_refused(out)
        assert "/dev/zero" in out, out
    assert not (tmp_path / "x.npy").exists()


def test_virtual_dataset_onto_another_file_is_refused(tmp_path, other):
    path, var = native(tmp_path)
    replace_primary(path, var, virtual(other))
    out = run("reader", path)
    assert_refused(out)
    assert "virtual dataset" in out and str(other) in out, out


def sharded_file(tmp_path: Path) -> Path:
    """A native file with one sharded variable ``s`` (two shards) and its stitched ``value``."""
    from parallelvars.formats import ArrayEntry, write_checkpoint

    path = tmp_path / "s.h5"
    entry = ArrayEntry(
        "s",
        [np.arange(2, dtype=np.float32), np.arange(2, 4, dtype=np.float32)],
        kind="sharded",
        shape=(4,),
        attrs={"shard_axis": 0, "shard_offsets": [0, 2]},
    )
    write_checkpoint(path, {"s": entry}, format="hdf5")
    return path


def test_own_sharded_value_vds_is_accepted(tmp_path):
    path = sharded_file(tmp_path)
    with h5py.File(path, "r") as f:
        assert f["s/value"].is_virtual
    out = run("reader", path)
    assert "ACCEPTED" in out, out


def test_sharded_value_vds_onto_another_file_is_refused_by_verify(tmp_path, other):
    """``verify`` also reads a sharded variable's stitched ``value``: a ``value`` whose sources
    are in another file is refused there too, and none of its bytes are read."""
    path = sharded_file(tmp_path)
    with h5py.File(path, "r+") as f:
        del f["s/value"]
        virtual(other)(f["s"], "value")
    out = run("cli", "verify", path)
    assert_refused(out)
    assert "virtual dataset" in out and str(other) in out, out


@pytest.mark.slow  # 4 subprocesses under limits; CI runs it (.ci/run, -m slow)
@pytest.mark.parametrize("target", ["abs", "outside", "dotdot", "other-parts"])
def test_external_links_outside_the_parts_folder_are_refused(tmp_path, other, target):
    path, var = native(tmp_path)
    (tmp_path / "a.h5.parts").mkdir()
    name = {
        "abs": str(other),
        "outside": "other.h5",
        "dotdot": "a.h5.parts/../other.h5",
        "other-parts": "b.h5.parts/rank-00000-of-00001.h5",
    }[target]
    replace_primary(path, var, link(name))
    for op in (
        ("reader", path),
        ("restore", path, 4),
        ("cli", "inspect", path),
        ("cli", "verify", path),
    ):
        out = run(*op)
        if op[:2] == ("cli", "inspect"):
            assert "EXIT 0" in out or "REFUSED" in out  # inspect reads no component
            assert SECRET.decode() not in out
            continue
        assert_refused(out)
        assert "external link" in out and var in out, out


def test_an_intermediate_external_link_is_refused_before_it_is_followed(tmp_path, other):
    path, var = native(tmp_path)
    with h5py.File(path, "r+") as f:
        del f[var]
        f[var] = h5py.ExternalLink(str(other), "/g")
    out = run("reader", path)
    assert_refused(out)
    assert "external link" in out


def test_a_soft_link_is_refused(tmp_path):
    path, var = native(tmp_path)
    with h5py.File(path, "r+") as f:
        f["hidden"] = np.frombuffer(SECRET, np.float32)
    replace_primary(path, var, lambda g, n: g.__setitem__(n, h5py.SoftLink("/hidden")))
    out = run("reader", path)
    assert_refused(out)
    assert "soft link" in out


def _parts(tmp_path: Path) -> Path:
    parts = tmp_path / "a.h5.parts"
    parts.mkdir()
    return parts


def test_an_external_link_to_a_fifo_does_not_hang(tmp_path):
    path, var = native(tmp_path)
    fifo = _parts(tmp_path) / "rank-00000-of-00001.h5"
    os.mkfifo(fifo)
    replace_primary(path, var, link("a.h5.parts/rank-00000-of-00001.h5", f"/{var}/primary"))
    for op in (("reader", path), ("restore", path, 4), ("cli", "verify", path)):
        out = run(*op, bounded=True)  # a hang would be the subprocess timeout
        assert_refused(out)
        assert "FIFO" in out, out


def test_external_storage_on_a_fifo_does_not_hang(tmp_path):
    path, var = native(tmp_path)
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    replace_primary(path, var, external_storage(fifo))
    out = run("cli", "verify", path, bounded=True)
    assert_refused(out)


def test_a_fifo_given_as_the_checkpoint_does_not_hang(tmp_path):
    fifo = tmp_path / "ckpt.h5"
    os.mkfifo(fifo)
    out = run("reader", fifo, bounded=True)
    assert "REFUSED NotACheckpointError" in out and "FIFO" in out, out


def test_a_symlink_in_the_parts_folder_is_refused(tmp_path, other):
    path, var = native(tmp_path)
    (_parts(tmp_path) / "rank-00000-of-00001.h5").symlink_to(other)
    replace_primary(path, var, link("a.h5.parts/rank-00000-of-00001.h5", "/x"))
    out = run("reader", path)
    assert_refused(out)
    assert "symbolic link" in out, out


def test_a_symlinked_parts_folder_is_refused(tmp_path, other):
    path, var = native(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    with h5py.File(elsewhere / "rank-00000-of-00001.h5", "w") as f:
        f["x"] = np.frombuffer(SECRET, np.float32)
    (tmp_path / "a.h5.parts").symlink_to(elsewhere)
    replace_primary(path, var, link("a.h5.parts/rank-00000-of-00001.h5", "/x"))
    out = run("reader", path)
    assert_refused(out)


def test_a_link_into_the_own_parts_folder_is_followed(tmp_path):
    """The multi-process layout's exception (proves the refusals above are about the target)."""
    path, var = native(tmp_path)
    with h5py.File(_parts(tmp_path) / "rank-00000-of-00001.h5", "w") as f:
        f["x"] = np.arange(4, dtype=np.float32) * 2
    crc = crc32c.crc32c((np.arange(4, dtype=np.float32) * 2).tobytes())
    replace_primary(path, var, link("a.h5.parts/rank-00000-of-00001.h5", "/x"))
    with h5py.File(path, "r+") as f:  # the right checksum this time
        doc = json.loads(f[INDEX_DATASET][()])
        doc[var]["crc32c"] = [crc]
        del f[INDEX_DATASET]
        _write_json(f, INDEX_DATASET, doc)
    write_columns(str(path))
    with H5Reader(path) as r:
        assert r.verify_all() == []
        np.testing.assert_array_equal(r[var].value(), np.arange(4, dtype=np.float32) * 2)


def test_a_part_may_not_link_further(tmp_path, secret):
    path, var = native(tmp_path)
    with h5py.File(_parts(tmp_path) / "rank-00000-of-00001.h5", "w") as f:
        f.create_dataset("x", shape=(4,), dtype=np.float32, external=[(str(secret), 0, 16)])
    replace_primary(path, var, link("a.h5.parts/rank-00000-of-00001.h5", "/x"))
    with H5Reader(path) as r, pytest.raises(CorruptCheckpointError, match="external storage"):
        r[var].value()


@pytest.mark.parametrize("document", ["index", "columns"])
def test_the_index_document_may_not_be_indirect(tmp_path, secret, document):
    """The document a reader opens the file with (the columns; the index of a file without
    them) refused at open; the index beside the columns refused by verify."""
    path, _ = native(tmp_path)
    if document == "index":
        strip_columns(str(path))
    name = INDEX_DATASET if document == "index" else COLUMNS_DATASET
    with h5py.File(path, "r+") as f:
        del f[name]
        f.create_dataset(name, shape=(16,), dtype="S1", external=[(str(secret), 0, 16)])
    out = run("reader", path)
    assert_refused(out)
    assert "external storage" in out


def test_an_indirect_index_beside_the_columns_fails_verify(tmp_path, secret):
    path, _ = native(tmp_path)
    with h5py.File(path, "r+") as f:
        del f[INDEX_DATASET]
        f.create_dataset(INDEX_DATASET, shape=(16,), dtype="S1", external=[(str(secret), 0, 16)])
    out = run("cli", "verify", path)
    assert "EXIT 1" in out and "external storage" in out, out
    assert SECRET.decode() not in out and "Traceback" not in out


# ----------------------------------------------------------------------------- Keras readers
def keras3(tmp_path: Path, make=None, depth: int = 1) -> Path:
    path = tmp_path / "m.weights.h5"
    with h5py.File(path, "w") as f:
        grp = f.require_group("/".join(["layers"] + ["d"] * depth) + "/vars")
        if make is None:
            grp["0"] = np.arange(4, dtype=np.float32)
        else:
            make(grp, "0")
    return path


def legacy(tmp_path: Path, make) -> Path:
    path = tmp_path / "legacy.h5"
    with h5py.File(path, "w") as f:
        f.attrs["layer_names"] = np.array([b"dense"])
        grp = f.create_group("dense")
        grp.attrs["weight_names"] = np.array([b"dense/kernel:0"])
        make(grp.create_group("dense"), "kernel:0")
    return path


KERAS_ATTACKS = ["external-storage", "virtual", "external-link", "soft-link"]


def _attack(kind: str, secret: Path, other: Path):
    return {
        "external-storage": external_storage(secret),
        "virtual": virtual(other),
        "external-link": link(str(other)),
        "soft-link": lambda g, n: g.__setitem__(n, h5py.SoftLink("/x")),
    }[kind]


@pytest.mark.parametrize("kind", KERAS_ATTACKS)
@pytest.mark.parametrize("fmt", ["keras", "keras-legacy"])
def test_keras_readers_refuse_indirection(tmp_path, secret, other, kind, fmt):
    make = _attack(kind, secret, other)
    if kind == "soft-link":
        inner = make

        def make(g, n):  # a dataset of this file, reached through a soft link
            g.file["x"] = np.frombuffer(SECRET, np.float32)
            inner(g, n)

    path = keras3(tmp_path, make) if fmt == "keras" else legacy(tmp_path, make)
    out_file = tmp_path / "out.npz"
    for op in (("open", path, fmt), ("convert", path, out_file, fmt)):
        out = run(*op)
        assert_refused(out)
        assert str(path) in out, out
    assert not out_file.exists()


def test_keras_reader_refuses_paths_deeper_than_the_limit_quickly(tmp_path):
    path = keras3(tmp_path, depth=_h5policy.MAX_DEPTH + 10)
    out = run("convert", path, tmp_path / "out.npz", "keras", bounded=True)
    assert "REFUSED" in out and "too deep" in out, out


def test_keras_reader_reads_deep_paths_below_the_limit(tmp_path):
    path = keras3(tmp_path, depth=200)
    out = run("convert", path, tmp_path / "out.npz", "keras")
    assert "ACCEPTED" in out, out


def test_inspect_renders_deep_paths_without_recursion(tmp_path):
    from parallelvars.formats import ArrayEntry, write_checkpoint

    deep = "/".join(["x"] * 5000)
    path = tmp_path / "deep.npz"
    write_checkpoint(path, {deep: ArrayEntry(deep, [np.zeros(2, np.float32)])}, format="npz")
    out = run("cli", "inspect", path, bounded=True)
    assert "EXIT 0" in out and "RecursionError" not in out, out


def test_the_walk_is_linear_and_refuses_hard_link_cycles(tmp_path):
    path = tmp_path / "cycle.h5"
    with h5py.File(path, "w") as f:
        f["a/b/c"] = np.zeros(2)
        f["a/b"]["loop"] = f["a"]
    with h5py.File(path, "r") as f, pytest.raises(CorruptCheckpointError, match="linked twice"):
        list(_h5policy.walk(f, str(path)))


# ----------------------------------------------------------------------------- type bombs
def _bytes_variable(tmp_path: Path) -> Path:
    from parallelvars.formats import ArrayEntry, write_checkpoint

    path = tmp_path / "b.h5"
    write_checkpoint(
        path, {"s": ArrayEntry("s", [np.array([b"ab", b"cd"], dtype=object)])}, format="hdf5"
    )
    return path


def test_a_bytes_variable_stored_as_huge_fixed_length_strings_is_refused(tmp_path):
    """The index says ``bytes`` (16 bytes an element in the checks); the dataset's elements
    are 1 MB fixed-length strings, compressed: 1 GB to inflate from a few KB."""
    path = _bytes_variable(tmp_path)
    n = 1000
    replace_primary(
        path,
        "s",
        lambda g, name: g.create_dataset(
            name, shape=(n,), dtype="S1048576", chunks=(1,), compression="gzip"
        ),
        shape=(n,),
    )
    with h5py.File(path, "r+") as f:  # a few chunks written: enough storage for the old size check
        for i in range(8):
            f["s/primary"][i] = b"x"
    assert path.stat().st_size < 1 << 20
    out = run("reader", path, bounded=True)
    assert_refused(out)
    assert "stored type" in out, out


def test_a_bytes_variable_must_be_contiguous(tmp_path):
    path = _bytes_variable(tmp_path)
    replace_primary(
        path,
        "s",
        lambda g, name: g.create_dataset(
            name, shape=(4,), dtype=h5py.vlen_dtype(bytes), chunks=(2,), compression="gzip"
        ),
    )
    with H5Reader(path) as r, pytest.raises(CorruptCheckpointError, match="chunked or filtered"):
        r["s"].value()


def test_a_numeric_variable_stored_with_another_type_is_refused(tmp_path):
    path, var = native(tmp_path)
    replace_primary(
        path, var, lambda g, name: g.create_dataset(name, shape=(4,), dtype=h5py.vlen_dtype(bytes))
    )
    with H5Reader(path) as r, pytest.raises(CorruptCheckpointError, match="stored type"):
        r[var].value()


def test_keras_fixed_length_strings_are_sized_by_their_stored_type(tmp_path):
    path = keras3(
        tmp_path,
        lambda g, name: g.create_dataset(
            name, shape=(1000,), dtype="S1048576", chunks=(1,), compression="gzip"
        ),
    )
    out = run("convert", path, tmp_path / "out.npz", "keras", bounded=True)
    assert "REFUSED TruncatedFileError" in out, out


def test_keras_variable_length_strings_must_be_contiguous(tmp_path):
    path = keras3(
        tmp_path,
        lambda g, name: g.create_dataset(
            name, shape=(4,), dtype=h5py.vlen_dtype(bytes), chunks=(2,), compression="gzip"
        ),
    )
    out = run("open", path, "keras", bounded=True)
    assert "REFUSED CorruptCheckpointError" in out and "chunked or filtered" in out, out


# h5py raising a lookup or arithmetic error on a damaged file becomes our error in every HDF5
# reader (the native reader's own copy of the tuple once lacked IndexError and ArithmeticError).
@pytest.mark.parametrize("exc", [IndexError("index"), ZeroDivisionError("div"), OverflowError("o")])
def test_h5py_lookup_and_arithmetic_errors_become_ours_in_every_reader(tmp_path, monkeypatch, exc):
    from parallelvars import formats

    native = tmp_path / "native.h5"
    with pv.MirroredStrategy(2).scope():
        v = pv.Variable(np.arange(4, dtype=np.float32), name="v")
    pv.Checkpoint(v=v).write(str(native))
    foreign = tmp_path / "foreign.h5"
    with h5py.File(foreign, "w") as f:
        f["a"] = np.zeros(3, np.float32)

    def damaged(*args, **kwargs):
        raise exc

    monkeypatch.setattr(h5py, "File", damaged)
    with pytest.raises(CorruptCheckpointError):
        H5Reader(str(native))
    with pytest.raises(CorruptCheckpointError):
        formats.open_checkpoint(str(foreign), format="hdf5")


def test_the_hdf5_sniffer_takes_damage_as_not_ours(tmp_path: Path) -> None:
    from parallelvars.formats import hdf5

    path = tmp_path / "x.h5"
    with h5py.File(path, "w") as f:
        f["a"] = np.zeros(3)
    raw = path.read_bytes()
    assert hdf5.sniff(str(path), raw[:64]) is False  # HDF5, but not our root attribute
    path.write_bytes(raw[:200])  # truncated
    assert hdf5.sniff(str(path), raw[:64]) is False


# ------------------------------------------------------------ names that are not UTF-8 text


def _non_utf8_named(tmp_path: Path, kind: str) -> str:
    """An HDF5 file without our index whose reader reaches a name that is not UTF-8 text."""
    from parallelvars.checkpoint.h5io.layout import DOCUMENTS_ATTR, META_GROUP

    if kind == "native":  # ours, without its index (as files of the first layout versions)
        path = str(tmp_path / "n.h5")
        pv.Checkpoint(w=pv.Variable(np.ones(2, np.float32), name="w")).write(path)
        with h5py.File(path, "r+") as f:
            del f[META_GROUP]
            del f.attrs[DOCUMENTS_ATTR]
            f.copy(f["w"], f["/"], name=b"v\xff")
        return path
    if kind == "keras":  # Keras 3 weights: layers/<name>/vars/<n>
        path = str(tmp_path / "m.weights.h5")
        with h5py.File(path, "w") as f:
            f.create_group("layers").create_group(b"d\xff").create_group("vars").create_dataset(
                "0", data=np.ones(2, np.float32)
            )
        return path
    path = str(tmp_path / f"{kind}.h5")  # legacy Keras: names listed in attributes
    with h5py.File(path, "w") as f:
        f.attrs["keras_version"] = np.bytes_(b"2.4.0")
        layer = b"d\xff" if kind == "legacy-layer" else b"d"
        f.attrs["layer_names"] = np.array([layer])
        group = f.create_group(layer)
        group.attrs["weight_names"] = np.array([b"k\xfe" if kind == "legacy-weight" else b"d/k"])
        group.create_group("d").create_dataset("k", data=np.ones(2, np.float32))
    return path


@pytest.mark.parametrize("kind", ["native", "keras", "legacy-layer", "legacy-weight"])
def test_a_name_that_is_not_utf8_is_refused_at_open_in_every_reader(
    tmp_path: Path, kind: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from parallelvars import formats
    from parallelvars.cli import main

    path = _non_utf8_named(tmp_path, kind)
    with pytest.raises(CorruptCheckpointError, match="not UTF-8 text") as info:
        formats.open_checkpoint(path)
    assert info.value.file == path
    with pytest.raises(CorruptCheckpointError, match="not UTF-8 text"):
        pv.Checkpoint(w=pv.Variable(np.zeros(2, np.float32), name="w")).restore(path)
    out = str(tmp_path / "out.safetensors")
    for argv, code in (
        (["inspect", path], 2),
        (["verify", path], 1),
        (["convert", path, out], 2),
    ):
        capsys.readouterr()
        assert main(argv) == code
        said = capsys.readouterr()
        assert f"{path}: " in said.out + said.err and "not UTF-8 text" in said.out + said.err
        assert "UnicodeDecodeError" not in said.out + said.err
    assert not os.path.exists(out)


def _index_with_value(tmp_path, sources):
    """An index-like file whose ``s/value`` is virtual over ``sources`` ((file, dataset) each)."""
    layout = h5py.VirtualLayout(shape=(2 * len(sources), 2), dtype=np.float32)
    for i, (name, dataset) in enumerate(sources):
        layout[2 * i : 2 * i + 2] = h5py.VirtualSource(name, dataset, shape=(2, 2))
    path = tmp_path / "x.h5"
    with h5py.File(path, "w") as f:
        f.create_group("s").create_virtual_dataset("value", layout)
    return str(path)


def test_a_stitched_value_over_the_own_parts_is_allowed_and_its_sources_checked(tmp_path):
    """A multi-process index's sharded ``value`` reads shards from its own parts, each a plain
    dataset; a source elsewhere, or a source that is itself virtual, is refused."""
    from parallelvars.testing import h5policy as _h5policy

    parts = tmp_path / "x.h5.parts"
    parts.mkdir()
    for r in range(2):
        with h5py.File(parts / f"rank-{r:05d}-of-00002.h5", "w") as f:
            f["s/primary"] = np.full((2, 2), r, np.float32)
    good = _index_with_value(
        tmp_path, [(f"x.h5.parts/rank-{r:05d}-of-00002.h5", "/s/primary") for r in range(2)]
    )
    with h5py.File(good, "r") as f:
        _h5policy.check_dataset(f["s/value"].id, good, "s/value", own_virtual=True)
        with pytest.raises(CorruptCheckpointError, match="virtual dataset"):
            _h5policy.check_dataset(f["s/value"].id, good, "s/value")  # not where allowed
    # A part whose dataset is virtual again (onto a file outside): refused, nothing read.
    with h5py.File(parts / "rank-00001-of-00002.h5", "a") as f:
        inner = h5py.VirtualLayout(shape=(2, 2), dtype=np.float32)
        inner[...] = h5py.VirtualSource(str(tmp_path / "secret.h5"), "/x", shape=(2, 2))
        f["s"].create_virtual_dataset("nested", inner)
    nested = _index_with_value(
        tmp_path,
        [
            ("x.h5.parts/rank-00000-of-00002.h5", "/s/primary"),
            ("x.h5.parts/rank-00001-of-00002.h5", "/s/nested"),
        ],
    )
    with h5py.File(nested, "r") as f, pytest.raises(CorruptCheckpointError, match="virtual"):
        _h5policy.check_dataset(f["s/value"].id, nested, "s/value", own_virtual=True)
    outside = _index_with_value(tmp_path, [("other.h5", "/s/primary")] * 2)
    with h5py.File(outside, "r") as f, pytest.raises(CorruptCheckpointError, match="parts folder"):
        _h5policy.check_dataset(f["s/value"].id, outside, "s/value", own_virtual=True)
