"""Groups of more than MAX_COMPACT_LINKS links: generated as HDF5 symbol tables
(``h5raw/symbol_table.py``), read by h5py, the HDF5 tools, verify and our own bounded reader
exactly as the libhdf5 writer's files of the same content; damaged tables are refused."""

from __future__ import annotations

import os
import shutil
import struct
import subprocess

import fuzz_readers
import h5py
import numpy as np
import pytest
from test_h5raw import both, walk

import parallelvars as pv
from parallelvars.checkpoint.h5io import H5Reader
from parallelvars.checkpoint.h5raw import native
from parallelvars.checkpoint.h5raw.generate import MAX_COMPACT_LINKS
from parallelvars.checkpoint.h5raw.source import FileSource, ImageSource, Refused
from parallelvars.checkpoint.h5raw.symbol_table import (
    LEAF_K,
    NODE_K,
    SYMBOL_TABLE,
    TREE_SIZE,
    SymbolTable,
    read_symbol_table,
)
from parallelvars.checkpoint.registry import SaveRecord
from parallelvars.errors import InvalidEntryError

WIDE = MAX_COMPACT_LINKS + 1


def _records(paths: list[str], dtype=np.float32) -> list[SaveRecord]:
    return [
        SaveRecord("single", [np.full(2, k, dtype)], (2,), {"devices": ["cpu:0"]}, path=path)
        for k, path in enumerate(paths)
    ]


def _table_of(path: str, group: str) -> tuple[bytes, int]:
    """The symbol table message body of ``group`` and the group's header address."""
    from parallelvars.checkpoint.h5raw import header as hdr

    with h5py.File(path, "r") as f:
        address = h5py.h5o.get_info(f[group].id).addr
    with open(path, "rb") as fh:
        raw = fh.read()
    h = hdr.read_object_header(ImageSource(raw), address, checksums=h5py is not None)
    m = h.first(SYMBOL_TABLE)
    assert m is not None, "no symbol table message"
    return m.body, address


# Each wide layout costs seconds (two files of 1,025 variables walked through h5py): the default
# run reads a wide nested group and a two-level B-tree; CI's slow step (-m slow) adds the wide
# root group and the variable whose group holds the wide list.
@pytest.mark.parametrize(
    "layout",
    [
        pytest.param("root", marks=pytest.mark.slow),
        "nested",
        pytest.param("parent-variable", marks=pytest.mark.slow),
        "two-levels",
    ],
)
def test_wide_groups_read_as_libhdf5_writes_them(tmp_path, layout) -> None:
    if layout == "root":
        paths = [f"v{k}" for k in range(WIDE)]
    elif layout == "nested":
        paths = [f"m/layers/w{k:04d}" for k in range(WIDE)] + ["m/b", "opt/x"]
    elif layout == "parent-variable":  # a variable whose group also holds the wide list
        paths = ["a"] + [f"a/x{k}" for k in range(WIDE)]
    else:  # enough links for a B-tree of two levels (more than 2 * LEAF_K * 2 * NODE_K)
        paths = [f"g/{k:x}" for k in range(2 * LEAF_K * 2 * NODE_K + 7)]
    records = _records(paths)
    lib, gen = both(tmp_path, records)
    wa, wb = walk(lib), walk(gen)
    assert wa.keys() == wb.keys()
    for key in wa:
        assert wa[key] == wb[key], key
    with H5Reader(gen) as r:
        assert r.verify_all() == []
        assert r[paths[-1]].value()[0] == len(paths) - 1


def test_our_reader_reads_generated_and_libhdf5_symbol_tables(tmp_path) -> None:
    names = [f"n{k}" for k in range(600)] + ["é", "a..b", "Z" * 300]
    records = _records([f"g/{n}" for n in names])
    _lib, gen = both(tmp_path, records + _records([f"g/x{k}" for k in range(WIDE)]))
    body, _ = _table_of(gen, "g")
    with open(gen, "rb") as fh:
        links = read_symbol_table(FileSource(fh.fileno(), os.path.getsize(gen)), body, "g")
    with h5py.File(gen, "r") as f:
        expect = sorted((k.encode(), h5py.h5o.get_info(f["g"][k].id).addr) for k in f["g"])
    assert links == expect
    # a symbol table libhdf5 wrote (h5py's default: the earliest file format), with its
    # half-full nodes, free space in the heap and cached scratch pads
    old = str(tmp_path / "old.h5")
    with h5py.File(old, "w") as f:
        for k in range(3000):
            f.create_group(f"g/k{(k * 7919) % 3000}")
    from parallelvars.checkpoint.h5raw import header as hdr

    with h5py.File(old, "r") as f:
        address = h5py.h5o.get_info(f["g"].id).addr
        expect = sorted((k.encode(), h5py.h5o.get_info(f["g"][k].id).addr) for k in f["g"])
    with open(old, "rb") as fh:
        src = FileSource(fh.fileno(), os.path.getsize(old))
        h = hdr.read_object_header(src, address)
        m = h.first(SYMBOL_TABLE)
        assert m is not None
        assert read_symbol_table(src, m.body, "g") == expect


