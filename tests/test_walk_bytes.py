"""A save's walk of the object graph and its records, made together per container and per
optimizer (``graph.build_object_graph``, ``Saveable.gather_all``), write the very bytes the walk
object by object writes: the same graph document, paths, slot names, records and attributes,
over every kind (single, mirrored, on-read, independent, sharded), optimizer slots, nested
lists, dicts and tuples, variables reachable twice, names that need escaping.

``sweep_models`` and ``written_digests`` also compare the files two source trees write."""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np
import pytest

import parallelvars as pv
from parallelvars.checkpoint import graph as graph_module
from parallelvars.checkpoint import registry
from parallelvars.checkpoint.h5io.records import PlanCache

CREATED = 1_700_000_000.25


def _values(rng: np.random.Generator, k: int) -> np.ndarray:
    dtypes = [np.float32, np.float64, np.int32, np.int8, np.bool_, ml_dtypes.bfloat16]
    shapes = [(3,), (2, 3), (), (0, 2), (5,)]
    dtype, shape = dtypes[k % len(dtypes)], shapes[k % len(shapes)]
    return (rng.standard_normal(shape) * 4).astype(dtype)


def _train(strategy: Any, opt: Any, variables: list[Any], size_of: Callable[[Any], Any]) -> None:
    grads = pv.PerReplica(
        [[np.ones(size_of(v), v.dtype) for v in variables]] * strategy.num_replicas_in_sync
    )
    strategy.run(lambda g: opt.apply_gradients(zip(g, variables, strict=True)), args=(grads,))


def build_model(count: int, seed: int, devices: int = 2) -> pv.Checkpoint:
    """A checkpoint of ``count`` variables per container: lists, dicts, tuples and modules
    nested, every kind, names with ``.``, ``/`` and non-ASCII text, a variable reachable
    twice, two optimizers' slots (one of a variable reached through two paths)."""
    rng = np.random.default_rng(seed)
    strategy = pv.MirroredStrategy(devices)
    with strategy.scope():
        model = pv.Module()
        model.layers = []
        for k in range(3):
            layer = pv.Module()
            for j in range(count):
                v = rng.standard_normal((2, 3)).astype(np.float32)
                setattr(layer, f"w{j}", pv.Variable(v, name=f"layer{k}/w{j}"))
            model.layers.append(layer)
        model.flat = [pv.Variable(_values(rng, i), name=f"v{i}") for i in range(count)]
        model.table = {
            "a.b": pv.Variable(np.float32(1), name="dot"),
            "c/d": pv.Variable(np.arange(4, dtype=np.int64), name="slash"),
            "é": pv.Variable(np.ones(2, np.float16), name="ünï"),
            "nested": [
                pv.Variable(np.zeros(3, np.float32), name="n0"),
                (pv.Variable(np.ones(3, np.float32), name="n1"), 7),
                {"deep": pv.Variable(np.full(2, 3, np.int16), name="n2")},
            ],
        }
        model.escaped = {  # (only variables: added together, their names escaped)
            name: pv.Variable(np.full(2, k, np.float32), name=f"esc{k}")
            for k, name in enumerate(["x.y", "p/q", "r..s", "./", "plain"])
        }
        model.mixed = [pv.Variable(np.float64(k), name=f"m{k}") for k in range(count)] + [
            pv.Module(),
            "not a variable",
        ]
        model.shared = model.flat[0]  # reachable twice: saved at its first path
        model.also = [model.layers[1].w0, model.flat[1]]
        model.emb = pv.Variable(
            np.arange(40, dtype=np.float32).reshape(10, 4) + seed, name="e", shard_axis=0
        )
        model.shards = [
            pv.Variable(np.arange(6 * (k + 1), dtype=np.float32).reshape(-1, 2), shard_axis=0)
            for k in range(count)
        ]
        model.count = pv.Variable(
            np.int64(0), name="count", synchronization="on_read", aggregation="sum"
        )
        model.reads = [
            pv.Variable(np.float64(k), synchronization="on_read", aggregation=agg)
            for k, agg in enumerate(["sum", "mean", "only_first_replica"] * count)
        ]
        adam = pv.optimizers.Adam(1e-3)
        momentum = pv.optimizers.Momentum(0.1, 0.9)
    with pv.independent_buffers(devices):
        model.independent = [pv.Variable(np.full(3, k, np.float32)) for k in range(count)]
    model.single = pv.Variable(np.float64(2.5), name="single")
    model.bytes = pv.Variable(np.array([b"a", b"bb", b""], object), name="bytes")
    trained = [layer.w0 for layer in model.layers] + list(model.flat[:2]) + [model.emb]
    trained += [getattr(model.layers[0], f"w{j}") for j in range(1, count)]
    _train(strategy, adam, trained, lambda v: v.shape)
    _train(strategy, momentum, [model.layers[2].w1, model.flat[0]], lambda v: v.shape)
    return pv.Checkpoint(model=model, opt=adam, momentum=momentum, extra=[model.flat[-1]])


