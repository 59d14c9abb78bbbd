"""All-reduce of a gradient set per step over MPI: fused (one collective per dtype) against one
collective per variable, measured in the same run, over 2 and 4 processes.

    python bench/bench_mpi.py                    # 100 MB of float32 gradients, 2 and 4 processes
    python bench/bench_mpi.py --size-mb 20 --procs 2 4 --steps 5
    python bench/bench_mpi.py --json mpi.json    # also write the figures as JSON

The script launches itself under the ``mpiexec`` of the ``[mpi]`` extra. Each step reduces the
same gradients with ``MultiWorkerMirroredStrategy.batch_reduce`` (``ReduceOp.SUM``):

* fused: every gradient packed into one buffer, one ``Allgather``, rank-ordered sum;
* per variable (the baseline): one ``Allgather`` + rank-ordered sum per gradient;
* for context, MPI's own ``Allreduce`` on one packed buffer (whose summation order is the
  library's choice, hence not what the strategy uses).

The contenders take turns within each step, so machine noise hits them alike; the median step
time of each is printed with the ratio baseline / fused.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def gradient_sizes(total_bytes: int, n_vars: int, seed: int = 0) -> list[int]:
    """Element counts of ``n_vars`` float32 gradients adding up to ``total_bytes``: a few large
    kernels and many small ones, like a model's variables."""
    rng = np.random.default_rng(seed)
    weights = rng.lognormal(mean=0.0, sigma=2.0, size=n_vars)
    total = total_bytes // 4
    sizes = np.maximum(1, (weights / weights.sum() * total).astype(np.int64))
    sizes[np.argmax(sizes)] += total - int(sizes.sum())
    return [int(s) for s in sizes]


def worker(args: argparse.Namespace) -> None:
    import parallelvars as pv

    strategy = pv.MultiWorkerMirroredStrategy()
    comm, rank, n = strategy.comm, strategy.cluster_rank, strategy.num_replicas_in_sync
    from mpi4py import MPI

    sizes = gradient_sizes(int(args.size_mb * 1e6), args.vars)
    rng = np.random.default_rng(rank)
    grads = [rng.standard_normal(s).astype(np.float32) for s in sizes]
    pairs = [(pv.PerReplica([g]), None) for g in grads]
    packed = np.empty(sum(sizes), np.float32)

    def fused() -> None:
        strategy.fusion = True
        with strategy.scope():
            strategy.batch_reduce(pv.ReduceOp.SUM, pairs)

    def per_variable() -> None:
        strategy.fusion = False
        with strategy.scope():
            strategy.batch_reduce(pv.ReduceOp.SUM, pairs)

    def mpi_allreduce() -> None:
        np.concatenate(grads, out=packed)
        comm.Allreduce(MPI.IN_PLACE, packed, op=MPI.SUM)

    contenders = {"fused": fused, "per_variable": per_variable, "mpi_allreduce": mpi_allreduce}
    times: dict[str, list[float]] = {k: [] for k in contenders}
    for step in range(args.steps + 1):
        for name, fn in contenders.items():
            comm.Barrier()
            t0 = time.perf_counter()
            fn()
            comm.Barrier()
            if step:  # the first step warms up buffers and connections
                times[name].append(time.perf_counter() - t0)
    # Check the two strategy paths agree bit for bit before reporting their speeds.
    strategy.fusion = True
    with strategy.scope():
        a = strategy.batch_reduce(pv.ReduceOp.SUM, pairs)
        strategy.fusion = False
        b = strategy.batch_reduce(pv.ReduceOp.SUM, pairs)
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    if rank == 0:
        med = {k: float(np.median(v)) for k, v in times.items()}
        mb = sum(sizes) * 4 / 1e6
        print(
            f"procs={n} gradients={len(sizes)} vars, {mb:.1f} MB/step: "
            f"fused {med['fused'] * 1e3:.1f} ms, per-variable {med['per_variable'] * 1e3:.1f} ms, "
            f"MPI Allreduce (unordered, reference) {med['mpi_allreduce'] * 1e3:.1f} ms; "
            f"ratio per-variable / fused = {med['per_variable'] / med['fused']:.2f}x"
        )
        sys.stdout.flush()
        if args.part:
            with open(args.part, "w") as f:
                json.dump(
                    {
                        "procs": n,
                        "vars": len(sizes),
                        "bytes_per_step": sum(sizes) * 4,
                        "times": {f"{k}_s": v for k, v in med.items()},
                        "samples": times,
                        "ratios": {
                            "per_variable_over_fused": med["per_variable"] / med["fused"],
                            "mpi_allreduce_over_fused": med["mpi_allreduce"] / med["fused"],
                        },
                    },
                    f,
                    indent=2,
                )


def find_mpiexec() -> tuple[Path, str | None]:
    """The ``mpiexec`` of the ``[mpi]`` extra and why MPI runs cannot start (None if they can)."""
    mpiexec = Path(sys.executable).parent / "mpiexec"
    if not mpiexec.exists():
        mpiexec = Path(sys.prefix) / "bin" / "mpiexec"
    missing = (
        "mpi4py is not installed (pip install 'parallelvars[mpi]')"
        if importlib.util.find_spec("mpi4py") is None
        else None
        if mpiexec.exists()
        else f"no mpiexec at {mpiexec}"
    )
    return mpiexec, missing


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size-mb", type=float, default=100.0, help="gradient bytes per step (MB)")
    parser.add_argument("--vars", type=int, default=200, help="number of gradient tensors")
    parser.add_argument("--steps", type=int, default=5, help="timed steps")
    parser.add_argument("--procs", type=int, nargs="+", default=[2, 4], help="process counts")
    parser.add_argument("--json", metavar="PATH", help="also write the figures to PATH as JSON")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--part", default=None, help=argparse.SUPPRESS
    )  # rank 0 writes its figures here
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return 0
    params = {"size_mb": args.size_mb, "vars": args.vars, "steps": args.steps, "procs": args.procs}
    mpiexec, missing = find_mpiexec()
    if missing:
        print(f"skipped: {missing}")
        _write_json(args.json, {"benchmark": "mpi", "params": params, "skipped": missing})
        return 0
    runs: dict[str, dict[str, object]] = {}
    status = 0
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.procs:
            part = os.path.join(tmp, f"procs{n}.json")
            cmd = [
                str(mpiexec),
                "-n",
                str(n),
                sys.executable,
                os.path.abspath(__file__),
                "--worker",
                "--size-mb",
                str(args.size_mb),
                "--vars",
                str(args.vars),
                "--steps",
                str(args.steps),
                "--part",
                part,
            ]
            if not args.json:
                subprocess.run(cmd, check=True, timeout=1800)
                continue
            try:
                subprocess.run(cmd, check=True, timeout=1800)
                with open(part) as f:
                    runs[str(n)] = json.load(f)
            except (subprocess.SubprocessError, OSError, ValueError) as exc:
                print(f"procs={n} failed: {exc}", file=sys.stderr)
                runs[str(n)] = {"procs": n, "error": str(exc)}
                status = 1
    _write_json(args.json, {"benchmark": "mpi", "params": params, "runs": runs})
    return status


def _write_json(path: str | None, figures: dict[str, object]) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(figures, f, indent=2)


if __name__ == "__main__":
    sys.exit(main())
