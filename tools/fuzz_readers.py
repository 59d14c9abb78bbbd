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
    python tools/fuzz_readers.py --crafted                # the hand-made hostile files (CRAFTED)
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
            np.float32(5.0),
            name="n",
            synchronization=pv.Synchronization.ON_READ,
            aggregation=pv.Aggregation.SUM,
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
    "hdf5": ".h5",
    "safetensors": ".safetensors",
    "npz": ".npz",
    "keras": ".weights.h5",
    "keras-legacy": ".h5",
    "tf": "",
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
    if fmt == "tf":  # always a fresh prefix: written over itself, a TF checkpoint takes the
        for f in os.listdir(directory):  # other data file count (a new set of file names)
            if f.startswith(os.path.basename(target) + "."):
                os.unlink(os.path.join(directory, f))
    with H5Reader(native) as reader:
        return write_checkpoint(target, dict(reader.items()), format=fmt)


def checkpoint_files(path: str) -> list[str]:
    """The files a checkpoint consists of: the file itself, or ``<prefix>.*`` for a TF prefix."""
    if os.path.isfile(path):
        return [path]
    directory, prefix = os.path.split(path)
    files = sorted(
        os.path.join(directory, f) for f in os.listdir(directory) if f.startswith(prefix + ".")
    )
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


# --------------------------------------------------------------------------- crafted files
# Hand-made hostile inputs, one per class of attack: each maker writes its file(s) under a
# directory and returns the path to open. Every one must be refused with a documented error
# (or, for the legal ones, read), in bounded time and memory; see tests/test_hostile.py.

DEEP = 100_000  # nesting of the deep JSON documents


def _deep_json(depth: int = DEEP) -> bytes:
    return b'{"x": ' + b"[" * depth + b"]" * depth + b"}"


def _safetensors_bytes(header: bytes, data: bytes = b"") -> bytes:
    import struct

    header += b" " * (-len(header) % 8)
    return struct.pack("<Q", len(header)) + header + data


def _write(path: str, data: bytes) -> str:
    with open(path, "wb") as f:
        f.write(data)
    return path


def craft_npz_lying_directory(directory: str, claimed: int = 64 << 30) -> str:
    """A ~300-byte npz whose one DEFLATED member claims ``claimed`` bytes (zip64 sizes), with
    a .npy header that agrees, so nothing but the directory's word says how large it is."""
    import struct
    import zlib

    npy = bytearray(b"\x93NUMPY\x01\x00")
    text = f"{{'descr': '<f4', 'fortran_order': False, 'shape': ({(claimed - 128) // 4},), }}"
    text = text.ljust(128 - 10 - 1) + "\n"
    npy += struct.pack("<H", len(text)) + text.encode("latin1")
    assert len(npy) == 128 and (claimed - 128) % 4 == 0
    comp = zlib.compressobj(9, zlib.DEFLATED, -15)
    body = comp.compress(bytes(npy) + bytes(64)) + comp.flush()
    name = b"w.npy"
    crc = zlib.crc32(bytes(npy))
    extra = struct.pack("<HHQQ", 1, 16, claimed, len(body))
    local = (
        struct.pack(
            "<IHHHHHIIIHH",
            0x04034B50,
            45,
            0,
            8,
            0,
            0x21,
            crc,
            0xFFFFFFFF,
            0xFFFFFFFF,
            len(name),
            len(extra),
        )
        + name
        + extra
    )
    central = (
        struct.pack(
            "<IHHHHHHIIIHHHHHII",
            0x02014B50,
            45,
            45,
            0,
            8,
            0,
            0x21,
            crc,
            0xFFFFFFFF,
            0xFFFFFFFF,
            len(name),
            len(extra),
            0,
            0,
            0,
            0,
            0,
        )
        + name
        + extra
    )
    start = len(local) + len(body)
    end = struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, 1, 1, len(central), start, 0)
    return _write(os.path.join(directory, "lying.npz"), local + body + central + end)


