"""The single-process save path through the generator (``h5raw/native.py``: ``save_native``):
every kind and dtype, first and repeated saves, mirrored components stored once, conversions
into HDF5; h5py (and the libhdf5 writer's file of the same content) as the oracle."""

from __future__ import annotations

import json
import os

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
from parallelvars.formats import convert


def every_name(f: h5py.File) -> dict[str, object]:
    """What h5py reads under every link name (components stored once appear under each)."""
    seen: dict[str, object] = {}

    def walk(group: h5py.Group, prefix: str) -> None:
        for key in group:
            obj = group[key]
            attrs = {k: repr(v) for k, v in obj.attrs.items()}
            name = prefix + key
            if isinstance(obj, h5py.Dataset):
                if not name.startswith("_parallelvars"):
                    value = np.asarray(obj[()])
                    raw = value.tobytes() if value.dtype.kind != "O" else repr(value.tolist())
                    seen[name] = (attrs, obj.dtype.str, obj.shape, obj.is_virtual, raw)
            else:
                seen[name] = attrs
                walk(obj, name + "/")

    seen["/"] = {k: repr(v) for k, v in f.attrs.items() if k != "created"}
    walk(f, "")
    return seen


def assert_h5py_reads_the_same(ours: str, ckpt: pv.Checkpoint, tmp_path) -> None:
    records, graph, metadata = ckpt._gather(False)
    theirs = write_h5(str(tmp_path / "libhdf5.h5"), records, object_graph=graph, metadata=metadata)
    with h5py.File(ours, "r") as fa, h5py.File(theirs, "r") as fb:
        wa, wb = every_name(fa), every_name(fb)
        ia, ib = (json.loads(bytes(f["_parallelvars/index"][()])) for f in (fa, fb))
    assert wa.keys() == wb.keys()
    for key in wa:
        assert wa[key] == wb[key], key
    for meta in (*ia.values(), *ib.values()):
        del meta["offsets"]
    assert ia == ib


def model(dtype) -> pv.Module:
    m = pv.Module()
    value = np.arange(12).reshape(3, 4).astype(dtype)
    with pv.MirroredStrategy(3).scope():
        m.mirrored = pv.Variable(value, name="mirrored")
        m.on_read = pv.Variable(value, name="r", synchronization="on_read", aggregation="sum")
        m.sharded = pv.Variable(value, name="s", shard_axis=0)
        m.scalar = pv.Variable(np.asarray(7).astype(dtype), name="scalar")
        m.empty = pv.Variable(np.zeros((0, 2), dtype), name="empty")
    m.single = pv.Variable(value[0], name="single")
    return m


DTYPES = [
    np.float32,
    np.float64,
    np.float16,
    ml_dtypes.bfloat16,
    ml_dtypes.float8_e4m3fn,
    np.int8,
    np.int64,
    np.uint16,
    np.bool_,
]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_every_kind_and_dtype_first_and_repeated(tmp_path, dtype) -> None:
    m = model(dtype)
    ckpt = pv.Checkpoint(model=m)
    first = ckpt.write(tmp_path / "first.h5")
    assert isinstance(ckpt._pv_plans.held, native.Prepared)
    assert_h5py_reads_the_same(first, ckpt, tmp_path)
    m.on_read.components[1][...] = np.ones((3, 4), dtype)  # components that differ
    again = ckpt.write(tmp_path / "again.h5")
    assert_h5py_reads_the_same(again, ckpt, tmp_path)
    with H5Reader(again) as r:
        assert r.verify_all() == []
        np.testing.assert_array_equal(r["model/on_read"].component(1), np.ones((3, 4), dtype))
    back = model(dtype)
    pv.Checkpoint(model=back).restore(again).assert_consumed()
    for name in ("mirrored", "on_read", "sharded", "scalar", "empty", "single"):
        for a, b in zip(getattr(back, name).components, getattr(m, name).components, strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_mirrored_components_are_stored_once(tmp_path) -> None:
    m = pv.Module()
    with pv.MirroredStrategy(4).scope():
        m.w = pv.Variable(np.arange(1000, dtype=np.float32), name="w")
        m.r = pv.Variable(np.zeros(1000, np.float32), name="r", synchronization="on_read")
    m.r.components[2][0] = 1.0  # component 2 differs: written apart; 1 and 3 share 0's
    path = pv.Checkpoint(model=m).write(tmp_path / "c.h5")
    with h5py.File(path, "r") as f:
        w = [
            f[f"model/w/{n}"] for n in ("primary", *(f"parallel_component_{i}" for i in (1, 2, 3)))
        ]
        assert len({d.id.get_offset() for d in w}) == 1
        assert all(d.id == w[0].id for d in w)  # one dataset, four names
        for d in w:
            np.testing.assert_array_equal(d[()], np.arange(1000, dtype=np.float32))
        r = [
            f[f"model/r/{n}"] for n in ("primary", *(f"parallel_component_{i}" for i in (1, 2, 3)))
        ]
        offsets = [d.id.get_offset() for d in r]
        assert offsets[0] == offsets[1] == offsets[3] != offsets[2]
        assert r[2][0] == 1.0 and r[3][0] == 0.0
        index = json.loads(bytes(f["_parallelvars/index"][()]))
    assert index["model/w"]["offsets"] == [index["model/w"]["offsets"][0]] * 4
    with H5Reader(path) as reader:
        assert reader.table is not None  # the bulk reader takes shared offsets as one dataset
        assert reader.verify_all() == []
    back = pv.Module()
    with pv.MirroredStrategy(4).scope():
        back.w = pv.Variable(np.zeros(1000, np.float32), name="w")
        back.r = pv.Variable(np.zeros(1000, np.float32), name="r", synchronization="on_read")
    pv.Checkpoint(model=back).restore(path).assert_consumed()
    assert back.r.components[2][0] == 1.0 and back.r.components[3][0] == 0.0
    np.testing.assert_array_equal(back.w.components[3], np.arange(1000, dtype=np.float32))


def test_byte_strings_are_generated_and_read_back(tmp_path) -> None:
    ckpt = pv.Checkpoint(s=pv.Variable(np.array([b"ab", b"c"], dtype=object), name="s"))
    for name in ("a.h5", "b.h5"):
        path = ckpt.write(tmp_path / name)
        with H5Reader(path) as r:
            assert r.verify_all() == [] and r["s"].value().tolist() == [b"ab", b"c"]
        assert_h5py_reads_the_same(path, ckpt, tmp_path)
    assert isinstance(ckpt._pv_plans.held, native.Prepared)


def byte_strings(max_size: int = 6) -> st.SearchStrategy[np.ndarray]:
    """Arrays of byte strings: empty ones, NULs, bytes that are not UTF-8, 0-d and 2-d."""
    item = st.binary(max_size=40).map(lambda b: b.replace(b"\x00", b"0"))  # (see below)
    return st.one_of(
        item.map(lambda b: np.array(b, dtype=object)),
        st.lists(item, max_size=max_size).map(lambda xs: np.array(xs, dtype=object)),
        st.lists(item, min_size=4, max_size=4).map(
            lambda xs: np.array(xs, dtype=object).reshape(2, 2)
        ),
    )


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    values=st.lists(byte_strings(), min_size=1, max_size=4),
    devices=st.sampled_from([1, 2, 3]),
    sharded=st.booleans(),
)
def test_any_byte_strings_read_as_libhdf5_writes_them(
    tmp_path_factory, values, devices, sharded
) -> None:
    d = tmp_path_factory.mktemp("b")
    m = pv.Module()
    made = []
    for k, value in enumerate(values):
        if devices == 1:
            made.append(pv.Variable(value, name=f"s{k}"))
            continue
        with pv.MirroredStrategy(devices).scope():
            if sharded and value.ndim and value.shape[0] >= devices:
                made.append(pv.Variable(value, name=f"s{k}", shard_axis=0))
            else:
                made.append(pv.Variable(value, name=f"s{k}"))
    m.vs = made
    ckpt = pv.Checkpoint(model=m)
    path = ckpt.write(d / "c.h5")
    assert isinstance(ckpt._pv_plans.held, native.Prepared)
    assert_h5py_reads_the_same(path, ckpt, d)
    with H5Reader(path) as r:
        assert r.verify_all() == []
        for k, value in enumerate(values):
            assert r[f"model/vs/{k}"].value().tolist() == value.tolist()


