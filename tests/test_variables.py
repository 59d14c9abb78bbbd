"""ParallelVariable semantics: the numpy face, in-place writes on every component, kinds."""

from __future__ import annotations

import contextlib
import copy
import pickle

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import parallelvars as pv
from parallelvars.errors import ShapeMismatchError


@pytest.fixture
def strategy() -> pv.MirroredStrategy:
    return pv.MirroredStrategy(4)


def mirrored(strategy: pv.MirroredStrategy, value, **kw) -> pv.ParallelVariable:
    with strategy.scope():
        return pv.Variable(value, **kw)


def assert_all_components(var: pv.ParallelVariable, expected) -> None:
    for i, c in enumerate(var.components):
        np.testing.assert_array_equal(c, expected, err_msg=f"component {i}")


def test_parallel_device() -> None:
    assert pv.ParallelDevice(3).components == ("cpu:0", "cpu:1", "cpu:2")
    assert len(pv.ParallelDevice(["CPU:0", "/device:GPU:1"])) == 2
    assert pv.ParallelDevice(["CPU:0", "/device:GPU:1"]).components == ("cpu:0", "gpu:1")
    with pytest.raises(ValueError, match="distinct"):
        pv.ParallelDevice(["cpu:0", "cpu:0"])
    with pytest.raises(ValueError, match="at least one"):
        pv.ParallelDevice(0)
    with pytest.raises(ValueError, match="invalid device"):
        pv.ParallelDevice(["nonsense"])


def test_single_outside_any_strategy() -> None:
    v = pv.Variable(np.arange(3.0), name="v")
    assert v.kind == "single" and v.num_components == 1 and v.devices == ("cpu:0",)
    assert v.dtype == np.float64
    assert pv.Variable(1.5).dtype == np.float32  # Python floats become float32


def test_numpy_face(strategy) -> None:
    w = mirrored(strategy, np.arange(6, dtype=np.float32).reshape(3, 2), name="w")
    assert w.shape == (3, 2) and w.dtype == np.float32 and w.ndim == 2 and w.size == 6
    arr = np.asarray(w)
    assert np.shares_memory(arr, w.components[0])  # zero-copy
    assert isinstance(w, np.ndarray)  # the proxy passes for its wrapped array
    np.testing.assert_array_equal(w + 1, np.arange(6).reshape(3, 2) + 1)
    np.testing.assert_array_equal(1 + w, np.arange(6).reshape(3, 2) + 1)
    np.testing.assert_array_equal(w[1:], [[2, 3], [4, 5]])
    np.testing.assert_array_equal(w @ np.ones(2, np.float32), [1, 5, 9])
    np.testing.assert_array_equal(w > 2, np.arange(6).reshape(3, 2) > 2)
    assert float(np.sum(w)) == 15.0  # __array_function__
    assert np.add(w, w).dtype == np.float32  # __array_ufunc__
    assert np.concatenate([w, w]).shape == (6, 2)
    assert type(np.add(w, 1)) is np.ndarray  # numpy never returns a proxy
    assert w.T.shape == (2, 3) and w.sum() == 15
    assert -w[0, 1] == -1 and abs(-w)[2, 1] == 5
    assert float(mirrored(strategy, 2.5)) == 2.5 and int(mirrored(strategy, 3)) == 3


@pytest.mark.parametrize(
    ("op", "expected"),
    [
        (lambda v: v.__iadd__(2), 3),
        (lambda v: v.__isub__(2), -1),
        (lambda v: v.__imul__(4), 4),
        (lambda v: v.__itruediv__(2), 0.5),
        (lambda v: v.__ifloordiv__(2), 0),
        (lambda v: v.__imod__(1), 0),
        (lambda v: v.__ipow__(3), 1),
    ],
)
def test_inplace_operators_reach_every_component(strategy, op, expected) -> None:
    v = mirrored(strategy, np.ones((2, 2), np.float32))
    result = op(v)
    assert result is v
    assert_all_components(v, np.full((2, 2), expected, np.float32))


