"""All-reduce of a gradient set per step over MPI: fused (one collective per dtype) against one
collective per variable, measured in the same run, over 2 and 4 processes; then the rows of
sharded variables (``--table-mb``, 64 MB by default; ``--no-sharded`` leaves them out):

* a step of a sharded table against the same table mirrored, per process count: the bytes each
  rank sends (reduce-scatter against all-reduce; target <= 0.6x) and the step time;
* the save of a 3-process sharded checkpoint against one process saving the same bytes;
* the restore of that checkpoint onto 2 processes: the bytes each rank reads (``rchar`` of
  ``/proc/self/io``, metadata and checksum reads included) against its share (target <= 1.2x).

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


# ------------------------------------------------------------------ sharded variables
class _SentBytes:
    """A communicator proxy counting the bytes each rank sends, as a bandwidth-optimal
    implementation of each collective must: ``Alltoall(v)`` the blocks for the other ranks,
    ``Allgather(v)`` (a ring) ``(size - 1) / size`` of the gathered buffer."""

    def __init__(self, comm: object) -> None:
        self._comm = comm
        self.sent = 0

    def __getattr__(self, name: str) -> object:
        attr = getattr(self._comm, name)
        if name not in ("Alltoall", "Alltoallv", "Allgather", "Allgatherv"):
            return attr
        size, rank = self._comm.Get_size(), self._comm.Get_rank()

        def counted(send: object, recv: object) -> object:
            if name == "Alltoallv":
                counts = send[1][0]  # [buffer, (counts, displacements), type]
                self.sent += sum(c for j, c in enumerate(counts) if j != rank)
            elif name == "Alltoall":
                self.sent += send[0].nbytes * (size - 1) // size
            else:
                self.sent += recv[0].nbytes * (size - 1) // size
            return attr(send, recv)

        return counted


def sharded_step_worker(args: argparse.Namespace) -> None:
    """A training step of a sharded table against the same table mirrored: bytes each rank
    sends (reduce-scatter vs all-reduce) and the step's time (reduction and update)."""
    import parallelvars as pv

    strategy = pv.MultiWorkerMirroredStrategy()
    comm, rank, n = strategy.comm, strategy.cluster_rank, strategy.num_replicas_in_sync
    rows = int(args.table_mb * 1e6) // (64 * 4)
    table = np.random.default_rng(0).standard_normal((rows, 64)).astype(np.float32)
    with strategy.scope():
        sharded = pv.Variable(table, name="sharded", shard_axis=0)
        mirrored = pv.Variable(table, name="mirrored")
        opt = pv.optimizers.SGD(0.01)
    del table
    grad = np.random.default_rng(rank + 1).standard_normal((rows, 64)).astype(np.float32)

    def step(var: object) -> None:
        strategy.run(lambda: opt.apply_gradients([(grad, var)]))

    counter = _SentBytes(comm)
    sent = {}
    for name, var in (("sharded", sharded), ("mirrored", mirrored)):
        strategy._comm = counter
        counter.sent = 0
        step(var)
        strategy._comm = comm
        sent[name] = counter.sent
    times: dict[str, list[float]] = {"sharded": [], "mirrored": []}
    for _ in range(args.steps):
        for name, var in (("sharded", sharded), ("mirrored", mirrored)):
            comm.Barrier()
            t0 = time.perf_counter()
            step(var)
            comm.Barrier()
            times[name].append(time.perf_counter() - t0)
    # The sharded table's rows equal the mirrored table's after the same steps, bit for bit.
    with strategy.scope():
        full = strategy.gather(sharded)
    assert np.array_equal(full, np.asarray(mirrored))
    if rank == 0:
        med = {k: float(np.median(v)) for k, v in times.items()}
        ratio = sent["sharded"] / sent["mirrored"]
        print(
            f"procs={n} sharded table {rows * 64 * 4 / 1e6:.0f} MB: bytes sent per rank "
            f"reduce-scatter {sent['sharded'] / 1e6:.1f} MB vs all-reduce "
            f"{sent['mirrored'] / 1e6:.1f} MB = {ratio:.2f}x (target <= 0.6x); step "
            f"{med['sharded'] * 1e3:.0f} ms vs mirrored {med['mirrored'] * 1e3:.0f} ms = "
            f"{med['sharded'] / med['mirrored']:.2f}x"
        )
        _dump(args.part, {"procs": n, "table_bytes": rows * 64 * 4, "sent": sent, "times": med})


def _read_bytes() -> int:
    """Bytes this process has read through system calls (``/proc/self/io`` rchar)."""
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar")).split()[1])


def sharded_save_worker(args: argparse.Namespace) -> None:
    """Save a sharded table from every rank (each writes its shard; best of ``steps``)."""
    import parallelvars as pv

    strategy = pv.MultiWorkerMirroredStrategy()
    rows = int(args.table_mb * 1e6) // (64 * 4)
    with strategy.scope():
        table = pv.Variable(
            np.random.default_rng(0).standard_normal((rows, 64)).astype(np.float32),
            name="table",
            shard_axis=0,
        )
    ckpt = pv.Checkpoint(table=table)
    best = float("inf")
    for _ in range(args.steps):
        strategy.barrier()
        t0 = time.perf_counter()
        ckpt.write(args.ckpt)
        strategy.barrier()
        best = min(best, time.perf_counter() - t0)
    if strategy.cluster_rank == 0:
        _dump(args.part, {"procs": strategy.num_replicas_in_sync, "save_s": best})