@pytest.mark.parametrize("value", [b"\x00", b"a\x00", b"a\x00b"])
def test_byte_strings_holding_a_nul_byte_are_refused(tmp_path, value) -> None:
    # HDF5's variable-length strings end at a NUL: libhdf5 refuses them too.
    ckpt = pv.Checkpoint(s=pv.Variable(np.array([b"ok", value], dtype=object), name="s"))
    with pytest.raises(pv.errors.UnsupportedDtypeError, match=r"s\[0\].*NUL"):
        ckpt.write(tmp_path / "c.h5")
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match="NUL"):
        records, graph, metadata = ckpt._gather(False)
        write_h5(str(tmp_path / "libhdf5.h5"), records, object_graph=graph, metadata=metadata)


def test_many_byte_strings_fill_several_heap_collections(tmp_path) -> None:
    # 10,000 elements: more objects than one global heap collection holds (4,096)
    value = np.array([b"%d" % i * (i % 7) for i in range(10_000)], dtype=object)
    ckpt = pv.Checkpoint(s=pv.Variable(value, name="s"))
    path = ckpt.write(tmp_path / "c.h5")
    assert_h5py_reads_the_same(path, ckpt, tmp_path)
    with H5Reader(path) as r:
        assert r.verify_all() == [] and r["s"].value().tolist() == value.tolist()


def test_a_list_of_more_than_1024_variables_is_written(tmp_path) -> None:
    m = pv.Module()
    m.vs = [pv.Variable(np.full(2, i, np.float32), name=f"v{i}") for i in range(1030)]
    path = pv.Checkpoint(model=m).write(tmp_path / "c.h5")  # (generated: a symbol table)
    with H5Reader(path) as r:
        assert r.verify_all() == [] and r["model/vs/1029"].value()[0] == 1029


def test_conversion_into_hdf5_is_generated_and_streamed(tmp_path) -> None:
    from safetensors.numpy import save_file

    tensors = {
        "a": np.arange(6, dtype=np.float32).reshape(2, 3),
        "b/c": np.ones(4, ml_dtypes.bfloat16),
        "z": np.zeros((0,), np.int32),
    }
    save_file(tensors, str(tmp_path / "o.safetensors"))
    out = convert(str(tmp_path / "o.safetensors"), str(tmp_path / "o.h5"))
    with H5Reader(str(out)) as r:
        assert r.verify_all() == []
        for name, value in tensors.items():
            np.testing.assert_array_equal(r[name].value(), value)
    with h5py.File(out, "r") as f:
        np.testing.assert_array_equal(f["a/primary"][()], tensors["a"])


