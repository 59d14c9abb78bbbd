"""Read throughput of the TensorFlow checkpoint reader against plain file I/O.

Writes a bundle of about ``--mb`` MiB (float32 tensors of ``--tensor-mb`` MiB each, plus a few
small ones), then, several times over and alternating:

- baseline: the data file read tensor by tensor with ``readinto`` into a fresh numpy buffer of
  each tensor's size (no parsing, no checksum);
- reader: ``open_checkpoint`` + ``Entry.component(0)`` for every entry, CRC-32C verified
  (and once more with ``verify=False``, for reference).

It prints the best time of each, the throughputs and the ratio reader / baseline (target:
>= 0.5 with verification on), and the CRC-32C speed over an in-memory buffer. Both reads come
from the page cache (the file was just written), so the ratio measures the reader's own cost.

Usage:
    python bench/bench_tf_read.py --mb 1024
    python bench/bench_tf_read.py --mb 64 --repeat 3   # a quick check
    python bench/bench_tf_read.py --json tf_read.json  # also write the figures as JSON
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time

import numpy as np

from parallelvars.formats import Entry, open_checkpoint, write_checkpoint
from parallelvars.formats._view import CheckpointView
from parallelvars.formats.tf import BundleReader
from parallelvars.formats.tf._crc import crc32c

MiB = 1 << 20


class _RandomEntry(Entry):
    """A float32 tensor made on demand, so writing never holds more than one in memory."""

    def __init__(self, path: str, shape: tuple[int, ...], seed: int) -> None:
        self.path = path
        self.dtype = np.dtype(np.float32)
        self.shape = shape
        self.kind = "single"
        self.num_components = 1
        self.attrs = {}
        self._seed = seed

    def component(self, i: int) -> np.ndarray:
        self._check_index(i)
        return np.random.default_rng(self._seed).random(self.shape, dtype=np.float32)


class _LazyView(CheckpointView):
    def __init__(self, entries: list[Entry]) -> None:
        self._entries = {e.path: e for e in entries}

    def __getitem__(self, key: str) -> Entry:
        return self._entries[key]

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)


def make_bundle(directory: str, total_mb: int, tensor_mb: int) -> str:
    rows = tensor_mb * MiB // 4 // 1024
    entries: list[Entry] = [
        _RandomEntry(f"model/big/{i}", (rows, 1024), i)
        for i in range(max(1, total_mb // tensor_mb))
    ]
    entries += [_RandomEntry(f"model/small/{i}", (17, 3), 1000 + i) for i in range(50)]
    return write_checkpoint(os.path.join(directory, "ckpt-1"), _LazyView(entries), format="tf")


def read_baseline(prefix: str) -> int:
    """Every tensor's bytes with plain readinto, in data-file order, into fresh buffers."""
    with BundleReader(prefix) as r:
        spans = sorted((e.shard_id, e.offset, e.size) for e in r.entries.values() if e.size)
        paths = {s: r.shard_path(s) for s, _, _ in spans}
    total = 0
    files = {s: open(p, "rb", buffering=0) for s, p in paths.items()}  # noqa: SIM115
    try:
        for shard, offset, size in spans:
            buf = np.empty(size, np.uint8)
            f = files[shard]
            f.seek(offset)
            view = memoryview(buf)
            done = 0
            while done < size:
                n = f.readinto(view[done:])
                if not n:
                    raise OSError("short read")
                done += n
            total += size
    finally:
        for f in files.values():
            f.close()
    return total


def read_checkpoint(prefix: str, verify: bool) -> int:
    total = 0
    with open_checkpoint(prefix, format="tf", verify=verify) as view:
        for entry in view.values():
            for i in range(entry.num_components):
                total += entry.component(i).nbytes
    return total


def best_of(fn, repeat: int) -> tuple[float, int]:  # type: ignore[no-untyped-def]
    times = []
    nbytes = 0
    for _ in range(repeat):
        t0 = time.perf_counter()
        nbytes = fn()
        times.append(time.perf_counter() - t0)
    return min(times), nbytes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=1024, help="bundle size in MiB (default 1024)")
    parser.add_argument(
        "--tensor-mb", type=int, default=16, help="size of each large tensor in MiB"
    )
    parser.add_argument(
        "--repeat", type=int, default=5, help="runs of each reader; the best counts"
    )
    parser.add_argument(
        "--dir", default=None, help="where to write the bundle (default: a temp dir)"
    )
    parser.add_argument("--json", metavar="PATH", help="also write the figures to PATH as JSON")
    args = parser.parse_args(argv)

    directory = args.dir or tempfile.mkdtemp(prefix="bench_tf_read_")
    os.makedirs(directory, exist_ok=True)
    try:
        t0 = time.perf_counter()
        prefix = make_bundle(directory, args.mb, min(args.tensor_mb, args.mb))
        written = time.perf_counter() - t0
        size = sum(os.path.getsize(os.path.join(directory, f)) for f in os.listdir(directory))
        print(
            f"bundle: {prefix} ({size / MiB:.1f} MiB, written in {written:.2f} s, "
            f"{size / MiB / written:.0f} MiB/s incl. generating the data)"
        )

        buf = np.random.default_rng(0).random(64 * MiB // 4, dtype=np.float32)
        crc_time, _ = best_of(lambda: (crc32c(buf), buf.nbytes)[1], args.repeat)
        print(f"crc32c: {buf.nbytes / crc_time / 1e9:.1f} GB/s over a 64 MiB buffer")

        results: dict[str, list[float]] = {"baseline": [], "verified": [], "unverified": []}
        nbytes = 0
        for _ in range(args.repeat):  # alternate, so both see the same machine state
            for name, fn in (
                ("baseline", lambda: read_baseline(prefix)),
                ("verified", lambda: read_checkpoint(prefix, True)),
                ("unverified", lambda: read_checkpoint(prefix, False)),
            ):
                t, nbytes = best_of(fn, 1)
                results[name].append(t)
        best = {k: min(v) for k, v in results.items()}
        for name, label in (
            ("baseline", "plain readinto      "),
            ("verified", "reader, CRC verified"),
            ("unverified", "reader, no CRC      "),
        ):
            print(f"{label}: {best[name]:.3f} s  {nbytes / best[name] / 1e9:6.2f} GB/s")
        ratio = best["baseline"] / best["verified"]
        print(f"ratio reader (CRC verified) / plain readinto: {ratio:.2f}x (target >= 0.5x)")
        print(
            f"ratio reader (no CRC) / plain readinto: {best['baseline'] / best['unverified']:.2f}x"
        )
        if args.json:
            figures = {
                "benchmark": "tf_read",
                "params": {"mb": args.mb, "tensor_mb": args.tensor_mb, "repeat": args.repeat},
                "bundle_bytes": size,
                "tensor_bytes": nbytes,
                "write_seconds": written,
                "crc32c_bytes_per_s": buf.nbytes / crc_time,
                "times": {f"{k}_s": v for k, v in best.items()},
                "runs": results,
                "ratios": {
                    "verified_rate_over_baseline": ratio,
                    "unverified_rate_over_baseline": best["baseline"] / best["unverified"],
                },
                "targets": {
                    "verified_rate_over_baseline": {"op": ">=", "value": 0.5, "met": ratio >= 0.5}
                },
            }
            with open(args.json, "w") as f:
                json.dump(figures, f, indent=2)
    finally:
        if args.dir is None:
            shutil.rmtree(directory, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