def test_bitwise_inplace_on_every_component(strategy) -> None:
    v = mirrored(strategy, np.array([1, 2, 4], np.int32))
    v |= 8
    v <<= 1
    v &= 0b11110
    v ^= 2
    v >>= 1
    assert_all_components(v, (((np.array([1, 2, 4]) | 8) << 1) & 0b11110 ^ 2) >> 1)


def test_python_statement_forms(strategy) -> None:
    v = mirrored(strategy, np.zeros(3, np.float32))
    v += 1
    v *= 3
    v[0] = 10
    v[1:] -= 1
    v[...] += 1
    assert_all_components(v, [11, 3, 3])


def test_item_assignment_variants(strategy) -> None:
    v = mirrored(strategy, np.zeros((3, 4)))
    v[1] = 1
    v[:, 2] = 2
    v[v > 1.5] = 5  # boolean mask computed from the variable itself
    v[(0, 0)] = 7
    v[np.array([2]), 3] = 9
    expected = np.zeros((3, 4))
    expected[1] = 1
    expected[:, 2] = 5
    expected[0, 0] = 7
    expected[2, 3] = 9
    assert_all_components(v, expected)


def test_assign_methods_and_shape_check(strategy) -> None:
    v = mirrored(strategy, np.zeros((2, 3), np.float32), name="w")
    assert v.assign(np.ones((2, 3))) is v
    v.assign_add(np.arange(3, dtype=np.float32))  # broadcasts
    v.assign_sub(1)
    assert_all_components(v, np.tile(np.arange(3, dtype=np.float32), (2, 1)))
    with pytest.raises(ShapeMismatchError, match=r"'w'.*expected \(2, 3\), found \(3, 2\)"):
        v.assign(np.zeros((3, 2)))
    with pytest.raises(ShapeMismatchError):
        v += np.ones((4, 2, 3))  # would broadcast over the stack: refused


def test_ufunc_out_and_mutating_functions(strategy) -> None:
    v = mirrored(strategy, np.ones(4))
    np.multiply(v, 3, out=v)
    assert_all_components(v, [3, 3, 3, 3])
    np.copyto(v, [1, 2, 3, 4])
    assert_all_components(v, [1, 2, 3, 4])
    np.put(v, [0], [9])
    assert_all_components(v, [9, 2, 3, 4])
    v.fill(5)
    assert_all_components(v, [5, 5, 5, 5])
    v.assign([3, 1, 2, 0])
    v.sort()
    assert_all_components(v, [0, 1, 2, 3])
    with pytest.raises(TypeError):
        v.resize((8,))


def test_repr_names_kind_shape_dtype_devices(strategy) -> None:
    v = mirrored(strategy, np.zeros((3, 2), np.float32), name="w")
    text = repr(v)
    for part in (
        "ParallelVariable",
        "'w'",
        "kind=mirrored",
        "shape=(3, 2)",
        "dtype=float32",
        "cpu:3",
    ):
        assert part in text


def test_hash_identity_ref_copy_pickle(strategy) -> None:
    v = mirrored(strategy, np.arange(3.0))
    assert hash(v) == id(v)
    assert {v.ref(): 1}[v.ref()] == 1
    c = copy.deepcopy(v)
    assert type(c) is np.ndarray and c.tolist() == [0, 1, 2]
    assert pickle.loads(pickle.dumps(v)).tolist() == [0, 1, 2]


def test_attributes(strategy) -> None:
    v = mirrored(strategy, np.zeros(2), name="w")
    assert v.name == "w" and v.kind == "mirrored" and v.trainable
    assert v.synchronization is pv.Synchronization.ON_WRITE and v.aggregation is pv.Aggregation.NONE
    assert v.device == strategy.devices and len(v.components) == 4
    assert v.stacked.shape == (4, 2)
    assert all(np.shares_memory(c, v.stacked) for c in v.components)
    r = v.read_value()
    r += 1
    assert_all_components(v, [0, 0])  # read_value is a copy


