"""Repeated saves written from a structure's cached metadata are the files a first save of the
same content writes (the generator, ``h5raw/native.py``), and what h5py reads of them is what it
reads of the file libhdf5 writes."""

from __future__ import annotations

import errno
import json
import os
import time

import crc32c
import h5py
import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import parallelvars as pv
from parallelvars.checkpoint import H5Reader
from parallelvars.checkpoint.h5io import write_h5
from parallelvars.checkpoint.h5raw import component_bytes, native
from parallelvars.errors import CheckpointWriteError
from parallelvars.testing import PlanCache, fileio, lookup3

CREATED = 1_700_000_000.25


@pytest.fixture
def fixed_clock(monkeypatch):
    """Every save records the same ``created`` time, so two ways of writing can be compared."""
    monkeypatch.setattr(time, "time", lambda: CREATED)


def make_model() -> pv.Module:
    m = pv.Module()
    with pv.MirroredStrategy(2).scope():
        m.w = pv.Variable(np.arange(12, dtype=np.float32).reshape(3, 4), name="w")
        m.big = pv.Variable(np.linspace(0, 1, 40_000, dtype=np.float32), name="big")
        m.count = pv.Variable(
            np.int64(3), name="count", synchronization="on_read", aggregation="sum"
        )
        m.half = pv.Variable(np.ones(5, ml_dtypes.bfloat16), name="half")
        m.empty = pv.Variable(np.zeros((0, 3), np.float64), name="empty")
        m.emb = pv.Variable(np.arange(20, dtype=np.float32).reshape(10, 2), name="e", shard_axis=0)
    m.single = pv.Variable(np.float64(2.5), name="single")
    return m


def change_values(m: pv.Module, k: int) -> None:
    m.w.assign(np.full((3, 4), k, np.float32))
    m.big.assign(np.linspace(k, k + 1, 40_000, dtype=np.float32))
    m.emb.assign(np.arange(20, dtype=np.float32).reshape(10, 2) * k)
    m.single.assign(np.float64(k) / 3)


def plain_write(ckpt: pv.Checkpoint, path: str) -> str:
    """The same checkpoint written as a first save (nothing cached)."""
    records, graph, metadata = ckpt._gather(False)
    return native.save_native(path, list(records), object_graph=graph, metadata=metadata)


def h5py_write(ckpt: pv.Checkpoint, path: str) -> str:
    """The same checkpoint written by libhdf5 (the reference writer)."""
    records, graph, metadata = ckpt._gather(False)
    return write_h5(path, records, object_graph=graph, metadata=metadata)


def walk(f: h5py.File) -> dict[str, object]:
    """Everything h5py sees: every group and dataset, attributes, values, types, layouts."""
    seen: dict[str, object] = {"/": {k: repr(v) for k, v in f.attrs.items()}}

    def visit(name: str, obj: object) -> None:
        attrs = {k: repr(v) for k, v in obj.attrs.items()}  # type: ignore[attr-defined]
        if isinstance(obj, h5py.Dataset):
            plist = obj.id.get_create_plist()
            value = np.asarray(obj[()])
            seen[name] = (
                attrs,
                obj.dtype.str,
                obj.shape,
                plist.get_layout(),
                plist.get_nfilters(),
                obj.is_virtual,
                value.tobytes() if value.dtype.kind != "O" else repr(value.tolist()),
            )
        else:
            seen[name] = attrs

    def every_name(group: h5py.Group, prefix: str) -> None:
        # every link, not every object: components stored once are one dataset under each name
        for key in group:
            obj = group[key]
            visit(prefix + key, obj)
            if isinstance(obj, h5py.Group):
                every_name(obj, prefix + key + "/")

    every_name(f, "")
    return seen


def assert_same_for_h5py(a: str, b: str) -> None:
    with h5py.File(a, "r") as fa, h5py.File(b, "r") as fb:
        wa, wb = walk(fa), walk(fb)
    assert wa.keys() == wb.keys()
    for key in wa:
        assert wa[key] == wb[key], key