def test_slots_groups_from_templates_read_as_libhdf5_writes_them(tmp_path) -> None:
    """A model with optimizer slots: the slots' groups (no attributes, links ``m``/``v``) and
    the variable groups of each layout are written from templates."""
    m = pv.Module()
    with pv.MirroredStrategy(2).scope():
        m.layers = [pv.Module() for _ in range(3)]
        for k, layer in enumerate(m.layers):
            layer.w = pv.Variable(np.full((2, 3), k, np.float32), name="w")
            layer.b = pv.Variable(np.zeros(3, ml_dtypes.bfloat16), name="b")
            layer.s = pv.Variable(np.arange(6.0).reshape(3, 2), name="s", shard_axis=0)
        opt = pv.optimizers.Adam(1e-3)
    variables = [v for layer in m.layers for v in (layer.w, layer.b, layer.s)]
    grads = [[np.ones(v.shape, v.dtype) for v in variables]] * 2
    pv.MirroredStrategy(2).run(
        lambda g: opt.apply_gradients(zip(g, variables, strict=True)),
        args=(pv.PerReplica(grads),),
    )
    ckpt = pv.Checkpoint(model=m, opt=opt)
    path = ckpt.write(tmp_path / "c.h5")
    assert_h5py_reads_the_same(path, ckpt, tmp_path)
    with H5Reader(path) as r:
        assert r.verify_all() == []


def test_attributes_equal_but_for_the_sign_of_zero_get_their_own_layout(tmp_path) -> None:
    from parallelvars.checkpoint.registry import SaveRecord

    records = [
        SaveRecord(
            "single",
            [np.zeros(2, np.float32)],
            (2,),
            {"scale": s, "scales": [s, 1.5], "more": {"a": [np.float64(s)]}},
            path=f"v{k}",
        )
        for k, s in enumerate((0.0, -0.0, 0.0))
    ]
    path = native.save_native(tmp_path / "c.h5", records)
    with h5py.File(path, "r") as f:
        signs = [np.copysign(1.0, f[f"v{k}"].attrs["scale"]) for k in range(3)]
        lists = [f[f"v{k}"].attrs["scales"] for k in range(3)]
        nested = [f[f"v{k}"].attrs["more"] for k in range(3)]
    assert signs == [1.0, -1.0, 1.0]
    assert lists == ["json:[0.0, 1.5]", "json:[-0.0, 1.5]", "json:[0.0, 1.5]"]
    assert nested == ['json:{"a": [0.0]}', 'json:{"a": [-0.0]}', 'json:{"a": [0.0]}']


def test_a_value_with_the_checksums_mark_text_keeps_the_index_exact(tmp_path) -> None:
    """The index template stands a mark for each record's checksums; a value of the same
    text makes it record by record, and the index is still json.dumps of the index."""
    from parallelvars.checkpoint.registry import SaveRecord
    from parallelvars.testing import crc_mark
    from parallelvars.testing import index_template as _index_template

    records = [
        SaveRecord(
            "mirrored",
            [np.full(2, k, np.float32)] * 2,
            (2,),
            {"note": crc_mark(2), "pct": "100%d"},
            path=f"v{k}",
        )
        for k in range(2)
    ]
    path = native.save_native(tmp_path / "c.h5", records)
    with H5Reader(path) as r:
        assert r.verify_all() == []
        assert r["v1"].attrs["note"] == crc_mark(2) and r["v1"].attrs["pct"] == "100%d"
    with h5py.File(path, "r") as f:
        text = bytes(f["_parallelvars/index"][()]).rstrip(b" ").decode()
    index = json.loads(text)
    assert text == json.dumps(index)
    crcs = tuple(c for meta in index.values() for c in meta["crc32c"])
    assert _index_template(index) % crcs == text


def test_a_repeated_structure_is_found_by_its_records_token(tmp_path) -> None:
    m = model(np.float32)
    ckpt = pv.Checkpoint(model=m)
    ckpt.write(tmp_path / "a.h5")
    prep = ckpt._pv_plans.held
    assert isinstance(prep, native.Prepared)
    records = ckpt._gather(False)[0]
    assert records._key is None  # (the first save built no key of every record)
    ckpt.write(tmp_path / "b.h5")
    assert ckpt._pv_plans.held is prep  # the same plan
    m.extra = pv.Variable(np.zeros(3, np.float32), name="extra")  # a new structure
    ckpt.write(tmp_path / "c.h5")
    assert ckpt._pv_plans.held is not prep
    with H5Reader(tmp_path / "c.h5") as r:
        assert "model/extra" in r and r.verify_all() == []


# ------------------------------------------------------------- the byte path: sharing, writes
def _bits(dtype: np.dtype, n: int, seed: int) -> np.ndarray:
    """``n`` values of ``dtype`` from random bits (NaNs of several payloads, both zeros)."""
    raw = np.random.default_rng(seed).integers(0, 256, n * dtype.itemsize, dtype=np.uint8)
    if dtype.kind == "b":
        raw &= 1
    return raw.view(dtype)


