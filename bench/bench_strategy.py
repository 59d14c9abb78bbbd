"""Per-step overhead of ``MirroredStrategy.run`` with one ``merge_call``.

Measures, in the same run and on the same replica function ``fn``:

* loop: ``fn`` called once per replica in a plain loop outside any strategy (its
  ``merge_call`` is then a direct call in the default replica context);
* run: ``strategy.run(fn)``, each replica in its own pool thread, with a ``merge_call``
  rendezvous in the middle;
* floor: the bare lock hand-offs any thread-per-replica design with one rendezvous needs
  (wake every thread, park all but the last at the rendezvous, release them, wake the caller),
  without the library. It shows how much of the overhead is the machine's thread switching.

Prints the per-step times, the overhead of ``run`` over the loop (the figure with a target:
under 200 microseconds per step with 8 replicas) and the ratio.

Usage:
    python bench/bench_strategy.py [--replicas 8] [--steps 2000] [--repeats 7] [--size 256]
                                   [--json PATH]
"""

from __future__ import annotations

import _thread
import argparse
import json
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

import parallelvars as pv


def bare_rendezvous(n: int) -> Callable[[], None]:
    """One step of the minimal wake / rendezvous / done hand-off pattern over ``n`` threads."""
    wakes = [_thread.allocate_lock() for _ in range(n)]
    parks = [_thread.allocate_lock() for _ in range(n)]
    for lock in (*wakes, *parks):
        lock.acquire()
    done = _thread.allocate_lock()
    done.acquire()
    guard = threading.Lock()
    arrived: list[int] = []
    finished = [0]

    def worker(i: int) -> None:
        while True:
            wakes[i].acquire()
            with guard:
                last = len(arrived) == n - 1
                if not last:
                    arrived.append(i)
            if last:
                with guard:
                    waiting = arrived[:]
                    arrived.clear()
                for j in waiting:
                    parks[j].release()
            else:
                parks[i].acquire()
            with guard:
                finished[0] += 1
                all_done = finished[0] == n
                if all_done:
                    finished[0] = 0
            if all_done:
                done.release()

    for i in range(n):
        threading.Thread(target=worker, args=(i,), daemon=True).start()

    def step() -> None:
        for wake in wakes:
            wake.release()
        done.acquire()

    return step


OVERHEAD_TARGET_S = 200e-6  # run() over the plain loop, per step, with 8 replicas


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--replicas", type=int, default=8)
    parser.add_argument("--steps", type=int, default=2000, help="steps per timed repeat")
    parser.add_argument(
        "--repeats", type=int, default=7, help="timed repeats (the median is reported)"
    )
    parser.add_argument("--size", type=int, default=256, help="elements of each replica's value")
    parser.add_argument("--json", metavar="PATH", help="also write the figures to PATH as JSON")
    args = parser.parse_args(argv)

    n = args.replicas
    strategy = pv.MirroredStrategy(n)
    values = [np.full(args.size, i, np.float32) for i in range(n)]
    per_replica = pv.PerReplica(values)

    def merge_fn(s: Any, x: Any) -> Any:
        # Each replica gets the sum of its own value back: the same result in both set-ups.
        return pv.PerReplica([float(np.sum(v)) for v in s.experimental_local_results(x)])

    def fn(x: np.ndarray) -> Any:
        y = x * 2.0
        ctx = pv.get_replica_context()
        return ctx.merge_call(merge_fn, args=(y,)) + 1.0  # type: ignore[union-attr]

    def loop_step() -> list[Any]:
        return [fn(v) for v in values]

    def run_step() -> Any:
        return strategy.run(fn, args=(per_replica,))

    floor_step = bare_rendezvous(n)

    # Both compute the same thing (the first run also starts the replica threads).
    got = run_step()
    assert list(got.values) == loop_step(), "run() and the plain loop disagree"

    steps = {"loop": loop_step, "run": run_step, "floor": floor_step}
    for step in steps.values():
        for _ in range(max(1, args.steps // 10)):
            step()
    # Interleave the repeats so that load from elsewhere on the machine hits all three alike.
    samples: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(args.repeats):
        for name, step in steps.items():
            start = time.perf_counter()
            for _ in range(args.steps):
                step()
            samples[name].append((time.perf_counter() - start) / args.steps)
    loop, run, floor = (statistics.median(samples[k]) for k in ("loop", "run", "floor"))
    print(f"replicas={n} steps={args.steps} repeats={args.repeats} size={args.size} (medians)")
    print(f"loop  ({n} calls of fn, plain):             {loop * 1e6:9.1f} us/step")
    print(f"run   (strategy.run, threads + merge_call): {run * 1e6:9.1f} us/step")
    print(f"floor (bare {n}-thread lock hand-offs):      {floor * 1e6:9.1f} us/step")
    print(
        f"overhead of run over loop: {(run - loop) * 1e6:.1f} us/step (target < 200 us); "
        f"ratio run/loop {run / loop:.1f}x; library cost above the floor "
        f"{(run - loop - floor) * 1e6:.1f} us/step"
    )
    if args.json:
        overhead = run - loop
        figures = {
            "benchmark": "strategy",
            "params": {
                "replicas": n,
                "steps": args.steps,
                "repeats": args.repeats,
                "size": args.size,
            },
            "times": {
                "loop_s_per_step": loop,
                "run_s_per_step": run,
                "floor_s_per_step": floor,
                "overhead_s_per_step": overhead,
                "above_floor_s_per_step": run - loop - floor,
            },
            "samples": samples,
            "ratios": {"run_over_loop": run / loop},
            "targets": {
                "overhead_s_per_step": {
                    "op": "<",
                    "value": OVERHEAD_TARGET_S,
                    "met": overhead < OVERHEAD_TARGET_S,
                }
            },
        }
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
