"""The native HDF5 checkpoint: layout, round trips, restore onto M devices, bad input."""

from __future__ import annotations

import json
import os
from pathlib import Path

import h5py
import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import parallelvars as pv
from parallelvars import errors
from parallelvars.checkpoint import H5Reader, Saveable, SaveRecord, register_saveable
from parallelvars.checkpoint.registry import unregister_saveable


class Dense(pv.Module):
    def __init__(self, n_in: int = 3, n_out: int = 2, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.kernel = pv.Variable(
            rng.standard_normal((n_in, n_out)).astype(np.float32), name="kernel"
        )
        self.bias = pv.Variable(np.zeros(n_out, np.float32), name="bias")


def make_model(devices: int | None, seed: int = 0) -> pv.Module:
    """A model with every kind of variable, on `devices` replicas (None: no strategy)."""

    def build() -> pv.Module:
        m = pv.Module()
        m.layers = [Dense(seed=seed), Dense(2, 2, seed=seed + 1)]
        m.embedding = pv.Variable(
            np.arange(40, dtype=np.float32).reshape(10, 4) + seed, name="e", shard_axis=0
        )
        m.count = pv.Variable(
            np.int64(0), name="count", synchronization="on_read", aggregation="sum"
        )
        m.mean = pv.Variable(
            np.float64(0), name="mean", synchronization="on_read", aggregation="mean"
        )
        m.first = pv.Variable(
            np.float32(0), name="first", synchronization="on_read", aggregation="only_first_replica"
        )
        return m

    if devices is None:
        return build()
    with pv.MirroredStrategy(devices).scope():
        return build()


def fill_on_read(m: pv.Module) -> None:
    for i, c in enumerate(m.count.components):
        c[...] = 10 * (i + 1)
    for i, c in enumerate(m.mean.components):
        c[...] = i + 1
    for i, c in enumerate(m.first.components):
        c[...] = 7 + i


def test_save_returns_numbered_file_and_layout_is_plain_hdf5(tmp_path) -> None:
    m = make_model(4)
    fill_on_read(m)
    ckpt = pv.Checkpoint(model=m)
    path = ckpt.save(tmp_path / "run")
    assert path == str(tmp_path / "run-1.h5")
    assert ckpt.save(tmp_path / "run").endswith("run-2.h5")
    # Plain h5py, not our reader:
    with h5py.File(path, "r") as f:
        assert f.attrs["parallelvars_format"] == 1
        g = f["model/layers/0/kernel"]
        assert sorted(g) == [
            "parallel_component_1",
            "parallel_component_2",
            "parallel_component_3",
            "primary",
        ]
        for name in g:
            np.testing.assert_array_equal(g[name][()], np.asarray(m.layers[0].kernel))
        assert g.attrs["kind"] == "mirrored" and list(g.attrs["shape"]) == [3, 2]
        # Scalars are scalars, strings are str: what a plain h5py user expects to read.
        assert type(g.attrs["kind"]) is str and type(g.attrs["dtype"]) is str
        assert int(g.attrs["num_components"]) == 4 and np.ndim(g.attrs["num_components"]) == 0
        # Component checksums live in the (checksummed) index, not in the datasets' headers.
        assert "crc32c" not in g["primary"].attrs
        index = json.loads(f["_parallelvars/index"][()])
        assert len(index["model/layers/0/kernel"]["crc32c"]) == 4
        e = f["model/embedding"]
        assert e.attrs["kind"] == "sharded" and list(e.attrs["shard_offsets"]) == [0, 3, 6, 8]
        np.testing.assert_array_equal(
            e["value"][()], np.arange(40, dtype=np.float32).reshape(10, 4)
        )
        assert e["parallel_component_3"].shape == (2, 4)
        assert [int(f["model/count"][k][()]) for k in ("primary", "parallel_component_3")] == [
            10,
            40,
        ]
        assert list(g.attrs["devices"]) == [
            "cpu:0",
            "cpu:1",
            "cpu:2",
            "cpu:3",
        ]
        assert f["_parallelvars/object_graph"][()]


def test_round_trip_same_devices_restores_every_component(tmp_path) -> None:
    m = make_model(4, seed=1)
    fill_on_read(m)
    with pv.independent_buffers(4):
        m.ind = pv.Variable(np.zeros(3), name="ind")
    for i, c in enumerate(m.ind.components):
        c[...] = i
    saved = {v.name + str(i): np.array(c) for v in m.variables for i, c in enumerate(v.components)}
    path = pv.Checkpoint(model=m).write(tmp_path / "a.h5")
    for v in m.variables:
        for c in v.components:
            c[...] = 0
    pv.Checkpoint(model=m).restore(path).assert_consumed()
    now = {v.name + str(i): np.array(c) for v in m.variables for i, c in enumerate(v.components)}
    assert saved.keys() == now.keys()
    for k in saved:
        np.testing.assert_array_equal(saved[k], now[k], err_msg=k)


@pytest.mark.parametrize("target", [None, 1, 2, 3, 4, 5])
def test_restore_onto_other_device_counts(tmp_path, target) -> None:
    src = make_model(4, seed=3)
    fill_on_read(src)
    path = pv.Checkpoint(model=src).write(tmp_path / "a.h5")
    dst = make_model(target, seed=99)
    pv.Checkpoint(model=dst).restore(path).assert_consumed()
    m = 1 if target is None else target
    # mirrored: the primary on every component
    for layer_src, layer_dst in zip(src.layers, dst.layers, strict=True):
        for c in layer_dst.kernel.components:
            np.testing.assert_array_equal(c, layer_src.kernel.components[0])
    # sharded: the full value, re-split into M shards
    np.testing.assert_array_equal(
        np.asarray(dst.embedding), np.arange(40, dtype=np.float32).reshape(10, 4) + 3
    )
    if target and target > 1:
        assert len(dst.embedding.components) == m
    # on-read SUM keeps the total, MEAN the mean, ONLY_FIRST the first
    assert dst.count.read_value() == 100
    assert dst.mean.read_value() == 2.5
    assert dst.first.read_value() == 7
    if m == 4:  # same layout: component-wise
        assert [int(c) for c in dst.count.components] == [10, 20, 30, 40]
    elif m > 1:
        assert [int(c) for c in dst.count.components] == [100] + [0] * (m - 1)
        assert all(float(c) == 2.5 for c in dst.mean.components)


def test_single_checkpoint_restores_onto_mirrored(tmp_path) -> None:
    src = make_model(None, seed=5)
    path = pv.Checkpoint(model=src).write(tmp_path / "a.h5")
    dst = make_model(3, seed=6)
    pv.Checkpoint(model=dst).restore(path).assert_consumed()
    for c in dst.layers[1].kernel.components:
        np.testing.assert_array_equal(c, src.layers[1].kernel)
    np.testing.assert_array_equal(dst.embedding, src.embedding)


def test_independent_buffers_need_the_same_device_count(tmp_path) -> None:
    with pv.independent_buffers(3):
        v = pv.Variable(np.zeros(2), name="ind")
    path = pv.Checkpoint(v=v).write(tmp_path / "a.h5")
    with pv.independent_buffers(2):
        w = pv.Variable(np.ones(2), name="ind")
    with pytest.raises(errors.DeviceCountError, match=r"a\.h5.*'v'.*expected 2 devices, found 3"):
        pv.Checkpoint(v=w).restore(path)
    np.testing.assert_array_equal(w.components[0], [1, 1])
    # A plain variable takes component 0 (the rest is unmatched: see tests/test_porting.py).
    plain = pv.Variable(np.ones(2))
    pv.Checkpoint(v=plain).restore(path).expect_partial()
    np.testing.assert_array_equal(plain, [0, 0])


DTYPES = [
    np.float16,
    np.float32,
    np.float64,
    np.int8,
    np.int16,
    np.int32,
    np.int64,
    np.uint8,
    np.uint16,
    np.uint32,
    np.uint64,
    np.bool_,
    np.complex64,
    np.complex128,
    ml_dtypes.bfloat16,
    ml_dtypes.float8_e4m3fn,
    ml_dtypes.float8_e5m2,
    ml_dtypes.float8_e4m3fnuz,
    ml_dtypes.float8_e5m2fnuz,
]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_every_dtype_round_trips_bit_exactly(tmp_path, dtype) -> None:
    rng = np.random.default_rng(0)
    bits = rng.integers(0, 256, size=(5, 3, np.dtype(dtype).itemsize), dtype=np.uint8)
    value = (
        bits.view(np.dtype(dtype)).reshape(5, 3)
        if np.dtype(dtype) != np.bool_
        else bits[..., 0] % 2 == 1
    )
    with pv.MirroredStrategy(2).scope():
        v = pv.Variable(value, name="v", dtype=dtype)
    path = pv.Checkpoint(v=v).write(tmp_path / "a.h5")
    with pv.MirroredStrategy(2).scope():
        w = pv.Variable(np.zeros((5, 3), dtype=dtype))  # the dtype comes from the array
    pv.Checkpoint(v=w).restore(path).assert_consumed()
    for c in w.components:
        assert c.tobytes() == np.asarray(value, dtype=dtype).tobytes()
    assert H5Reader(path)["v"].dtype == np.dtype(dtype)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    value=hnp.arrays(
        dtype=st.sampled_from([np.float32, np.int64, np.uint8, np.float16]),
        shape=hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=5),
    ),
    devices=st.integers(1, 4),
    kind=st.sampled_from(["mirrored", "sharded", "on_read"]),
)
def test_property_round_trip(tmp_path, value, devices, kind) -> None:
    if kind == "sharded" and value.ndim == 0:
        kind = "mirrored"
    kw = {"shard_axis": 0} if kind == "sharded" else {}
    if kind == "on_read":
        kw = {"synchronization": "on_read", "aggregation": "only_first_replica"}
    with pv.MirroredStrategy(devices).scope():
        v = pv.Variable(value, name="v", **kw)
        w = pv.Variable(np.zeros_like(value), name="v", **kw)
    path = pv.Checkpoint(v=v).write(tmp_path / "p.h5")
    pv.Checkpoint(v=w).restore(path).assert_consumed()
    for a, b in zip(v.components, w.components, strict=True):
        assert a.tobytes() == b.tobytes()