def sweep_models(count: int) -> dict[str, pv.Checkpoint]:
    """The sweep: the model above at ``count`` variables a container on 1, 2 and 3 devices,
    and one with no optimizer state (a checkpoint of one list)."""
    out = {f"d{d}-n{count}": build_model(count, seed=d, devices=d) for d in (1, 2, 3)}
    with pv.MirroredStrategy(2).scope():
        out[f"list-n{count}"] = pv.Checkpoint(
            vs=[pv.Variable(np.full(2, k, np.float32), name=f"x{k}") for k in range(count)]
        )
    return out


def written_digests(folder: str, models: dict[str, pv.Checkpoint]) -> dict[str, str]:
    """``name -> sha256`` of each model's save as a first save (nothing kept of an earlier
    one; ``time.time`` fixed by the caller)."""
    out = {}
    for name, ckpt in models.items():
        ckpt._pv_save_memo = None
        ckpt._pv_live_graph = None
        ckpt._pv_plans = PlanCache()
        path = os.path.join(folder, name + ".h5")
        ckpt.write(path)
        with open(path, "rb") as fh:
            out[name] = hashlib.sha256(fh.read()).hexdigest()
    return out


@pytest.fixture
def fixed_clock(monkeypatch):
    monkeypatch.setattr(time, "time", lambda: CREATED)


def _both_ways(tmp_path: Any, monkeypatch: Any, count: int) -> tuple[dict, dict]:
    models = sweep_models(count)
    (tmp_path / "bulk").mkdir()
    (tmp_path / "each").mkdir()
    bulk = written_digests(str(tmp_path / "bulk"), models)
    with monkeypatch.context() as m:
        _object_by_object(m)
        each = written_digests(str(tmp_path / "each"), models)
    return bulk, each


def _object_by_object(m: pytest.MonkeyPatch) -> None:
    """The walk and the gather object by object, as before they were made in bulk."""
    m.setattr(graph_module, "_new_leaves", lambda *args: None)
    for saveable in {type(s) for s in registry._registry.values()}:
        m.setattr(saveable, "gather_all", lambda self, objs: [self.gather(o) for o in objs])


@pytest.mark.parametrize("count", [2, 5])
def test_bulk_walk_writes_the_same_bytes(tmp_path, monkeypatch, fixed_clock, count):
    bulk, each = _both_ways(tmp_path, monkeypatch, count)
    assert bulk == each
    for name in bulk:  # (and the files are not trivially equal: their graphs differ)
        assert (tmp_path / "bulk" / f"{name}.h5").stat().st_size > 0


@pytest.mark.slow
@pytest.mark.parametrize("count", [40, 300])
def test_bulk_walk_writes_the_same_bytes_large(tmp_path, monkeypatch, fixed_clock, count):
    bulk, each = _both_ways(tmp_path, monkeypatch, count)
    assert bulk == each


@pytest.mark.parametrize("self_dict", [True, False])
def test_bulk_walk_same_graph_and_records(monkeypatch, self_dict):
    """The graph document and every record's fields and attributes, compared as objects (a
    byte comparison could hide a difference both writers normalise)."""
    if not self_dict:  # (a wrapt without the proxy's dict: its state read name by name)
        where = "parallelvars.checkpoint._restore._SELF_DICT"  # (the saveable's module)
        monkeypatch.setattr(where, "__no_such_attribute__")
    ckpt = build_model(4, seed=1)
    bulk_graph, bulk_records = _graph_and_records(ckpt)
    with monkeypatch.context() as m:
        _object_by_object(m)
        each_graph, each_records = _graph_and_records(ckpt)
    assert bulk_graph == each_graph
    assert len(bulk_records) == len(each_records)
    for a, b in zip(bulk_records, each_records, strict=True):
        assert type(a) is type(b)
        assert vars(a).keys() == vars(b).keys()
        assert (a.path, a.kind, a.shape, a.dtype, a.num_components) == (
            b.path,
            b.kind,
            b.shape,
            b.dtype,
            b.num_components,
        )
        assert list(a.attrs.items()) == list(b.attrs.items())  # (in order: bytes follow it)
        assert [type(v) for v in a.attrs.values()] == [type(v) for v in b.attrs.values()]
        assert all(x is y for x, y in zip(a.components, b.components, strict=True))
    paths = [r.path for r in bulk_records]
    assert "model/table/a..b" in paths and "model/table/c.Sd" in paths
    assert {"model/escaped/x..y", "model/escaped/p.Sq", "model/escaped/r....s"} <= set(paths)
    assert "model/escaped/...S" in paths
    assert any("/slots/" in p and p.endswith("/m") for p in paths)
    assert any(p.endswith("/momentum") for p in paths)
    kinds = {r.kind for r in bulk_records}
    assert kinds == {"single", "mirrored", "on_read", "independent", "sharded"}