@pytest.mark.parametrize("size", [1, 3000, 40_000])  # bytes compared as copies, and in place
@pytest.mark.parametrize(
    "dtype",
    [np.float32, np.float16, ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn, np.int8, np.bool_],
    ids=lambda d: np.dtype(d).name,
)
def test_replicas_share_exactly_when_their_bytes_are_equal(tmp_path, dtype, size) -> None:
    from parallelvars.checkpoint.registry import SaveRecord

    dt = np.dtype(dtype)
    base = _bits(dt, size, size)
    flipped = base.copy()
    flipped.view(np.uint8)[-1] ^= 1  # one bit apart (a NaN's payload, the sign of a zero...)
    if dt.kind == "b":
        flipped = ~base
    cases = {
        "all": [base, base.copy(), base.copy()],  # one dataset, three names
        "last": [base, base.copy(), flipped],  # the third apart
        "middle": [base, flipped, base.copy()],  # 0 and 2 share, 1 apart
    }
    want = {"all": [0, 0, 0], "last": [0, 0, 2], "middle": [0, 1, 0]}
    for writer in ("write_native", "save_native"):  # (one mechanism for both)
        records = [
            SaveRecord(kind="mirrored", components=cs, shape=cs[0].shape, path=k)
            for k, cs in cases.items()
        ]
        if writer == "write_native":
            path = native.write_native(tmp_path / f"{writer}.h5", records, share_equal=True)
        else:
            path = native.save_native(tmp_path / f"{writer}.h5", records)
        with h5py.File(path, "r") as f:
            index = json.loads(bytes(f["_parallelvars/index"][()]))
            for name, comps in cases.items():
                offsets = index[name]["offsets"]
                assert [offsets.index(o) for o in offsets] == want[name], (writer, name)
                for i, c in enumerate(comps):
                    ds = f[f"{name}/{'primary' if i == 0 else f'parallel_component_{i}'}"]
                    assert ds[()].tobytes() == c.tobytes(), (writer, name, i)
        with H5Reader(path) as r:
            assert r.verify_all() == []


def test_same_bytes_compares_bits_in_place_at_every_size() -> None:
    from parallelvars.testing import fileio

    same_bytes = fileio.same_bytes

    for n in (0, 1, 1 << 14, 1 << 16, (1 << 16) + 1, 3 << 20):
        a = _bits(np.dtype(np.float32), n, n)
        assert same_bytes(a, a.copy())
        if n:
            b = a.copy()
            b.view(np.uint8)[n * 2] ^= 0x80  # one bit, in the middle
            assert not same_bytes(a, b)
            assert not same_bytes(a, a[:-1].copy())  # sizes differ
    nan = np.array([np.nan, 0.0], np.float32)
    assert same_bytes(nan, nan.copy())  # bits: a NaN equals itself
    assert not same_bytes(np.array([0.0], np.float32), np.array([-0.0], np.float32))
    grid = np.arange(200_000, dtype=np.float32).reshape(400, 500)
    assert same_bytes(grid[:, ::2], np.ascontiguousarray(grid[:, ::2]))  # strided: C order
    assert not same_bytes(grid[:, ::2], np.ascontiguousarray(grid[:, 1::2]))
    strings = np.array([b"ab", b"c"], dtype=object)
    assert same_bytes(strings, np.array([b"ab", b"c"], dtype=object))  # objects, not pointers
    assert not same_bytes(strings, np.array([b"ab", b"d"], dtype=object))


def _many(n: int) -> tuple[pv.Checkpoint, pv.Module]:
    m = pv.Module()
    with pv.MirroredStrategy(2).scope():
        m.vs = [pv.Variable(np.full(3000, i, np.float32), name=f"v{i}") for i in range(n)]
    return pv.Checkpoint(model=m), m


@pytest.mark.parametrize("where", ["data", "metadata"])
def test_a_first_save_failing_while_its_bytes_go_out_keeps_the_last_good_file(
    tmp_path, monkeypatch, where
) -> None:
    """A first save writes its component bytes on a helper thread while it makes the metadata:
    a full disk in the helper, or an interrupt in the saving thread meanwhile, leaves the last
    good file and no temporary, and the next save writes a sound file."""
    import errno
    import os
    import threading

    from parallelvars.checkpoint.h5raw import generate
    from parallelvars.errors import CheckpointWriteError

    ckpt, m = _many(300)
    path = str(tmp_path / "c.h5")
    ckpt.write(path)
    with open(path, "rb") as fh:
        good = fh.read()
    m.vs[0].assign(np.full(3000, -1, np.float32))
    m.vs2 = [pv.Variable(np.ones(10, np.float32), name="x")]  # a new structure: a first save
    writers: list[str] = []
    if where == "data":
        real = component_bytes.pwritev_all

        def full_disk(fd: int, buffers: list, offset: int, size: int) -> None:
            writers.append(threading.current_thread().name)
            real(fd, buffers[:1], offset, buffers[0].nbytes)  # a torn write, then a full disk
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        monkeypatch.setattr(component_bytes, "pwritev_all", full_disk)
        expected: type[BaseException] = CheckpointWriteError
    else:
        real_metadata = generate.FilePlan.metadata

        def interrupted(self, *args, **kwargs):  # the data write is under way meanwhile
            raise KeyboardInterrupt

        monkeypatch.setattr(generate.FilePlan, "metadata", interrupted)
        expected = KeyboardInterrupt
    with pytest.raises(expected):
        ckpt.write(path)
    with open(path, "rb") as fh:
        assert fh.read() == good
    assert sorted(os.listdir(tmp_path)) == ["c.h5"]  # no temporary left behind
    if where == "data" and component_bytes.thread_count() > 1:
        assert writers and all(w != threading.current_thread().name for w in writers)
    monkeypatch.undo()
    if where == "metadata":
        assert generate.FilePlan.metadata is real_metadata
    ckpt.write(path)
    with H5Reader(path) as r:
        assert r.verify_all() == []
        assert r["model/vs/0"].component(1)[0] == -1 and r["model/vs/299"].value()[0] == 299