def assert_same_but_offsets(a: str, b: str) -> None:
    """What h5py reads of two files of one content from two writers: the same, but where the
    data lies (the documents record the data offsets)."""
    with h5py.File(a, "r") as fa, h5py.File(b, "r") as fb:
        wa, wb = walk(fa), walk(fb)
        ia, ib = (json.loads(bytes(f["_parallelvars/index"][()])) for f in (fa, fb))
    assert wa.keys() == wb.keys()
    for key in wa:
        if not key.startswith("_parallelvars"):
            assert wa[key] == wb[key], key
    for meta in (*ia.values(), *ib.values()):
        del meta["offsets"]
    assert ia == ib


def read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def test_lookup3_matches_the_reference_vectors() -> None:
    # Bob Jenkins' lookup3.c driver: hashlittle("", 0, 0) and the "Four score" vectors.
    assert lookup3(b"", 0) == 0xDEADBEEF
    text = b"Four score and seven years ago"
    assert lookup3(text, 0) == 0x17770551
    assert lookup3(text, 1) == 0xCD628161


def test_repeated_save_is_the_file_hdf5_writes(tmp_path, fixed_clock) -> None:
    m = make_model()
    step = pv.Variable(np.int64(0), name="step")
    ckpt = pv.Checkpoint(model=m, step=step)
    first = ckpt.save(tmp_path / "run")  # generated; its metadata cached
    assert isinstance(ckpt._pv_plans.held, native.Prepared)
    for k in (2, 3):
        change_values(m, k)
        step.assign(k * 10)
        path = ckpt.save(tmp_path / "run")  # from the cached metadata
        plain = plain_write(ckpt, str(tmp_path / f"plain-{k}.h5"))
        with open(path, "rb") as fa, open(plain, "rb") as fb:
            assert fa.read() == fb.read()
        assert_same_but_offsets(path, h5py_write(ckpt, str(tmp_path / f"h5py-{k}.h5")))
        with h5py.File(path, "r") as f:
            assert int(f.attrs["save_counter"]) == k and int(f.attrs["step"]) == k * 10
            assert float(f.attrs["created"]) == CREATED
            # the columns document with this save's checksums, its own checksum patched
            index = json.loads(bytes(f["_parallelvars/index"][()]))
            raw = bytes(f["_parallelvars/columns"][()])
            assert int(f["_parallelvars/columns"].attrs["crc32c"]) == crc32c.crc32c(raw)
            assert json.loads(raw)["crc32c"] == [c for e in index.values() for c in e["crc32c"]]
        with H5Reader(path) as r:
            assert r._columns  # opened from the columns
        with H5Reader(path) as r:
            assert r.verify_all() == []
    fresh = make_model()
    back = pv.Checkpoint(model=fresh, step=pv.Variable(np.int64(0), name="step"))
    back.restore(path).assert_consumed()
    np.testing.assert_array_equal(fresh.emb.numpy(), m.emb.numpy())
    np.testing.assert_array_equal(fresh.big.components[1], m.big.components[1])
    assert int(back.step) == 30 and float(fresh.single) == 1.0
    with H5Reader(first) as r:  # the first file is unchanged by the later saves
        assert r.verify_all() == [] and int(r.metadata["save_counter"]) == 1


def test_first_save_is_the_plain_file(tmp_path, fixed_clock) -> None:
    ckpt = pv.Checkpoint(model=make_model())
    path = ckpt.write(tmp_path / "a.h5")
    plain = plain_write(ckpt, str(tmp_path / "plain.h5"))
    with open(path, "rb") as fa, open(plain, "rb") as fb:
        assert fa.read() == fb.read()


