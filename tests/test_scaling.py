"""Per-variable costs are linear: operation counts at N and 4N variables, never timings.

Each check runs the same operation on N and on 4N variables and counts the Python lines it
executes (``sys.settrace``, in every thread the operation starts). A linear operation executes
about 4x the lines at 4N (fixed costs make it less); a term that scans a list per variable
(``next(r for r in records if ...)``, ``list.pop(0)``, ``i not in set(...)`` rebuilt per item)
makes it 16x at these sizes. The sizes are chosen so that such a term would dominate.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

import parallelvars as pv
from parallelvars.checkpoint.graph import build_object_graph
from parallelvars.cli import main as cli_main
from parallelvars.formats import ArrayEntry, write_checkpoint

N = 150
GROWTH = 4.6  # the most lines 4N may cost over N (4.0 is linear; a quadratic term gives ~16)


class _LineCounter:
    """Counts executed Python lines in this thread and in threads started while it is active."""

    def __init__(self) -> None:
        self.lines = 0
        self.active = False
        self._lock = threading.Lock()

    def _trace(self, frame: Any, event: str, arg: Any) -> Any:
        if not self.active:
            return None
        if event == "line":
            self.lines += 1  # a lost increment between threads is noise far below the margin
        return self._trace

    @contextlib.contextmanager
    def watching_new_threads(self) -> Iterator[None]:
        """Threads started inside (a strategy's replica pool) can be counted later."""
        threading.settrace(self._trace)
        try:
            yield
        finally:
            threading.settrace(None)  # type: ignore[arg-type]

    def count(self, fn: Callable[[], Any]) -> int:
        self.lines = 0
        self.active = True
        threading.settrace(self._trace)
        sys.settrace(self._trace)
        try:
            fn()
        finally:
            sys.settrace(None)
            threading.settrace(None)  # type: ignore[arg-type]
            self.active = False
        return self.lines


_COUNTER = _LineCounter()
lines = _COUNTER.count


def assert_linear(make: Callable[[int], Callable[[], Any]], n: int = N) -> tuple[int, int]:
    """``make(k)`` prepares an operation over k variables (untraced) and returns it."""
    small, large = make(n), make(4 * n)
    a, b = lines(small), lines(large)
    assert b <= GROWTH * a, (
        f"{b} lines at {4 * n} against {a} at {n}: {b / a:.1f}x for 4x the variables"
    )
    return a, b


def test_the_line_counter_sees_a_quadratic_term():
    def make(k: int) -> Callable[[], Any]:
        records = list(range(k))
        return lambda: [next(r for r in records if r == i) for i in range(k)]

    with pytest.raises(AssertionError, match="for 4x the variables"):
        assert_linear(make)


# ---------------------------------------------------------------------------------------------
# A model of k variables on 2 replicas, trained one step with Adam (so it has 2k slots)


def _model(k: int) -> tuple[pv.MirroredStrategy, pv.Module, Any, list[np.ndarray]]:
    strategy = pv.MirroredStrategy(2)
    with strategy.scope():
        model = pv.Module()
        model.layers = []
        for i in range(k):
            layer = pv.Module()
            layer.kernel = pv.Variable(np.full(3, i, np.float32), name=f"kernel{i}")
            model.layers.append(layer)
        opt = pv.optimizers.Adam(1e-3)
    grads = [np.ones(3, np.float32) for _ in range(k)]
    return strategy, model, opt, grads


def _trained(k: int) -> tuple[pv.MirroredStrategy, pv.Module, Any, list[np.ndarray]]:
    strategy, model, opt, grads = _model(k)
    variables = model.variables
    strategy.run(lambda: opt.apply_gradients(zip(grads, variables, strict=True)))
    return strategy, model, opt, grads


@pytest.mark.slow  # saves and restores at several sizes; CI runs it (.ci/run, -m slow)
def test_save_with_optimizer_slots_is_linear(tmp_path):
    def make(k: int) -> Callable[[], Any]:
        _, model, opt, _ = _trained(k)
        ckpt = pv.Checkpoint(model=model, opt=opt)
        path = str(tmp_path / f"save{k}.h5")
        return lambda: ckpt.write(path)

    assert_linear(make)


@pytest.mark.slow  # saves and restores at several sizes; CI runs it (.ci/run, -m slow)
def test_restore_is_linear(tmp_path):
    def make(k: int) -> Callable[[], Any]:
        _, model, opt, _ = _trained(k)
        ckpt = pv.Checkpoint(model=model, opt=opt)
        path = ckpt.write(str(tmp_path / f"restore{k}.h5"))
        return lambda: ckpt.restore(path).assert_consumed()

    assert_linear(make)


@pytest.mark.slow  # saves and restores at several sizes; CI runs it (.ci/run, -m slow)
def test_deferred_restore_as_layers_are_appended_is_linear(tmp_path):
    def make(k: int) -> Callable[[], Any]:
        _, model, _, _ = _model(k)
        path = pv.Checkpoint(model=model).write(str(tmp_path / f"deferred{k}.h5"))
        values = [np.full(3, i, np.float32) for i in range(k)]

        def restore_then_build() -> None:
            fresh = pv.Module()
            fresh.layers = []
            status = pv.Checkpoint(model=fresh).restore(path)
            for i, value in enumerate(values):
                layer = pv.Module()
                layer.kernel = pv.Variable(np.zeros(3, np.float32), name=f"kernel{i}")
                fresh.layers.append(layer)  # receives its saved value here
                assert layer.kernel.numpy()[0] == value[0]
            status.assert_consumed()

        return restore_then_build

    assert_linear(make)


def test_first_and_steady_steps_inside_run_are_linear():
    def first(k: int) -> Callable[[], Any]:
        strategy, model, opt, grads = _model(k)
        per_replica = pv.PerReplica([grads, [g * 2 for g in grads]])
        variables = model.variables

        def step() -> None:  # the first step creates the slots and the update plan
            strategy.run(
                lambda g: opt.apply_gradients(zip(g, variables, strict=True)), args=(per_replica,)
            )

        return step

    def steady(k: int) -> Callable[[], Any]:
        step = first(k)
        with _COUNTER.watching_new_threads():
            step()  # starts the replica threads
        return step

    assert_linear(first)
    assert_linear(steady)


def test_object_graph_and_tracking_are_linear():
    def graph(k: int) -> Callable[[], Any]:
        _, model, opt, _ = _trained(k)
        ckpt = pv.Checkpoint(model=model, opt=opt)
        return lambda: build_object_graph(ckpt)

    def variables(k: int) -> Callable[[], Any]:
        _, model, _, _ = _model(k)
        return lambda: model.variables

    def containers(k: int) -> Callable[[], Any]:
        values = [np.zeros(2, np.float32) for _ in range(k)]

        def build() -> None:
            m = pv.Module()
            m.items = []
            m.table = {}
            for i, v in enumerate(values):
                var = pv.Variable(v, name=f"v{i}")
                m.items.append(var)
                m.items[i] = var  # replacing an item looks up pending restores
                m.table[f"k{i}"] = var
                setattr(m, f"attr{i}", var)  # a module with many attributes
            m.items.insert(0, m.items[0])
            assert len(m.variables) == k

        return build

    for make in (graph, variables, containers):
        assert_linear(make)


def test_run_result_regrouping_is_linear():
    # strategy.run regroups what the replicas return (a list of k (value, dict) pairs each)
    def make(k: int) -> Callable[[], Any]:
        strategy = pv.MirroredStrategy(4)
        values = [[(np.float32(i), {"x": i * r}) for i in range(k)] for r in range(4)]

        def step() -> Any:
            return values[pv.get_replica_context().replica_id_in_sync_group]

        return lambda: strategy.run(step)

    assert_linear(make)


# ---------------------------------------------------------------------------------------------
# The command line over files of k entries


def _entries(k: int) -> dict[str, ArrayEntry]:
    entries = {}
    for i in range(k):
        path = f"model/layer{i // 4}/w{i % 4}"
        entries[path] = ArrayEntry(
            path,
            [np.full(4, i, np.float32)] * 2,
            kind="mirrored",
            attrs={"devices": ["cpu:0", "cpu:1"]},
        )
    return entries


@pytest.mark.slow  # 18 cases of 1-3 s; CI runs them (.ci/run, -m slow)
@pytest.mark.parametrize(
    "fmt,suffix", [("hdf5", "h5"), ("safetensors", "safetensors"), ("npz", "npz")]
)
@pytest.mark.parametrize("command", ["inspect", "verify", "diff", "extract", "convert", "reshard"])
def test_cli_commands_are_linear_in_entries(tmp_path, capsys, fmt, suffix, command):
    def make(k: int) -> Callable[[], Any]:
        d = tmp_path / str(k)
        d.mkdir()
        src = str(d / f"a.{suffix}")
        write_checkpoint(src, _entries(k), format=fmt)
        argv = {
            "inspect": ["inspect", src],
            "verify": ["verify", src],
            "diff": ["diff", src, src],
            "extract": ["extract", src, f"model/layer{k // 8}/w1", "-o", str(d / "x.npy")],
            "convert": ["convert", src, str(d / "b.npz")],
            "reshard": ["reshard", src, str(d / f"c.{suffix}"), "--devices", "3"],
        }[command]

        def run() -> None:
            for mode in (["--json"], []):  # the JSON document and the human output (a tree)
                for out in (d / "b.npz", d / f"c.{suffix}", d / "x.npy"):
                    out.unlink(missing_ok=True)
                assert cli_main(["-q", *mode, *argv]) == 0

        return run

    assert_linear(make, n=200)
    capsys.readouterr()


@pytest.mark.slow
def test_cli_over_100k_entries_finishes(tmp_path):
    """A file of 100,000 entries: inspect, verify and diff finish (a generous bound, not a benchmark)."""
    src = str(tmp_path / "big.safetensors")
    script = (
        "import sys, numpy as np\n"
        "from parallelvars.formats import ArrayEntry, write_checkpoint\n"
        "e = {f'm/l{i}/w': ArrayEntry(f'm/l{i}/w', [np.full(2, i, np.float32)]) for i in range(100_000)}\n"
        "write_checkpoint(sys.argv[1], e, format='safetensors')\n"
    )
    env = {**os.environ, "PYTHONWARNINGS": "error"}
    subprocess.run([sys.executable, "-c", script, src], check=True, timeout=600, env=env)
    for argv in (["inspect", src], ["verify", src], ["diff", src, src]):
        proc = subprocess.run(
            [sys.executable, "-m", "parallelvars", "-q", "--json", *argv],
            capture_output=True,
            text=True,
            timeout=600,
            env=env,
        )
        assert proc.returncode == 0, proc.stderr


def test_a_variable_given_twice_is_named():
    def make(k: int) -> Callable[[], Any]:
        _, model, opt, grads = _model(k)
        variables = model.variables
        pairs = [*zip(grads, variables, strict=True), (grads[0], variables[k // 2])]

        def step() -> None:
            with pytest.raises(pv.errors.GradientError, match="appears twice") as info:
                opt.apply_gradients(pairs)
            assert info.value.variable == f"kernel{k // 2}"

        return step

    assert_linear(make)


# ---------------------------------------------------------------------------------------------
# The cyclic garbage collector is paused while a save gathers and while a restore runs


def test_save_and_restore_leave_the_collector_alone(tmp_path):
    # No process-wide side effect: the cyclic collector stays as the program set it, while a
    # restore plans, while a non-blocking save writes in its thread, and after either fails.
    import gc

    with pv.MirroredStrategy(2).scope():
        model = pv.Module()
        model.layers = [pv.Module() for _ in range(3)]
        for i, layer in enumerate(model.layers):
            layer.kernel = pv.Variable(np.full(3, i, np.float32), name=f"kernel{i}")
    ckpt = pv.Checkpoint(model=model)
    seen: list[bool] = []
    saveable = pv.checkpoint.registry.get_saveable(model.layers[0].kernel)
    original = type(saveable).plan_restore

    frozen: list[int] = []

    def spy(self: Any, *args: Any, **kwargs: Any) -> Any:
        seen.append(gc.isenabled())
        frozen.append(gc.get_freeze_count())
        return original(self, *args, **kwargs)

    from parallelvars.checkpoint import matching as _matching

    direct = _matching.plan_direct  # the planner of the common case, in bulk

    def spy_direct(*args: Any) -> Any:
        seen.append(gc.isenabled())
        frozen.append(gc.get_freeze_count())
        return direct(*args)

    assert gc.isenabled()
    path = ckpt.write(str(tmp_path / "a.h5"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(type(saveable), "plan_restore", spy)
        mp.setattr(_matching, "plan_direct", spy_direct)
        ckpt.restore(path).assert_consumed()
    assert seen and all(seen)  # on while planning the restore
    # The objects older than the restore are not walked by its collections, and given back after.
    assert frozen and all(frozen)
    assert gc.get_freeze_count() == 0

    writing, release = threading.Event(), threading.Event()
    real = pv.checkpoint.checkpoint.save_native

    def slow_write(*args: Any, **kwargs: Any) -> str:
        writing.set()
        release.wait(10)
        return real(*args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pv.checkpoint.checkpoint, "save_native", slow_write)
        with pv.CheckpointManager(ckpt, str(tmp_path / "d")) as mgr:
            mgr.save(blocking=False)
            assert writing.wait(10)
            assert gc.isenabled()  # the training thread keeps its collector during the write
            release.set()
    assert gc.isenabled()

    model.layers[0].kernel = pv.Variable(np.zeros(4, np.float32), name="kernel0")  # another shape
    with pytest.raises(pv.errors.ShapeMismatchError):
        ckpt.restore(path)
    assert gc.isenabled()

    gc.disable()
    try:
        ckpt.write(str(tmp_path / "b.h5"))
        assert not gc.isenabled()  # a collector the caller turned off stays off
    finally:
        gc.enable()


def test_a_restore_leaves_the_programs_own_frozen_objects_frozen(tmp_path):
    # A program that froze its objects (e.g. before forking workers) keeps them frozen: the
    # restore neither freezes more nor unfreezes theirs, in one thread or overlapping in several.
    import gc

    with pv.MirroredStrategy(2).scope():
        v = pv.Variable(np.arange(3, dtype=np.float32), name="v")
    ckpt = pv.Checkpoint(v=v)
    path = ckpt.write(str(tmp_path / "a.h5"))
    gc.freeze()
    try:
        before = gc.get_freeze_count()
        ckpt.restore(path).assert_consumed()
        assert gc.get_freeze_count() == before
    finally:
        gc.unfreeze()

    errors: list[BaseException] = []

    def restore() -> None:
        try:
            for _ in range(5):
                ckpt.restore(path).assert_consumed()
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=restore) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors
    assert gc.get_freeze_count() == 0  # given back once, after the last
