"""Per-variable costs as the number of variables grows and the total bytes stay the same.

For each count (500, 5,000 and 50,000 variables by default) a model of that many mirrored
float32 variables holding the same total parameters (4M by default) on 2 devices is trained
one step with Adam inside ``strategy.run`` (every replica its own gradients), so the
checkpoint holds the variables and both slots of each. Measured at every count, in one run:

* step: one steady ``strategy.run(step)`` with ``apply_gradients`` (the first step, which
  creates the slots, is printed too);
* gather: ``Checkpoint._prepare_write()``, the Python work of a save around the writer
  (object graph, records, slot attributes);
* save: ``Checkpoint.save`` (object graph, records, HDF5 writer, checksums, fsync, rename);
* restore: ``Checkpoint.restore(...).assert_consumed()`` (every checksum verified);
* baseline: safetensors' ``save_file`` / ``load_file`` of the same tensors (every component of
  every variable and slot), the peer a user would pick, where it is importable.

Prints the per-variable cost of each and its growth from one count to the next. Linear costs
grow 10x from 500 to 5,000 variables; the target is <= 12x for save, restore and the step.
Writing an HDF5 object costs a fixed amount per variable (groups, datasets, attributes), so
at many small variables the save is bound by that floor, not by the bytes.

    python bench/bench_scaling.py [--counts 500 5000 50000] [--params 4e6] [--devices 2]
                                  [--repeat 3] [--json PATH]

Every figure is the best of ``--repeat`` runs, but saves past 5,000 variables (a minute or more
each) are timed once. A garbage collection runs before each timed run, so that one operation
does not pay for the garbage of the one before; the collector stays on while it is timed.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import tempfile
import time
from typing import Any

import numpy as np
from bench_checkpoint import best, remove  # run as bench/bench_scaling.py: bench/ is on the path

import parallelvars as pv

try:
    from safetensors.numpy import load_file as st_load
    from safetensors.numpy import save_file as st_save
except ImportError:  # the peer is optional
    st_save = st_load = None

OPS = ("step", "gather", "save", "restore")
TARGET_GROWTH = 12.0  # from 500 to 5,000 variables (linear: 10x)
TARGETED = ("step", "save", "restore")


def measure(
    count: int, params: int, devices: int, repeat: int, save_repeat: int, folder: str
) -> dict[str, Any]:
    """Every figure at one variable count."""
    size = max(1, params // count)
    rng = np.random.default_rng(count)
    strategy = pv.MirroredStrategy(devices)
    with strategy.scope():
        model = pv.Module()
        model.vars = [
            pv.Variable(rng.standard_normal(size).astype(np.float32), name=f"v{i}")
            for i in range(count)
        ]
        opt = pv.optimizers.Adam(1e-3)
    variables = list(model.vars)
    grads = pv.PerReplica(
        [
            [rng.standard_normal(size).astype(np.float32) for _ in range(count)]
            for _ in range(devices)
        ]
    )

    def step() -> None:
        strategy.run(lambda g: opt.apply_gradients(zip(g, variables, strict=True)), args=(grads,))

    t = time.perf_counter()
    step()  # creates the slots and the update plan
    first = time.perf_counter() - t
    times = {"step_first": first, "step": best(step, repeat, before=gc.collect)}

    ckpt = pv.Checkpoint(model=model, opt=opt)
    prefix = os.path.join(folder, f"ckpt{count}")
    saved: list[str] = []
    times["gather"] = best(ckpt._prepare_write, repeat, before=gc.collect)

    def save() -> None:
        saved.append(ckpt.save(prefix))

    def clear() -> None:
        while saved:  # writing a new file, not freeing the old one's blocks, is timed
            remove(saved.pop())
        gc.collect()

    times["save"] = best(save, save_repeat, before=clear)
    path = saved[-1]
    times["restore"] = best(lambda: ckpt.restore(path).assert_consumed(), repeat, before=gc.collect)

    tensors: dict[str, np.ndarray] = {}
    for i, v in enumerate(variables):
        owners = [v, opt.get_slot(v, "m"), opt.get_slot(v, "v")]
        for j, owner in enumerate(owners):
            for c, comp in enumerate(owner.components):
                tensors[f"{i}/{j}/{c}"] = comp
    nbytes = sum(a.nbytes for a in tensors.values())
    if st_save is not None and st_load is not None:
        st_path = os.path.join(folder, f"peer{count}.safetensors")
        times["peer_save"] = best(
            lambda: st_save(tensors, st_path),
            repeat,
            before=lambda: (remove(st_path), gc.collect()),
        )
        times["peer_load"] = best(lambda: st_load(st_path), repeat, before=gc.collect)
        remove(st_path)
    clear()
    return {
        "variables": count,
        "params_per_variable": size,
        "tensors": len(tensors),
        "bytes": nbytes,
        "repeat": repeat,
        "save_repeat": save_repeat,
        "times": times,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--counts", type=int, nargs="+", default=[500, 5000, 50000])
    ap.add_argument("--params", type=float, default=4e6, help="total parameters, split evenly")
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument(
        "--repeat", type=int, default=3, help="best of (saves past 5,000 variables: once)"
    )
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    ap.add_argument("--json", metavar="PATH", help="also write the figures to PATH as JSON")
    args = ap.parse_args(argv)

    counts = sorted(set(args.counts))
    runs: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        for count in counts:
            save_repeat = args.repeat if count <= 5000 else 1
            runs[str(count)] = run = measure(
                count, int(args.params), args.devices, args.repeat, save_repeat, d
            )
            t = run["times"]
            print(
                f"{count:>7} variables: " + ", ".join(f"{k} {v:.3f} s" for k, v in t.items()),
                flush=True,
            )

    print(
        f"\nscaling: {int(args.params):,} parameters in every model, {args.devices} devices, Adam "
        f"(each checkpoint: variables + 2 slots); per-variable cost in microseconds"
    )
    names = [*OPS, "step_first"] + (["peer_save", "peer_load"] if st_save is not None else [])
    labels = {
        "step": "step (steady)",
        "step_first": "step (first)",
        "gather": "save gather",
        "save": "save",
        "restore": "restore",
        "peer_save": "safetensors save",
        "peer_load": "safetensors load",
    }
    print(
        f"{'':18}"
        + "".join(f"{c:>12,}" for c in counts)
        + "".join(f"{f'{a:,}->{b:,}':>16}" for a, b in itertools.pairwise(counts))
    )
    growth: dict[str, dict[str, float]] = {}
    for name in names:
        per = [runs[str(c)]["times"][name] / c * 1e6 for c in counts]
        steps = {
            f"{a}->{b}": runs[str(b)]["times"][name] / runs[str(a)]["times"][name]
            for a, b in itertools.pairwise(counts)
        }
        growth[name] = steps
        print(
            f"{labels[name]:18}"
            + "".join(f"{p:12.1f}" for p in per)
            + "".join(f"{g:15.2f}x" for g in steps.values())
        )
    ratios: dict[str, float] = {}
    if st_save is not None:
        for c in counts:
            t = runs[str(c)]["times"]
            ratios[f"peer_save_over_save_{c}"] = t["peer_save"] / t["save"]
            ratios[f"peer_load_over_restore_{c}"] = t["peer_load"] / t["restore"]
        print(
            "ours vs safetensors (its time / ours, higher is better): "
            + "; ".join(
                f"{c:,} vars save {ratios[f'peer_save_over_save_{c}']:.2f}x, "
                f"restore {ratios[f'peer_load_over_restore_{c}']:.2f}x"
                for c in counts
            )
        )
    targets = {}
    if 500 in counts and 5000 in counts:
        for name in TARGETED:
            g = growth[name]["500->5000"]
            targets[f"{name}_growth_500_5000"] = {
                "op": "<=",
                "value": TARGET_GROWTH,
                "met": g <= TARGET_GROWTH,
            }
        print(
            "target: each of save, restore, step grows <= 12x from 500 to 5,000 variables: "
            + ", ".join(f"{n} {growth[n]['500->5000']:.2f}x" for n in TARGETED)
        )
    if args.json:
        figures = {
            "benchmark": "scaling",
            "params": {
                "counts": counts,
                "params": int(args.params),
                "devices": args.devices,
                "repeat": args.repeat,
                "peer": "safetensors" if st_save is not None else None,
            },
            "runs": runs,
            "growth": growth,
            "ratios": ratios,
            "targets": targets,
        }
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