@pytest.mark.parametrize(
    ("aggregation", "expected_read"),
    [("sum", 10), ("mean", 2.5), ("only_first_replica", 1)],
)
def test_on_read_aggregation(strategy, aggregation, expected_read) -> None:
    with strategy.scope():
        n = pv.Variable(0.0, synchronization=pv.Synchronization.ON_READ, aggregation=aggregation)
    assert n.kind == "on_read" and not n.trainable
    for i, c in enumerate(n.components):
        c[...] = i + 1
    assert n.read_value() == expected_read


def test_on_read_sum_cross_replica_writes_keep_exact_total(strategy) -> None:
    with strategy.scope():
        n = pv.Variable(np.int64(5), synchronization="on_read", aggregation="sum")
    # Every replica holds the initial value, as in TensorFlow: the total is 4 times it.
    assert n.read_value() == 20 and [int(c) for c in n.components] == [5] * 4
    n.assign_add(3)
    n += 2
    assert n.read_value() == 25
    # A cross-replica write of the total splits it over the replicas (TensorFlow divides by
    # their number); integers exactly, the remainder one unit at a time from the first.
    n.assign(7)
    assert n.read_value() == 7 and [int(c) for c in n.components] == [2, 2, 2, 1]
    n *= 3
    assert n.read_value() == 21 and [int(c) for c in n.components] == [6, 5, 5, 5]
    n.assign(-7)
    assert n.read_value() == -7 and [int(c) for c in n.components] == [-1, -2, -2, -2]
    with strategy.scope():
        f = pv.Variable(np.zeros(2, np.float32), synchronization="on_read", aggregation="sum")
    f.assign([6.0, 2.0])
    assert [c.tolist() for c in f.components] == [[1.5, 0.5]] * 4
    assert f.read_value().tolist() == [6.0, 2.0]


def _on_read_parts(strategy, aggregation, parts, dtype=np.int64) -> pv.ParallelVariable:
    with strategy.scope():
        v = pv.Variable(
            np.zeros(np.shape(parts[0]), dtype),
            name="metric",
            synchronization="on_read",
            aggregation=aggregation,
        )
    for c, p in zip(v.components, parts, strict=True):
        c[...] = p
    return v


@pytest.mark.parametrize(
    ("aggregation", "logical"), [("sum", 138), ("mean", 34), ("only_first_replica", 30)]
)
def test_on_read_reads_as_its_aggregate_in_cross_replica_context(
    strategy, aggregation, logical
) -> None:
    # The parts 30, 40, 50, 18: SUM 138, integer MEAN 34, ONLY_FIRST_REPLICA 30.
    v = _on_read_parts(strategy, aggregation, [30, 40, 50, 18])
    for ctx in (contextlib.nullcontext(), strategy.scope()):  # default and cross-replica contexts
        with ctx:
            assert int(v) == logical and float(v) == logical and v.__index__() == logical
            assert np.asarray(v).tolist() == logical and np.asarray(v).dtype == np.int64
            assert v.read_value().tolist() == logical and v.numpy().tolist() == logical
            assert f"value={logical}>" in repr(v) and str(v) == str(logical)
            assert f"{v:d}" == str(logical)
            assert (v + 1).tolist() == logical + 1 and (1 + v).tolist() == logical + 1
            assert (v * 2).tolist() == 2 * logical and (-v).tolist() == -logical
            assert bool(v == logical) and bool(v > logical - 1)
            assert np.add(v, 0).tolist() == logical and np.sum(v) == logical
            assert v.sum() == logical and v.item() == logical and v.tolist() == logical
            assert copy.copy(v).tolist() == logical and pickle.loads(pickle.dumps(v)) == logical
    # The raw parts stay the parts.
    assert [int(c) for c in v.components] == [30, 40, 50, 18]
    assert int(v.primary) == 30 and v.stacked.tolist() == [30, 40, 50, 18]
    assert v.shape == () and v.dtype == np.int64