def test_string_variables_round_trip(tmp_path) -> None:
    v = pv.Variable(np.array([b"ab", b"", b"xyz"], dtype=object), name="s")
    path = pv.Checkpoint(s=v).write(tmp_path / "s.h5")
    w = pv.Variable(np.array([b"", b"", b""], dtype=object))
    pv.Checkpoint(s=w).restore(path).assert_consumed()
    assert list(w.components[0]) == [b"ab", b"", b"xyz"]


def test_deferred_restoration_of_lazily_built_objects(tmp_path) -> None:
    src = pv.Module()
    src.dense = Dense(seed=7)
    src.stack = [Dense(seed=8)]
    src.table = {"a": Dense(seed=9)}
    path = pv.Checkpoint(model=src).write(tmp_path / "a.h5")

    dst = pv.Module()
    status = pv.Checkpoint(model=dst).restore(path)
    with pytest.raises(errors.RestoreMismatchError, match="not restored"):
        status.assert_consumed()
    dst.dense = Dense(seed=0)  # attached after restore(): receives its saved value now
    dst.stack = []
    dst.stack.append(Dense(seed=0))
    dst.table = {}
    dst.table["a"] = Dense(seed=0)
    np.testing.assert_array_equal(dst.dense.kernel, src.dense.kernel)
    np.testing.assert_array_equal(dst.stack[0].kernel, src.stack[0].kernel)
    np.testing.assert_array_equal(dst.table["a"].kernel, src.table["a"].kernel)
    status.assert_consumed()


