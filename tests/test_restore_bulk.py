"""The bulk restore (the index read as arrays, the common case read in a few large reads) against
the general path (one StoredVariable and one plan per variable): the same values, the same
errors, nothing written when anything is wrong; and crafted indexes refused by name."""

from __future__ import annotations

import contextlib
import json
import pathlib

import h5py
import ml_dtypes
import numpy as np
import pytest
from _columns_support import write_columns
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import parallelvars as pv
from parallelvars import errors
from parallelvars.checkpoint import matching as _matching
from parallelvars.checkpoint.h5io import H5Reader
from parallelvars.testing import restore_rules as _restore

KINDS = ("single", "mirrored", "on_read_sum", "on_read_mean", "independent")
DTYPES = ("float32", "float64", "int32", "int8", "bool", "float16", "bfloat16")


@pytest.fixture(autouse=True)
def _bulk_from_one_component(monkeypatch: pytest.MonkeyPatch) -> None:
    """These models are small: the bulk path takes them whatever their number of components
    (its minimum has a test of its own)."""
    monkeypatch.setattr(_restore, "DIRECT_MIN_COMPONENTS", 0)


def _general_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Restores take the general path for every variable (the bulk planner takes none)."""

    def none_taken(table, lives, paths):
        return None, list(range(len(lives)))

    monkeypatch.setattr(_matching, "plan_direct", none_taken)


def _scope(kind: str, devices: int) -> contextlib.AbstractContextManager[object]:
    if kind == "single" or (devices == 1 and kind != "independent"):
        return contextlib.nullcontext()
    if kind == "independent":
        return pv.independent_buffers(devices)
    return pv.MirroredStrategy(devices).scope()


def _variable(kind: str, devices: int, dtype: str, shape: tuple[int, ...], seed: int):
    rng = np.random.default_rng(seed)
    value = (rng.standard_normal(shape) * 50).astype(np.dtype(getattr(ml_dtypes, dtype, dtype)))
    options: dict[str, object] = {}
    if kind.startswith("on_read"):
        options = {"synchronization": "on_read", "aggregation": kind.split("_")[-1]}
    with _scope(kind, devices):
        var = pv.Variable(value, name=f"v{seed}", **options)
    for i, c in enumerate(var.components):  # every component its own values
        c[...] = (rng.standard_normal(shape) * 50 + i).astype(c.dtype)
    return var


def _model(specs: list[tuple[str, int, str, tuple[int, ...]]], seed: int) -> pv.Module:
    m = pv.Module()
    m.vars = [_variable(k, d, t, s, seed * 100 + i) for i, (k, d, t, s) in enumerate(specs)]
    return m


def _state(m: pv.Module) -> list[bytes]:
    return [c.tobytes() for v in m.vars for c in v.components]


def _outcome(path: pathlib.Path, m: pv.Module) -> tuple[object, list[bytes]]:
    """What a restore of ``path`` into ``m`` gives: the error (type and text) or None, and
    the values afterwards."""
    try:
        pv.Checkpoint(model=m).restore(path)
        result: object = None
    except pv.ParallelVarsError as exc:
        result = (type(exc), str(exc))
    return result, _state(m)


spec = st.tuples(
    st.sampled_from(KINDS),
    st.integers(1, 3),
    st.sampled_from(DTYPES),
    st.sampled_from([(), (1,), (5,), (3, 4), (2, 0), (300, 70)]),
)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    saved=st.lists(spec, min_size=1, max_size=5),
    change=st.sampled_from(["none", "devices", "dtype", "shape", "kind"]),
    which=st.integers(0, 4),
    corrupt=st.one_of(st.none(), st.integers(0, 10**9)),
)
def test_bulk_and_general_restores_agree(
    tmp_path_factory: pytest.TempPathFactory,
    monkeypatch: pytest.MonkeyPatch,
    saved: list[tuple[str, int, str, tuple[int, ...]]],
    change: str,
    which: int,
    corrupt: int | None,
) -> None:
    """Same values, same error (type and text), and nothing written on an error, whichever
    path restores: over kinds, dtypes, shapes, device counts, a live variable that differs
    from the saved one, and a damaged byte in any component's data."""
    d = tmp_path_factory.mktemp("agree")
    path = d / "ckpt.h5"
    pv.Checkpoint(model=_model(saved, seed=1)).write(path)
    live = list(saved)
    k = which % len(live)
    kind, devices, dtype, shape = live[k]
    if change == "devices":
        live[k] = (kind, devices % 3 + 1, dtype, shape)
    elif change == "dtype":
        live[k] = (kind, devices, "float32" if dtype != "float32" else "float64", shape)
    elif change == "shape":
        live[k] = (kind, devices, dtype, (*shape, 2))
    elif change == "kind":
        live[k] = (KINDS[(KINDS.index(kind) + 1) % len(KINDS)], devices, dtype, shape)
    if corrupt is not None:
        with H5Reader(path) as reader:
            places = [
                (var._location(i)[0], var.component_nbytes(i))
                for var in reader.values()
                for i in range(var.num_components)
                if var.component_nbytes(i) and var._location(i) is not None
            ]
        offset, nbytes = places[corrupt % len(places)]
        with open(path, "r+b") as f:
            f.seek(offset + corrupt % nbytes)
            byte = f.read(1)
            f.seek(offset + corrupt % nbytes)
            f.write(bytes([byte[0] ^ 0x5A]))
    bulk_model, general_model = _model(live, seed=2), _model(live, seed=2)
    before = _state(bulk_model)
    bulk = _outcome(path, bulk_model)
    with monkeypatch.context() as patch:
        _general_only(patch)
        general = _outcome(path, general_model)
    assert bulk == general
    if bulk[0] is not None:
        assert bulk[1] == before  # all or nothing
    if corrupt is not None and change == "none":  # (else another refusal may come first)
        assert bulk[0] is not None and issubclass(bulk[0][0], errors.ChecksumMismatchError)