def test_repeated_saves_compare_replicas_by_runs_and_see_divergence(tmp_path) -> None:
    """From a structure's second save on, the replicas of its records are compared by runs of
    their arena rows (the snapshot plan's); a replica that diverges later is still found and
    saved apart, and its variable is compared one by one from then on."""
    m = pv.Module()
    with pv.MirroredStrategy(3).scope():
        m.vs = [pv.Variable(np.full(3000, i, np.float32), name=f"v{i}") for i in range(40)]
    ckpt = pv.Checkpoint(model=m)
    ckpt.write(tmp_path / "a.h5")
    ckpt.write(tmp_path / "b.h5")
    records = ckpt._gather(False)[0]
    plan = records.replicas
    assert plan is not None and plan is not False and len(plan.runs) <= 2 and not plan.divergent
    m.vs[7].components[2][5] = -1.0  # one replica diverges
    path = ckpt.write(tmp_path / "c.h5")
    assert records.replicas is plan
    (n,) = [n for n, r in enumerate(records) if r.path == "model/vs/7"]
    assert plan.divergent == {n}
    with h5py.File(path, "r") as f:
        index = json.loads(bytes(f["_parallelvars/index"][()]))
        offsets = index["model/vs/7"]["offsets"]
        assert offsets[0] == offsets[1] != offsets[2]
        assert f["model/vs/7/parallel_component_2"][5] == -1.0
        assert f["model/vs/7/primary"][5] == 7.0
        assert len(set(index["model/vs/8"]["offsets"])) == 1
    m.vs[7].components[2][5] = 7.0  # equal again: stored once again (compared one by one)
    path = ckpt.write(tmp_path / "d.h5")
    with h5py.File(path, "r") as f:
        index = json.loads(bytes(f["_parallelvars/index"][()]))
        assert len(set(index["model/vs/7"]["offsets"])) == 1
    with H5Reader(path) as r:
        assert r.verify_all() == []