def test_a_deferred_value_that_does_not_fit_raises_on_attach_and_keeps_waiting(tmp_path) -> None:
    src = pv.Module()
    src.w = pv.Variable(np.arange(3, dtype=np.float32), name="w")
    path = pv.Checkpoint(model=src).write(tmp_path / "a.h5")
    dst = pv.Module()
    status = pv.Checkpoint(model=dst).restore(path)
    with pytest.raises(errors.ShapeMismatchError, match="model/w"):
        dst.w = pv.Variable(np.zeros(4, np.float32), name="w")
    dst.w = pv.Variable(np.zeros(3, np.float32), name="w")  # the value still waits for it
    assert dst.w.tolist() == [0.0, 1.0, 2.0]
    status.assert_consumed()


class _SlotOwner(pv.Module):
    """A minimal optimizer-like owner of slots, to test slot relations and deferral."""

    def __init__(self) -> None:
        self._pv_slots: dict[tuple[int, str], pv.ParallelVariable] = {}

    def make_slot(self, var, name):
        slot = pv.Variable(np.zeros(var.shape, var.dtype), name=f"{var.name}/{name}")
        self._pv_slots[(id(var), name)] = slot
        self._pv_slot_vars = [*getattr(self, "_pv_slot_vars", []), (var, name, slot)]
        self._maybe_restore_slot(var, name, slot)
        return slot

    def _checkpoint_slots(self):
        return list(getattr(self, "_pv_slot_vars", []))

    def _lookup_slot(self, var, name):
        return self._pv_slots.get((id(var), name))