def craft_npz_zip_bomb(directory: str, size: int = 256 << 20) -> str:
    """An honest zip bomb: a DEFLATED member of ``size`` zero bytes (~1000:1)."""
    import zipfile

    import numpy as np

    path = os.path.join(directory, "bomb.npz")
    with (
        zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf,
        zf.open("w.npy", "w", force_zip64=True) as f,
    ):
        np.lib.format.write_array_header_1_0(
            f, {"descr": "<f4", "fortran_order": False, "shape": (size // 4,)}
        )
        chunk = bytes(1 << 20)
        for _ in range(size // len(chunk)):
            f.write(chunk)
    return path


def craft_npz_huge_npy_header(directory: str) -> str:
    """An npz whose member's .npy (format 2.0) header length field claims 4 GiB."""
    import struct
    import zipfile

    path = os.path.join(directory, "huge-header.npz")
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("w.npy", b"\x93NUMPY\x02\x00" + struct.pack("<I", 0xFFFFFFF0) + b"{'descr'")
    return path


def craft_npz_deep_json(directory: str) -> str:
    """An npz whose parallelvars record is JSON nested 100,000 deep."""
    import zipfile

    path = os.path.join(directory, "deep.npz")
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("__parallelvars__.json", _deep_json())
    return path


def craft_safetensors_deep_json(directory: str) -> str:
    return _write(os.path.join(directory, "deep.safetensors"), _safetensors_bytes(_deep_json()))


def craft_safetensors_deep_metadata(directory: str) -> str:
    """Deep JSON inside the ``parallelvars`` metadata string of an otherwise valid header."""
    header = json.dumps({"__metadata__": {"parallelvars": _deep_json().decode()}}).encode()
    return _write(os.path.join(directory, "deep-meta.safetensors"), _safetensors_bytes(header))


def craft_safetensors_index_deep_json(directory: str) -> str:
    return _write(
        os.path.join(directory, "model.safetensors.index.json"),
        b'{"weight_map": {}, "metadata": ' + _deep_json() + b"}",
    )


def craft_safetensors_lying_offsets(directory: str) -> str:
    """A tensor whose data_offsets run 1 TiB past the end of the file."""
    header = json.dumps(
        {"w": {"dtype": "F32", "shape": [1 << 38], "data_offsets": [0, 1 << 40]}}
    ).encode()
    return _write(
        os.path.join(directory, "lying.safetensors"), _safetensors_bytes(header, bytes(16))
    )


def craft_safetensors_overlap(directory: str) -> str:
    """Two tensors sharing the same bytes."""
    header = json.dumps(
        {
            "a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
            "b": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
        }
    ).encode()
    return _write(
        os.path.join(directory, "overlap.safetensors"), _safetensors_bytes(header, bytes(16))
    )


def craft_safetensors_header_past_end(directory: str) -> str:
    """A header length of 90 MB in a 64-byte file."""
    import struct

    return _write(
        os.path.join(directory, "short.safetensors"),
        struct.pack("<Q", 90_000_000) + b"{" + bytes(55),
    )


def craft_safetensors_large_header(directory: str, tensors: int = 200_000) -> str:
    """A legal file whose header holds ``tensors`` one-element tensors (~17 MB at 200,000;
    1,000,000 gives the ~90 MB of the slow test)."""
    parts = [b"{"]
    for i in range(tensors):
        parts.append(
            b'"model.layers.%d.weight":{"dtype":"F32","shape":[1],"data_offsets":[%d,%d]},'
            % (i, 4 * i, 4 * i + 4)
        )
    parts[-1] = parts[-1][:-1]
    parts.append(b"}")
    return _write(
        os.path.join(directory, "large-header.safetensors"),
        _safetensors_bytes(b"".join(parts), bytes(4 * tensors)),
    )


def craft_tf_many_slices(directory: str, slices: int = 8000) -> str:
    """A TF bundle with one variable partitioned into ``slices`` slices along axis 0."""
    import numpy as np

    from parallelvars.formats.tf._bundle import BundleWriter

    prefix = os.path.join(directory, "slices", "ckpt")
    os.makedirs(os.path.dirname(prefix), exist_ok=True)
    with BundleWriter(prefix) as w:
        for i in range(slices):
            w.add_slice(b"v", (slices, 2), ((i, 1), (0, None)), np.full((1, 2), i, np.float32))
    return prefix


def craft_tf_deep_metadata(directory: str) -> str:
    """A TF bundle whose parallelvars metadata key holds deep JSON."""
    import numpy as np

    from parallelvars.formats.tf._bundle import BundleWriter

    prefix = os.path.join(directory, "deepmeta", "ckpt")
    os.makedirs(os.path.dirname(prefix), exist_ok=True)
    with BundleWriter(prefix) as w:
        w.add(b"w/.ATTRIBUTES/VARIABLE_VALUE", np.ones(2))
        w.add(b"_PARALLELVARS_METADATA", np.array(_deep_json(), dtype=object))
    return prefix


def craft_tf_state_outside(directory: str, how: str = "dotdot") -> str:
    """A directory whose ``checkpoint`` state file names a checkpoint elsewhere (through
    ``..``, or by absolute path); the checkpoint there is valid."""
    import numpy as np

    from parallelvars.formats.tf._bundle import BundleWriter

    elsewhere = os.path.join(directory, "elsewhere")
    os.makedirs(elsewhere, exist_ok=True)
    with BundleWriter(os.path.join(elsewhere, "ckpt-1")) as w:
        w.add(b"w/.ATTRIBUTES/VARIABLE_VALUE", np.ones(2))
    here = os.path.join(directory, f"state-{how}")
    os.makedirs(here, exist_ok=True)
    target = (
        "../elsewhere/ckpt-1"
        if how == "dotdot"
        else os.path.abspath(os.path.join(elsewhere, "ckpt-1"))
    )
    with open(os.path.join(here, "checkpoint"), "w") as f:
        f.write(f'model_checkpoint_path: "{target}"\n')
    return here


def craft_hdf5_deep_graph(directory: str) -> str:
    """A native checkpoint whose object graph document is deep JSON (with a matching CRC)."""
    import crc32c
    import h5py
    import numpy as np

    from parallelvars.checkpoint.h5io import GRAPH_DATASET

    path = write_sample("hdf5", directory)
    raw = _deep_json()
    with h5py.File(path, "r+") as f:
        del f[GRAPH_DATASET]
        ds = f.create_dataset(GRAPH_DATASET, data=np.bytes_(raw))
        ds.attrs["crc32c"] = np.int64(crc32c.crc32c(raw))
    return path


def craft_hdf5_bad_graph(directory: str) -> str:
    """A native checkpoint whose object graph has children of the wrong shape."""
    import crc32c
    import h5py
    import numpy as np

    from parallelvars.checkpoint.h5io import GRAPH_DATASET

    path = os.path.join(directory, "badgraph.h5")
    os.replace(write_sample("hdf5", directory), path)
    raw = json.dumps(
        {"nodes": [{"children": [["model", "x"]]}, {"children": 5, "path": 7}]}
    ).encode()
    with h5py.File(path, "r+") as f:
        del f[GRAPH_DATASET]
        ds = f.create_dataset(GRAPH_DATASET, data=np.bytes_(raw))
        ds.attrs["crc32c"] = np.int64(crc32c.crc32c(raw))
    return path


#: name -> maker. Each is refused with a documented error, except the legal ones in LEGAL.
CRAFTED: dict[str, Any] = {
    "npz-lying-directory": craft_npz_lying_directory,
    "npz-zip-bomb": craft_npz_zip_bomb,
    "npz-huge-npy-header": craft_npz_huge_npy_header,
    "npz-deep-json": craft_npz_deep_json,
    "safetensors-deep-json": craft_safetensors_deep_json,
    "safetensors-deep-metadata": craft_safetensors_deep_metadata,
    "safetensors-index-deep-json": craft_safetensors_index_deep_json,
    "safetensors-lying-offsets": craft_safetensors_lying_offsets,
    "safetensors-overlap": craft_safetensors_overlap,
    "safetensors-header-past-end": craft_safetensors_header_past_end,
    "safetensors-large-header": craft_safetensors_large_header,
    "tf-many-slices": craft_tf_many_slices,
    "tf-deep-metadata": craft_tf_deep_metadata,
    "tf-state-dotdot": lambda d: craft_tf_state_outside(d, "dotdot"),
    "tf-state-absolute": lambda d: craft_tf_state_outside(d, "absolute"),
    "hdf5-deep-graph": craft_hdf5_deep_graph,
    "hdf5-bad-graph": craft_hdf5_bad_graph,
}
#: Crafted inputs that are legal files and must read (in bounded time and memory).
LEGAL = frozenset({"npz-zip-bomb", "safetensors-large-header", "tf-many-slices"})


def sweep(path: str, scratch: str) -> list[str]:
    """Run ``path`` through every entry point; what went wrong (empty when all is well).

    The entry points: ``formats.open_checkpoint`` (every component read), ``formats.convert``,
    ``Checkpoint.restore`` and the CLI's ``inspect``, ``verify`` and ``convert``. Only
    :class:`~parallelvars.errors.ParallelVarsError` may escape the library, and the CLI must
    exit 0, 1 or 2 (never 3, "internal error").
    """
    import contextlib
    import io

    import numpy as np

    import parallelvars as pv
    from parallelvars.cli import main
    from parallelvars.errors import ParallelVarsError
    from parallelvars.formats import convert, open_checkpoint

    problems: list[str] = []

    def guarded(what: str, fn: Any) -> None:
        try:
            fn()
        except ParallelVarsError:
            pass
        except FileNotFoundError:
            if os.path.isfile(path):  # only a name that is no file (a TF prefix) may be "not found"
                problems.append(f"{what}: FileNotFoundError for an existing file")
        except BaseException as exc:  # the point is to catch everything
            problems.append(f"{what}: {type(exc).__name__}: {str(exc)[:200]}")

    def read_all() -> None:
        with open_checkpoint(path) as view:
            for key in view:
                entry = view[key]
                for i in range(entry.num_components):
                    np.asarray(entry.component(i))

    guarded("open_checkpoint", read_all)
    guarded("convert", lambda: convert(path, os.path.join(scratch, "out.npz")))

    def restore() -> None:
        ckpt = pv.Checkpoint(model=pv.Module())
        ckpt.restore(path)

    guarded("Checkpoint.restore", restore)
    for argv in (
        ["inspect", path],
        ["verify", path],
        ["convert", path, os.path.join(scratch, "cli.npz")],
    ):
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(["-q", *argv])
        if code not in (0, 1, 2):
            problems.append(f"cli {argv[0]}: exit {code}: {err.getvalue().strip()[:200]}")
    return problems


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
                "path": key,
                "kind": entry.kind,
                "dtype": str(np.dtype(entry.dtype)),
                "shape": [int(s) for s in entry.shape],
                "n": int(entry.num_components),
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

                raise CorruptCheckpointError(
                    "verify found problems", file=path, found="; ".join(problems)
                )
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
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
                env=env,
            )
        return self._proc

    def check(
        self, path: str, clean: str, fmt: str, *, selftest: str | None = None
    ) -> dict[str, Any]:
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
            return {
                "outcome": "hang",
                "detail": f"no answer within {self.timeout:.0f} s",
                "peak": 0,
            }
        line = proc.stdout.readline()
        if not line:
            return self._died(proc)
        res: dict[str, Any] = json.loads(line)
        size = max(sum(sample_sizes(path)), sum(sample_sizes(clean)))
        if res["outcome"] in OK_OUTCOMES and res["peak"] > 2 * size + ALLOC_SLACK:
            res = {
                **res,
                "outcome": "alloc",
                "detail": f"peak {res['peak']} bytes for a {size}-byte file",
            }
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
    suffix = (
        _SUFFIX.get(fmt, "") if base.endswith(_SUFFIX.get(fmt, "")) else os.path.splitext(base)[1]
    )
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
    parser.add_argument(
        "--format", action="append", help="format(s) to fuzz (default: all available)"
    )
    parser.add_argument("--cases", type=int, default=5000, help="damaged files per format")
    parser.add_argument(
        "--seconds", type=float, default=None, help="stop each format after this long"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--strings", action="store_true", help="add a byte-string variable to the sample"
    )
    parser.add_argument(
        "--crafted",
        action="store_true",
        help="sweep the crafted hostile files (CRAFTED) through every entry point instead",
    )
    args = parser.parse_args(argv)
    if args.worker:
        _worker_main()
        return 0
    import tempfile

    if args.crafted:
        bad = 0
        for name, maker in CRAFTED.items():
            with tempfile.TemporaryDirectory() as d:
                t0 = time.monotonic()
                problems = sweep(maker(d), d)
            print(f"{name}: {'ok' if not problems else 'FAIL'} in {time.monotonic() - t0:.1f} s")
            for p in problems:
                print(f"  {p}")
            bad += len(problems)
        return 1 if bad else 0

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
                    fmt,
                    d,
                    random_mutations(sample_sizes(clean), args.cases, args.seed),
                    worker=worker,
                    string_variable=args.strings,
                    deadline=deadline,
                )
            n = sum(counts.values())
            print(
                f"{fmt}: {n} damaged files ({size} bytes each) in {time.monotonic() - t0:.1f} s: "
                + ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
            )
            for what, detail in failures[:20]:
                print(f"  FAIL {what}: {detail}")
            total_bad += len(failures)
    return 1 if total_bad else 0


if __name__ == "__main__":
    sys.exit(main())