def _graph_and_records(ckpt: pv.Checkpoint) -> tuple[Any, list[Any]]:
    ckpt._pv_save_memo = None
    ckpt._pv_live_graph = None
    records, graph, _ = ckpt._gather(False)
    return graph, list(records)


def test_bulk_walk_takes_the_bulk_path():
    """The bulk path is the one a save takes for a container of variables and an optimizer's
    slots (else the comparisons above compare the slow path with itself)."""
    calls = []
    real = graph_module._add_leaves

    def spy(graph: Any, values: Any, paths: Any, saveables: Any) -> Any:
        calls.append(len(values))
        return real(graph, values, paths, saveables)

    ckpt = build_model(3, seed=0)
    try:
        graph_module._add_leaves = spy
        graph_module.build_object_graph(ckpt)
    finally:
        graph_module._add_leaves = real
    assert len(calls) >= 5 and max(calls) >= 6


def test_a_variable_reachable_twice_in_one_container_keeps_its_first_path():
    with pv.MirroredStrategy(2).scope():
        a = pv.Variable(np.zeros(2, np.float32), name="a")
        b = pv.Variable(np.ones(2, np.float32), name="b")
    graph = graph_module.build_object_graph(pv.Checkpoint(vs=[a, b, a]))
    assert [p for _, _, p in graph.variables()] == ["save_counter", "vs/0", "vs/1"]
    assert graph.nodes[0]["children"] == [["vs", 1], ["save_counter", 2]]
    assert graph.nodes[1]["children"] == [["0", 3], ["1", 4], ["2", 3]]


def test_a_non_ascii_invalid_name_is_refused_in_a_container_of_variables():
    with pv.MirroredStrategy(2).scope():
        vs = {"ok": pv.Variable(np.zeros(2)), "bad\ud800": pv.Variable(np.ones(2))}
    with pytest.raises(pv.errors.InvalidEntryError, match="not valid Unicode"):
        graph_module.build_object_graph(pv.Checkpoint(vs=vs))


class _Box:
    """A value of a type of its own, saved by a saveable registered in the test."""

    def __init__(self, value: float) -> None:
        self.value = np.array([value], np.float64)


class _BoxSaveable(registry.Saveable):
    def gather(self, obj: _Box) -> registry.SaveRecord:
        return registry.SaveRecord(kind="single", components=[obj.value], shape=(1,))

    def plan_restore(self, obj: Any, stored: Any, **kwargs: Any) -> Any:
        raise NotImplementedError


def test_runs_of_two_saveables_keep_node_order(monkeypatch):
    registry.register_saveable(_Box, _BoxSaveable())
    try:
        with pv.MirroredStrategy(2).scope():
            mixed = [pv.Variable(np.full(2, k, np.float32)) for k in range(3)]
        mixed[1:1] = [_Box(1.0), _Box(2.0)]
        ckpt = pv.Checkpoint(mixed=mixed, box=_Box(3.0), tail=mixed[0])
        bulk_graph, bulk = _graph_and_records(ckpt)
        with monkeypatch.context() as m:
            _object_by_object(m)
            each_graph, each = _graph_and_records(ckpt)
    finally:
        registry.unregister_saveable(_Box)
    assert bulk_graph == each_graph
    assert [(r.path, r.kind, r.attrs) for r in bulk] == [(r.path, r.kind, r.attrs) for r in each]
    # (``tail`` is found first, at the root; the list's item 0 refers to it)
    assert [r.path for r in bulk] == [
        "box",
        "tail",
        "save_counter",
        *(f"mixed/{k}" for k in range(1, 5)),
    ]


def _three_mirrored() -> list[Any]:
    with pv.MirroredStrategy(2).scope():
        return [pv.Variable(np.ones(3, np.float32), name=f"v{i}") for i in range(3)]


