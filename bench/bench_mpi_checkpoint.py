"""Multi-process checkpoint saves (``MultiWorkerMirroredStrategy``): the first save of a
structure, a repeated save (rank files and index file written with their cached generated
metadata), a save with no cache (every file's metadata generated anew), and a one-process save
of the same model under ``MirroredStrategy(n)`` (first and repeated), all in one run.

    python bench/bench_mpi_checkpoint.py                  # 5,000 variables, 20 MB, 2 and 4 processes
    python bench/bench_mpi_checkpoint.py --vars 5000 --params 5e6 --procs 2 --rounds 5
    python bench/bench_mpi_checkpoint.py --json mpi_ckpt.json

Model: ``--vars`` mirrored float32 variables of log-uniform sizes adding up to ``--params``
parameters per replica (the defaults are ``bench_checkpoint.py --peers``' 5k size: 5,000
tensors, 20 MB), one replica per process: the logical checkpoint holds ``n`` components of
each. Every save writes a new file (``Checkpoint.write`` to ``<kind>-<k>.h5``, names of one length
as a ``CheckpointManager``'s are between powers of ten), so every index file's links name a
new rank-file folder; the files of a save are deleted before the next, untimed. The contenders take turns in
each round (first, repeated, no cache); the best of ``--rounds`` is printed with the
ratios. Wall time on rank 0 from a barrier to ``save()`` returning (it returns on every rank
once the index is committed). The one-process saves run in the launching process, on the
same disk, after the MPI run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np
from bench_mpi import _write_json, find_mpiexec  # run as bench/bench_mpi_checkpoint.py


def sizes(total: int, count: int, seed: int = 0) -> list[int]:
    """Log-uniform element counts (a few big, many small) adding up to ``total``."""
    rng = np.random.default_rng(seed)
    weights = np.exp(rng.uniform(0, np.log(1000), count))
    out = np.maximum(1, (weights / weights.sum() * total).astype(np.int64))
    out[np.argmax(out)] += total - out.sum()
    return [int(s) for s in out]


def build(strategy: object, args: argparse.Namespace) -> object:
    """The model: ``args.vars`` mirrored float32 variables under ``strategy``."""
    import parallelvars as pv

    model = pv.Module()
    with strategy.scope():  # type: ignore[attr-defined]
        model.layers = [
            pv.Variable(np.full(s, 0.5, np.float32), name=f"v{i}")
            for i, s in enumerate(sizes(int(args.params), args.vars))
        ]
    return model


def touch(model: object, k: int) -> None:
    """New values for the next save (every component of the first variable changes)."""
    v = model.layers[0]  # type: ignore[attr-defined]
    v.assign(np.full(v.shape, float(k), np.float32))


def timed_saves(save: object, rounds: int) -> dict[str, list[float]]:
    """``save(kind)`` (which returns its seconds) for each kind, in turns, ``rounds`` times."""
    times: dict[str, list[float]] = {"first": [], "repeated": [], "no_cache": []}
    for _ in range(rounds):
        for kind in times:
            times[kind].append(save(kind))  # type: ignore[operator]
    return times


def saver(ckpt: object, directory: str, barrier: object, rank: int) -> object:
    """``save(kind) -> seconds``: a save with an empty plan cache (``first``), with the
    cache of the previous repeated save (``repeated``; an untimed save primes it) or with none
    (``no_cache``), each to a new file name of one length (``<kind>-<k>.h5``)."""
    from parallelvars.checkpoint.h5io.records import PlanCache

    cache = PlanCache()
    state = {"k": 1000}

    def sync() -> None:
        if barrier is not None:
            barrier()  # type: ignore[operator]

    def one(kind: str, plans: PlanCache | None) -> tuple[str, float]:
        state["k"] += 1
        touch(ckpt.model, state["k"])  # type: ignore[attr-defined]
        ckpt._pv_plans = plans  # type: ignore[attr-defined]
        sync()
        t0 = time.perf_counter()
        path = ckpt.write(os.path.join(directory, f"{kind}-{state['k']}.h5"))  # type: ignore[attr-defined]
        elapsed = time.perf_counter() - t0
        sync()
        return path, elapsed

    def remove(path: str) -> None:
        if rank == 0:
            os.remove(path)
            shutil.rmtree(path + ".parts", ignore_errors=True)
        sync()

    def save(kind: str) -> float:
        if kind == "repeated" and state["k"] == 1000:
            remove(one("prime", cache)[0])
        plans = {"first": PlanCache(), "repeated": cache, "no_cache": None}[kind]
        path, elapsed = one(kind, plans)
        remove(path)
        return elapsed

    return save


def worker(args: argparse.Namespace) -> None:
    import parallelvars as pv
    from parallelvars.checkpoint import H5Reader
    from parallelvars.checkpoint.h5io.records import PlanCache

    strategy = pv.MultiWorkerMirroredStrategy()
    comm, rank, n = strategy.comm, strategy.cluster_rank, strategy.num_replicas_in_sync
    ckpt = pv.Checkpoint(model=build(strategy, args))
    directory = comm.bcast(tempfile.mkdtemp(dir=args.dir) if rank == 0 else None, root=0)
    try:
        times = timed_saves(saver(ckpt, directory, comm.Barrier, rank), args.rounds)
        # Save twice more and check the committed files: every component through the links.
        ckpt._pv_plans = PlanCache()  # type: ignore[attr-defined]
        ckpt.write(os.path.join(directory, "check-1.h5"))  # type: ignore[attr-defined]
        touch(ckpt.model, 10_000)  # type: ignore[attr-defined]
        path = ckpt.write(os.path.join(directory, "check-2.h5"))  # type: ignore[attr-defined]
        comm.Barrier()
        if rank == 0:
            with H5Reader(path) as reader:
                assert reader.verify_all() == []
                first = reader["model/layers/0"]
                assert first.num_components == n
                assert all((first.component(i) == 10_000).all() for i in range(n))
            with open(args.part, "w") as f:
                json.dump({"procs": n, "times": times}, f)
    finally:
        comm.Barrier()
        if rank == 0:
            shutil.rmtree(directory, ignore_errors=True)


def one_process(args: argparse.Namespace, n: int) -> dict[str, list[float]]:
    """The same model and saves in this process, under ``MirroredStrategy(n)``."""
    import parallelvars as pv

    ckpt = pv.Checkpoint(model=build(pv.MirroredStrategy(n), args))
    directory = tempfile.mkdtemp(dir=args.dir)
    try:
        return timed_saves(saver(ckpt, directory, None, 0), args.rounds)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def report(n: int, mpi: dict[str, list[float]], one: dict[str, list[float]]) -> dict[str, object]:
    m = {k: min(v) for k, v in mpi.items()}
    o = {k: min(v) for k, v in one.items()}
    ratios = {
        "mpi_first_over_repeated": m["first"] / m["repeated"],
        "mpi_no_cache_over_repeated": m["no_cache"] / m["repeated"],
        "mpi_repeated_over_one_process_repeated": m["repeated"] / o["repeated"],
        "mpi_first_over_one_process_first": m["first"] / o["first"],
    }
    print(
        f"procs={n}: MPI first {m['first'] * 1e3:.0f} ms, repeated {m['repeated'] * 1e3:.0f} ms, "
        f"no cache {m['no_cache'] * 1e3:.0f} ms | one process (MirroredStrategy({n})) "
        f"first {o['first'] * 1e3:.0f} ms, repeated {o['repeated'] * 1e3:.0f} ms"
    )
    print(
        f"  ratios: MPI first/repeated {ratios['mpi_first_over_repeated']:.2f}x, "
        f"no-cache/repeated {ratios['mpi_no_cache_over_repeated']:.2f}x, "
        f"MPI repeated / one-process repeated {ratios['mpi_repeated_over_one_process_repeated']:.2f}x, "
        f"MPI first / one-process first {ratios['mpi_first_over_one_process_first']:.2f}x"
    )
    return {
        "procs": n,
        "best_s": {"mpi": m, "one_process": o},
        "samples_s": {"mpi": mpi, "one_process": one},
        "ratios": ratios,
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--vars", type=int, default=5000, help="variables")
    parser.add_argument("--params", type=float, default=5e6, help="parameters per replica")
    parser.add_argument("--procs", type=int, nargs="+", default=[2, 4], help="process counts")
    parser.add_argument("--rounds", type=int, default=3, help="rounds (best is reported)")
    parser.add_argument("--dir", default=None, help="where to write (default: the temp dir)")
    parser.add_argument("--json", metavar="PATH", help="also write the figures to PATH as JSON")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--part", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return 0
    params = {"vars": args.vars, "params": args.params, "procs": args.procs, "rounds": args.rounds}
    mpiexec, missing = find_mpiexec()
    if missing:
        print(f"skipped: {missing}")
        _write_json(
            args.json, {"benchmark": "mpi_checkpoint", "params": params, "skipped": missing}
        )
        return 0
    print(
        f"multi-process checkpoint saves: {args.vars} variables, {args.params * 4 / 1e6:.0f} MB "
        f"per replica, best of {args.rounds}"
    )
    runs: dict[str, object] = {}
    status = 0
    env = dict(os.environ)
    # Oversubscribed ranks (4 on 2 cores) should yield the CPU while they wait.
    env.setdefault("MPIR_CVAR_CH4_OFI_ENABLE_PROGRESS_THREAD", "0")
    env.setdefault("MPIR_CVAR_POLLS_BEFORE_YIELD", "100")
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.procs:
            part = os.path.join(tmp, f"procs{n}.json")
            cmd = [str(mpiexec), "-n", str(n), sys.executable, os.path.abspath(__file__)]
            cmd += ["--worker", "--part", part, "--vars", str(args.vars)]
            cmd += ["--params", str(args.params), "--rounds", str(args.rounds)]
            cmd += ["--dir", args.dir] if args.dir else []
            try:
                subprocess.run(cmd, check=True, timeout=1800, env=env)
                with open(part) as f:
                    mpi = json.load(f)["times"]
            except (subprocess.SubprocessError, OSError, ValueError) as exc:
                print(f"procs={n} failed: {exc}", file=sys.stderr)
                runs[str(n)] = {"procs": n, "error": str(exc)}
                status = 1
                continue
            runs[str(n)] = report(n, mpi, one_process(args, n))
    _write_json(args.json, {"benchmark": "mpi_checkpoint", "params": params, "runs": runs})
    return status


if __name__ == "__main__":
    sys.exit(main())
