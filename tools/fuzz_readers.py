"""Corrupt and fuzz checkpoint files, and read each one in an isolated worker process.

Every damaged file must end one of two ways: the reader raises one of the library's documented
exceptions (a :class:`parallelvars.errors.ParallelVarsError`), or it reads back exactly what
was saved (a digest of every path, kind, dtype, shape, attribute and component byte, plus the
object graph, equals the clean file's). Anything else is a failure and is counted by kind:

* ``wrong``: the file read without an error but gave other values (silent corruption);
* ``undocumented``: an exception outside the library's hierarchy escaped;
* ``crash``: the reader process died (a segfault in a C library);
* ``hang``: the read took longer than the timeout;
* ``alloc``: the reader allocated more than the file could hold (traced numpy allocations).

The reads run in a long-lived worker subprocess (restarted after a crash or a hang), so a
damaged file can never take the caller down.

Run it as a long fuzz session (the tests run the same code with a few hundred cases)::

    python tools/fuzz_readers.py --cases 20000 --format hdf5
    python tools/fuzz_readers.py --seconds 600            # every format, until time is up
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import select
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

# --------------------------------------------------------------------------- the sample model

#: Formats the sample can be written in; non-native ones need parallelvars.formats' adapter.
ALL_FORMATS = ("hdf5", "safetensors", "npz", "keras", "keras-legacy", "tf")
OK_OUTCOMES = ("detected", "harmless")
BAD_OUTCOMES = ("wrong", "undocumented", "crash", "hang", "alloc")
#: Reads may allocate about one copy of the largest component twice over, plus h5py's own.
ALLOC_SLACK = 4 << 20


def build_sample(string_variable: bool = False) -> Any:
    """A small checkpoint with every variable kind (mirrored, on-read, sharded, single)."""
    import numpy as np

    import parallelvars as pv

    with pv.MirroredStrategy(2).scope():
        w = pv.Variable(np.linspace(-1, 1, 24, dtype=np.float32).reshape(6, 4), name="w")
        b = pv.Variable(np.arange(4, dtype=np.float64) / 3, name="b")
        n = pv.Variable(
            np.float32(5.0), name="n",
            synchronization=pv.Synchronization.ON_READ, aggregation=pv.Aggregation.SUM,
        )
        e = pv.Variable(np.arange(40, dtype=np.int32).reshape(10, 4), name="e", shard_axis=0)
    model = pv.Module()
    model.w, model.b, model.n, model.e = w, b, n, e
    if string_variable:
        model.s = pv.Variable(np.array([b"alpha", b"", b"gamma"], dtype=object), name="s")
    step = pv.Variable(np.int64(42), name="step")
    return pv.Checkpoint(model=model, step=step)


def available_formats() -> list[str]:
    """The formats this installation can write (hdf5 always; others once their adapter exists)."""
    out = ["hdf5"]
    try:
        from parallelvars.formats import get_format
    except ImportError:
        return out
    for name in ALL_FORMATS[1:]:
        try:
            spec = get_format(name)
        except (ImportError, AttributeError, ValueError):
            continue
        if spec.write is not None:
            out.append(name)
    return out


_SUFFIX = {
    "hdf5": ".h5", "safetensors": ".safetensors", "npz": ".npz", "keras": ".weights.h5", "keras-legacy": ".h5", "tf": "",
}


def write_sample(fmt: str, directory: str, *, string_variable: bool = False) -> str:
    """Write the sample checkpoint in ``fmt`` under ``directory``; returns its path."""
    ckpt = build_sample(string_variable)
    native = ckpt.write(os.path.join(directory, "sample.h5"))
    if fmt == "hdf5":
        return native
    from parallelvars.checkpoint.h5io import H5Reader
    from parallelvars.formats import write_checkpoint

    target = os.path.join(directory, f"sample-{fmt}{_SUFFIX.get(fmt, '')}")
    with H5Reader(native) as reader:
        return write_checkpoint(target, dict(reader.items()), format=fmt)


def checkpoint_files(path: str) -> list[str]:
    """The files a checkpoint consists of: the file itself, or ``<prefix>.*`` for a TF prefix."""
    if os.path.isfile(path):
        return [path]
    directory, prefix = os.path.split(path)
    files = sorted(os.path.join(directory, f) for f in os.listdir(directory) if f.startswith(prefix + "."))
    if not files:
        raise FileNotFoundError(path)
    return files


def copy_checkpoint(path: str, new_path: str) -> list[str]:
    """Copy every file of the checkpoint at ``path`` to the same names under ``new_path``."""
    out = []
    for f in checkpoint_files(path):
        target = new_path + f[len(path) :]
        with open(f, "rb") as src, open(target, "wb") as dst:
            dst.write(src.read())
        out.append(target)
    return out


# --------------------------------------------------------------------------- reading (worker side)
def _canon(value: Any) -> Any:
    import numpy as np

    if isinstance(value, dict):
        return {str(k): _canon(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, (list, tuple)):
        return [_canon(v) for v in value]
    if isinstance(value, np.ndarray):
        return _canon(value.tolist())
    if isinstance(value, np.generic):
        return _canon(value.item())
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, float) and value != value:
        return "nan"
    return value


def read_digest(path: str, fmt: str) -> str:
    """Read everything in the checkpoint (verifying checksums) and digest it."""
    import numpy as np

    h = hashlib.sha256()
    if fmt == "hdf5":
        from parallelvars.checkpoint.h5io import H5Reader

        view: Any = H5Reader(path)
        extra = {"graph": view.object_graph}
    else:
        from parallelvars.formats import open_checkpoint

        view = open_checkpoint(path, format=fmt)
        extra = {}
    try:
        meta = dict(getattr(view, "metadata", {}) or {})
        meta.pop("created", None)  # the write time: compared on the clean file only
        h.update(json.dumps(_canon({"meta": meta, **extra}), sort_keys=True).encode())
        for key in list(view):
            entry = view[key]
            head = {
                "path": key, "kind": entry.kind, "dtype": str(np.dtype(entry.dtype)),
                "shape": [int(s) for s in entry.shape], "n": int(entry.num_components),
                "attrs": _canon(dict(entry.attrs)),
            }
            h.update(json.dumps(head, sort_keys=True, default=str).encode())
            for i in range(entry.num_components):
                comp = np.asarray(entry.component(i))
                if comp.dtype.kind == "O":
                    for item in comp.reshape(-1):
                        b = bytes(item)
                        h.update(len(b).to_bytes(8, "little") + b)
                else:
                    h.update(str(comp.shape).encode())
                    h.update(np.ascontiguousarray(comp).tobytes())
                del comp
        if fmt == "hdf5":
            problems = view.verify_all()
            if problems:  # damage verify reports is detected damage
                from parallelvars.errors import CorruptCheckpointError

                raise CorruptCheckpointError("verify found problems", file=path, found="; ".join(problems))
    finally:
        view.close()
    return h.hexdigest()


def _classify(path: str, fmt: str, clean: str) -> dict[str, Any]:
    import tracemalloc

    from parallelvars.errors import ParallelVarsError

    tracemalloc.start()
    tracemalloc.reset_peak()
    try:
        digest = read_digest(path, fmt)
        outcome, detail = ("harmless", "") if digest == clean else ("wrong", "digest differs")
    except ParallelVarsError as exc:
        outcome, detail = "detected", f"{type(exc).__name__}: {exc}"[:300]
    except Exception as exc:
        outcome, detail = "undocumented", f"{type(exc).__name__}: {exc}"[:300]
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return {"outcome": outcome, "detail": detail, "peak": peak}


def _worker_main() -> None:
    clean: dict[tuple[str, str], str] = {}
    for line in sys.stdin:
        req = json.loads(line)
        if req.get("selftest") == "segfault":  # the harness's own test: a real crash
            import faulthandler

            faulthandler.disable()
            faulthandler._sigsegv()
        if req.get("selftest") == "hang":
            time.sleep(3600)
        key = (req["clean"], req["format"])
        if key not in clean:
            clean[key] = read_digest(req["clean"], req["format"])
        res = _classify(req["path"], req["format"], clean[key])
        sys.stdout.write(json.dumps(res) + "\n")
        sys.stdout.flush()


# --------------------------------------------------------------------------- the worker (caller side)
class ReaderWorker:
    """A subprocess that reads damaged files on request; restarted after a crash or hang."""

    def __init__(self, timeout: float = 20.0) -> None:
        self.timeout = timeout
        self._proc: subprocess.Popen[str] | None = None

    def _start(self) -> subprocess.Popen[str]:
        if self._proc is None or self._proc.poll() is not None:
            env = dict(os.environ, PYTHONFAULTHANDLER="1")
            self._proc = subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), "--worker"],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                text=True, env=env,
            )
        return self._proc

    def check(self, path: str, clean: str, fmt: str, *, selftest: str | None = None) -> dict[str, Any]:
        """Read ``path`` in the worker and classify the result (see the module docstring)."""
        proc = self._start()
        assert proc.stdin is not None and proc.stdout is not None
        request = {"path": path, "clean": clean, "format": fmt, "selftest": selftest}
        try:
            proc.stdin.write(json.dumps(request) + "\n")
            proc.stdin.flush()
        except BrokenPipeError:
            return self._died(proc)
        ready, _, _ = select.select([proc.stdout], [], [], self.timeout)
        if not ready:
            self.close()
            return {"outcome": "hang", "detail": f"no answer within {self.timeout:.0f} s", "peak": 0}
        line = proc.stdout.readline()
        if not line:
            return self._died(proc)
        res: dict[str, Any] = json.loads(line)
        size = max(sum(sample_sizes(path)), sum(sample_sizes(clean)))
        if res["outcome"] in OK_OUTCOMES and res["peak"] > 2 * size + ALLOC_SLACK:
            res = {**res, "outcome": "alloc", "detail": f"peak {res['peak']} bytes for a {size}-byte file"}
        return res

    def _died(self, proc: subprocess.Popen[str]) -> dict[str, Any]:
        rc = proc.wait()
        self.close()
        return {"outcome": "crash", "detail": f"reader process exited with {rc}", "peak": 0}

    def close(self) -> None:
        if self._proc is not None:
            if self._proc.poll() is None:
                self._proc.kill()
            self._proc.wait()
            for stream in (self._proc.stdin, self._proc.stdout):
                if stream is not None:
                    try:
                        stream.close()
                    except OSError:
                        pass
            self._proc = None

    def __enter__(self) -> ReaderWorker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --------------------------------------------------------------------------- mutations
@dataclass(frozen=True)
class Mutation:
    """One way of damaging a file: flip bytes (xor masks at offsets) or cut it short."""

    flips: tuple[tuple[int, int], ...] = ()
    truncate_to: int | None = None
    target: int = 0  # which file of a multi-file checkpoint

    def apply(self, data: bytes) -> bytes:
        out = bytearray(data)
        for offset, mask in self.flips:
            if 0 <= offset < len(out):
                out[offset] ^= mask or 0xFF
        if self.truncate_to is not None:
            del out[self.truncate_to :]
        return bytes(out)

    def describe(self) -> str:
        where = f"file {self.target}: " if self.target else ""
        if self.truncate_to is not None:
            return f"{where}truncate to {self.truncate_to}"
        return where + ", ".join(f"xor {m:#04x} at {o}" for o, m in self.flips)


def random_mutations(
    sizes: int | list[int], count: int, seed: int, truncate_share: float = 0.2
) -> Iterator[Mutation]:
    """Single-byte flips anywhere and truncations at any length, reproducibly.

    ``sizes``: the file size, or the sizes of each file of a multi-file checkpoint (each file
    is damaged as often as the others, so a small index gets as much attention as the data).
    """
    rng = random.Random(seed)
    sizes = [sizes] if isinstance(sizes, int) else list(sizes)
    for _ in range(count):
        target = rng.randrange(len(sizes))
        size = max(1, sizes[target])
        if rng.random() < truncate_share:
            yield Mutation(truncate_to=rng.randrange(size), target=target)
        else:
            yield Mutation(flips=((rng.randrange(size), rng.randrange(1, 256)),), target=target)


def sample_sizes(path: str) -> list[int]:
    return [os.path.getsize(f) for f in checkpoint_files(path)]


def run_campaign(
    fmt: str,
    directory: str,
    mutations: Iterator[Mutation] | list[Mutation],
    *,
    worker: ReaderWorker | None = None,
    string_variable: bool = False,
    deadline: float | None = None,
) -> tuple[Counter[str], list[tuple[str, str]]]:
    """Write the sample in ``fmt``, damage it by each mutation, read each copy in the worker.

    Returns:
        counts by outcome, and ``(mutation, detail)`` for every bad outcome.
    """
    clean = write_sample(fmt, directory, string_variable=string_variable)
    base = os.path.basename(clean)
    suffix = _SUFFIX.get(fmt, "") if base.endswith(_SUFFIX.get(fmt, "")) else os.path.splitext(base)[1]
    damaged = os.path.join(directory, "damaged" + suffix)
    files = copy_checkpoint(clean, damaged)
    originals = []
    for name in files:
        with open(name, "rb") as f:
            originals.append(f.read())
    own = worker is None
    worker = worker or ReaderWorker()
    counts: Counter[str] = Counter()
    failures: list[tuple[str, str]] = []
    try:
        for mutation in mutations:
            if deadline is not None and time.monotonic() > deadline:
                break
            target = mutation.target % len(files)
            with open(files[target], "wb") as f:
                f.write(mutation.apply(originals[target]))
            try:
                res = worker.check(damaged, clean, fmt)
            finally:
                with open(files[target], "wb") as f:
                    f.write(originals[target])
            counts[res["outcome"]] += 1
            if res["outcome"] not in OK_OUTCOMES:
                failures.append((mutation.describe(), f"{res['outcome']}: {res['detail']}"))
    finally:
        if own:
            worker.close()
    return counts, failures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--format", action="append", help="format(s) to fuzz (default: all available)")
    parser.add_argument("--cases", type=int, default=5000, help="damaged files per format")
    parser.add_argument("--seconds", type=float, default=None, help="stop each format after this long")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--strings", action="store_true", help="add a byte-string variable to the sample")
    args = parser.parse_args(argv)
    if args.worker:
        _worker_main()
        return 0
    import tempfile

    formats = args.format or available_formats()
    total_bad = 0
    with ReaderWorker() as worker:
        for fmt in formats:
            with tempfile.TemporaryDirectory() as d:
                clean = write_sample(fmt, d, string_variable=args.strings)
                size = sum(sample_sizes(clean))
                deadline = None if args.seconds is None else time.monotonic() + args.seconds
                t0 = time.monotonic()
                counts, failures = run_campaign(
                    fmt, d, random_mutations(sample_sizes(clean), args.cases, args.seed), worker=worker,
                    string_variable=args.strings, deadline=deadline,
                )
            n = sum(counts.values())
            print(f"{fmt}: {n} damaged files ({size} bytes each) in {time.monotonic() - t0:.1f} s: "
                  + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
            for what, detail in failures[:20]:
                print(f"  FAIL {what}: {detail}")
            total_bad += len(failures)
    return 1 if total_bad else 0


if __name__ == "__main__":
    sys.exit(main())
