"""The generated HDF5 metadata (``parallelvars.checkpoint.h5raw``) against safetensors and the
libhdf5 writer, on the same tensors, in one run.

Structure: N variables (default 5,000 and 50,000), each mirrored on 2 devices (2 float32
components of 100 parameters), under ``model/layers/<k>/w<j>`` (100 variables a group) as a
model's parameters are. Per size, best of ``--repeat`` rounds, all timed in the same rounds
so they see the same load:

* ``generate``: the metadata alone (``FilePlan`` + ``metadata``: superblock, every object
  header with its checksums, the global heap), from the variables' structure (the cyclic
  garbage collector running, as in every save);
* ``write_native``: a whole file through the generator (index, columns, checksums of every
  component, metadata, gathered data writes, fsync, atomic rename);
* ``safetensors``: ``safetensors.numpy.save_file`` of the same 2N tensors + fsync;
* ``write_h5``: today's first save through libhdf5 (skipped above ``--h5py-max`` variables:
  it takes minutes there).

Prints times, per-variable costs and the ratios generate/safetensors, write_native/safetensors
and write_h5/write_native.

    python bench/bench_h5raw.py [--sizes 5000,50000] [--repeat 3] [--h5py-max 5000]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import numpy as np

try:
    import safetensors.numpy
except ImportError:
    safetensors = None  # type: ignore[assignment]

from parallelvars.checkpoint.h5io import write_h5
from parallelvars.checkpoint.h5io.layout import COLUMNS_DATASET, GRAPH_DATASET, INDEX_DATASET
from parallelvars.checkpoint.h5raw.generate import FilePlan, Variable
from parallelvars.checkpoint.h5raw.native import write_native
from parallelvars.checkpoint.registry import SaveRecord

DEVICES = ["cpu:0", "cpu:1"]


def records(n: int) -> list[SaveRecord]:
    rng = np.random.default_rng(0)
    out = []
    for k in range(n):
        w = rng.standard_normal(100).astype(np.float32)
        attrs = {"name": f"w{k % 100}", "devices": DEVICES, "aggregation": "none"}
        attrs.update(synchronization="on_write", trainable=True)
        out.append(
            SaveRecord(
                "mirrored", [w, w.copy()], (100,), attrs, path=f"model/layers/{k // 100}/w{k % 100}"
            )
        )
    return out


def generate(recs: list[SaveRecord]) -> int:
    variables = [Variable(r.path, r.kind, r.components[0].dtype, r.shape, 2, r.attrs) for r in recs]
    root = {"parallelvars_format": np.int64(1), "created": np.float64(0.0)}
    plan = FilePlan(
        variables, root_attrs=root, documents=[INDEX_DATASET, COLUMNS_DATASET, GRAPH_DATASET]
    )
    meta = plan.metadata({INDEX_DATASET: 1 << 20, COLUMNS_DATASET: 1 << 20, GRAPH_DATASET: 64})
    return sum(len(b) for _, b in meta.pieces)


def save_safetensors(recs: list[SaveRecord], path: str) -> None:
    tensors = {f"{r.path}/{i}": c for r in recs for i, c in enumerate(r.components)}
    safetensors.numpy.save_file(tensors, path)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="5000,50000")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--h5py-max", type=int, default=5000)
    args = ap.parse_args(argv)
    print(f"load: {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} {os.getloadavg()[2]:.2f}")
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as d:
        for n in (int(s) for s in args.sizes.split(",")):
            recs = records(n)
            best: dict[str, float] = {}
            size = 0
            for r in range(args.repeat):
                t = time.perf_counter()
                size = generate(recs)
                times = {"generate": time.perf_counter() - t}
                t = time.perf_counter()
                write_native(os.path.join(d, f"gen-{r}.h5"), recs, object_graph={"nodes": []})
                times["write_native"] = time.perf_counter() - t
                if safetensors is not None:
                    t = time.perf_counter()
                    save_safetensors(recs, os.path.join(d, f"st-{r}.safetensors"))
                    times["safetensors"] = time.perf_counter() - t
                if n <= args.h5py_max:
                    t = time.perf_counter()
                    write_h5(os.path.join(d, f"h5-{r}.h5"), recs, object_graph={"nodes": []})
                    times["write_h5"] = time.perf_counter() - t
                for k, v in times.items():
                    best[k] = min(best.get(k, v), v)
                for f in os.listdir(d):
                    os.unlink(os.path.join(d, f))
            print(f"{n} variables x 2 components, metadata {size / 1e6:.1f} MB:")
            for k, v in best.items():
                print(f"  {k:13s} {v * 1e3:8.1f} ms  {v / n * 1e6:6.1f} us/variable")
            if "safetensors" in best:
                st = best["safetensors"]
                print(f"  generate/safetensors      {best['generate'] / st:.2f}")
                print(
                    f"  write_native/safetensors  {best['write_native'] / st:.2f}  (target <= 1.5)"
                )
            if "write_h5" in best:
                print(f"  write_h5/write_native     {best['write_h5'] / best['write_native']:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