def test_slot_variables_saved_under_owner_and_deferred(tmp_path) -> None:
    w = pv.Variable(np.ones(3, np.float32), name="w")
    opt = _SlotOwner()
    opt.make_slot(w, "m").assign([1, 2, 3])
    path = pv.Checkpoint(w=w, optimizer=opt).write(tmp_path / "a.h5")
    with h5py.File(path, "r") as f:
        g = f["optimizer/slots/w/m"]
        assert g.attrs["slot_of"] == "w" and g.attrs["slot_name"] == "m"
    w2 = pv.Variable(np.zeros(3, np.float32))
    opt2 = _SlotOwner()
    status = pv.Checkpoint(w=w2, optimizer=opt2).restore(path)
    slot = opt2.make_slot(w2, "m")  # created after restore: filled at creation
    np.testing.assert_array_equal(slot, [1, 2, 3])
    status.assert_consumed()


def test_shared_variable_saved_once(tmp_path) -> None:
    v = pv.Variable(np.ones(2), name="shared")
    m = pv.Module()
    m.a = v
    m.b = [v]
    path = pv.Checkpoint(model=m).write(tmp_path / "a.h5")
    assert list(H5Reader(path)) == ["model/a", "save_counter"]


def test_save_counter_continues_after_restore(tmp_path) -> None:
    v = pv.Variable(np.ones(2))
    c = pv.Checkpoint(v=v)
    c.save(tmp_path / "r")
    last = c.save(tmp_path / "r")
    c2 = pv.Checkpoint(v=pv.Variable(np.ones(2)))
    c2.restore(last)
    assert c2.save(tmp_path / "r").endswith("r-3.h5")


def test_failed_save_takes_its_count_back(tmp_path) -> None:
    c = pv.Checkpoint(v=pv.Variable(np.ones(2)))
    c.save(tmp_path / "r")
    (tmp_path / "d-2.h5").mkdir()  # the next file's name is taken by a directory
    with pytest.raises(OSError):
        c.save(tmp_path / "d")
    assert int(c.save_counter) == 1
    assert c.save(tmp_path / "r").endswith("r-2.h5")


def test_names_with_dots_and_slashes_are_escaped(tmp_path) -> None:
    m = pv.Module()
    m.table = {"a.b/c": pv.Variable(np.ones(1), name="x")}
    path = pv.Checkpoint(model=m).write(tmp_path / "a.h5")
    assert "model/table/a..b.Sc" in H5Reader(path)
    m2 = pv.Module()
    m2.table = {"a.b/c": pv.Variable(np.zeros(1))}
    pv.Checkpoint(model=m2).restore(path).assert_consumed()
    assert m2.table["a.b/c"][0] == 1


# ----------------------------------------------------------------------------- registry
class Counter:
    def __init__(self) -> None:
        self.value = np.zeros(2, np.int32)


class CounterSaveable(Saveable):
    def gather(self, obj):
        return SaveRecord(kind="single", components=[obj.value], shape=obj.value.shape)

    def plan_restore(self, obj, stored, *, file, path, allow_cast):
        return lambda: stored.read_component_into(0, obj.value)


def test_registry_custom_type_and_double_registration(tmp_path) -> None:
    register_saveable(Counter, CounterSaveable())
    try:
        with pytest.raises(ValueError, match="already has a saveable"):
            register_saveable(Counter, CounterSaveable())
        register_saveable(Counter, CounterSaveable(), override=True)
        c = Counter()
        c.value[:] = [4, 5]
        path = pv.Checkpoint(c=c).write(tmp_path / "a.h5")
        d = Counter()
        pv.Checkpoint(c=d).restore(path).assert_consumed()
        assert d.value.tolist() == [4, 5]
    finally:
        unregister_saveable(Counter)


# ----------------------------------------------------------------------------- bad input
@pytest.fixture
def saved(tmp_path):
    m = make_model(4, seed=11)
    fill_on_read(m)
    return m, pv.Checkpoint(model=m).write(tmp_path / "good.h5")


def snapshot(m: pv.Module) -> list[bytes]:
    return [c.tobytes() for v in m.variables for c in v.components]


def test_shape_mismatch_names_file_and_variable(saved) -> None:
    _, path = saved
    dst = make_model(2, seed=0)
    with pv.MirroredStrategy(2).scope():
        dst.layers[1].kernel = pv.Variable(np.zeros((3, 3), np.float32))
    before = snapshot(dst)
    with pytest.raises(errors.ShapeMismatchError) as info:
        pv.Checkpoint(model=dst).restore(path)
    msg = str(info.value)
    assert (
        "good.h5" in msg
        and "model/layers/1/kernel" in msg
        and "expected (3, 3), found (2, 2)" in msg
    )
    assert snapshot(dst) == before  # all or nothing


