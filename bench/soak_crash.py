"""Kill a saving process with SIGKILL at random moments; check what survives, every time.

A child process restores the latest checkpoint of a directory (or starts at step 0), then
loops: step += 1, set every variable to a value derived from the step, save through a
:class:`parallelvars.CheckpointManager` (blocking and non-blocking saves alternate). The
parent kills it with SIGKILL after a random delay, then, without any lock:

* ``parallelvars.latest_checkpoint(directory)`` names a checkpoint that restores whole
  (checksums verified) into a fresh model;
* every variable equals exactly the values of one saved step, the one in the file's name;
* the step never goes backwards from one kill to the next.

The next child starts on the same directory, so each restart also checks that the lock of a
killed process is released and that its leftover temporaries are cleaned up.

    python bench/soak_crash.py                 # 300 kills (the soak)
    python bench/soak_crash.py --kills 25      # what the test suite runs
"""

from __future__ import annotations

import argparse
import os
import random
import select
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np


def build(num_devices: int = 2) -> tuple[Any, dict[str, Any]]:
    """A small model with every variable kind; returns the checkpoint and its variables."""
    import parallelvars as pv

    with pv.MirroredStrategy(num_devices).scope():
        w = pv.Variable(np.zeros((16, 8), np.float32), name="w")
        n = pv.Variable(
            np.float64(0.0),
            name="n",
            synchronization=pv.Synchronization.ON_READ,
            aggregation=pv.Aggregation.SUM,
        )
        e = pv.Variable(np.zeros((12, 3), np.int64), name="e", shard_axis=0)
    model = pv.Module()
    model.w, model.n, model.e = w, n, e
    step = pv.Variable(np.int64(0), name="step")
    variables = {"w": w, "n": n, "e": e, "step": step}
    return pv.Checkpoint(model=model, step=step), variables


def expected(step: int) -> dict[str, np.ndarray]:
    """The logical values every variable holds right after training step ``step``."""
    return {
        "w": (np.arange(128, dtype=np.float32).reshape(16, 8) * 0.5 + step).astype(np.float32),
        "n": np.float64(3 * step),  # the sum over replicas
        "e": np.arange(36, dtype=np.int64).reshape(12, 3) * step,
    }


def set_step(variables: dict[str, Any], step: int) -> None:
    values = expected(step)
    variables["w"].assign(values["w"])
    n = variables["n"]
    parts = [step * (i + 1) for i in range(n.num_components)]
    scale = 3 * step / sum(parts) if sum(parts) else 0.0
    for i, c in enumerate(n.components):  # unequal replica-local parts with the right sum
        c[...] = parts[i] * scale
    variables["e"].assign(values["e"])
    variables["step"].assign(np.int64(step))


def child(directory: str, max_to_keep: int) -> None:
    import parallelvars as pv

    ckpt, variables = build()
    mgr = pv.CheckpointManager(ckpt, directory, max_to_keep=max_to_keep)
    mgr.restore_or_initialize()
    step = int(variables["step"])
    print(f"ready {step}", flush=True)
    while True:
        step += 1
        set_step(variables, step)
        mgr.save(blocking=step % 2 == 0)


@dataclass
class SoakResult:
    kills: int = 0
    saves_seen: int = 0
    mid_write: int = 0  # kills that left a temporary file behind: they hit a write
    steps: list[int] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)