def test_replicas_compared_while_written_still_see_divergence(tmp_path, monkeypatch) -> None:
    """A repeated save compares the replicas while the helper thread writes the bytes (taken
    to be equal, as at the last save): a replica that differs by then is still found, the save
    is made again comparing first, and the file stores it apart."""
    from parallelvars.checkpoint.h5raw import native

    m = pv.Module()
    with pv.MirroredStrategy(2).scope():
        m.vs = [pv.Variable(np.full(3000, i, np.float32), name=f"v{i}") for i in range(20)]
    ckpt = pv.Checkpoint(model=m)
    ckpt.write(tmp_path / "a.h5")
    ckpt.write(tmp_path / "b.h5")
    real = native._checksummed
    calls = []

    def then_diverge(items, share_equal, **kw):
        out = real(items, share_equal, **kw)
        calls.append(kw.get("compare", True))
        if len(calls) == 1:  # (after the first pass took the replicas as equal)
            m.vs[3].components[1][5] = -1.0
        return out

    monkeypatch.setattr(native, "_checksummed", then_diverge)
    path = ckpt.write(tmp_path / "c.h5")
    assert calls == [False, True]  # compared later, then again first
    with h5py.File(path, "r") as f:
        index = json.loads(bytes(f["_parallelvars/index"][()]))
        offsets = index["model/vs/3"]["offsets"]
        assert offsets[0] != offsets[1]
        assert f["model/vs/3/parallel_component_1"][5] == -1.0
        assert f["model/vs/3/primary"][5] == 3.0
    with H5Reader(path) as r:
        assert r.verify_all() == []


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_short_gathered_write_is_resumed(tmp_path, monkeypatch, dtype) -> None:
    """``pwritev`` may write less than asked (Linux stops at about 2 GiB a call; network file
    systems write less): the save resumes it buffer by buffer, from arrays of any dtype."""
    real = os.pwritev

    def short(fd, buffers, offset):
        sizes = [
            memoryview(b).nbytes if not isinstance(b, np.ndarray) else b.nbytes for b in buffers
        ]
        total = sum(sizes)
        if total < 8:
            return real(fd, buffers, offset)
        first = bytes(memoryview(buffers[0]).cast("B"))[: max(1, sizes[0] // 2)]
        return os.pwrite(fd, first, offset)  # (half of the first buffer only)

    monkeypatch.setattr(os, "pwritev", short)
    dt = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float32
    m = pv.Module()
    m.vs = [pv.Variable((np.arange(50 + k) * 0.5).astype(dt), name=f"v{k}") for k in range(5)]
    path = pv.Checkpoint(model=m).write(tmp_path / "c.h5")
    monkeypatch.undo()
    back = pv.Module()
    back.vs = [pv.Variable(np.zeros(50 + k, dt), name=f"v{k}") for k in range(5)]
    pv.Checkpoint(model=back).restore(path)
    for k in range(5):
        assert back.vs[k].numpy().tobytes() == m.vs[k].numpy().tobytes()


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, np.int8, np.bool_], ids=str)
def test_components_are_checksummed_as_they_are_written(tmp_path, monkeypatch, dtype) -> None:
    """The writer checksums each component in the pass that writes it (batches, and a
    component larger than a batch in pieces): the index holds every component's checksum of
    its bytes, first, repeated and non-blocking saves, components stored once or apart."""
    from parallelvars.testing import fileio

    monkeypatch.setattr(component_bytes, "_FUSE_BYTES", 4096)  # (pieces of a few KiB)
    dt = np.dtype(dtype)
    m = pv.Module()
    with pv.MirroredStrategy(2).scope():
        m.vs = [
            pv.Variable(_bits(dt, n, n), name=f"v{n}")
            for n in (1, 7, 4095 // dt.itemsize, 4096 // dt.itemsize, 9000 // dt.itemsize)
        ]
        m.r = pv.Variable(_bits(dt, 5000, 1), name="r", synchronization="on_read")
        m.s = pv.Variable(_bits(dt, 6000, 2).reshape(3000, 2), name="s", shard_axis=0)
    m.scalar = pv.Variable(np.asarray(_bits(dt, 1, 3)[0]), name="scalar")
    m.r.components[1][...] = _bits(dt, 5000, 4)  # replicas apart
    ckpt = pv.Checkpoint(model=m)
    paths = [ckpt.write(tmp_path / "first.h5"), ckpt.write(tmp_path / "again.h5")]
    for path in paths:
        assert_h5py_reads_the_same(path, ckpt, tmp_path)
    with pv.CheckpointManager(ckpt, tmp_path / "mgr", max_to_keep=2) as mgr:
        for _ in range(2):
            mgr.save(blocking=False)
            mgr.wait()
            paths.append(mgr.latest_checkpoint)
    for path in paths:
        with h5py.File(path, "r") as f:
            index = json.loads(bytes(f["_parallelvars/index"][()]))
        records = ckpt._gather(False)[0]
        for r in records:
            if r.path == "save_counter":  # (counts the saves)
                continue
            want = [fileio.checksum(np.ascontiguousarray(c)) for c in r.components]
            assert index[r.path]["crc32c"] == want, (path, r.path)
        with H5Reader(path) as r:
            assert r.verify_all() == []


def test_a_component_changed_after_a_piece_of_it_was_written_fails_the_save(
    tmp_path, monkeypatch
) -> None:
    """A component larger than a batch is written in pieces and checksummed whole again once
    written: a piece changed after it was written (the file holds its old bytes) fails the
    save, and the last good file stays."""
    monkeypatch.setattr(component_bytes, "_FUSE_BYTES", 4096)
    m = pv.Module()
    m.big = pv.Variable(np.arange(5000, dtype=np.float32), name="big")
    ckpt = pv.Checkpoint(model=m)
    path = ckpt.write(tmp_path / "c.h5")
    with open(path, "rb") as fh:
        good = fh.read()
    real = component_bytes.pwritev_all
    calls: list[int] = []

    def racing(fd: int, buffers: list, offset: int, size: int) -> None:
        real(fd, buffers, offset, size)
        calls.append(size)
        if len(calls) == 2:
            m.big.components[0][0] = -1.0  # in the piece written first

    monkeypatch.setattr(component_bytes, "pwritev_all", racing)
    with pytest.raises(pv.errors.ConcurrentWriteError, match="model/big"):
        ckpt.write(path)
    with open(path, "rb") as fh:
        assert fh.read() == good
    assert sorted(os.listdir(tmp_path)) == ["c.h5"]


@pytest.mark.parametrize("replicas", [2, 3])
@pytest.mark.parametrize("per_shard", [1000, 3000], ids=["batch", "pieces"])
def test_a_variable_changed_between_the_batches_of_its_components_fails_the_save(
    tmp_path, monkeypatch, replicas, per_shard
) -> None:
    """A sharded variable whose shards go out in different batches: another thread assigning
        it after its first shard's batch was written and checked, before its last shard's, would
        leave old and new shards in the file under matching checksums. Once its last component is
        written, the earlier ones are checked again: the save fails, and the last good file stays
    (shards of a batch each, and shards larger than a batch, written in pieces)."""
    import crc32c as real_crc

    monkeypatch.setattr(component_bytes, "_FUSE_BYTES", 4096)  # (each shard a batch of its own)
    m = pv.Module()
    with pv.MirroredStrategy(replicas).scope():
        m.s = pv.Variable(np.zeros(per_shard * replicas, np.float32), name="s", shard_axis=0)
    ckpt = pv.Checkpoint(model=m)
    path = ckpt.write(tmp_path / "c.h5")
    with open(path, "rb") as fh:
        good = fh.read()
    lastshard = m.s.components[-1]
    done: list[bool] = []

    class Racing:  # assigns the variable just before its last shard is first checksummed
        @staticmethod
        def crc32c(b, *more):
            if not done and np.shares_memory(np.asarray(b), lastshard):
                done.append(True)
                m.s.assign(np.ones(per_shard * replicas, np.float32))
            return real_crc.crc32c(b, *more)

    monkeypatch.setattr(component_bytes, "_crc32c", Racing)
    with pytest.raises(pv.errors.ConcurrentWriteError, match=r"model/s\[0\]"):
        ckpt.write(path)
    assert done
    with open(path, "rb") as fh:
        assert fh.read() == good
    assert sorted(os.listdir(tmp_path)) == ["c.h5"]


def test_repeated_saves_of_the_live_records_reuse_their_gathered_writes(tmp_path) -> None:
    """The gathered writes of the live records are laid out once per plan and reused while the
    records hold the same arrays (each save still reads their bytes anew); a snapshot's copies
    are not kept by them."""
    ckpt, m = _many(30)
    ckpt.write(tmp_path / "a.h5")
    prep = ckpt._pv_plans.held
    records = ckpt._gather(False)[0]
    assert prep.batches is not None and prep.batches[0] is records
    laid = prep.batches[1]
    for k in (1, 2):
        m.vs[5].assign(np.full(3000, -k, np.float32))
        path = ckpt.write(tmp_path / f"b{k}.h5")
        assert ckpt._pv_plans.held is prep and prep.batches[1] is laid
        with H5Reader(path) as r:
            assert r.verify_all() == [] and r["model/vs/5"].value()[0] == -k
    with pv.CheckpointManager(ckpt, tmp_path / "m", max_to_keep=1) as mgr:
        mgr.save(blocking=False)
        mgr.wait()
    assert prep.batches[1] is laid  # (the copies' batches were not kept)


def test_a_repeated_save_asks_the_disk_for_its_metadata_as_it_writes_it(tmp_path, monkeypatch):
    """A save through a cached plan writes the metadata image first and asks the disk to
    start on it at once (while the components' writes are laid out), not at the fsync."""
    m = pv.Module()
    with pv.MirroredStrategy(2).scope():
        m.vs = [pv.Variable(np.full(100, i, np.float32), name=f"v{i}") for i in range(50)]
    ckpt = pv.Checkpoint(model=m)
    ckpt.write(tmp_path / "a.h5")
    asked: list[tuple[int, int]] = []
    real = native.start_writeback
    monkeypatch.setattr(
        native, "start_writeback", lambda fd, at, n: asked.append((at, n)) or real(fd, at, n)
    )
    path = ckpt.write(tmp_path / "b.h5")
    prep = ckpt._pv_plans.held
    assert isinstance(prep, native.Prepared) and asked == [(0, len(prep.image))]
    with H5Reader(path) as reader:
        assert reader.verify_all() == []


@pytest.mark.parametrize(
    ("wrong", "error"),
    [
        (np.zeros(3, np.float32), pv.errors.ShapeMismatchError),
        (np.zeros((2, 2), np.float32), pv.errors.ShapeMismatchError),
        (np.zeros(2, np.float64), pv.errors.DtypeMismatchError),
    ],
)
@pytest.mark.parametrize("at", [0, 1, 5])
def test_a_component_unlike_its_layout_names_its_variable(tmp_path, wrong, error, at) -> None:
    """A first save compares every component's shape and dtype with its entry's: a component
    unlike its entry's layout (among many that are right) is refused naming the variable and
    the component, and no file is written."""
    from parallelvars.checkpoint.registry import SaveRecord

    records = [
        SaveRecord(
            "mirrored", [np.zeros(2, np.float32), np.zeros(2, np.float32)], (2,), path=f"v{k}"
        )
        for k in range(6)
    ]
    records[at].components[1] = wrong
    with pytest.raises(error, match=rf"v{at}\[1\]"):
        native.save_native(tmp_path / "c.h5", records)
    assert not os.path.exists(tmp_path / "c.h5")


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.text(alphabet="ab%d{}", max_size=40), max_size=12),
    st.integers(0, 70),
    st.integers(1, 64),
)
def test_a_document_is_written_a_few_pieces_at_a_time(
    tmp_path_factory, pieces: list[str], pad: int, write_bytes: int
) -> None:
    """A save writes each document a few pieces at a time (at most about
    ``DOCUMENT_WRITE_BYTES`` held): the bytes written are the pieces' text padded with spaces
    to the room, and its CRC-32C is theirs, however the pieces fall into writes."""
    import crc32c

    text = "".join(pieces).encode()
    room = len(text) + pad
    path = tmp_path_factory.mktemp("doc") / "doc"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(native, "DOCUMENT_WRITE_BYTES", write_bytes)
            crc = native._write_padded(fd, "doc", 5, room, iter(pieces))
    finally:
        os.close(fd)
    written = path.read_bytes()
    assert written[5:] == text.ljust(room, b" ")
    assert crc == crc32c.crc32c(written[5:])