def test_dtype_mismatch_and_opt_in_cast(saved) -> None:
    src, path = saved
    dst = make_model(2, seed=0)
    with pv.MirroredStrategy(2).scope():
        dst.layers[0].kernel = pv.Variable(np.zeros((3, 2), np.float64))
    before = snapshot(dst)
    with pytest.raises(
        errors.DtypeMismatchError, match=r"model/layers/0/kernel.*expected float64, found float32"
    ):
        pv.Checkpoint(model=dst).restore(path)
    assert snapshot(dst) == before
    pv.Checkpoint(model=dst).restore(path, allow_cast=True).assert_consumed()
    np.testing.assert_array_equal(dst.layers[0].kernel, src.layers[0].kernel.astype(np.float64))


def test_missing_variable(saved) -> None:
    _, path = saved
    dst = make_model(2)
    dst.extra = pv.Variable(np.zeros(2), name="extra")
    status = pv.Checkpoint(model=dst).restore(path)
    with pytest.raises(errors.RestoreMismatchError, match=r"good\.h5.*model/extra"):
        status.assert_existing_objects_matched()
    with pytest.raises(errors.MissingVariableError, match=r"good\.h5: variable 'model/nope'"):
        H5Reader(path)["model/nope"]
    with pytest.raises(KeyError):
        H5Reader(path)["model/nope"]


def test_not_hdf5(tmp_path) -> None:
    p = tmp_path / "x.h5"
    p.write_bytes(b"PK\x03\x04 not an hdf5 file at all")
    with pytest.raises(
        errors.NotACheckpointError, match=r"x\.h5: not an HDF5 file \(expected HDF5 signature"
    ):
        pv.Checkpoint(v=pv.Variable(1.0)).restore(p)


def test_hdf5_but_not_ours(tmp_path) -> None:
    p = tmp_path / "other.h5"
    with h5py.File(p, "w") as f:
        f["x"] = np.ones(3)
    with pytest.raises(errors.NotACheckpointError, match="not a parallelvars checkpoint"):
        pv.Checkpoint(v=pv.Variable(1.0)).restore(p)


def test_newer_format_version(saved) -> None:
    _, path = saved
    with h5py.File(path, "r+") as f:
        f.attrs["parallelvars_format"] = 99
    with pytest.raises(errors.FormatVersionError, match=r"expected version <= 1, found version 99"):
        pv.Checkpoint(model=make_model(4)).restore(path)


def test_checksum_mismatch_names_the_variable_and_changes_nothing(saved) -> None:
    # (the mirrored components are stored once: the damaged dataset is every component's)
    _, path = saved
    with h5py.File(path, "r") as f:
        offset = f["model/layers/1/bias/parallel_component_2"].id.get_offset()
        assert f["model/layers/1/bias/primary"].id.get_offset() == offset
    with open(path, "r+b") as fh:
        fh.seek(offset)
        fh.write(b"\x01\x02\x03\x04")
    dst = make_model(4, seed=0)
    before = snapshot(dst)
    with pytest.raises(
        errors.ChecksumMismatchError,
        match=r"model/layers/1/bias/(primary|parallel_component_\d).*crc32c",
    ):
        pv.Checkpoint(model=dst).restore(path)
    assert snapshot(dst) == before
    assert any("parallel_component_2" in p for p in H5Reader(path).verify_all())


