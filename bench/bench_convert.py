"""Benchmark: convert HDF5 -> safetensors -> HDF5 against a plain file copy, and its memory.

Builds a checkpoint of ``--mb`` megabytes (default 2048) in our HDF5 layout with
``write_h5`` (single, mirrored and sharded float32 / bfloat16 variables; the largest tensor is
``--largest-mb``, default an eighth of the total), then in one run:

* copies the file with ``shutil.copyfile`` + ``fsync`` (the baseline),
* converts it to safetensors and back with :func:`parallelvars.formats.convert`, each step in
  its own child process, so that its peak resident memory (``VmHWM``) and
  its peak anonymous memory (``RssAnon``, sampled; file pages mapped for reading are not
  allocations) belong to that step alone.

It prints throughput (tensor bytes per second) against the copy, the peak memory against the
largest tensor, and checks the targets: throughput >= 0.5x the copy, peak RSS < largest
tensor + 256 MB.

Usage::

    python bench/bench_convert.py            # 2 GB
    python bench/bench_convert.py --mb 200   # a quick run
    python bench/bench_convert.py --json convert.json   # also write the figures as JSON
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import ml_dtypes
import numpy as np

MB = 1 << 20


def _peak_rss() -> int:
    """This process's peak resident set (``VmHWM``), in bytes.

    Not ``getrusage().ru_maxrss``: on Linux that survives fork and exec, so a child would
    report its parent's peak (here: the parent that generated the whole source file).
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _anon_rss() -> int:
    """Resident anonymous memory of this process in bytes (Linux), else 0."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _child(step: str, src: str, dst: str) -> None:
    """Run one convert step and print its figures as JSON."""
    from parallelvars.formats import convert

    peak_anon = _anon_rss()
    stop = threading.Event()

    def sample() -> None:
        nonlocal peak_anon
        while not stop.wait(0.005):
            peak_anon = max(peak_anon, _anon_rss())

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t0 = time.perf_counter()
    convert(src, dst)
    seconds = time.perf_counter() - t0
    stop.set()
    sampler.join()
    peak_anon = max(peak_anon, _anon_rss())
    print(
        json.dumps(
            {
                "step": step,
                "seconds": seconds,
                "peak_rss": _peak_rss(),
                "peak_anon": peak_anon,
            }
        )
    )


class _Synth:
    """An entry whose components are generated on demand (so building the file streams too)."""

    def __init__(
        self, path: str, dtype: Any, shape: tuple[int, ...], kind: str, n: int, seed: int
    ) -> None:
        self.path = path
        self.dtype = np.dtype(dtype)
        self.shape = shape
        self.kind = kind
        self.num_components = n
        self.attrs: dict[str, Any] = (
            {"devices": [f"cpu:{i}" for i in range(n)]} if kind != "single" else {}
        )
        if kind == "sharded":
            rows = shape[0]
            base, extra = divmod(rows, n)
            offsets, start = [], 0
            for i in range(n):
                offsets.append(start)
                start += base + (1 if i < extra else 0)
            self.attrs.update(shard_axis=0, shard_offsets=offsets)
        self._seed = seed

    def component_shape(self, i: int) -> tuple[int, ...]:
        if self.kind != "sharded":
            return self.shape
        offsets = [*self.attrs["shard_offsets"], self.shape[0]]
        return (offsets[i + 1] - offsets[i], *self.shape[1:])

    def component(self, i: int) -> np.ndarray:
        rng = np.random.default_rng(self._seed * 1000 + i)
        shape = self.component_shape(i)
        return rng.random(shape, dtype=np.float32).astype(self.dtype, copy=False)

    def read_component_into(self, i: int, out: np.ndarray) -> None:
        # write_h5 reads entries that hold no arrays through this, into one reused buffer.
        out[...] = self.component(i)


def _entries(total: int, largest: int) -> list[_Synth]:
    """Variables adding up to ``total`` bytes, the largest tensor ``largest`` bytes."""
    out: list[_Synth] = [
        _Synth("model/embedding", np.float32, (largest // 4096, 1024), "single", 1, 0)
    ]
    used = out[0].shape[0] * 4096
    chunk = max(MB, min(largest // 2, total // 16))
    i = 1
    kinds = [
        ("single", 1, np.float32),
        ("mirrored", 2, np.float32),
        ("sharded", 4, np.float32),
        ("single", 1, ml_dtypes.bfloat16),
    ]
    while used + 4096 * 2 <= total:
        kind, n, dtype = kinds[i % len(kinds)]
        itemsize = np.dtype(dtype).itemsize
        per_tensor = min(chunk, (total - used) // (n if kind == "mirrored" else 1))
        rows = max(1, per_tensor // (1024 * itemsize))
        e = _Synth(f"model/layer{i:03d}/kernel", dtype, (rows, 1024), kind, n, i)
        size = rows * 1024 * itemsize * (n if kind == "mirrored" else 1)
        if used + size > total:
            break
        out.append(e)
        used += size
        i += 1
    return out


def _copy(src: str, dst: str) -> float:
    if os.path.exists(dst):
        os.unlink(dst)  # each timed run writes a new file, as each convert does
    t0 = time.perf_counter()
    shutil.copyfile(src, dst)
    fd = os.open(dst, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - t0


def _run_child(step: str, src: str, dst: str) -> dict[str, Any]:
    if os.path.exists(dst):
        os.unlink(dst)
    proc = subprocess.run(
        [sys.executable, __file__, "--child", step, src, dst],
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=2048, help="checkpoint size in MB (default 2048)")
    parser.add_argument(
        "--largest-mb", type=int, default=None, help="largest tensor in MB (default mb/8)"
    )
    parser.add_argument("--repeat", type=int, default=3, help="runs per step; the best time counts")
    parser.add_argument("--dir", default=None, help="work folder (default: a temporary folder)")
    parser.add_argument("--json", metavar="PATH", help="also write the figures to PATH as JSON")
    parser.add_argument("--child", nargs=3, metavar=("STEP", "SRC", "DST"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        _child(*args.child)
        return 0

    from parallelvars.checkpoint.h5io import write_h5
    from parallelvars.formats import open_checkpoint

    total = args.mb * MB
    largest = (args.largest_mb or max(1, args.mb // 8)) * MB
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        src = os.path.join(tmp, "ckpt.h5")
        entries = _entries(total, largest)
        t0 = time.perf_counter()
        write_h5(src, entries)
        build = time.perf_counter() - t0
        with open_checkpoint(src) as view:
            data = sum(e.nbytes for e in view.values())
            biggest = max(
                e.component_nbytes(i) for e in view.values() for i in range(e.num_components)
            )
            biggest = max(
                biggest, max(int(np.prod(e.shape)) * e.dtype.itemsize for e in view.values())
            )
        print(
            f"checkpoint: {len(entries)} variables, {data / MB:.0f} MB of tensors "
            f"(file {os.path.getsize(src) / MB:.0f} MB, built in {build:.1f} s), "
            f"largest tensor {biggest / MB:.0f} MB"
        )

        copy_path = os.path.join(tmp, "copy.h5")
        copy_s = min(_copy(src, copy_path) for _ in range(args.repeat))
        os.unlink(copy_path)
        copy_rate = os.path.getsize(src) / copy_s
        print(
            f"baseline  shutil.copyfile + fsync: {copy_s:6.2f} s  {copy_rate / MB:8.0f} MB/s "
            f"(best of {args.repeat})"
        )

        st = os.path.join(tmp, "ckpt.safetensors")
        back = os.path.join(tmp, "back.h5")
        ok = True
        steps: dict[str, dict[str, Any]] = {}
        for step, a, b in (("hdf5 -> safetensors", src, st), ("safetensors -> hdf5", st, back)):
            runs = [_run_child(step, a, b) for _ in range(args.repeat)]
            seconds = min(r["seconds"] for r in runs)
            peak = max(r["peak_rss"] for r in runs)
            anon = max(r["peak_anon"] for r in runs)
            rate = data / seconds
            ratio = rate / copy_rate
            limit = biggest + 256 * MB
            print(
                f"convert   {step}: {seconds:6.2f} s  {rate / MB:6.0f} MB/s = {ratio:.2f}x copy "
                f"[target >= 0.5x: {'met' if ratio >= 0.5 else 'MISSED'}]"
            )
            print(
                f"          peak RSS {peak / MB:.0f} MB [target < largest + 256 MB = {limit / MB:.0f} MB: "
                f"{'met' if peak < limit else 'MISSED'}]; peak anonymous memory {anon / MB:.0f} MB "
                f"[{'met' if anon < limit else 'MISSED'}] (RSS also counts the file pages a reader "
                f"maps; they are page cache, not allocations)"
            )
            ok &= ratio >= 0.5 and peak < limit
            steps[step] = {
                "seconds": seconds,
                "rate_bytes_per_s": rate,
                "runs_seconds": [r["seconds"] for r in runs],
                "peak_rss_bytes": peak,
                "peak_anon_bytes": anon,
                "budget_bytes": limit,
                "ratios": {"rate_over_copy": ratio, "peak_rss_over_budget": peak / limit},
                "targets": {
                    "rate_over_copy": {"op": ">=", "value": 0.5, "met": ratio >= 0.5},
                    "peak_rss_over_budget": {"op": "<", "value": 1.0, "met": peak < limit},
                },
            }
        with open_checkpoint(src) as a, open_checkpoint(back) as b:
            same = sorted(a) == sorted(b) and all(
                a[k].num_components == b[k].num_components
                and np.array_equal(
                    a[k].component(0).view(np.uint8), b[k].component(0).view(np.uint8)
                )
                for k in list(a)[:3]
            )
        print(f"round trip identical (first variables checked bit for bit): {same}")
        print("targets met" if ok and same else "TARGETS MISSED")
        if args.json:
            figures = {
                "benchmark": "convert",
                "params": {"mb": args.mb, "largest_mb": largest // MB, "repeat": args.repeat},
                "variables": len(entries),
                "tensor_bytes": data,
                "file_bytes": os.path.getsize(src),
                "largest_tensor_bytes": biggest,
                "copy_seconds": copy_s,
                "copy_rate_bytes_per_s": copy_rate,
                "steps": steps,
                "round_trip_identical": bool(same),
            }
            with open(args.json, "w") as f:
                json.dump(figures, f, indent=2)
    return 0 if ok and same else 1


if __name__ == "__main__":
    sys.exit(main())