def sharded_restore_worker(args: argparse.Namespace) -> None:
    """Restore the sharded table onto this job's ranks: bytes each rank read vs its share."""
    import parallelvars as pv

    strategy = pv.MultiWorkerMirroredStrategy()
    rows = int(args.table_mb * 1e6) // (64 * 4)
    with strategy.scope():
        table = pv.Variable(np.zeros((rows, 64), np.float32), name="table", shard_axis=0)
    strategy.barrier()
    before = _read_bytes()
    pv.Checkpoint(table=table).restore(args.ckpt).assert_consumed()
    read = _read_bytes() - before
    share = np.asarray(table).nbytes
    reads = strategy.comm.gather((read, share), root=0)
    if strategy.cluster_rank == 0:
        worst = max(r / s for r, s in reads)
        print(
            f"restore onto {strategy.num_replicas_in_sync} processes: bytes read per rank "
            + ", ".join(f"{r / 1e6:.1f} MB of a {s / 1e6:.1f} MB share" for r, s in reads)
            + f"; worst {worst:.2f}x its share (target <= 1.2x + metadata)"
        )
        _dump(args.part, {"procs": strategy.num_replicas_in_sync, "reads": reads, "worst": worst})


def _dump(path: str | None, figures: dict[str, object]) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(figures, f, indent=2)


def one_process_save(table_mb: float, directory: str, repeats: int) -> float:
    """One process (no MPI) saving the same bytes as one plain variable: best of ``repeats``."""
    import parallelvars as pv

    rows = int(table_mb * 1e6) // (64 * 4)
    table = pv.Variable(
        np.random.default_rng(0).standard_normal((rows, 64)).astype(np.float32), name="table"
    )
    ckpt = pv.Checkpoint(table=table)
    path = os.path.join(directory, "one")
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        ckpt.write(path)
        best = min(best, time.perf_counter() - t0)
    return best


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
    parser.add_argument(
        "--table-mb", type=float, default=64.0, help="the sharded table's size (MB)"
    )
    parser.add_argument(
        "--no-sharded", action="store_true", help="leave out the sharded-variable rows"
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="allreduce", help=argparse.SUPPRESS)
    parser.add_argument("--ckpt", default=None, help=argparse.SUPPRESS)
    parser.add_argument(
        "--part", default=None, help=argparse.SUPPRESS
    )  # rank 0 writes its figures here
    args = parser.parse_args()
    if args.worker:
        {
            "allreduce": worker,
            "sharded_step": sharded_step_worker,
            "sharded_save": sharded_save_worker,
            "sharded_restore": sharded_restore_worker,
        }[args.mode](args)
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
        sharded: dict[str, object] = {}
        if not args.no_sharded:
            status |= _sharded_rows(args, mpiexec, tmp, sharded)
    _write_json(args.json, {"benchmark": "mpi", "params": params, "runs": runs, "sharded": sharded})
    return status


def _sharded_rows(args: argparse.Namespace, mpiexec: Path, tmp: str, out: dict[str, object]) -> int:
    """The sharded-variable rows: a step per process count, a 3-process save against one
    process saving the same bytes, and a restore of that save onto 2 processes."""

    def launch(n: int, mode: str, part: str, *extra: str) -> dict[str, object]:
        cmd = [str(mpiexec), "-n", str(n), sys.executable, os.path.abspath(__file__)]
        cmd += ["--worker", "--mode", mode, "--table-mb", str(args.table_mb)]
        cmd += ["--steps", str(args.steps), "--part", part, *extra]
        subprocess.run(cmd, check=True, timeout=1800)
        with open(part) as f:
            return dict(json.load(f))

    status = 0
    try:
        for n in args.procs:
            out[f"step_{n}"] = launch(n, "sharded_step", os.path.join(tmp, f"step{n}.json"))
        ckpt = os.path.join(tmp, "sharded.h5")
        saved = launch(3, "sharded_save", os.path.join(tmp, "save.json"), "--ckpt", ckpt)
        one = one_process_save(args.table_mb, tmp, args.steps)
        out["save_3"] = dict(saved, one_process_s=one)
        print(
            f"save of a {args.table_mb:.0f} MB sharded table: 3 processes {saved['save_s']:.3f} s "
            f"vs one process saving the same bytes {one:.3f} s = "
            f"{one / float(saved['save_s']):.2f}x (one / three)"
        )
        out["restore_3_to_2"] = launch(
            2, "sharded_restore", os.path.join(tmp, "restore.json"), "--ckpt", ckpt
        )
    except (subprocess.SubprocessError, OSError, ValueError) as exc:
        print(f"sharded rows failed: {exc}", file=sys.stderr)
        out["error"] = str(exc)
        status = 1
    return status


def _write_json(path: str | None, figures: dict[str, object]) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(figures, f, indent=2)


if __name__ == "__main__":
    sys.exit(main())