def test_a_document_longer_than_its_room_is_refused(tmp_path) -> None:
    """A document whose text passes the room its structure gives it is refused naming the
    document, room and length, and an index template given other than its count of checksums
    is refused the same way."""
    from parallelvars.checkpoint.h5io.columns import index_pieces
    from parallelvars.errors import InvalidEntryError

    fd = os.open(tmp_path / "doc", os.O_RDWR | os.O_CREAT, 0o666)
    try:
        with pytest.raises(InvalidEntryError, match="does not fit the room") as info:
            native._write_padded(fd, "_parallelvars/index", 0, 4, ["ab", "cde"])
    finally:
        os.close(fd)
    assert "_parallelvars/index" in str(info.value) and "4 bytes" in str(info.value)
    runs = [('"a": {"crc32c": [%d, %d]}', 2)]
    assert "".join(index_pieces(runs, [1, 2])) == '{"a": {"crc32c": [1, 2]}}'
    for given_crcs in ([1], [1, 2, 3]):
        with pytest.raises(InvalidEntryError, match="take the checksums given"):
            "".join(index_pieces(runs, given_crcs))


def test_documents_written_in_small_pieces_are_the_documents(tmp_path, monkeypatch) -> None:
    """A save whose documents are made and written in many small pieces (the checksums'
    digits a few at a time, a few bytes a write) writes the same documents as one made in
    large ones, every checksum apart: the pieces' separators and the CRC chained over them."""
    from parallelvars.checkpoint.h5io.layout import COLUMNS_DATASET, INDEX_DATASET
    from parallelvars.cli import main

    def save(name: str) -> dict[str, bytes]:
        strategy = pv.MirroredStrategy(3)
        with strategy.scope():
            module = pv.Module()
            module.ws = [pv.Variable(np.full(4, i, np.float32), name=f"w%{i}") for i in range(7)]
        path = str(tmp_path / name)
        pv.Checkpoint(m=module).write(path)
        with h5py.File(path, "r") as f:
            docs = {d: bytes(f[d][()]) for d in (INDEX_DATASET, COLUMNS_DATASET)}
        assert main(["verify", path]) == 0
        return docs

    whole = save("whole.h5")
    monkeypatch.setattr(native, "_DIGITS_RUN", 2)
    monkeypatch.setattr(native, "DOCUMENT_WRITE_BYTES", 5)
    pieces = save("pieces.h5")
    assert pieces == whole
    crcs = json.loads(whole[COLUMNS_DATASET])["crc32c"]
    assert len(crcs) == 22 and all(0 <= c < 1 << 32 for c in crcs)  # (7 x 3 and the counter)


