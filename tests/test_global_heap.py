"""verify checks variable-length attribute values in HDF5's global heap with its own parser.

The heap has no checksum: each field of a collection and of an object is damaged here by
hand, and verify must report it (a CorruptCheckpointError naming the file and the variable)
before HDF5 reads anything from it, since HDF5 itself may fail, read another value or loop.
"""

from __future__ import annotations

import struct
import subprocess
import sys

import h5py
import numpy as np
import pytest
from test_corruption import sample_model

import parallelvars as pv
from parallelvars.checkpoint.h5io import H5Reader
from parallelvars.checkpoint.h5raw.global_heap import GlobalHeapCheck
from parallelvars.testing import held_value as _held_value


def collection(raw: bytes) -> tuple[int, list[tuple[int, int, int]]]:
    """The first collection's address and its objects: (position, index, size)."""
    at = raw.find(b"GCOL")
    assert at > 0
    size = struct.unpack_from("<Q", raw, at + 8)[0]
    objects, p = [], at + 16
    while p < at + size:
        index, length = struct.unpack_from("<H6xQ", raw, p)
        objects.append((p, index, length))
        if index == 0:
            break
        p += 16 + ((length + 7) & ~7)
    return at, objects


@pytest.fixture
def sample(tmp_path):
    ckpt, *_ = sample_model()
    path = ckpt.write(tmp_path / "clean.h5")
    with open(path, "rb") as f:
        return str(path), f.read()


def damaged(tmp_path, raw: bytes, change) -> str:
    data = bytearray(raw)
    change(data)
    path = str(tmp_path / "damaged.h5")
    with open(path, "wb") as f:
        f.write(bytes(data))
    return path


def problems(path: str) -> list[str]:
    with H5Reader(path) as reader:
        return reader.verify_all()


def _object(raw: bytes, index: int) -> int:
    return next(p for p, i, _n in collection(raw)[1] if i == index)


def _free(raw: bytes) -> int:
    return next(p for p, i, _n in collection(raw)[1] if i == 0)


def _put(fmt: str, where, value):
    def change(data: bytearray) -> None:
        struct.pack_into(fmt, data, where(bytes(data)), value)

    return change


