"""Per-call cost of writing a parallel variable, against the same numpy write in one run.

Every way of writing (``assign``, ``assign_add``, ``+=``, ``*=``, item assignment, ``fill``, a
ufunc with the variable as ``out``) on a mirrored variable of ``--replicas`` components and on an
on-read SUM variable, outside replica functions; and inside one (``strategy.run``) on an
independent variable (each replica its own component) and on a mirrored one (merged across
replicas). Baselines, in the same run: the same numpy write on the stacked buffer (outside), and
``strategy.run`` of a function that writes nothing (inside). Small variables, so the figures are
the library's dispatch, not the arithmetic.

    python bench/bench_variable_writes.py [--replicas 4] [--size 256] [--calls 20000] [--repeat 7]

Prints microseconds per call, ours and baseline, and the ratio ours/baseline (best of
``--repeat``).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import numpy as np

import parallelvars as pv


def best_per_call(fn: Callable[[], Any], calls: int, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t) / calls)
    return min(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--size", type=int, default=256)
    ap.add_argument("--calls", type=int, default=20000)
    ap.add_argument("--repeat", type=int, default=7)
    args = ap.parse_args(argv)
    n, size = args.replicas, args.size

    strategy = pv.MirroredStrategy(n)
    with strategy.scope():
        m = pv.Variable(np.zeros(size, np.float32), name="m", aggregation="mean")
        r = pv.Variable(np.zeros(size, np.float32), synchronization="on_read", aggregation="sum")
    with pv.independent_buffers(strategy.devices):
        ind = pv.Variable(np.zeros(size, np.float32), name="ind")
    x = np.ones(size, np.float32)
    raw = np.zeros((n, size), np.float32)

    outside: dict[str, tuple[Callable[[], Any], Callable[[], Any]]] = {
        "assign": (lambda: m.assign(x), lambda: raw.__setitem__(Ellipsis, x)),
        "assign_add": (lambda: m.assign_add(x), lambda: np.add(raw, x, out=raw)),
        "+=": (lambda: m.__iadd__(x), lambda: np.add(raw, x, out=raw)),
        "*=": (lambda: m.__imul__(1.0), lambda: np.multiply(raw, 1.0, out=raw)),
        "v[0] = 1": (lambda: m.__setitem__(0, 1.0), lambda: raw.__setitem__((slice(None), 0), 1.0)),
        "fill": (lambda: m.fill(1.0), lambda: raw.fill(1.0)),
        "np.add(out=v)": (lambda: np.add(m, x, out=m), lambda: np.add(raw, x, out=raw)),
        "on_read assign_add": (lambda: r.assign_add(x), lambda: np.add(raw[0], x, out=raw[0])),
        "on_read *=": (lambda: r.__imul__(1.0), lambda: np.multiply(raw, 1.0, out=raw)),
    }
    calls, repeat = args.calls, args.repeat
    print(f"replicas={n} size={size} float32, best of {repeat} x {calls} calls (us/call)")
    print(f"{'outside replica functions':32s} {'ours':>8s} {'numpy':>8s} {'ratio':>7s}")
    for name, (ours, base) in outside.items():
        a, b = best_per_call(ours, calls, repeat), best_per_call(base, calls, repeat)
        print(f"{name:32s} {a * 1e6:8.2f} {b * 1e6:8.2f} {a / b:7.2f}")

    steps = max(1, calls // 20)
    inside: dict[str, Callable[[], Any]] = {
        "independent assign_add": lambda: ind.assign_add(x),
        "independent *=": lambda: ind.__imul__(1.0),
        "independent v[0] = 1": lambda: ind.__setitem__(0, 1.0),
        "mirrored assign_add (merged)": lambda: m.assign_add(x),
        "mirrored *= (merged)": lambda: m.__imul__(1.0),
    }
    empty = best_per_call(lambda: strategy.run(lambda: None), steps, repeat)
    print(f"{'inside strategy.run (per step)':32s} {'ours':>8s} {'empty':>8s} {'ratio':>7s}")
    for name, write in inside.items():
        a = best_per_call(lambda w=write: strategy.run(w), steps, repeat)
        print(f"{name:32s} {a * 1e6:8.2f} {empty * 1e6:8.2f} {a / empty:7.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