def check_latest(directory: str, previous: int) -> tuple[int, str | None]:
    """Restore the latest checkpoint into a fresh model; (step, problem or None)."""
    import parallelvars as pv

    path = pv.latest_checkpoint(directory)
    if path is None:
        return previous, None if previous == 0 else f"no checkpoint after step {previous} was seen"
    ckpt, variables = build(num_devices=2)
    try:
        ckpt.restore(path).assert_consumed()
    except Exception as exc:
        return previous, f"{path}: restore failed: {type(exc).__name__}: {exc}"
    step = int(variables["step"])
    number = int(os.path.basename(path).rsplit("-", 1)[1].split(".")[0])
    problems = []
    if number != step or int(ckpt.save_counter) != step:
        problems.append(f"file number {number}, save_counter {int(ckpt.save_counter)}, step {step}")
    want = expected(step)
    for name in ("w", "e"):
        for i, comp in enumerate(
            variables[name].components if name == "w" else [np.asarray(variables[name])]
        ):
            if not np.array_equal(comp, want[name]):
                problems.append(f"{name}[{i}] is not the value of step {step}")
    total = float(np.sum([float(c) for c in variables["n"].components]))
    if total != float(want["n"]):
        problems.append(f"n sums to {total}, not {want['n']} of step {step}")
    if step < previous:
        problems.append(f"step went backwards: {previous} -> {step}")
    return step, (f"{path}: " + "; ".join(problems)) if problems else None


def run_kills(
    directory: str,
    kills: int,
    *,
    seed: int = 0,
    max_delay: float = 0.25,
    max_to_keep: int = 3,
    deadline: float | None = None,
) -> SoakResult:
    """Start, kill and check the saving child ``kills`` times in ``directory``."""
    rng = random.Random(seed)
    result = SoakResult()
    previous = 0
    env = dict(os.environ, PYTHONFAULTHANDLER="1")
    for _ in range(kills):
        if deadline is not None and time.monotonic() > deadline:
            break
        proc = subprocess.Popen(
            [
                sys.executable,
                os.path.abspath(__file__),
                "--child",
                directory,
                "--max-to-keep",
                str(max_to_keep),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
        )
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 60)
        line = proc.stdout.readline() if ready else b""
        if not line.startswith(b"ready"):
            proc.kill()
            _, err = proc.communicate()
            result.failures.append(
                f"child did not start: {line!r} {err.decode(errors='replace')[-2000:]}"
            )
            break
        time.sleep(rng.uniform(0.0, max_delay))
        if proc.poll() is not None:
            _, err = proc.communicate()
            result.failures.append(f"child died by itself: {err.decode(errors='replace')[-2000:]}")
            break
        proc.send_signal(signal.SIGKILL)
        proc.communicate()
        result.kills += 1
        result.mid_write += bool(leftover_temporaries(directory))
        step, problem = check_latest(directory, previous)
        result.saves_seen += step - previous
        previous = step
        result.steps.append(step)
        if problem:
            result.failures.append(problem)
    return result


def leftover_temporaries(directory: str) -> list[str]:
    return [f for f in os.listdir(directory) if ".tmp-" in f]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--child", metavar="DIR", help=argparse.SUPPRESS)
    parser.add_argument("--kills", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--max-delay", type=float, default=0.25, help="longest wait before a kill, seconds"
    )
    parser.add_argument("--max-to-keep", type=int, default=3)
    parser.add_argument("--dir", help="directory to use (default: a temporary one)")
    args = parser.parse_args(argv)
    if args.child:
        child(args.child, args.max_to_keep)
        return 0
    import parallelvars as pv

    with tempfile.TemporaryDirectory() as tmp:
        directory = args.dir or tmp
        t0 = time.monotonic()
        res = run_kills(
            directory,
            args.kills,
            seed=args.seed,
            max_delay=args.max_delay,
            max_to_keep=args.max_to_keep,
        )
        before = len(leftover_temporaries(directory))
        ckpt, _ = build()
        with pv.CheckpointManager(ckpt, directory, max_to_keep=args.max_to_keep):
            after = leftover_temporaries(directory)
        print(
            f"kills survived: {res.kills - len(res.failures)}/{res.kills} in {time.monotonic() - t0:.1f} s; "
            f"steps saved and restored: {res.saves_seen} (last step {res.steps[-1] if res.steps else 0}); "
            f"kills inside a write: {res.mid_write}; "
            f"temporaries left by the last kill: {before}, after reopening: {len(after)}"
        )
        for failure in res.failures[:20]:
            print("  FAIL", failure)
    return 1 if res.failures or after else 0


if __name__ == "__main__":
    sys.exit(main())