@pytest.mark.parametrize("aggregation", ["sum", "mean", "only_first_replica"])
def test_on_read_reads_its_own_part_in_a_replica_function(strategy, aggregation) -> None:
    v = _on_read_parts(strategy, aggregation, [30, 40, 50, 18])

    got: list = [None] * 4

    def read():
        a = np.asarray(v)
        got[pv.get_replica_context().replica_id_in_sync_group] = (
            int(v),
            float(v),
            a.tolist(),
            np.shares_memory(a, v.components[pv.get_replica_context().replica_id_in_sync_group]),
            v.read_value().tolist(),
            (v + 1).tolist(),
            repr(v).rsplit("value=", 1)[1],
        )

    strategy.run(read)
    assert [g[0] for g in got] == [30, 40, 50, 18]
    assert [g[1] for g in got] == [30.0, 40.0, 50.0, 18.0]
    assert [g[2] for g in got] == [30, 40, 50, 18]
    assert all(g[3] for g in got)  # np.asarray is the replica's own buffer, not a copy
    assert [g[4] for g in got] == [30, 40, 50, 18]
    assert [g[5] for g in got] == [31, 41, 51, 19]
    assert [g[6] for g in got] == ["30>", "40>", "50>", "18>"]


def test_on_read_aggregate_is_a_copy_and_only_first_replica_shares_the_primary(strategy) -> None:
    total = _on_read_parts(strategy, "sum", [np.ones(3)] * 4, np.float32)
    a = np.asarray(total)
    assert a.tolist() == [4.0] * 3 and not np.shares_memory(a, total.stacked)
    a += 1  # a computed value: writing to it changes no part
    assert total.stacked.sum() == 12
    with pytest.raises(ValueError, match="aggregate"):
        np.asarray(total, copy=False)
    with pytest.raises(AttributeError):
        total.__array_interface__  # noqa: B018 - absent, so numpy uses __array__
    first = _on_read_parts(strategy, "only_first_replica", [np.arange(3)] * 4, np.float32)
    assert np.shares_memory(np.asarray(first), first.primary)
    assert np.asarray(first, copy=False).tolist() == [0.0, 1.0, 2.0]


def test_on_read_mean_of_floats_keeps_the_dtype(strategy) -> None:
    v = _on_read_parts(strategy, "mean", [1, 2, 3, 5], np.float16)
    assert np.asarray(v).dtype == np.float16 and float(v) == 2.75
    assert v.read_value().dtype == np.float16


@given(
    aggregation=st.sampled_from(["sum", "mean", "only_first_replica"]),
    parts=st.lists(st.integers(-(2**40), 2**40), min_size=1, max_size=6),
)
@settings(max_examples=40, deadline=None)
def test_on_read_reads_follow_the_aggregation(aggregation, parts) -> None:
    n = len(parts)
    strategy = pv.MirroredStrategy(n)
    v = _on_read_parts(strategy, aggregation, parts)
    expected = {
        "sum": sum(parts),
        "mean": sum(parts) // n,
        "only_first_replica": parts[0],
    }[aggregation]
    if n == 1:
        expected = parts[0]  # one replica: the variable is a plain one
    assert int(v) == expected and np.asarray(v).tolist() == expected
    assert v.read_value().tolist() == expected and (v - expected).tolist() == 0
    seen = [None] * n

    def read() -> None:
        seen[pv.get_replica_context().replica_id_in_sync_group] = int(v)

    strategy.run(read)
    assert seen == parts  # each replica its own part


def test_on_read_without_an_aggregation_has_parts_only(strategy) -> None:
    # TensorFlow makes it; it has no value in cross-replica context, only its parts.
    with strategy.scope():
        v = pv.Variable(0.0, name="parts", synchronization="on_read")
    assert v.kind == "on_read" and v.aggregation is pv.Aggregation.NONE and not v.trainable
    assert "parts" in repr(v) and "value=" not in repr(v)
    with pytest.raises(pv.errors.ContextError, match=r"'parts'.*aggregation NONE has no value"):
        float(v)
    seen = strategy.run(lambda: float(v.assign_add(1.0)))
    assert seen.values == (1.0,) * 4