@pytest.mark.parametrize("change", ["add", "shape", "dtype", "reorder", "attrs"])
def test_a_changed_structure_makes_a_new_plan(tmp_path, fixed_clock, change) -> None:
    m = pv.Module()
    m.a = pv.Variable(np.ones(4, np.float32), name="a")
    m.b = pv.Variable(np.arange(3, dtype=np.int32), name="b")
    ckpt = pv.Checkpoint(model=m)
    ckpt.write(tmp_path / "one.h5")
    before = ckpt._pv_plans.held
    if change == "add":
        m.c = pv.Variable(np.zeros(2, np.float64), name="c")
    elif change == "shape":
        m.a = pv.Variable(np.ones(5, np.float32), name="a")
    elif change == "dtype":
        m.b = pv.Variable(np.arange(3, dtype=np.int64), name="b")
    elif change == "reorder":
        m.a, m.b = m.b, m.a
    else:
        m.a = pv.Variable(np.ones(4, np.float32), name="renamed", trainable=False)
    path = ckpt.write(tmp_path / "two.h5")
    assert ckpt._pv_plans.held is not before
    plain = plain_write(ckpt, str(tmp_path / "plain.h5"))
    with open(path, "rb") as fa, open(plain, "rb") as fb:
        assert fa.read() == fb.read()
    live = {k: np.asarray(v.numpy()) for k, v in pv.tracking.children_of(m).items()}
    with H5Reader(path) as r:
        assert r.verify_all() == []
        for name, value in live.items():
            np.testing.assert_array_equal(r[f"model/{name}"].value(), value)


def test_a_failed_repeated_save_leaves_the_last_good_file(tmp_path, monkeypatch) -> None:
    m = pv.Module()
    m.a = pv.Variable(np.ones(100, np.float32), name="a")
    ckpt = pv.Checkpoint(model=m)
    path = ckpt.write(tmp_path / "c.h5")
    good = read(path)
    m.a.assign(np.full(100, 7, np.float32))

    def full_disk(fd: int, buffers: list, offset: int, size: int) -> None:
        os.pwrite(fd, bytes(buffers[0][:10]), offset)  # a torn write, then the disk is full
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(component_bytes, "pwritev_all", full_disk)
    with pytest.raises(CheckpointWriteError):
        ckpt.write(path)
    assert read(path) == good
    assert sorted(os.listdir(tmp_path)) == ["c.h5"]  # no temporary left behind
    monkeypatch.undo()
    ckpt.write(path)  # the cached plan is still sound
    with H5Reader(path) as r:
        assert r.verify_all() == [] and r["model/a"].value()[0] == 7


def test_byte_strings_repeat_while_their_values_do(tmp_path, fixed_clock) -> None:
    # Their values lay out the global heap: the same values reuse the plan, new ones make one.
    s = pv.Variable(np.array([b"ab", b"c"], dtype=object), name="s")
    w = pv.Variable(np.ones(3, np.float32), name="w")
    ckpt = pv.Checkpoint(s=s, w=w)
    ckpt.write(tmp_path / "a.h5")
    first = ckpt._pv_plans.held
    assert isinstance(first, native.Prepared)
    w.assign(np.full(3, 2, np.float32))
    path = ckpt.write(tmp_path / "b.h5")
    assert ckpt._pv_plans.held is first
    assert read(path) == read(plain_write(ckpt, str(tmp_path / "plain-b.h5")))
    s.assign(np.array([b"xyz", b""], dtype=object))
    path = ckpt.write(tmp_path / "c.h5")
    assert ckpt._pv_plans.held is not first
    assert read(path) == read(plain_write(ckpt, str(tmp_path / "plain-c.h5")))
    assert_same_but_offsets(path, h5py_write(ckpt, str(tmp_path / "h5py-c.h5")))
    with H5Reader(path) as r:
        assert r.verify_all() == [] and r["s"].value().tolist() == [b"xyz", b""]


DTYPES = [np.float32, np.float64, np.int8, np.int64, np.uint16, ml_dtypes.bfloat16]