def test_the_common_case_is_read_in_bulk(tmp_path: pathlib.Path, monkeypatch) -> None:
    """Variables of the same layout as the file's are restored by the bulk path, without a
    StoredVariable or a plan of their own (bfloat16 too, which the buffer protocol cannot
    export); the values are the saved ones."""
    specs = [
        ("mirrored", 2, "float32", (4, 3)),
        ("single", 1, "int64", ()),
        ("on_read_sum", 3, "float64", (7,)),
        ("mirrored", 2, "bfloat16", (5,)),
        ("single", 1, "bfloat16", ()),
    ]
    src = _model(specs, seed=3)
    path = pv.Checkpoint(model=src).write(tmp_path / "c.h5")
    dst = _model(specs, seed=4)
    made = []
    real = _matching.plan_direct

    def spy(table, lives, paths):
        direct, rest = real(table, lives, paths)
        made.append((direct, rest))
        return direct, rest

    monkeypatch.setattr(_matching, "plan_direct", spy)
    pv.Checkpoint(model=dst).restore(path).assert_consumed()
    assert _state(dst) == _state(src)
    ((direct, rest),) = made
    assert direct is not None and len(direct.taken) == 6  # the five and save_counter
    assert rest == []


def test_fewer_components_than_the_minimum_go_the_general_way(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Below ``DIRECT_MIN_COMPONENTS`` components the bulk path takes nothing (a few reads in
    bulk, serial, would only delay the general path's threads); at the minimum it takes all."""
    specs = [("mirrored", 2, "float32", (4,)), ("single", 1, "float64", (3,))]
    src = _model(specs, seed=5)
    path = pv.Checkpoint(model=src).write(tmp_path / "c.h5")
    real = _matching.plan_direct
    made = []

    def spy(table, lives, paths):
        direct, rest = real(table, lives, paths)
        made.append((direct, rest))
        return direct, rest

    monkeypatch.setattr(_matching, "plan_direct", spy)
    components = 2 + 1 + 1  # and save_counter's
    for minimum, bulk in ((components + 1, False), (components, True)):
        monkeypatch.setattr(_restore, "DIRECT_MIN_COMPONENTS", minimum)
        dst = _model(specs, seed=6)
        pv.Checkpoint(model=dst).restore(path).assert_consumed()
        assert _state(dst) == _state(src)
        direct, rest = made.pop()
        assert (direct is not None) == bulk
        assert rest == ([] if bulk else [0, 1, 2])  # the two variables and save_counter


def test_sharded_and_byte_string_variables_go_the_general_way(tmp_path, monkeypatch) -> None:
    """A file with a sharded and a byte-string variable is still opened in bulk: those two are
    planned one by one (their StoredVariables made at open), the others read in bulk."""

    def build(seed: int) -> pv.Module:
        m = _model([("mirrored", 2, "float32", (6,))], seed=seed)
        with pv.MirroredStrategy(2).scope():
            m.table = pv.Variable(
                np.arange(12.0, dtype=np.float32).reshape(6, 2) + seed, shard_axis=0
            )
        m.words = pv.Variable(np.array([b"a%d" % seed, b"bc"], dtype=object))
        return m

    src, dst = build(1), build(2)
    path = pv.Checkpoint(model=src).write(tmp_path / "c.h5")
    with H5Reader(path) as reader:
        assert reader.table is not None
        general = {
            p
            for p, direct in zip(reader.table.names, reader.table.direct, strict=True)
            if not direct
        }
        assert general == {"model/table", "model/words"}
    taken = []
    real = _matching.plan_direct

    def spy(table, lives, paths):
        direct, rest = real(table, lives, paths)
        taken.append(sorted(paths[k] for k in rest))
        return direct, rest

    monkeypatch.setattr(_matching, "plan_direct", spy)
    pv.Checkpoint(model=dst).restore(path).assert_consumed()
    assert taken == [["model/table", "model/words"]]
    assert _state(dst) == _state(src)
    assert np.array_equal(dst.table.numpy(), src.table.numpy())
    assert list(dst.words.numpy()) == list(src.words.numpy())


def _rewrite_index(path: pathlib.Path, edit) -> None:
    with h5py.File(path, "r+") as f:
        index = json.loads(f["_parallelvars/index"][()])
        edit(index)
        del f["_parallelvars/index"]
        f.create_dataset("_parallelvars/index", data=json.dumps(index), dtype=h5py.string_dtype())
    write_columns(str(path))  # the same edit in the columns, which a reader takes first


@pytest.fixture
def small_file(tmp_path: pathlib.Path) -> tuple[pv.Module, pathlib.Path]:
    specs = [("single", 1, "float32", (16,)), ("mirrored", 2, "float32", (8,))]
    path = pv.Checkpoint(model=_model(specs, seed=5)).write(tmp_path / "c.h5")
    return _model(specs, seed=5), pathlib.Path(path)


def _refused(path: pathlib.Path, m: pv.Module, error: type[Exception]) -> pv.ParallelVarsError:
    before = _state(m)
    with pytest.raises(error) as info:
        pv.Checkpoint(model=m).restore(path)
    assert _state(m) == before
    assert info.value.file == str(path)
    return info.value


def test_an_offset_past_the_end_of_the_file_is_refused(small_file) -> None:
    m, path = small_file

    def edit(index):
        index["model/vars/1"]["offsets"][1] = 10**9

    _rewrite_index(path, edit)
    exc = _refused(path, m, errors.TruncatedFileError)
    assert exc.variable == "model/vars/1/parallel_component_1"
    assert exc.expected == f"{10**9 + 32} bytes"
    assert exc.found == f"{path.stat().st_size} bytes"


def test_a_size_past_every_file_is_refused(small_file) -> None:
    """Dimensions whose product overflows 64 bits: the general path names the variable."""
    m, path = small_file

    def edit(index):
        index["model/vars/0"]["shape"] = [2**40, 2**40]

    _rewrite_index(path, edit)
    exc = _refused(path, m, errors.ShapeMismatchError)
    assert exc.variable == "model/vars/0"
    assert exc.expected == (16,) and exc.found == (2**40, 2**40)
    with H5Reader(path) as reader, pytest.raises(errors.TruncatedFileError) as info:
        reader["model/vars/0"].verify(0)
    assert info.value.variable == "model/vars/0/primary"
    assert info.value.expected is not None and info.value.found is not None


def test_a_wrong_dtype_string_is_refused(small_file) -> None:
    m, path = small_file

    def edit(index):
        index["model/vars/1"]["dtype"] = "float33"

    _rewrite_index(path, edit)
    exc = _refused(path, m, errors.UnsupportedDtypeError)
    assert exc.variable == "model/vars/1"
    assert exc.found == "float33" and exc.expected is not None


def test_overlapping_offsets_are_checked_where_hdf5_places_the_data(small_file) -> None:
    """Offsets that overlap are stale or crafted: each component is then verified where the
    index says and, failing that, where HDF5 places it; damage there too is refused."""
    m, path = small_file
    src = _model([("single", 1, "float32", (16,)), ("mirrored", 2, "float32", (8,))], seed=5)

    def overlap(index):
        first = index["model/vars/0"]["offsets"][0]
        index["model/vars/1"]["offsets"] = [first, first + 4]

    _rewrite_index(path, overlap)
    with H5Reader(path) as reader:
        assert reader.table is None  # the general path reads this file
        real = reader["model/vars/1"]._location_from_h5(0)
    pv.Checkpoint(model=m).restore(path).assert_consumed()
    assert _state(m) == _state(src)
    with open(path, "r+b") as f:  # damage where HDF5 places it too: refused
        assert real is not None
        f.seek(real[0])
        f.write(b"\xff\xff\xff\xff")
    dst = _model([("single", 1, "float32", (16,)), ("mirrored", 2, "float32", (8,))], seed=6)
    exc = _refused(path, dst, errors.ChecksumMismatchError)
    assert exc.variable == "model/vars/1/primary"
    assert exc.expected is not None and exc.found is not None


def test_a_reader_is_freed_without_the_cyclic_collector(small_file) -> None:
    """A closed reader holds no StoredVariable (each refers back to it): the index goes with
    the reader at once, not at the next collection."""
    import gc
    import weakref

    _, path = small_file
    reader = H5Reader(path)
    reader["model/vars/0"].verify(0)
    ref = weakref.ref(reader)
    reader.close()
    gc.disable()
    try:
        del reader
        assert ref() is None
    finally:
        gc.enable()