DAMAGE = {
    # the collection's header
    "signature": (_put("<4s", lambda r: collection(r)[0], b"GCOX"), "signature b'GCOL'"),
    "version": (_put("<B", lambda r: collection(r)[0] + 4, 2), "version"),
    "size-small": (_put("<Q", lambda r: collection(r)[0] + 8, 2048), "size"),
    "size-odd": (_put("<Q", lambda r: collection(r)[0] + 8, 4097), "size"),
    "size-past-file": (_put("<Q", lambda r: collection(r)[0] + 8, 1 << 40), "size"),
    # an object's header
    "index-missing": (_put("<H", lambda r: _object(r, 1), 99), "missing heap object"),
    "index-twice": (_put("<H", lambda r: _object(r, 2), 3), "appears twice"),
    "size-past-collection": (_put("<Q", lambda r: _object(r, 2) + 8, 1 << 33), "runs past the end"),
    "size-other": (_put("<Q", lambda r: _object(r, 1) + 8, 7), "another length"),
    "size-shifts-next": (_put("<Q", lambda r: _object(r, 1) + 8, 9), "runs past the end"),
    # the free-space object
    "free-size-zero": (_put("<Q", lambda r: _free(r) + 8, 0), "free-space object"),
    "free-size-other": (_put("<Q", lambda r: _free(r) + 8, 64), "free-space object"),
    "free-index": (_put("<H", lambda r: _free(r), 77), "runs past the end"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_damaged_heap_fields_are_reported_by_verify(tmp_path, sample, damage):
    _path, raw = sample
    change, words = DAMAGE[damage]
    bad = damaged(tmp_path, raw, change)
    found = problems(bad)
    assert found, "verify passed a damaged heap"
    assert all(bad in p and "variable '" in p for p in found), found
    assert any(words in p for p in found), found


def test_a_flipped_character_disagrees_with_the_index(tmp_path, sample):
    _path, raw = sample

    def change(data: bytearray) -> None:  # object 1 is save_counter's kind, "single"
        at = _object(bytes(data), 1) + 16
        assert bytes(data[at : at + 6]) == b"single"
        data[at + 4] ^= 0x02  # "singne"

    found = problems(damaged(tmp_path, raw, change))
    assert len(found) == 1 and "'kind' disagrees with the index" in found[0], found
    assert "'single'" in found[0] and "'singne'" in found[0] and "save_counter" in found[0]


def test_a_reference_into_another_place_is_refused(tmp_path, sample):
    """A reference naming an address where no collection is (the attribute message itself
    is checksummed in our files: crafted here by moving the collection's signature)."""
    _path, raw = sample

    def change(data: bytearray) -> None:
        at = collection(bytes(data))[0]
        data[at : at + 4] = b"\x00\x00\x00\x00"

    found = problems(damaged(tmp_path, raw, change))
    assert found and all("no global heap collection at" in p for p in found), found


@pytest.mark.slow  # waits for HDF5 to be cut by a timeout
def test_what_the_parser_refuses_makes_hdf5_loop(tmp_path, sample):
    """A free-space object of size 0: HDF5 walks the collection forever; verify refuses it
    without asking HDF5."""
    _path, raw = sample
    bad = damaged(tmp_path, raw, DAMAGE["free-size-zero"][0])
    assert any("free-space object" in p for p in problems(bad))
    code = "import h5py, sys; print(dict(h5py.File(sys.argv[1])['save_counter'].attrs))"
    try:
        proc = subprocess.run([sys.executable, "-c", code, bad], capture_output=True, timeout=4)
    except subprocess.TimeoutExpired:
        return  # HDF5 looped
    assert proc.returncode != 0, "HDF5 read the damaged heap"


def every_kind(tmp_path) -> str:
    with pv.MirroredStrategy(3).scope():
        m = pv.Variable(np.ones((2, 3), np.float32), name="m")
        s = pv.Variable(np.arange(10, dtype=np.int64).reshape(5, 2), name="s", shard_axis=0)
        e = pv.Variable(np.zeros((0, 4), np.float16), name="e", shard_axis=0)
    single = pv.Variable(np.float64(3.5), name="x")
    text = pv.Variable(np.array([b"ab", b"", b"\xffz"], dtype=object), name="t")
    return pv.Checkpoint(m=m, s=s, e=e, x=single, t=text).write(tmp_path / "kinds.h5")


def test_clean_files_of_every_kind_pass_and_heap_values_are_what_h5py_reads(tmp_path):
    path = every_kind(tmp_path)
    with H5Reader(path) as reader:
        assert reader.verify_all() == []
        f = reader._h5()
        heap = GlobalHeapCheck(reader._fd(), reader.file_size, reader.path, 8, 8)
        checked = 0
        for var in reader.values():
            group = f[var.path]
            vlen = []
            for key in group.attrs:
                attr = h5py.h5a.open(group.id, key.encode())
                tid = attr.get_type()
                if tid.get_class() == h5py.h5t.STRING and tid.is_variable_str():
                    n = int(np.prod(attr.shape))
                    vlen.append((key, tid, n, attr.shape))
            held = heap.check_attributes(group.id, [v[:3] for v in vlen], var.path)
            for key, tid, _n, shape in vlen:
                read = group.attrs[key]  # h5py's own read
                expected = read if isinstance(read, str) else list(read)
                assert _held_value(held[key], shape, tid) == expected, (var.path, key)
                checked += 1
        assert checked >= 10


def test_an_empty_string_attribute_passes(tmp_path):
    """A zero-length heap object (an empty str) is valid."""
    with pv.MirroredStrategy(2).scope():
        v = pv.Variable(np.ones(3, np.float32), name="v")
    path = pv.Checkpoint(v=v).write(tmp_path / "c.h5")
    with h5py.File(path, "r+") as f:
        f["v"].attrs["note"] = ""
    assert problems(path) == []


def test_a_damaged_virtual_mapping_is_refused_before_hdf5_opens_it(tmp_path, sample):
    """A sharded variable's ``value`` is a virtual dataset whose mapping (sources and
    selections) is a global heap object: HDF5 decodes it before checking its checksum, and a
    damaged selection there crashed it; verify checks the collection and that checksum first."""
    _path, raw = sample

    def change(data: bytearray) -> None:
        at = bytes(data).find(b"/model/e/primary\x00")
        assert at > collection(bytes(data))[0]
        data[at + 22] ^= 0x10  # inside the first source's selection

    found = problems(damaged(tmp_path, raw, change))
    assert len(found) == 1 and "model/e/value" in found[0], found
    assert "mapping fails its checksum" in found[0], found


def sharded_with_slots(tmp_path, name: str = "c.h5") -> str:
    """A sharded variable with Adam's slots: the slots' groups have 10 attributes."""
    with pv.MirroredStrategy(2).scope():
        m = pv.Module()
        m.e = pv.Variable(np.arange(8, dtype=np.float32).reshape(4, 2), name="e", shard_axis=0)
        opt = pv.optimizers.Adam(0.1)
    opt.apply_gradients([(np.ones((4, 2), np.float32), m.e)])
    return str(pv.Checkpoint(model=m, opt=opt).write(tmp_path / name))


def is_dense(path: str, group: str) -> bool:
    """Whether HDF5 keeps the group's attributes in dense storage (a fractal heap)."""
    with H5Reader(path) as reader, h5py.File(path, "r") as f:
        heap = GlobalHeapCheck(reader._fd(), reader.file_size, reader.path, 8, 8)
        return heap._header_messages(int(h5py.h5o.get_info(f[group].id).addr))[1]


SLOTS = ("opt/slots/model/e/m", "opt/slots/model/e/v")


def test_groups_of_many_attributes_keep_them_in_their_header_and_are_checked(tmp_path):
    path = sharded_with_slots(tmp_path)
    with h5py.File(path, "r") as f:
        assert len(f[SLOTS[0]].attrs) == 10 and f[SLOTS[0]].attrs["slot_of"] == "model/e"
    assert not any(is_dense(path, g) for g in SLOTS)
    assert problems(path) == []
    with open(path, "rb") as fh:
        raw = fh.read()

    def change(data: bytearray) -> None:  # a slot's slot_of: a heap object "model/e"
        raw = bytes(data)
        at = next(
            p + 16
            for p, _i, n in collection(raw)[1]
            if n == 7 and raw[p + 16 : p + 23] == b"model/e"
        )
        data[at + 6] ^= 0x01  # "model/d"

    found = problems(damaged(tmp_path, raw, change))
    assert found and all("'slot_of' disagrees with the index" in p for p in found), found


def test_attributes_in_dense_storage_are_checked_for_presence_only(tmp_path, monkeypatch):
    # Files written before groups kept more than 8 attributes in their header still pass.
    from parallelvars.checkpoint.h5io import write as write_module
    from parallelvars.checkpoint.h5raw import messages, native

    def libhdf5_only(*args, **kwargs):
        raise messages.Unsupported("written by libhdf5 here")

    monkeypatch.setattr(native, "_save_arrays", libhdf5_only)  # the libhdf5 writer's file
    monkeypatch.setattr(write_module, "_COMPACT_ATTRS", 100)  # every group made as by default
    path = sharded_with_slots(tmp_path, "dense.h5")
    assert all(is_dense(path, g) for g in SLOTS)
    assert problems(path) == []