@settings(
    max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    spec=st.lists(
        st.tuples(
            st.lists(st.integers(0, 40), max_size=2).map(tuple),
            st.sampled_from(DTYPES),
            st.sampled_from([1, 2]),
        ),
        min_size=1,
        max_size=6,
    ),
    seed=st.integers(0, 2**16),
)
def test_any_structure_repeats_byte_for_byte(tmp_path_factory, fixed_clock, spec, seed) -> None:
    d = tmp_path_factory.mktemp("s")
    rng = np.random.default_rng(seed)
    m = pv.Module()
    variables = []
    for shape, dtype, n in spec:
        value = (rng.standard_normal(shape) * 50).astype(dtype)
        scope = pv.MirroredStrategy(n).scope() if n > 1 else None
        if scope is None:
            variables.append(pv.Variable(value))
        else:
            with scope:
                variables.append(pv.Variable(value))
    m.vars = variables
    ckpt = pv.Checkpoint(model=m)
    ckpt.write(d / "first.h5")
    for v in variables:
        v.assign((rng.standard_normal(v.shape) * 50).astype(v.dtype))
    path = ckpt.write(d / "again.h5")
    plain = plain_write(ckpt, str(d / "plain.h5"))
    with open(path, "rb") as fa, open(plain, "rb") as fb:
        assert fa.read() == fb.read()
    with H5Reader(path) as r:
        assert r.verify_all() == []


def test_a_key_that_does_not_compare_is_a_miss() -> None:
    cache = PlanCache()
    skel = native.Unexpressed(("v", {"a": np.arange(3)}))
    cache.put(skel)
    assert cache.get(("v", {"a": np.arange(3)})) is None  # arrays: no truth value, no reuse
    assert cache.get(skel.key) is skel
    cache.clear()
    assert cache.get(skel.key) is None


def test_manager_saves_blocking_or_not_reuse_the_plan(tmp_path, fixed_clock) -> None:
    m = make_model()
    ckpt = pv.Checkpoint(model=m)
    with pv.CheckpointManager(ckpt, tmp_path / "run", max_to_keep=None) as mgr:
        mgr.save()
        first = ckpt._pv_plans.held
        assert isinstance(first, native.Prepared)
        for k, blocking in ((2, False), (3, True), (4, False)):
            change_values(m, k)
            path = mgr.save(blocking=blocking)
            mgr.wait()
            assert ckpt._pv_plans.held is first  # the same structure: reused
            plain = plain_write(ckpt, str(tmp_path / f"plain-{k}.h5"))
            assert read(path) == read(plain)
    fresh = make_model()
    pv.Checkpoint(model=fresh).restore(path).assert_consumed()
    np.testing.assert_array_equal(fresh.big.components[0], m.big.components[0])


def many_small(n: int = 600) -> pv.Module:
    m = pv.Module()
    m.vs = [pv.Variable(np.full(3, i, np.float32), name=f"v{i}") for i in range(n)]
    return m


def test_many_small_components_are_read_ahead_and_verified(tmp_path) -> None:
    path = pv.Checkpoint(model=many_small()).write(tmp_path / "c.h5")
    with H5Reader(path) as r:
        verified = r.stage(r[k] for k in r)
        assert r._staged is not None and len(r._staged[0]) < 10  # a few reads, not 600
        assert verified == {(k, 0) for k in r}  # checked as they were read
        assert r["model/vs/7"].value().tolist() == [7, 7, 7]
        r.unstage()
    back = many_small()
    for v in back.vs:
        v.assign(np.full(3, -1, np.float32))
    pv.Checkpoint(model=back).restore(path).assert_consumed()
    assert [float(v.numpy()[0]) for v in back.vs] == list(range(600))
    # A damaged byte in one of them: refused, and no variable written.
    with H5Reader(path) as r:
        offset = r["model/vs/123"]._location(0)[0]
    with open(path, "r+b") as f:
        f.seek(offset + 2)
        byte = f.read(1)
        f.seek(offset + 2)
        f.write(bytes([byte[0] ^ 0x10]))
    for v in back.vs:
        v.assign(np.full(3, -1, np.float32))
    with pytest.raises(pv.errors.ChecksumMismatchError, match="vs/123"):
        pv.Checkpoint(model=back).restore(path)
    assert all(float(v.numpy()[0]) == -1 for v in back.vs)
    with H5Reader(path) as r:  # the damaged one is left for the full check, which raises
        verified = r.stage(r[k] for k in r)
        assert verified == {(k, 0) for k in r} - {("model/vs/123", 0)}
        with pytest.raises(pv.errors.ChecksumMismatchError, match="vs/123"):
            r["model/vs/123"].verify(0)