def test_independent_buffers() -> None:
    with pv.independent_buffers(pv.ParallelDevice(3)):
        v = pv.Variable(np.zeros(2), name="ind")
    assert v.kind == "independent"
    for i, c in enumerate(v.components):
        c[...] = i
    v += 1
    assert [c.tolist() for c in v.components] == [[1, 1], [2, 2], [3, 3]]


def test_replicated_scope() -> None:
    with pv.replicated_scope(2):
        v = pv.Variable(np.ones(2))
    assert v.kind == "mirrored" and len(v.components) == 2


def test_sharded_uneven_split(strategy) -> None:
    with strategy.scope():
        e = pv.Variable(np.arange(40.0).reshape(10, 4), name="e", shard_axis=0)
    assert isinstance(e, pv.ShardedVariable) and e.kind == "sharded"
    assert [c.shape[0] for c in e.components] == [3, 3, 2, 2]
    assert e.shard_offsets == (0, 3, 6, 8)
    assert e.shape == (10, 4)
    np.testing.assert_array_equal(e.components[2], np.arange(24.0, 32.0).reshape(2, 4))
    e += 1
    np.testing.assert_array_equal(e.components[3][-1], [37, 38, 39, 40])
    e[0, 0] = -1
    assert e.components[0][0, 0] == -1


def test_sharded_other_axis(strategy) -> None:
    with strategy.scope():
        e = pv.Variable(np.arange(12).reshape(2, 6), shard_axis=1)
    assert [c.shape for c in e.components] == [(2, 2), (2, 2), (2, 1), (2, 1)]
    np.testing.assert_array_equal(np.concatenate(e.components, axis=1), np.arange(12).reshape(2, 6))


def test_scalar_components_are_views(strategy) -> None:
    s = mirrored(strategy, np.float32(1))
    assert all(isinstance(c, np.ndarray) and c.shape == () for c in s.components)
    s += 1
    assert_all_components(s, 2)


@pytest.mark.parametrize(
    "dtype", ["bfloat16", "float8_e4m3fn", "float16", "int8", "bool", "complex64"]
)
def test_dtypes(strategy, dtype) -> None:
    v = mirrored(strategy, np.ones(3), dtype=dtype)
    assert v.dtype == (
        np.dtype(getattr(ml_dtypes, dtype)) if hasattr(ml_dtypes, dtype) else np.dtype(dtype)
    )


def test_creator_scopes_nest() -> None:
    calls = []

    def creator(next_creator, **kwargs):
        calls.append(kwargs["name"])
        kwargs["name"] = "renamed"
        return next_creator(**kwargs)

    with pv.variable_creator_scope(creator):
        v = pv.Variable(1.0, name="orig")
    assert calls == ["orig"] and v.name == "renamed"


def test_nested_strategy_scopes() -> None:
    s1, s2 = pv.MirroredStrategy(2), pv.MirroredStrategy(3)
    with s1.scope():
        with s1.scope():  # re-entering is a no-op
            assert pv.get_strategy() is s1
        with (
            pytest.raises(pv.errors.ContextError, match=r"MirroredStrategy.*MirroredStrategy"),
            s2.scope(),
        ):
            pass
    assert not pv.has_strategy()


# ---------------------------------------------------------------------------- extension dtypes
EXTENSION_NAMES = sorted(pv._dtypes.EXTENSION_DTYPES)


def _kinds(dtype: np.dtype) -> list[pv.ParallelVariable]:
    value = np.arange(4).astype(dtype)
    single = pv.Variable(value)
    with pv.MirroredStrategy(2).scope():
        mirror = pv.Variable(value)
        sharded = pv.Variable(value, shard_axis=0)
        on_read = pv.Variable(value, synchronization="on_read", aggregation="only_first_replica")
    with pv.independent_buffers(2):
        independent = pv.Variable(value)
    return [single, mirror, sharded, on_read, independent]