def test_the_layout_is_a_function_of_the_names() -> None:
    names = [f"w{k}".encode() for k in range(5000)]
    a = SymbolTable(names)
    b = SymbolTable(list(reversed(names)))
    addresses = list(range(1000, 6000))
    assert a.size == b.size
    assert a.encode(64, addresses) == b.encode(64, list(reversed(addresses)))
    links = read_symbol_table(ImageSource(b"\0" * 64 + a.encode(64, addresses)), a.message(64), "g")
    assert links == sorted(zip(names, addresses, strict=True))
    with pytest.raises(InvalidEntryError, match="two links"):
        SymbolTable([b"a", b"b", b"a"])


def _damaged(kind: str) -> tuple[bytes, bytes]:
    names = [f"w{k:04d}".encode() for k in range(2 * LEAF_K * 2 * NODE_K + 3)]
    t = SymbolTable(names)
    raw = bytearray(t.encode(0, list(range(len(names)))))
    body = bytearray(t.message(0))
    heap_data = len(t.heap_data)
    root = 32 + heap_data
    first_leaf = root + TREE_SIZE  # (the level below the root)
    node = 32 + heap_data + t.trees * TREE_SIZE
    if kind == "loop":  # the root's first child is the root
        struct.pack_into("<Q", raw, root + 24 + 8, root)
    elif kind == "level":  # a leaf B-tree node claims a level above the root's children
        raw[first_leaf + 5] = 3
    elif kind == "used":
        struct.pack_into("<H", raw, root + 6, 2 * NODE_K + 1)
    elif kind == "snod-count":
        struct.pack_into("<H", raw, node + 6, 2 * LEAF_K + 1)
    elif kind == "snod-signature":
        raw[node] ^= 1
    elif kind == "heap-size":
        struct.pack_into("<Q", raw, 8, 1 << 50)
    elif kind == "name-offset":
        struct.pack_into("<Q", raw, node + 8, heap_data + 8)
    elif kind == "order":  # two names swapped: out of order
        a, b = node + 8, node + 8 + 40
        raw[a : a + 8], raw[b : b + 8] = raw[b : b + 8], raw[a : a + 8]
    elif kind == "outside":
        struct.pack_into("<Q", body, 0, len(raw) + 100)
    elif kind == "no-nul":
        raw[32 : 32 + heap_data] = b"x" * heap_data
    elif kind == "same-node-twice":  # two children name one symbol table node
        leaf = bytearray(raw[first_leaf : first_leaf + TREE_SIZE])
        struct.pack_into("<Q", leaf, 24 + 8 + 16, node)
        raw[first_leaf : first_leaf + TREE_SIZE] = leaf
    return bytes(raw), bytes(body)


@pytest.mark.parametrize(
    "kind",
    [
        "loop",
        "level",
        "used",
        "snod-count",
        "snod-signature",
        "heap-size",
        "name-offset",
        "order",
        "outside",
        "no-nul",
        "same-node-twice",
    ],
)
def test_our_reader_refuses_damaged_tables(kind) -> None:
    raw, body = _damaged(kind)
    with pytest.raises(Refused):
        read_symbol_table(ImageSource(raw), body, "g")