# -- a repeated save sees every change of structure


class Registry(pv.tracking.Trackable):
    """A custom trackable: its children are whatever its own table holds now."""

    def __init__(self) -> None:
        self.table: dict[str, object] = {}

    def _trackable_children(self) -> dict[str, object]:
        return dict(self.table)


def structured_model() -> tuple[pv.Module, pv.optimizers.Optimizer]:
    m = pv.Module()
    m.a = pv.Variable(np.arange(4, dtype=np.float32), name="a")
    m.b = pv.Variable(np.arange(3, dtype=np.int32), name="b")
    with pv.MirroredStrategy(2).scope():
        m.mirrored = pv.Variable(np.ones(3, np.float32), name="mirrored")
        m.sharded = pv.Variable(np.arange(12, dtype=np.float32).reshape(6, 2), shard_axis=0)
    m.layers = [pv.Module(), pv.Module()]
    m.layers[0].k = pv.Variable(np.full(2, 5, np.float64), name="k")
    m.table = {"x": pv.Variable(np.float32(1), name="x")}
    m.inner = pv.Variable(np.zeros(2, np.float32), name="in0")
    m.nested = ([pv.Variable(np.zeros(2, np.float32), name="n0")], [])  # plain lists in a tuple
    m.registry = Registry()
    m.registry.table["r"] = pv.Variable(np.ones(2, np.float32), name="r")
    opt = pv.optimizers.Adam(0.1)
    return m, opt


def _step(m: pv.Module, opt: pv.optimizers.Optimizer) -> None:
    opt.apply_gradients([(np.ones(4, np.float32), m.a)])


CHANGES = {
    "add": lambda m, opt: setattr(m, "c", pv.Variable(np.zeros(2), name="c")),
    "remove": lambda m, opt: delattr(m, "b"),
    "slot": _step,  # the optimizer creates its slots for m.a
    "rename": lambda m, opt: (setattr(m, "b2", m.b), delattr(m, "b")),
    "swap": lambda m, opt: (setattr(m, "a", m.b), setattr(m, "b", m.a)),
    "shape": lambda m, opt: setattr(m, "a", pv.Variable(np.ones(5, np.float32), name="a")),
    "dtype": lambda m, opt: setattr(m, "b", pv.Variable(np.arange(3, dtype=np.int64), name="b")),
    "name": lambda m, opt: setattr(m, "b", pv.Variable(np.arange(3, dtype=np.int32), name="z")),
    "devices": lambda m, opt: _in_scope(
        3, lambda: setattr(m, "mirrored", pv.Variable(np.ones(3, np.float32), name="mirrored"))
    ),
    "sharding": lambda m, opt: _in_scope(
        3,
        lambda: setattr(
            m, "sharded", pv.Variable(np.arange(12, dtype=np.float32).reshape(6, 2), shard_axis=0)
        ),
    ),
    "list-append": lambda m, opt: m.layers.append(pv.Variable(np.ones(2), name="l2")),
    "list-replace": lambda m, opt: m.layers.__setitem__(1, pv.Variable(np.ones(2), name="l1")),
    "list-in-module": lambda m, opt: m.layers[1].__setattr__("k", pv.Variable(np.ones(1))),
    "dict": lambda m, opt: m.table.__setitem__("y", pv.Variable(np.ones(2), name="y")),
    "plain-list": lambda m, opt: m.nested[0].append(pv.Variable(np.ones(2), name="n1")),
    "empty-plain-list": lambda m, opt: m.nested[1].append(pv.Variable(np.ones(2), name="n2")),
    "custom": lambda m, opt: m.registry.table.__setitem__("s", pv.Variable(np.ones(3))),
    "custom-replace": lambda m, opt: m.registry.table.__setitem__("r", pv.Variable(np.ones(2))),
    "module-dict": lambda m, opt: setattr(
        m.layers[0], "__dict__", {"k": pv.Variable(np.zeros(2, np.float64), name="k")}
    ),
}