def test_truncated_file(saved) -> None:
    _, path = saved
    size = os.path.getsize(path)
    with open(path, "r+b") as fh:
        fh.truncate(size // 2)
    with pytest.raises(errors.CorruptCheckpointError, match=r"good\.h5"):
        pv.Checkpoint(model=make_model(4)).restore(path)


def test_missing_file(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match=r"nope\.h5"):
        pv.Checkpoint(v=pv.Variable(1.0)).restore(tmp_path / "nope.h5")


def test_failed_write_leaves_previous_checkpoint_intact(tmp_path) -> None:
    v = pv.Variable(np.ones(3), name="v")
    ckpt = pv.Checkpoint(v=v)
    path = ckpt.write(tmp_path / "a.h5")
    original = Path(path).read_bytes()

    class Boom:
        pass

    class BoomSaveable(Saveable):
        def gather(self, obj):
            raise RuntimeError("disk full")

        def plan_restore(self, *a, **k):
            raise AssertionError

    register_saveable(Boom, BoomSaveable())
    try:
        with pytest.raises(RuntimeError, match="disk full"):
            pv.Checkpoint(v=v, boom=Boom()).write(path)
    finally:
        unregister_saveable(Boom)
    assert Path(path).read_bytes() == original
    assert sorted(os.listdir(tmp_path)) == ["a.h5"]  # no temporary left behind


def test_save_creates_missing_directories(tmp_path) -> None:
    path = pv.Checkpoint(v=pv.Variable(np.ones(2))).save(tmp_path / "a" / "b" / "run")
    assert path == str(tmp_path / "a" / "b" / "run-1.h5") and os.path.isfile(path)


def test_stale_index_offsets_fall_back_to_hdf5s_own_locations(saved) -> None:
    """A file whose index offsets no longer match (rewritten by another HDF5 tool) still restores."""
    import json

    src, path = saved
    with h5py.File(path, "r+") as f:
        index = json.loads(f["_parallelvars/index"][()])
        for meta in index.values():
            meta["offsets"] = [None if o is None else 0 for o in meta["offsets"]]  # all wrong
        del f["_parallelvars/index"]
        f.create_dataset("_parallelvars/index", data=json.dumps(index), dtype=h5py.string_dtype())
    dst = make_model(4, seed=0)
    pv.Checkpoint(model=dst).restore(path).assert_consumed()
    assert snapshot(dst) == snapshot(src)


def test_a_buffer_changing_during_save_fails_the_save(tmp_path, monkeypatch) -> None:
    """A live buffer written to by another thread while it is saved fails the save.

    The file would otherwise hold a mix of the old and new values under a matching checksum.
    """
    from parallelvars.checkpoint import h5io
    from parallelvars.testing import fileio as _fileio

    buf = np.zeros(3 * _fileio.DataWriter.CHUNK // 4, np.float32)  # three chunks of bytes
    real = _fileio.pwrite_all

    def pwrite_then_train(fd, data, offset):
        real(fd, data, offset)
        buf[-1] += 1  # another thread trains on while the chunks are written

    class Live:
        path, kind, shape, num_components, attrs = "v", "single", buf.shape, 1, {}
        dtype, components = buf.dtype, [buf]

        def component_shape(self, i):
            return buf.shape

        def component(self, i):
            return buf

    monkeypatch.setattr(_fileio, "pwrite_all", pwrite_then_train)
    target = tmp_path / "a.h5"
    with pytest.raises(errors.ConcurrentWriteError, match="'v': changed while it was being saved"):
        h5io.write_h5(target, [Live()])
    assert not target.exists() and os.listdir(tmp_path) == []


def test_save_reads_each_live_component_once(tmp_path) -> None:
    """The value saved is the one read; checksums describe the file's bytes."""
    from parallelvars.checkpoint.h5io import write_h5

    class Drifting:
        path, kind, shape, num_components, attrs = "v", "single", (4,), 1, {}
        dtype = np.dtype(np.float32)

        def __init__(self) -> None:
            self.components = [np.zeros(4, np.float32)]
            self.calls = 0

        def component_shape(self, i):
            return (4,)

        def component(self, i):
            self.calls += 1
            return self.components[0] + self.calls  # a fresh value on every call

    entry = Drifting()
    path = write_h5(tmp_path / "a.h5", [entry])
    assert entry.calls == 1
    with H5Reader(path) as r:
        assert r.verify_all() == []
        np.testing.assert_array_equal(r["v"].component(0), np.ones(4, np.float32))


def test_string_variable_checksums_are_recorded(tmp_path) -> None:
    v = pv.Variable(np.array([b"ab", b"c"], dtype=object), name="s")
    path = pv.Checkpoint(s=v).write(tmp_path / "s.h5")
    with h5py.File(path, "r") as f:
        assert len(json.loads(f["_parallelvars/index"][()])["s"]["crc32c"]) == 1
    with H5Reader(path) as r:
        assert r.verify_all() == []


def test_verify_compares_the_stitched_value_of_sharded_byte_strings(tmp_path) -> None:
    from parallelvars.checkpoint.h5io import H5Reader

    with pv.MirroredStrategy(3).scope():
        v = pv.Variable(np.array([b"a", b"bb", b"", b"ccc", b"d"], object), name="b", shard_axis=0)
    path = pv.Checkpoint(b=v).save(str(tmp_path / "bytes"))
    with H5Reader(path) as reader:
        assert reader.verify_all() == []