def test_a_wide_list_is_generated_cached_and_verified_by_regeneration(tmp_path, monkeypatch):
    from parallelvars.checkpoint.h5io import regenerated

    m = pv.Module()
    m.vs = [pv.Variable(np.full(2, i, np.float32), name=f"v{i}") for i in range(WIDE + 5)]
    ckpt = pv.Checkpoint(model=m)
    first = ckpt.write(tmp_path / "a.h5")
    assert isinstance(ckpt._pv_plans.held, native.Prepared)
    m.vs[3].assign(np.full(2, -1, np.float32))
    again = ckpt.write(tmp_path / "b.h5")
    calls: list[bool] = []
    real = regenerated.sound_as_generated
    monkeypatch.setattr(
        regenerated, "sound_as_generated", lambda r: calls.append(real(r)) or calls[-1]
    )
    for path in (first, again):
        with H5Reader(path) as r:
            assert r.verify_all() == []
    assert calls == [True, True]
    with h5py.File(again, "r") as f:
        assert f["model/vs/3/primary"][0] == -1 and len(f["model/vs"]) == WIDE + 5
    back = pv.Module()
    back.vs = [pv.Variable(np.zeros(2, np.float32), name=f"v{i}") for i in range(WIDE + 5)]
    pv.Checkpoint(model=back).restore(again).assert_consumed()
    assert back.vs[WIDE + 4].numpy()[0] == WIDE + 4


@pytest.mark.skipif(shutil.which("h5dump") is None, reason="the HDF5 tools are not installed")
def test_the_hdf5_tools_read_wide_groups(tmp_path) -> None:
    _lib, gen = both(tmp_path, _records([f"m/v{k}" for k in range(WIDE)]))
    listing = subprocess.run(["h5ls", "-r", gen], capture_output=True, text=True, check=True)
    assert listing.stdout.count("Dataset {2}") == WIDE
    dump = subprocess.run(
        ["h5dump", "-d", f"/m/v{WIDE - 1}/primary", gen], capture_output=True, text=True, check=True
    ).stdout
    assert f"(0): {WIDE - 1}, {WIDE - 1}" in dump


def _wide_sample(directory: str) -> str:
    ckpt = fuzz_readers.build_sample()
    ckpt.model.many = [pv.Variable(np.full(1, k, np.int16), name=f"x{k}") for k in range(WIDE)]
    return ckpt.write(os.path.join(directory, "wide.h5"))


# Even the quick campaign reads a 1,025-variable file three times under allocation tracking
# (15 CPU-seconds): both campaigns run in CI's slow step (-m slow); the default run keeps the
# crafted damages of test_our_reader_refuses_damaged_tables.
@pytest.mark.parametrize(
    "count",
    [
        pytest.param(2, id="quick", marks=pytest.mark.slow),
        pytest.param(60, id="sweep", marks=pytest.mark.slow),
    ],
)
def test_damaged_symbol_tables_are_detected_or_harmless(tmp_path, count) -> None:
    """Flips inside the symbol table block (heap, B-tree and symbol table nodes) of a generated
    file, read in a worker process by every reader path: detected, or what is read is the
    clean file's; never a crash, a hang, or a wrong value."""
    clean = _wide_sample(str(tmp_path))
    body, _ = _table_of(clean, "model/many")
    btree, heap = struct.unpack("<QQ", body)
    t_size = SymbolTable([f"{k}".encode() for k in range(WIDE)]).size
    start, end = heap, heap + t_size
    assert btree < end and end - start > 40 * WIDE
    with open(clean, "rb") as fh:
        raw = fh.read()
    damaged = os.path.join(str(tmp_path), "damaged.h5")
    rng = np.random.default_rng(26)
    failures: list[str] = []
    outcomes: dict[str, int] = {}
    with fuzz_readers.ReaderWorker(timeout=60) as worker:
        # (the sample's allocation bound is for a handful of variables: this file's is what
        # reading the clean file takes, and a damaged one may take twice that)
        base = worker.check(clean, clean, "hdf5")
        assert base["outcome"] in (*fuzz_readers.OK_OUTCOMES, "alloc"), base
        for _ in range(count):
            data = bytearray(raw)
            pos = int(rng.integers(start, end))
            data[pos] ^= int(rng.integers(1, 256))
            with open(damaged, "wb") as fh:
                fh.write(bytes(data))
            res = worker.check(damaged, clean, "hdf5")
            if res["outcome"] == "alloc" and res["peak"] <= 2 * base["peak"]:
                res["outcome"] = "harmless" if "digest" not in res["detail"] else "detected"
            outcomes[res["outcome"]] = outcomes.get(res["outcome"], 0) + 1
            if res["outcome"] not in fuzz_readers.OK_OUTCOMES:
                failures.append(f"byte {pos}: {res['outcome']}: {res['detail']}")
    assert not failures, "\n".join(failures)
    assert count < 10 or outcomes.get("detected", 0) > 0