def _in_scope(devices: int, make) -> None:
    with pv.MirroredStrategy(devices).scope():
        make()


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_every_change_of_structure_is_seen(tmp_path, fixed_clock, change) -> None:
    m, opt = structured_model()
    ckpt = pv.Checkpoint(model=m, opt=opt)
    ckpt.write(tmp_path / "one.h5")
    memo = ckpt._pv_save_memo
    ckpt.write(tmp_path / "same.h5")  # nothing changed: the last save's graph and records
    assert ckpt._pv_save_memo is memo
    CHANGES[change](m, opt)
    path = ckpt.write(tmp_path / "two.h5")
    assert ckpt._pv_save_memo is not memo
    # The reference: a new checkpoint of the same objects, written by HDF5 alone.
    ref = pv.Checkpoint(model=m, opt=opt).write(tmp_path / "ref.h5")
    assert read(path) == read(ref)
    assert_same_for_h5py(path, ref)
    live = {v.name: [np.asarray(c) for c in v.components] for v in m.variables}
    with H5Reader(path) as r:
        assert r.verify_all() == []
        saved = {r[k].attrs["name"]: k for k in r}
        for name, comps in live.items():
            entry = r[saved[name]]
            for i, c in enumerate(comps):
                np.testing.assert_array_equal(entry.component(i), c)
    ckpt.write(tmp_path / "three.h5")  # the new structure is kept
    assert read(tmp_path / "three.h5") == read(ref)


def test_a_registered_type_is_seen(tmp_path, fixed_clock) -> None:
    class Counter:
        def __init__(self) -> None:
            self.var = pv.Variable(np.int64(7), name="count")

    class CounterSaveable(pv.checkpoint.registry.Saveable):
        def gather(self, obj):
            return pv.checkpoint.registry.get_saveable(obj.var).gather(obj.var)

        def plan_restore(self, obj, stored, *, file, path, allow_cast):
            return lambda: None

    m = pv.Module()
    m.a = pv.Variable(np.ones(2, np.float32), name="a")
    m.counters = (Counter(),)  # not saveable yet: not in the graph
    ckpt = pv.Checkpoint(model=m)
    ckpt.write(tmp_path / "one.h5")
    pv.checkpoint.registry.register_saveable(Counter, CounterSaveable())
    try:
        path = ckpt.write(tmp_path / "two.h5")
        ref = pv.Checkpoint(model=m).write(tmp_path / "ref.h5")
    finally:
        pv.checkpoint.registry.unregister_saveable(Counter)
    assert read(path) == read(ref)
    with H5Reader(path) as r:
        assert "model/counters/0" in r


def test_a_buffer_changed_during_the_gathered_write_fails_the_save(tmp_path, monkeypatch) -> None:
    m = many_small(40)
    ckpt = pv.Checkpoint(model=m)
    path = ckpt.write(tmp_path / "c.h5")
    good = read(path)
    real = component_bytes.pwritev_all

    def racing(fd: int, buffers: list, offset: int, size: int) -> None:
        real(fd, buffers, offset, size)
        m.vs[3].assign(np.full(3, -1, np.float32))  # another thread, as it were

    monkeypatch.setattr(component_bytes, "pwritev_all", racing)
    with pytest.raises(pv.errors.ConcurrentWriteError, match="model/vs/3"):
        ckpt.write(path)
    assert read(path) == good
    assert sorted(os.listdir(tmp_path)) == ["c.h5"]


def test_repeated_saves_read_every_component_anew(tmp_path, fixed_clock) -> None:
    m = pv.Module()
    with pv.MirroredStrategy(2).scope():
        # shards along axis 1 are strided views: copied at each write, never kept
        m.cols = pv.Variable(np.arange(12, dtype=np.float32).reshape(3, 4), shard_axis=1)
        m.rows = pv.Variable(np.arange(8, dtype=np.float64).reshape(4, 2), shard_axis=0)
    m.scalar = pv.Variable(np.float32(1), name="scalar")
    assert not m.cols.components[0].flags.c_contiguous
    ckpt = pv.Checkpoint(model=m)
    ckpt.write(tmp_path / "first.h5")
    for k in (2, 3):
        m.cols.assign(np.full((3, 4), k, np.float32))
        m.rows.assign(np.full((4, 2), -k, np.float64))
        m.scalar.assign(np.float32(k))
        path = ckpt.write(tmp_path / f"again-{k}.h5")
        ref = pv.Checkpoint(model=m).write(tmp_path / f"ref-{k}.h5")
        assert read(path) == read(ref)
        with H5Reader(path) as r:
            assert r.verify_all() == []
            np.testing.assert_array_equal(r["model/cols"].value(), np.full((3, 4), k))
            assert float(r["model/scalar"].value()) == k


