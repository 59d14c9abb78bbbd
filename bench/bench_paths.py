"""Every path a user walks, against its peer on the same tensors, each case in a fresh process.

Save rows (``--save``):

* ``first``: the first ``Checkpoint.write`` in a fresh process of N variables (default 5,000
  and 50,000) mirrored on 2 devices (100 float32 parameters each), with and without Adam
  slots, against ``safetensors.numpy.save_file`` + fsync of the same tensors in the same
  process; then a repeated write. Two structures: ``layered`` (``model/layers/<k>/w<j>``, 100
  variables a group, as a model's parameters are) and ``flat`` (one list of N variables: a
  group of N links).
* ``mirrored``: a model of 2,000 variables x 2,500 float32 parameters with Adam, on 4 devices
  against 1 device: file size (target <= 1.05x) and save time (target <= 1.2x), 7 repeated
  saves of each alternated (best and median, wall and CPU), with the floor of the replicas'
  cost measured between them: one comparison of every replica with its first component, and
  one read of the replicas alone (the floor of a comparison fused with a pass made anyway).
* ``training``: 10,000 variables x 2,500 parameters x 2 devices with Adam (``--big``: also
  20,000 x 2,500 x 4): first and repeated save, a first and a second non-blocking
  ``CheckpointManager.save`` (the call and the whole save), restore, against a raw ``tofile``
  + fsync and ``readinto`` of the same bytes; then 3 rounds, each in another order, of a raw
  write of the stored bytes, a blocking and a non-blocking save (after the first two saves:
  the steady state), best and median against raw. Two write rates: per live byte (raw writes
  every component of every variable and slot) and per stored byte (raw writes the bytes the
  file holds: mirrored replicas once). The stored-byte rate is the one the target means: it
  compares the same disk work, while the live-byte rate credits a mirrored model's smaller
  file as speed. The resident set after building the model and each save's peak above it
  (``/proc/self/statm`` sampled in a thread around the call: ``ru_maxrss`` is a lifetime
  peak and says nothing about one call).

``first`` also measures the floor a save cannot go under in Python, walking the objects for the
graph and the records (as the first save does), and the first save's peak RSS above the
model's.

Prints per-variable costs and ratios measured in the same process. The command-line rows
(inspect, verify, diff, extract, convert, reshard against safetensors) are
``bench/bench_paths_commands.py``; ``--commands`` here runs that script with the other options.

    python bench/bench_paths.py [--save first,mirrored,training] [--sizes 5000,50000]
                                [--structures layered,flat] [--big] [--json PATH]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np

SAVE_CASES = ("first", "mirrored", "training")


def _rss_mb() -> float:
    """This process's resident set now (``/proc/self/statm``; ``ru_maxrss`` where there is
    none, a lifetime peak)."""
    try:
        with open("/proc/self/statm", "rb") as fh:
            return int(fh.read().split()[1]) * _PAGE / 2**20
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


class RssPeak:
    """The peak resident set while the block runs, sampled every 2 ms in a thread
    (a process-lifetime peak such as ``ru_maxrss`` says nothing about one call):
    ``extra_mb`` is the peak above the resident set when the block began."""

    def __init__(self, interval: float = 0.002) -> None:
        self.interval = interval
        self.before_mb = self.peak_mb = 0.0

    def __enter__(self) -> RssPeak:
        import threading

        self.before_mb = self.peak_mb = _rss_mb()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(self.interval):
            self.peak_mb = max(self.peak_mb, _rss_mb())

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak_mb = max(self.peak_mb, _rss_mb())

    @property
    def extra_mb(self) -> float:
        return self.peak_mb - self.before_mb


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _model(count: int, size: int, devices: int, adam: bool, layered: bool) -> tuple[Any, Any]:
    """A checkpoint of ``count`` mirrored float32 variables of ``size`` parameters (and, with
    ``adam``, both slots of each after one step), and its variables."""
    import parallelvars as pv

    rng = np.random.default_rng(count)
    strategy = pv.MirroredStrategy(devices)
    with strategy.scope():
        model = pv.Module()
        values = [rng.standard_normal(size).astype(np.float32) for _ in range(count)]
        if layered:
            model.layers = []
            for k in range(0, count, 100):
                layer = pv.Module()
                for j, v in enumerate(values[k : k + 100]):
                    setattr(layer, f"w{j}", pv.Variable(v, name=f"w{j}"))
                model.layers.append(layer)
            variables = [getattr(layer, f"w{j}") for layer in model.layers for j in range(100)]
            variables = variables[:count]
        else:
            model.vars = [pv.Variable(v, name=f"v{i}") for i, v in enumerate(values)]
            variables = list(model.vars)
        opt = pv.optimizers.Adam(1e-3) if adam else None
    if opt is not None:
        grads = pv.PerReplica([[np.ones(size, np.float32) for _ in variables]] * devices)
        strategy.run(lambda g: opt.apply_gradients(zip(g, variables, strict=True)), args=(grads,))
        return pv.Checkpoint(model=model, opt=opt), variables
    return pv.Checkpoint(model=model), variables


def _tensors(ckpt: Any) -> dict[str, np.ndarray]:
    """Every component of every saved variable, as safetensors would be given them."""
    records, _, _ = ckpt._gather(False)
    return {
        f"{r.path}/{i}": np.ascontiguousarray(c).reshape(c.shape or (1,))
        for r in records
        for i, c in enumerate(r.components)
    }


# ----------------------------------------------------------------------------- save rows
def worker_first(count: int, adam: bool, layered: bool, folder: str) -> dict[str, Any]:
    from safetensors.numpy import save_file

    from parallelvars.checkpoint._gcfreeze import older_objects_frozen
    from parallelvars.checkpoint.graph import build_object_graph

    ckpt, _ = _model(count, 100, 2, adam, layered)
    gc.collect()
    with RssPeak() as mem:
        t, c = time.perf_counter(), time.process_time()
        ckpt.write(os.path.join(folder, "first.h5"))
        first = time.perf_counter() - t
        first_cpu = time.process_time() - c  # (with the sampling thread's: a few ms)
    t = time.perf_counter()
    ckpt.write(os.path.join(folder, "again.h5"))
    again = time.perf_counter() - t
    # The floor a save cannot go under in Python: walking the objects for the graph and the
    # records (done again here as the first save did it, the older objects frozen for the
    # collector)
    t, c = time.perf_counter(), time.process_time()
    with older_objects_frozen():
        ckpt._gather_new(build_object_graph(ckpt))
    walk = time.perf_counter() - t
    walk_cpu = time.process_time() - c
    tensors = _tensors(ckpt)
    st = os.path.join(folder, "o.safetensors")
    t, c = time.perf_counter(), time.process_time()
    save_file(tensors, st)
    _fsync(st)
    safetensors = time.perf_counter() - t
    safetensors_cpu = time.process_time() - c
    entries = len(ckpt._gather(False)[0])
    libhdf5 = None
    if not layered and count <= 5000:
        # the libhdf5 writer on the same records, for the flat list (one group of ``count``
        # links): what a group past 1,024 links was written with before the generator wrote
        # symbol tables
        from parallelvars.checkpoint.h5io import write_h5

        records, graph, metadata = ckpt._gather(False)
        t = time.perf_counter()
        write_h5(os.path.join(folder, "libhdf5.h5"), records, object_graph=graph, metadata=metadata)
        libhdf5 = time.perf_counter() - t
    return {
        "libhdf5_s": libhdf5,
        "variables": count,
        "entries": entries,
        "first_s": first,
        "first_cpu_s": first_cpu,
        "walk_cpu_s": walk_cpu,
        "safetensors_cpu_s": safetensors_cpu,
        "repeated_s": again,
        "walk_s": walk,
        "safetensors_s": safetensors,
        "ratio_first": first / safetensors,
        "ratio_repeated": again / safetensors,
        "ratio_walk": walk / safetensors,
        "file_mb": os.path.getsize(os.path.join(folder, "first.h5")) / 2**20,
        "safetensors_mb": os.path.getsize(st) / 2**20,
        "rss_mb": _rss_mb(),
        "first_extra_mb": mem.extra_mb,
    }


def worker_mirrored(count: int, size: int, folder: str) -> dict[str, Any]:
    import crc32c

    from parallelvars.checkpoint.snapshot import SnapshotPlan

    out: dict[str, Any] = {}
    models = {devices: _model(count, size, devices, True, True)[0] for devices in (1, 4)}
    plan = SnapshotPlan(models[4]._gather(False)[0])
    replicas = [plan.runs[k][0] for k in range(len(plan.runs))]
    walls: dict[str, list[float]] = {}
    cpus: dict[str, list[float]] = {}

    def timed(name: str, fn: Any) -> None:
        gc.collect()
        t, c = time.perf_counter(), time.process_time()
        fn()
        walls.setdefault(name, []).append(time.perf_counter() - t)
        cpus.setdefault(name, []).append(time.process_time() - c)

    for devices, ckpt in models.items():  # (a first and a second save: plans made, not timed)
        for k in range(2):
            ckpt.write(os.path.join(folder, f"warm{devices}-{k}.h5"))
    # The 1- and 4-device saves alternated (the shared disk's rate drifts), 7 of each, with the
    # floor of the replicas' cost between them: one comparison of every replica's bytes with
    # its first component's (memcmp by runs; a check that never hides divergence reads them
    # all), and one read of the replicas' bytes alone (crc32c: the floor of a comparison fused
    # with a pass over the first components made anyway, which finds them in the CPU cache).
    for k in range(7):
        for devices in (1, 4) if k % 2 == 0 else (4, 1):
            path = os.path.join(folder, f"d{devices}-{k}.h5")
            timed(f"save_{devices}", lambda c=models[devices], p=path: c.write(p))
            if k == 0:
                out[f"file_{devices}_mb"] = os.path.getsize(path) / 2**20
            os.unlink(path)
        timed("compare", plan.replicas_differing)
        timed("read", lambda: [crc32c.crc32c(r) for r in replicas])
    for name in walls:  # (save_1, save_4, compare, read: best and median of each)
        out[f"{name}_s"], out[f"{name}_median_s"] = min(walls[name]), float(np.median(walls[name]))
        cpu = f"cpu_{name[5:]}" if name.startswith("save_") else f"{name}_cpu"
        out[f"{cpu}_s"], out[f"{cpu}_median_s"] = min(cpus[name]), float(np.median(cpus[name]))
    out["replica_mb"] = sum(r.size for r in replicas) / 2**20
    out["ratio_size"] = out["file_4_mb"] / out["file_1_mb"]
    out["ratio_save"] = out["save_4_s"] / out["save_1_s"]
    out["ratio_save_median"] = out["save_4_median_s"] / out["save_1_median_s"]
    out["ratio_cpu"] = out["cpu_4_s"] / out["cpu_1_s"]
    out["ratio_cpu_median"] = out["cpu_4_median_s"] / out["cpu_1_median_s"]
    # the 1-device save plus the comparison, done one after the other; and plus the read of the
    # replicas alone (the comparison fused with a pass over the first components)
    out["floor_save"] = (out["save_1_s"] + out["compare_s"]) / out["save_1_s"]
    out["floor_cpu"] = (out["cpu_1_s"] + out["compare_cpu_s"]) / out["cpu_1_s"]
    out["fused_floor_cpu"] = (out["cpu_1_s"] + out["read_cpu_s"]) / out["cpu_1_s"]
    out["load"] = os.getloadavg()[0]
    return out


def _raw_write(arrays: list[np.ndarray], path: str) -> tuple[float, float]:
    """Seconds (wall, and CPU of this process) to ``tofile`` the arrays one after another and
    fsync the file."""
    t, c = time.perf_counter(), time.process_time()
    with open(path, "wb") as fh:
        for a in arrays:
            a.tofile(fh)
        fh.flush()
        os.fsync(fh.fileno())
    return time.perf_counter() - t, time.process_time() - c


def worker_training(
    count: int, size: int, devices: int, folder: str, rounds: int = 3
) -> dict[str, Any]:
    import parallelvars as pv
    from parallelvars._fileio import same_bytes

    ckpt, variables = _model(count, size, devices, True, True)
    gc.collect()
    built = _rss_mb()  # (the resident set now, as every RSS figure of this worker)
    tensors = _tensors(ckpt)
    nbytes = sum(t.nbytes for t in tensors.values())
    largest = max(t.nbytes for t in tensors.values())
    # The bytes the file stores: a replica equal to its variable's first component is stored
    # once (its other names are links), as the writer does.
    stored: list[np.ndarray] = []
    for r in ckpt._gather(False)[0]:
        cs = [tensors[f"{r.path}/{i}"] for i in range(len(r.components))]
        stored += [cs[0]] + [c for c in cs[1:] if r.kind == "sharded" or not same_bytes(c, cs[0])]
    out: dict[str, Any] = {
        "variables": count,
        "entries": len(ckpt._gather(False)[0]),
        "bytes": nbytes,
        "stored_bytes": sum(a.nbytes for a in stored),
        "largest_component": largest,
        "rss_built_mb": built,
        "load_before": os.getloadavg()[0],
    }
    raw = os.path.join(folder, "raw.bin")
    out["raw_write_s"], out["raw_write_cpu_s"] = _raw_write(list(tensors.values()), raw)
    buf = np.empty(nbytes, np.uint8)
    t = time.perf_counter()
    with open(raw, "rb", buffering=0) as fh:
        fh.readinto(memoryview(buf))
    out["raw_read_s"] = time.perf_counter() - t
    del buf
    os.unlink(raw)
    out["raw_stored_s"], out["raw_stored_cpu_s"] = _raw_write(stored, raw)  # what the file holds
    os.unlink(raw)
    del tensors  # (``stored`` views the live components: written again by the rounds below)
    gc.collect()
    for name in ("first", "repeated"):
        with RssPeak() as mem:
            t, c = time.perf_counter(), time.process_time()
            path = ckpt.write(os.path.join(folder, f"{name}.h5"))
            out[f"{name}_s"] = time.perf_counter() - t
            out[f"{name}_cpu_s"] = time.process_time() - c
        out[f"{name}_extra_mb"] = mem.extra_mb  # the save's peak above the model's
        out[f"rss_after_{name}_mb"] = _rss_mb()
    out["file_mb"] = os.path.getsize(path) / 2**20
    with pv.CheckpointManager(ckpt, os.path.join(folder, "mgr"), max_to_keep=1) as mgr:
        for name in ("nonblocking", "nonblocking_again"):
            with RssPeak() as mem:
                t, c = time.perf_counter(), time.process_time()
                mgr.save(blocking=False)
                out[f"{name}_call_s"] = time.perf_counter() - t
                mgr.wait()
                out[f"{name}_whole_s"] = time.perf_counter() - t
                out[f"{name}_whole_cpu_s"] = time.process_time() - c
            out[f"{name}_extra_mb"] = mem.extra_mb
    # The later saves against the raw write of the stored bytes, alternated (the shared disk's
    # rate drifts from second to second: one save each says little): ``rounds`` rounds of a
    # raw write, a blocking save and a non-blocking save (call and whole), each round in
    # another order; best and median of each.
    walls: dict[str, list[float]] = {}
    cpus: dict[str, list[float]] = {}
    order = ["raw", "steady", "steady_nonblocking"]
    with pv.CheckpointManager(ckpt, os.path.join(folder, "mgr2"), max_to_keep=1) as mgr:
        for k in range(rounds):
            for name in order[k % 3 :] + order[: k % 3]:
                gc.collect()
                t, c = time.perf_counter(), time.process_time()
                if name == "raw":
                    _raw_write(stored, raw)
                elif name == "steady":
                    ckpt.write(os.path.join(folder, "steady.h5"))
                else:
                    mgr.save(blocking=False)
                    walls.setdefault("steady_nonblocking_call", []).append(time.perf_counter() - t)
                    mgr.wait()
                walls.setdefault(name, []).append(time.perf_counter() - t)
                cpus.setdefault(name, []).append(time.process_time() - c)
                for done in (raw, os.path.join(folder, "steady.h5")):
                    if os.path.exists(done):
                        os.unlink(done)
    for name, values in walls.items():
        out[f"{name}_best_s"], out[f"{name}_median_s"] = min(values), float(np.median(values))
    for name, values in cpus.items():
        out[f"{name}_best_cpu_s"] = min(values)
        out[f"{name}_median_cpu_s"] = float(np.median(values))
    out["rounds"] = rounds
    for v in variables[:3]:
        v.assign(np.zeros(size, np.float32))
    t = time.perf_counter()
    ckpt.restore(path).assert_consumed()
    out["restore_s"] = time.perf_counter() - t
    # Restore against a raw read of the checkpoint file itself (the same bytes, in the same
    # state of the page cache), alternated: 3 rounds each
    size_of = os.path.getsize(path)
    reads: dict[str, list[float]] = {"raw_read_file": [], "restore_again": []}
    for k in range(3):
        for name in ("raw_read_file", "restore_again")[:: 1 if k % 2 == 0 else -1]:
            gc.collect()
            t = time.perf_counter()
            if name == "raw_read_file":
                buf = np.empty(size_of, np.uint8)
                with open(path, "rb", buffering=0) as fh:
                    fh.readinto(memoryview(buf))
                del buf
            else:
                ckpt.restore(path).assert_consumed()
            reads[name].append(time.perf_counter() - t)
    for name, values in reads.items():
        out[f"{name}_best_s"], out[f"{name}_median_s"] = min(values), float(np.median(values))
    # the raw baselines again, after the saves: the shared disk's rate drifts
    raw_again = [a for r in ckpt._gather(False)[0] for a in r.components]
    out["raw_write_after_s"], _ = _raw_write(raw_again, raw)
    os.unlink(raw)
    out["rss_peak_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    out["load_after"] = os.getloadavg()[0]
    # Rates against raw: per live byte (raw writes every component; the file holds mirrored
    # replicas once, so this favours us by up to the replica count) and per stored byte
    # (raw writes exactly the bytes the file holds: the disk's work for the same file).
    for k in ("first", "repeated", "nonblocking_whole", "nonblocking_again_whole"):
        out[f"ratio_{k}"] = out[f"{k}_s"] / out["raw_write_s"]
        out[f"stored_ratio_{k}"] = out[f"{k}_s"] / out["raw_stored_s"]
    out["ratio_restore"] = out["restore_s"] / out["raw_read_s"]
    # the alternated rounds: write rate against the raw write of the stored bytes (raw's time
    # over the save's), best against best and median against median, wall and CPU
    for k in ("steady", "steady_nonblocking"):
        for stat in ("best", "median"):
            out[f"rate_{k}_{stat}"] = out[f"raw_{stat}_s"] / out[f"{k}_{stat}_s"]
            out[f"rate_{k}_{stat}_cpu"] = out[f"raw_{stat}_cpu_s"] / out[f"{k}_{stat}_cpu_s"]
    return out


def _run_worker(args: list[str]) -> dict[str, Any]:
    folder = tempfile.mkdtemp(prefix="pv_paths_")
    try:
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", *args, folder]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode:
            return {"error": done.stderr.strip().splitlines()[-1:] or ["failed"]}
        return json.loads(done.stdout.strip().splitlines()[-1])
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def save_first(sizes: list[int], structures: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for count in sizes:
        for layered in [s == "layered" for s in structures]:
            for adam in (False, True):
                label = f"{count} {'layered' if layered else 'flat'}{' +Adam' if adam else ''}"
                r = _run_worker(["first", str(count), str(int(adam)), str(int(layered))])
                out[label] = r
                if "error" in r:
                    print(f"  {label}: failed: {r['error']}", flush=True)
                    continue
                n = r["entries"]
                print(
                    f"  {label:26s} first {r['first_s']:7.3f} s ({1e6 * r['first_s'] / n:6.1f} "
                    f"us/entry)  repeated {r['repeated_s']:7.3f} s  safetensors "
                    f"{r['safetensors_s']:6.3f} s  first/st {r['ratio_first']:5.2f} "
                    f"(target <= 1.5)  repeated/st {r['ratio_repeated']:5.2f}  "
                    f"file {r['file_mb']:.1f} MB vs {r['safetensors_mb']:.1f} MB",
                    flush=True,
                )
                print(
                    f"  {'':26s} CPU time (a loaded machine's wall clock waits for a core): "
                    f"first {r['first_cpu_s']:7.3f} s ({1e6 * r['first_cpu_s'] / n:6.1f} "
                    f"us/entry), safetensors {r['safetensors_cpu_s']:6.3f} s, first/st "
                    f"{r['first_cpu_s'] / max(r['safetensors_cpu_s'], 1e-9):5.2f}; floor "
                    f"{r['walk_cpu_s']:7.3f} s ({1e6 * r['walk_cpu_s'] / n:5.1f} us/entry)",
                    flush=True,
                )
                if r.get("libhdf5_s"):
                    print(
                        f"  {'':26s} the libhdf5 writer on the same records (one group of "
                        f"{count} links) {r['libhdf5_s']:7.3f} s: first/libhdf5 "
                        f"{r['first_s'] / r['libhdf5_s']:5.2f}",
                        flush=True,
                    )
                print(
                    f"  {'':26s} floor: graph walk + records {r['walk_s']:7.3f} s "
                    f"({1e6 * r['walk_s'] / n:5.1f} us/entry), walk/st {r['ratio_walk']:5.2f}; "
                    f"first save's peak RSS above the model's {r['first_extra_mb']:.0f} MB "
                    f"(target <= 256 MB + largest component)",
                    flush=True,
                )
    return out


def save_mirrored() -> dict[str, Any]:
    r = _run_worker(["mirrored", "2000", "2500"])
    if "error" not in r:
        print(
            f"  4 devices vs 1 (7 saves of each, alternated; load {r['load']:.2f}): file "
            f"{r['file_4_mb']:.1f} / {r['file_1_mb']:.1f} MB = {r['ratio_size']:.3f}x "
            f"(target <= 1.05)  save best {r['save_4_s']:.3f} / {r['save_1_s']:.3f} s = "
            f"{r['ratio_save']:.2f}x, median {r['ratio_save_median']:.2f}x (target <= 1.2); CPU "
            f"time best {r['cpu_4_s']:.3f} / {r['cpu_1_s']:.3f} s = {r['ratio_cpu']:.2f}x, "
            f"median {r['ratio_cpu_median']:.2f}x",
            flush=True,
        )
        print(
            f"    floor: comparing the {r['replica_mb']:.0f} MB of replicas with their first "
            f"components {r['compare_s']:.3f} s (CPU {r['compare_cpu_s']:.3f} s); the 1-device "
            f"save plus it, one after the other: {r['floor_save']:.2f}x (CPU "
            f"{r['floor_cpu']:.2f}x); plus only a read of the replicas (the comparison fused "
            f"with a pass over the first components, CPU {r['read_cpu_s']:.3f} s): CPU "
            f"{r['fused_floor_cpu']:.2f}x",
            flush=True,
        )
    else:
        print(f"  mirrored: failed: {r['error']}")
    return r


def save_training(big: bool) -> dict[str, Any]:
    out: dict[str, Any] = {}
    cases = [(10000, 2500, 2)] + ([(20000, 2500, 4)] if big else [])
    for count, size, devices in cases:
        label = f"{count} x {size} x {devices} +Adam"
        r = _run_worker(["training", str(count), str(size), str(devices)])
        out[label] = r
        if "error" in r:
            print(f"  {label}: failed: {r['error']}")
            continue
        mb, stored_mb = r["bytes"] / 2**20, r["stored_bytes"] / 2**20
        print(
            f"  {label}: {mb:.0f} MB of components ({stored_mb:.0f} MB stored: replicas once), "
            f"file {r['file_mb']:.0f} MB; load {r['load_before']:.2f} -> {r['load_after']:.2f}",
            flush=True,
        )
        print(
            f"    raw tofile+fsync: every live byte {r['raw_write_s']:.3f} s, CPU "
            f"{r['raw_write_cpu_s']:.3f} s (again after the saves {r['raw_write_after_s']:.3f} "
            f"s), the stored bytes {r['raw_stored_s']:.3f} s, CPU {r['raw_stored_cpu_s']:.3f} "
            f"s; readinto {r['raw_read_s']:.3f} s",
        )
        for k in ("first", "repeated", "nonblocking_whole", "nonblocking_again_whole"):
            cpu = r.get(f"{k}_cpu_s")
            print(
                f"    {k:24s} {r[f'{k}_s']:7.3f} s  ({1e6 * r[f'{k}_s'] / r['entries']:.1f} "
                f"us/entry{f', CPU {cpu:.3f} s' if cpu is not None else ''})  rate vs raw: "
                f"per live byte {1 / r[f'ratio_{k}']:.2f}, per stored byte "
                f"{1 / r[f'stored_ratio_{k}']:.2f} (target >= 0.7)"
            )
        print(
            f"    {r['rounds']} rounds alternated (raw tofile+fsync of the stored bytes, blocking "
            f"save, non-blocking save), best / median: raw {r['raw_best_s']:.3f} / "
            f"{r['raw_median_s']:.3f} s (CPU {r['raw_best_cpu_s']:.3f} / "
            f"{r['raw_median_cpu_s']:.3f} s)"
        )
        for k, text in (("steady", "blocking"), ("steady_nonblocking", "non-blocking (whole)")):
            print(
                f"      {text:22s} {r[f'{k}_best_s']:.3f} / {r[f'{k}_median_s']:.3f} s (CPU "
                f"{r[f'{k}_best_cpu_s']:.3f} / {r[f'{k}_median_cpu_s']:.3f} s): rate vs raw "
                f"{r[f'rate_{k}_best']:.2f} / {r[f'rate_{k}_median']:.2f} (target >= 0.7), CPU "
                f"{r[f'rate_{k}_best_cpu']:.2f} / {r[f'rate_{k}_median_cpu']:.2f}"
            )
        print(
            f"      non-blocking call      {r['steady_nonblocking_call_best_s']:.3f} / "
            f"{r['steady_nonblocking_call_median_s']:.3f} s"
        )
        print(
            f"    nonblocking call   {r['nonblocking_call_s']:7.3f} s, again "
            f"{r['nonblocking_again_call_s']:.3f} s"
        )
        print(f"    restore            {r['restore_s']:7.3f} s  ours/raw {r['ratio_restore']:.2f}")
        print(
            f"    restore against readinto of the checkpoint file itself (3 of each, "
            f"alternated), best / median: {r['restore_again_best_s']:.3f} / "
            f"{r['restore_again_median_s']:.3f} s vs {r['raw_read_file_best_s']:.3f} / "
            f"{r['raw_read_file_median_s']:.3f} s: ours/raw "
            f"{r['restore_again_best_s'] / r['raw_read_file_best_s']:.2f} / "
            f"{r['restore_again_median_s'] / r['raw_read_file_median_s']:.2f}"
        )
        print(
            f"    RSS: built {r['rss_built_mb']:.0f} MB, process peak {r['rss_peak_mb']:.0f} MB; "
            f"peak above the model's: first save {r['first_extra_mb']:.0f} MB, repeated "
            f"{r['repeated_extra_mb']:.0f} MB (target <= 256 MB + largest component "
            f"{r['largest_component'] / 2**20:.2f} MB), non-blocking "
            f"{r['nonblocking_extra_mb']:.0f} MB, again {r['nonblocking_again_extra_mb']:.0f} MB "
            f"(target <= the {mb:.0f} MB it snapshots)",
            flush=True,
        )
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--commands" in argv:
        here = os.path.dirname(os.path.abspath(__file__))
        cmd = [sys.executable, os.path.join(here, "bench_paths_commands.py"), *argv]
        return subprocess.run(cmd, check=False).returncode
    if argv and argv[0] == "--worker":
        kind, *rest = argv[1:]
        folder = rest.pop()
        if kind == "first":
            r = worker_first(int(rest[0]), bool(int(rest[1])), bool(int(rest[2])), folder)
        elif kind == "mirrored":
            r = worker_mirrored(int(rest[0]), int(rest[1]), folder)
        else:
            r = worker_training(int(rest[0]), int(rest[1]), int(rest[2]), folder)
        print(json.dumps(r))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--save", default=",".join(SAVE_CASES), help="save cases to run")
    parser.add_argument("--sizes", default="5000,50000")
    parser.add_argument(
        "--structures", default="layered,flat", help="layered (100 a group), flat (one list)"
    )
    parser.add_argument("--big", action="store_true", help="also 20,000 x 2,500 x 4 devices")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    print(f"load: {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    result: dict[str, Any] = {"load": os.getloadavg()}
    cases = [c for c in args.save.split(",") if c]
    if "first" in cases:
        print("first save in a fresh process (2 devices, 100 float32 params a variable):")
        result["first"] = save_first(
            [int(s) for s in args.sizes.split(",")], args.structures.split(",")
        )
    if "mirrored" in cases:
        print("mirrored model, 2,000 x 2,500 float32 with Adam, 4 devices vs 1:")
        result["mirrored"] = save_mirrored()
    if "training" in cases:
        print("training size:")
        result["training"] = save_training(args.big)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