def test_an_attribute_name_that_is_not_text_is_refused(tmp_path) -> None:
    """A saveable whose record has an attribute named by something other than text is refused
    with our error naming the file and the variable (an HDF5 attribute's name is text), and
    the last good file stays."""
    from parallelvars.checkpoint.registry import Saveable, SaveRecord, register_saveable
    from parallelvars.errors import InvalidEntryError

    class Box:
        def __init__(self, attrs: dict) -> None:
            self.v = np.zeros(3, np.float32)
            self.attrs = attrs

    class Saved(Saveable):
        def gather(self, obj):
            return SaveRecord("single", [obj.v], obj.v.shape, obj.attrs)

        def plan_restore(self, *args, **kwargs):
            return lambda: None

    register_saveable(Box, Saved())
    path = tmp_path / "c.h5"
    box = Box({"name": "b"})
    pv.Checkpoint(b=box).write(str(path))
    good = path.read_bytes()
    box.attrs = {"name": "b", 7: "x"}
    with pytest.raises(InvalidEntryError, match="attribute name 7 is not text") as info:
        pv.Checkpoint(b=box).write(str(path))
    assert str(path) in str(info.value) and "b" in str(info.value)
    assert path.read_bytes() == good


@pytest.mark.parametrize("kept", [True, False])
def test_a_first_save_makes_the_index_text_after_its_metadata_image(
    tmp_path, monkeypatch, kept
) -> None:
    """A first save sizes the index document's room by its length (known before its text)
    and makes the text only once the metadata image is written and the plan let go of what
    made it (kept in memory or written a chunk at a time): the plan's objects and the
    index's text are never held together. The file is the one made otherwise (it verifies)."""
    from parallelvars.checkpoint.h5io import columns
    from parallelvars.checkpoint.h5raw import generate
    from parallelvars.cli import main

    events: list[str] = []
    release, runs = generate.FilePlan.release, columns.RecordDocuments.index_runs
    monkeypatch.setattr(
        generate.FilePlan, "release", lambda plan: (events.append("release"), release(plan))[1]
    )
    monkeypatch.setattr(
        columns.RecordDocuments, "index_runs", lambda d: (events.append("index"), runs(d))[1]
    )
    if not kept:
        monkeypatch.setattr(generate, "KEPT_IMAGE_BYTES", 0)
    strategy = pv.MirroredStrategy(2)
    with strategy.scope():
        module = pv.Module()
        module.ws = [pv.Variable(np.full(3, i, np.float32), name=f"w{i}") for i in range(9)]
    path = str(tmp_path / "first.h5")
    pv.Checkpoint(m=module).write(path)
    assert events == ["release", "index"]
    assert main(["verify", path]) == 0


def test_a_conversion_into_hdf5_writes_its_documents_in_pieces_and_fails_cleanly(
    tmp_path, monkeypatch
) -> None:
    """A conversion into HDF5 (entries streamed from another file) writes its metadata first
    and its documents last a few bytes at a time (``_write_documents``: never made whole),
    their checksums put into their headers after: the file is the one made in large pieces
    and verifies. A full disk while the documents go out leaves the last good file and no
    temporary."""
    import errno

    from safetensors.numpy import save_file

    from parallelvars.checkpoint.h5io.layout import COLUMNS_DATASET, INDEX_DATASET
    from parallelvars.cli import main
    from parallelvars.errors import CheckpointWriteError

    tensors = {f"l{i}/w%{i}": np.full(3, i, np.float32) for i in range(9)}
    tensors["s"] = np.arange(4, dtype=np.int64)
    src = str(tmp_path / "o.safetensors")
    save_file(tensors, src)
    whole = str(convert(src, str(tmp_path / "whole.h5")))
    from parallelvars.checkpoint.h5io import columns

    monkeypatch.setattr(native, "DOCUMENT_WRITE_BYTES", 5)
    monkeypatch.setattr(columns, "_RUN", 1)
    writes: list[int] = []
    real = native.pwrite_all

    def counted(fd: int, data: memoryview, offset: int) -> None:
        writes.append(len(data))
        real(fd, data, offset)

    monkeypatch.setattr(native, "pwrite_all", counted)
    pieces = str(convert(src, str(tmp_path / "pieces.h5")))
    with h5py.File(whole, "r") as a, h5py.File(pieces, "r") as b:
        for d in (INDEX_DATASET, COLUMNS_DATASET):
            assert bytes(a[d][()]) == bytes(b[d][()])
            assert a[d].attrs["crc32c"] == b[d].attrs["crc32c"] != 0
    assert len(writes) > 50  # (the documents: a record's text or a few bytes a write)
    assert main(["verify", pieces]) == 0
    with open(pieces, "rb") as fh:
        good = fh.read()

    def full_disk(*args: object) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(native, "_write_padded", full_disk)
    with pytest.raises((CheckpointWriteError, OSError)):
        convert(src, pieces)
    with open(pieces, "rb") as fh:
        assert fh.read() == good
    assert sorted(os.listdir(tmp_path)) == ["o.safetensors", "pieces.h5", "whole.h5"]