def test_a_saveable_overriding_gather_is_gathered_by_it(tmp_path):
    """A subclass of the built-in saveable that overrides ``gather`` gets its records from it,
    in bulk (``gather_all``) as one by one, and a checkpoint's save calls it."""
    from parallelvars.testing import restore_rules

    calls: list[str] = []

    class Frozen(restore_rules.ParallelVariableSaveable):
        def gather(self, obj: Any) -> Any:
            calls.append(obj.name)
            record = super().gather(obj)
            record.attrs["trainable"] = False
            return record

    vs = _three_mirrored()
    records = Frozen().gather_all(vs)
    assert calls == ["v0", "v1", "v2"]
    assert [r.attrs["trainable"] for r in records] == [False] * 3
    cls = type(vs[0])
    before = registry.type_saveable(cls)
    assert before is not None
    calls.clear()
    pv.register_saveable(cls, Frozen(), override=True)
    try:
        pv.Checkpoint(vs=vs).write(str(tmp_path / "frozen.h5"))
    finally:
        pv.register_saveable(cls, before, override=True)
    assert {"v0", "v1", "v2"} <= set(calls)


def test_a_variable_missing_its_state_fails_in_bulk_as_alone():
    """A variable whose proxy lost a piece of the state its properties read: the bulk gather
    raises what ``gather`` raises for it (not a bare ``KeyError`` of the state's name)."""
    from parallelvars.testing import restore_rules

    vs = _three_mirrored()
    del object.__getattribute__(vs[1], "__self_dict__")["_self_trainable"]
    saveable = restore_rules.ParallelVariableSaveable()
    with pytest.raises(AttributeError, match="trainable") as alone:
        saveable.gather(vs[1])
    with pytest.raises(AttributeError, match="trainable") as bulk:
        saveable.gather_all(vs)
    assert str(bulk.value) == str(alone.value)


def test_made_records_are_the_constructors_even_without_components():
    """``SaveRecord.made`` (the bulk gather's records) makes what the constructor makes, the
    dtype of a record without components included."""
    from parallelvars.checkpoint.registry import SaveRecord

    columns = (
        ["mirrored", "single"],
        [[np.ones(2, np.float16), np.ones(2, np.float16)], []],
        [(2,), (0,)],
        [{"name": "a"}, {"name": "b"}],
    )
    made = SaveRecord.made(*columns)
    built = [
        SaveRecord(kind=k, components=c, shape=s, attrs=a)
        for k, c, s, a in zip(*columns, strict=True)
    ]
    for m, b in zip(made, built, strict=True):
        assert (m.kind, m.shape, m.attrs, m.path, m.dtype, m.num_components) == (
            b.kind,
            b.shape,
            b.attrs,
            b.path,
            b.dtype,
            b.num_components,
        )
        assert m.components is b.components


def test_the_walk_and_records_of_a_first_save_share_what_recurs():
    """What a first save's walk and records keep for the save's life (and for the next saves
    of the structure), over 2,000 mirrored variables with Adam slots (6,000 records): a leaf's
    graph node shares its container's one empty list for its children and slots, the walk's
    map of objects is emptied once it is done, the records of one device share its list of
    names and those of one shape its tuple (checked by identity, not by a byte count, which
    varies with the Python version)."""
    strategy = pv.MirroredStrategy(2)
    with strategy.scope():
        model = pv.Module()
        model.vars = [pv.Variable(np.zeros(4, np.float32), name=f"v{i}") for i in range(2000)]
        opt = pv.optimizers.Adam(1e-3)
    grads = pv.PerReplica([[np.ones(4, np.float32) for _ in model.vars]] * 2)
    variables = list(model.vars)
    strategy.run(lambda g: opt.apply_gradients(zip(g, variables, strict=True)), args=(grads,))
    ckpt = pv.Checkpoint(model=model, opt=opt)
    graph = graph_module.build_object_graph(ckpt)
    _, records, _ = ckpt._gather_new(graph)
    assert len(records) >= 6000
    assert graph.ids == {}
    leaves = [n for n in graph.nodes if "children" in n and not n["children"] and not n["slots"]]
    assert len(leaves) >= 6000
    # (one empty list per container of leaves: the model's list, the optimizer's slots)
    lists = {id(n["children"]) for n in leaves} | {id(n["slots"]) for n in leaves}
    assert len(lists) <= 8, len(lists)
    mirrored = [r for r in records if r.shape == (4,)]
    assert len(mirrored) >= 6000
    assert len({id(r.attrs["devices"]) for r in mirrored}) == 1
    assert len({id(r.shape) for r in mirrored}) == 1