def test_no_copy_of_a_strided_component_is_kept_between_saves(tmp_path) -> None:
    """The gathered writes kept for the next save of the live records hold the records' own
    arrays only: where a component is strided (shards along axis 1, a transposed array), its
    contiguous copy is made anew at each save and nothing of it is kept with the plan."""
    m = pv.Module()
    with pv.MirroredStrategy(2).scope():
        m.s = pv.Variable(np.ones((64, 64), np.float32), name="s", shard_axis=1)
        m.t = pv.Variable(np.ones((64, 64), np.float32).T, name="t")
    m.u = pv.Variable(np.ones(8, np.float32), name="u")
    ckpt = pv.Checkpoint(model=m)
    for k in range(2):
        m.s.assign(np.full((64, 64), k, np.float32))
        path = ckpt.write(tmp_path / f"c{k}.h5")
        with H5Reader(path) as r:
            assert r.verify_all() == []
            np.testing.assert_array_equal(r["model/s"].value(), np.full((64, 64), k))
        records = ckpt._gather(False)[0]
        assert (
            not records[[r.path for r in records].index("model/s")]
            .components[0]
            .flags["C_CONTIGUOUS"]
        )
        kept = ckpt._pv_plans.held.batches
        members = [] if kept is None else [m for b in kept[1] for m in b[3]]
        assert all(kept[0][k].components[i] is c for _, c, k, i, _ in members)
    # an all-contiguous model's are kept (and reused)
    m2 = pv.Module()
    m2.u = pv.Variable(np.ones(8, np.float32), name="u")
    ckpt2 = pv.Checkpoint(model=m2)
    ckpt2.write(tmp_path / "d.h5")
    assert ckpt2._pv_plans.held.batches is not None


def test_a_short_gathered_write_is_resumed(tmp_path, monkeypatch) -> None:
    real = os.pwritev

    def short(fd: int, buffers: list, offset: int) -> int:  # writes 2 buffers and 3 bytes
        return real(fd, [*buffers[:2], bytes(memoryview(buffers[2]).cast("B")[:3])], offset)

    monkeypatch.setattr(os, "pwritev", short)
    bufs = [np.arange(5, dtype=np.float32), np.zeros(0, np.uint8), np.arange(7, dtype=np.int64)]
    bufs.append(np.frombuffer(b"tail", np.uint8))
    path = tmp_path / "f.bin"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    try:
        fileio.pwritev_all(fd, bufs, 4, sum(b.nbytes for b in bufs))
    finally:
        os.close(fd)
    assert read(str(path)) == b"\0" * 4 + b"".join(b.tobytes() for b in bufs)


def test_the_writer_hands_back_the_checksums_its_index_records(tmp_path) -> None:
    # A multi-process save gathers every rank's checksums from the writer for its index file.
    m = make_model()
    ckpt = pv.Checkpoint(m=m)
    cache = PlanCache()
    records, graph, metadata = ckpt._gather(False)
    for k in range(3):  # a plan made by the first, used by the others
        change_values(m, k)
        found: dict[str, list[int]] = {}
        path = native.save_native(
            tmp_path / f"c{k}.h5",
            records,
            object_graph=graph,
            metadata=metadata,
            cache=cache,
            checksums=found,
        )
        assert isinstance(cache.held, native.Prepared)
        with h5py.File(path, "r") as f:
            index = json.loads(bytes(f["_parallelvars/index"][()]))
        assert found == {p: meta["crc32c"] for p, meta in index.items()}
        assert found["m/w"] == [crc32c.crc32c(c.tobytes()) for c in m.w.components]