@pytest.mark.parametrize("name", EXTENSION_NAMES)
def test_extension_dtypes_convert_with_their_dtype(name: str) -> None:
    dtype = pv._dtypes.EXTENSION_DTYPES[name]
    expected = np.arange(4).astype(dtype)
    for var in _kinds(dtype):
        for arr in (np.asarray(var), np.array(var), np.asanyarray(var), np.array(var, copy=True)):
            assert arr.dtype == dtype, (name, var.kind, arr.dtype)
            np.testing.assert_array_equal(arr.astype(np.float32), expected.astype(np.float32))
        assert not hasattr(var, "__array_interface__")
        assert not hasattr(var, "__array_struct__")
        with pytest.raises(TypeError):
            memoryview(var)  # never the raw bytes


def test_bfloat16_arithmetic_keeps_dtype() -> None:
    v = pv.Variable(np.array([1.0, 2.0], ml_dtypes.bfloat16))
    for result in (
        v + 1,
        np.add(v, 1),
        np.multiply(v, v),
        np.stack([v, v]),
        np.concatenate([v, v]),
    ):
        assert result.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(np.add(v, 1).astype(np.float32), [2.0, 3.0])


def test_asarray_shares_memory_for_ordinary_dtypes(strategy) -> None:
    w = pv.Variable(np.arange(3, dtype=np.float32))
    arr = np.asarray(w)
    assert arr.dtype == np.float32 and np.shares_memory(arr, w.primary)
    m = mirrored(strategy, np.ones(3, np.float32))
    assert np.shares_memory(np.asarray(m), m.primary)
    assert w.__array_interface__["typestr"] == "<f4"
    assert memoryview(np.asarray(w)).format == "f"


# ---------------------------------------------------------------------------- constructor errors
@pytest.mark.parametrize(
    "make, builtin",
    [
        (lambda: pv.MirroredStrategy(0), ValueError),
        (lambda: pv.MirroredStrategy(-1), ValueError),
        (lambda: pv.MirroredStrategy([]), ValueError),
        (lambda: pv.MirroredStrategy(["cpu:0", "cpu:0"]), ValueError),
        (lambda: pv.MirroredStrategy(["not a device"]), ValueError),
        (lambda: pv.ParallelDevice(0), ValueError),
        (lambda: pv.Variable(np.ones(3), shard_axis=5), ValueError),
        (lambda: pv.Variable(np.ones(3), shard_axis=-2), ValueError),
        (lambda: pv.Variable(1.0, shard_axis=0), ValueError),
        (lambda: pv.Variable(np.ones(3), shard_axis="0"), ValueError),
        (lambda: pv.Variable(np.ones(3), synchronization="sometimes"), ValueError),
        (lambda: pv.Variable(np.ones(3), aggregation="most"), ValueError),
        (lambda: pv.Variable(np.array(["text"])), TypeError),
        (lambda: pv.Variable(np.ones(3), dtype="float3"), TypeError),
        (lambda: pv.PerReplica([]), ValueError),
        (lambda: pv.Mirrored([]), ValueError),
        (lambda: pv.OneDeviceStrategy("not a device"), ValueError),
    ],
)
def test_constructor_errors_are_ours(make, builtin) -> None:
    with pytest.raises(pv.ParallelVarsError) as info:
        make()
    assert isinstance(info.value, builtin)


def test_constructor_errors_in_a_strategy_are_ours(strategy) -> None:
    with strategy.scope():
        with pytest.raises(pv.ParallelVarsError, match="shard_axis 5 out of range"):
            pv.Variable(np.ones(8), shard_axis=5)
        with pytest.raises(pv.ParallelVarsError, match="ON_READ"):
            pv.Variable(np.ones(8), synchronization="on_read", shard_axis=0, aggregation="sum")
        with pytest.raises(pv.ParallelVarsError, match="Aggregation: 'most'"):
            pv.Variable(np.ones(8), synchronization="on_read", aggregation="most")
