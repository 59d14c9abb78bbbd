"""Run every benchmark under bench/ and write one table of ratios, with the machine it ran on.

Each benchmark runs as its own process (``sys.executable bench/<script> ... --json PATH``); its
figures come back through the JSON file it writes. The table goes to stdout and to a markdown
file (default ``bench/RESULTS.md``), headed by the machine (CPU model, cores, memory, Python,
numpy and h5py versions, date, load average at the start) and the exact commands run, and
followed in the file by each benchmark's own printed output.

By default the sizes are reduced where the issue's full size would take long on a small
machine (convert and TF read at 512 MB, MPI at 20 MB per step, scaling at 500 and 5,000
variables, the generator at 5,000; the rest at their defaults), so the whole suite takes a few
minutes on 2 cores.
``--full`` runs every benchmark at its own default (the issue's) sizes. A benchmark that fails,
times out or is skipped becomes a row saying so; the run goes on.

Usage::

    python bench/run_all.py                   # reduced sizes, writes bench/RESULTS.md
    python bench/run_all.py --full            # every benchmark at the issue's sizes
    python bench/run_all.py --only update strategy --out /tmp/results.md
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(BENCH_DIR)
MB = 1 << 20


@dataclass(frozen=True)
class Benchmark:
    """One benchmark script and the options run_all gives it: ``base`` always, ``quick`` too
    unless ``--full``."""

    name: str
    script: str
    quick: tuple[str, ...] = ()
    base: tuple[str, ...] = ()


BENCHMARKS = (
    Benchmark("update", "bench_update.py"),
    Benchmark("train_step", "bench_train_step.py"),
    Benchmark("checkpoint", "bench_checkpoint.py"),  # the size: 25M parameters x 4
    # Against safetensors at 5,000 and 50,000 tensors (--full: 100 MB and 400 MB as well)
    Benchmark("checkpoint_peers", "bench_checkpoint.py", ("--sizes", "5k,50k"), ("--peers",)),
    Benchmark("async_save", "bench_async_save.py"),
    Benchmark("convert", "bench_convert.py", ("--mb", "512")),
    Benchmark("tf_read", "bench_tf_read.py", ("--mb", "512")),
    Benchmark("strategy", "bench_strategy.py"),
    Benchmark("mpi", "bench_mpi.py", ("--size-mb", "20")),
    Benchmark("mpi_checkpoint", "bench_mpi_checkpoint.py", ("--procs", "2")),  # --full: 4 too
    Benchmark("scaling", "bench_scaling.py", ("--counts", "500", "5000")),  # --full: 50,000 too
    # The command line against safetensors (--full: 50,000 variables too)
    Benchmark("paths_commands", "bench_paths_commands.py", ("--sizes", "5000"), ("--commands",)),
    # --full: 50,000 variables and the flat lists (libhdf5) too
    Benchmark("paths_save", "bench_paths.py", ("--sizes", "5000", "--structures", "layered")),
    # The native file's generator against safetensors' save (--full: 50,000 entries too)
    Benchmark("generate", "bench_generate.py", ("--sizes", "5000", "--repeat", "2")),
)

COLUMNS = ("area", "measurement", "ours", "baseline", "ratio", "target", "met")
NONE = "—"


# ---------------------------------------------------------------------------------------------
# Formatting


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


def _s(seconds: float) -> str:
    return f"{seconds:.3f} s"


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:.1f} us"


def _x(ratio: float) -> str:
    return f"{ratio:.2f}x"


def _target(t: dict[str, Any] | None, unit: str = "x", scale: float = 1.0) -> tuple[str, str]:
    """The target column and the met column for one target record of a benchmark's JSON."""
    if not t:
        return NONE, "n/a"
    value = t["value"] * scale
    bound = f"{value:g}" if unit != "x" else f"{value:g}x"
    if unit not in ("x", ""):
        bound += f" {unit}"
    return f"{t['op']} {bound}", "yes" if t["met"] else "no"


def _row(
    area: str,
    measurement: str,
    ours: str,
    baseline: str,
    ratio: str,
    target: tuple[str, str] = (NONE, "n/a"),
) -> list[str]:
    return [area, measurement, ours, baseline, ratio, target[0], target[1]]


# ---------------------------------------------------------------------------------------------
# Rows, one function per benchmark, from the figures in its JSON


def _rows_update(d: dict[str, Any]) -> list[list[str]]:
    rows = []
    replicas = d["params"]["replicas"]
    for label, m in d["models"].items():
        t, r, tg = m["times"], m["ratios"], m["targets"]
        size = f"model {label}: {m['vars']} vars, {m['params']:,} params, {replicas} replicas"
        rows.append(
            _row(
                "update",
                f"Adam step, core vs per-component loop ({size})",
                _ms(t["core_s"]),
                _ms(t["loop_s"]),
                _x(r["loop_over_core"]),
                _target(tg.get("loop_over_core")),
            )
        )
        rows.append(
            _row(
                "update",
                f"Adam step, core vs roofline from copy bandwidth ({size})",
                _ms(t["core_s"]),
                _ms(t["roofline_s"]),
                _x(r["core_over_roofline"]),
                _target(tg.get("core_over_roofline")),
            )
        )
        if t.get("torch_s") is not None:  # only where torch is importable
            rows.append(
                _row(
                    "update",
                    f"Adam step, core vs torch.optim.Adam(fused=True) ({size})",
                    _ms(t["core_s"]),
                    _ms(t["torch_s"]),
                    _x(r["torch_over_core"]),
                )
            )
    return rows


def _rows_train_step(d: dict[str, Any]) -> list[list[str]]:
    rows = []
    replicas = d["params"]["replicas"]
    for label, m in d["models"].items():
        t, r, tg = m["times"], m["ratios"], m["targets"]
        size = f"model {label}: {m['vars']} vars, {m['params']:,} params, {replicas} replicas"
        rows.append(
            _row(
                "train step",
                f"apply_gradients in strategy.run vs the core alone ({size})",
                _ms(t["run_s"]),
                _ms(t["core_s"]),
                _x(r["run_over_core"]),
                _target(tg.get("run_over_core")),
            )
        )
        rows.append(
            _row(
                "train step",
                f"the same with gradient buffers vs the core alone ({size})",
                _ms(t["buffers_s"]),
                _ms(t["core_s"]),
                _x(r["buffers_over_core"]),
            )
        )
        if "shared_s" in t:
            rows.append(
                _row(
                    "train step",
                    "one gradient object every replica hands in vs per-replica arrays, "
                    f"float32 mirrored ({size})",
                    _ms(t["shared_s"]),
                    _ms(t["run_s"]),
                    _x(r["shared_over_run"]),
                    _target(tg.get("shared_over_run")),
                )
            )
        if "bf16_s" in t:
            rows.append(
                _row(
                    "train step",
                    f"bfloat16 variables and gradients vs float32, both in strategy.run ({size})",
                    _ms(t["bf16_s"]),
                    _ms(t["run_s"]),
                    _x(r["bf16_over_run"]),
                    _target(tg.get("bf16_over_run")),
                )
            )
        if "bf16_floor_s" in t:
            rows.append(
                _row(
                    "train step",
                    "the float32 step plus the bfloat16 <-> float32 conversions alone (their "
                    "cost; no bound: the bfloat16 step moves half the bytes), vs the float32 "
                    f"step ({size})",
                    _ms(t["run_s"] + t["bf16_floor_s"]),
                    _ms(t["run_s"]),
                    _x(r["bf16_floor_over_run"]),
                )
            )
        if "bf16_f32g_s" in t:
            rows.append(
                _row(
                    "train step",
                    "bfloat16 variables with float32 gradients vs float32, both in strategy.run "
                    f"({size})",
                    _ms(t["bf16_f32g_s"]),
                    _ms(t["run_s"]),
                    _x(r["bf16_f32g_over_run"]),
                )
            )
        if "sharded_s" in t:
            rows.append(
                _row(
                    "train step",
                    "float32 variables sharded along axis 0 vs mirrored, both in strategy.run "
                    f"({size})",
                    _ms(t["sharded_s"]),
                    _ms(t["run_s"]),
                    _x(r["sharded_over_run"]),
                    _target(tg.get("sharded_over_run")),
                )
            )
        if "sparse_s" in t and "run2d_s" in t:
            rows.append(
                _row(
                    "train step",
                    "IndexedSlices, 4 rows per variable per replica, vs the dense step of the "
                    f"same 2-D variables, both in strategy.run ({size})",
                    _ms(t["sparse_s"]),
                    _ms(t["run2d_s"]),
                    _x(r["sparse_over_run2d"]),
                    _target(tg.get("sparse_over_run2d")),
                )
            )
        if "pervar_s" in t:
            rows.append(
                _row(
                    "train step",
                    "the step with the fused path off (every gradient reduced per variable) vs "
                    f"on ({size})",
                    _ms(t["pervar_s"]),
                    _ms(t["run_s"]),
                    _x(r["pervar_over_run"]),
                )
            )
        for key, what in (
            ("shared", "one gradient object every replica hands in"),
            ("bf16", "bfloat16 variables"),
            ("sharded", "sharded variables"),
            ("sparse", "IndexedSlices"),
        ):
            if f"{key}_s" in t and f"loop_over_{key}" in r:
                rows.append(
                    _row(
                        "train step",
                        f"{what}: speed-up over the per-component loop ({size})",
                        _ms(t[f"{key}_s"]),
                        _ms(t["loop_s"]),
                        _x(r[f"loop_over_{key}"]),
                    )
                )
        rows.append(
            _row(
                "train step",
                f"speed-up over the per-component loop ({size})",
                _ms(t["run_s"]),
                _ms(t["loop_s"]),
                _x(r["loop_over_run"]),
                _target(tg.get("loop_over_run")),
            )
        )
        if t.get("tf_function_s") is not None:
            rows.append(
                _row(
                    "train step",
                    f"tf.distribute.MirroredStrategy, tf.function ({size})",
                    _ms(t["run_s"]),
                    _ms(t["tf_function_s"]),
                    _x(r["tf_function_over_run"]),
                )
            )
    return rows


def _rows_checkpoint(d: dict[str, Any]) -> list[list[str]]:
    p, t = d["params"], d["times"]
    size = f"{d['bytes'] / 1e6:.0f} MB, {p['variables']} vars x {p['devices']} components"
    what = {
        "save": "save (checksums, fsync, rename) vs raw tofile + fsync",
        "restore_warm": "restore (verified) vs raw readinto, page cache warm",
        "restore_evicted": "restore (verified) vs raw readinto, pages evicted",
    }
    return [
        _row(
            "checkpoint",
            f"{text}, rate ours/raw ({size})",
            _s(t[f"{key}_ours_s"]),
            _s(t[f"{key}_raw_s"]),
            _x(d["ratios"][key]),
            _target(d["targets"].get(key)),
        )
        for key, text in what.items()
    ]


_PEER_ROWS = (
    # (ratio, measurement, ours, baseline)
    (
        "save_vs_safetensors",
        "repeated Checkpoint.write vs safetensors save_file + fsync",
        "ours_save",
        "safetensors_save",
    ),
    (
        "restore_vs_safetensors",
        "verified Checkpoint.restore vs safetensors load_file",
        "ours_restore",
        "safetensors_restore",
    ),
    ("save_vs_raw", "save, rate ours/raw tofile + fsync", "ours_save", "raw_save"),
    (
        "restore_evicted_vs_raw",
        "verified restore, pages evicted, rate ours/raw readinto",
        "ours_restore_evicted",
        "raw_restore_evicted",
    ),
    (
        "restore_evicted_vs_bound",
        "verified restore, pages evicted, rate ours/verify-then-write bound",
        "ours_restore_evicted",
        "verify_then_write_bound",
    ),
)


def _rows_checkpoint_peers(d: dict[str, Any]) -> list[list[str]]:
    rows = []
    for r in d["sizes"]:
        t, ratios, targets = r["times"], r["ratios"], r["targets"]
        size = f"{r['tensors']:,} tensors, {r['bytes'] / 1e6:.0f} MB"
        for key, text, ours, base in _PEER_ROWS:
            if key not in targets:  # each size shows the ratios it has targets for
                continue
            rows.append(
                _row(
                    "checkpoint peers",
                    f"{text} ({size})",
                    _s(t[ours]),
                    _s(t[base]),
                    _x(ratios[key]),
                    _target(targets[key]),
                )
            )
    return rows


_ASYNC_ROWS = (
    # (measurement, ours, ratio); the baseline is the blocking Checkpoint.write
    ("manager.save(blocking=False) returns", "async_call", "call_vs_blocking"),
    ("whole non-blocking save until wait() returns", "async_total", "total_vs_blocking"),
)


def _rows_async_save(d: dict[str, Any]) -> list[list[str]]:
    return [
        _row(
            "async save",
            f"{text}, vs blocking Checkpoint.write ({r['variables']:,} vars)",
            _s(r["times"][ours]),
            _s(r["times"]["blocking"]),
            _x(r["ratios"][ratio]),
        )
        for r in d["sizes"]
        for text, ours, ratio in _ASYNC_ROWS
    ]


def _rows_convert(d: dict[str, Any]) -> list[list[str]]:
    rows = []
    size = f"{d['tensor_bytes'] / MB:.0f} MB of tensors"
    for step, s in d["steps"].items():
        rows.append(
            _row(
                "convert",
                f"{step} vs file copy + fsync, rate ({size})",
                f"{s['rate_bytes_per_s'] / MB:.0f} MB/s",
                f"{d['copy_rate_bytes_per_s'] / MB:.0f} MB/s",
                _x(s["ratios"]["rate_over_copy"]),
                _target(s["targets"]["rate_over_copy"]),
            )
        )
        budget = s["budget_bytes"]
        rows.append(
            _row(
                "convert",
                f"{step} peak RSS vs largest tensor "
                f"({d['largest_tensor_bytes'] / MB:.0f} MB) + 256 MB",
                f"{s['peak_rss_bytes'] / MB:.0f} MB",
                f"{budget / MB:.0f} MB",
                _x(s["ratios"]["peak_rss_over_budget"]),
                _target(s["targets"]["peak_rss_over_budget"]),
            )
        )
    return rows


def _rows_tf_read(d: dict[str, Any]) -> list[list[str]]:
    t, r = d["times"], d["ratios"]
    size = f"{d['bundle_bytes'] / MB:.0f} MiB bundle"
    return [
        _row(
            "tf read",
            f"read + CRC-32C verify vs plain readinto, rate ({size})",
            _s(t["verified_s"]),
            _s(t["baseline_s"]),
            _x(r["verified_rate_over_baseline"]),
            _target(d["targets"].get("verified_rate_over_baseline")),
        ),
        _row(
            "tf read",
            f"read, no CRC, vs plain readinto, rate ({size})",
            _s(t["unverified_s"]),
            _s(t["baseline_s"]),
            _x(r["unverified_rate_over_baseline"]),
        ),
    ]


def _rows_strategy(d: dict[str, Any]) -> list[list[str]]:
    t, n = d["times"], d["params"]["replicas"]
    return [
        _row(
            "strategy",
            f"run() overhead per step over the plain loop ({n} replicas, one merge_call)",
            _us(t["overhead_s_per_step"]),
            NONE,
            NONE,
            _target(d["targets"].get("overhead_s_per_step"), "us", 1e6),
        ),
        _row(
            "strategy",
            f"run() vs plain loop, time per step ({n} replicas)",
            _us(t["run_s_per_step"]),
            _us(t["loop_s_per_step"]),
            _x(d["ratios"]["run_over_loop"]),
        ),
    ]


def _rows_mpi(d: dict[str, Any]) -> list[list[str]]:
    if "skipped" in d:
        return [_row("mpi", f"skipped: {d['skipped']}", NONE, NONE, NONE)]
    rows = []
    for procs, run in d["runs"].items():
        if "error" in run:
            rows.append(
                _row(
                    "mpi",
                    f"{procs} processes: failed: {run['error']}",
                    NONE,
                    NONE,
                    NONE,
                    (NONE, "no"),
                )
            )
            continue
        t = run["times"]
        rows.append(
            _row(
                "mpi",
                f"all-reduce, fused vs one collective per variable ({procs} processes, "
                f"{run['vars']} grads, {run['bytes_per_step'] / 1e6:.0f} MB/step)",
                _ms(t["fused_s"]),
                _ms(t["per_variable_s"]),
                _x(run["ratios"]["per_variable_over_fused"]),
            )
        )
    return rows + _rows_mpi_sharded(d.get("sharded") or {})


def _rows_mpi_sharded(d: dict[str, Any]) -> list[list[str]]:
    """The sharded-variable rows of bench_mpi.py (absent in older figures)."""
    area = "mpi sharded"
    if "error" in d:
        return [_row(area, f"failed: {d['error']}", NONE, NONE, NONE, (NONE, "no"))]
    rows = []
    for key in sorted(k for k in d if k.startswith("step_")):
        run = d[key]
        mb = f"{run['table_bytes'] / 1e6:.0f} MB table, {run['procs']} processes"
        sent, times = run["sent"], run["times"]
        ratio = sent["sharded"] / sent["mirrored"]
        rows.append(
            _row(
                area,
                f"bytes sent per rank, reduce-scatter vs all-reduce ({mb})",
                f"{sent['sharded'] / 1e6:.1f} MB",
                f"{sent['mirrored'] / 1e6:.1f} MB",
                _x(ratio),
                ("<= 0.6x", "yes" if ratio <= 0.6 else "no"),
            )
        )
        rows.append(
            _row(
                area,
                f"SGD step, sharded vs mirrored table ({mb})",
                _ms(times["sharded"]),
                _ms(times["mirrored"]),
                _x(times["mirrored"] / times["sharded"]),
            )
        )
    if "save_3" in d:
        save = d["save_3"]
        rows.append(
            _row(
                area,
                "save of a sharded table, 3 processes vs one process saving the same bytes",
                _s(save["save_s"]),
                _s(save["one_process_s"]),
                _x(save["one_process_s"] / save["save_s"]),
            )
        )
    if "restore_3_to_2" in d:
        worst = d["restore_3_to_2"]["worst"]
        reads = d["restore_3_to_2"]["reads"]
        rows.append(
            _row(
                area,
                "restore 3 -> 2 processes, bytes read per rank vs its share (rchar)",
                f"{max(r for r, _ in reads) / 1e6:.1f} MB",
                f"{max(s for _, s in reads) / 1e6:.1f} MB",
                _x(worst),
                ("<= 1.2x + metadata", "yes" if worst <= 1.2 else "no"),
            )
        )
    return rows


def _rows_mpi_checkpoint(d: dict[str, Any]) -> list[list[str]]:
    area = "mpi checkpoint"
    if "skipped" in d:
        return [_row(area, f"skipped: {d['skipped']}", NONE, NONE, NONE)]
    rows = []
    p = d["params"]
    size = f"{p['vars']} vars, {p['params'] * 4 / 1e6:.0f} MB per replica"
    for procs, run in d["runs"].items():
        if "error" in run:
            failed = f"{procs} processes: failed: {run['error']}"
            rows.append(_row(area, failed, NONE, NONE, NONE, (NONE, "no")))
            continue
        mpi, one = run["best_s"]["mpi"], run["best_s"]["one_process"]
        rows.append(
            _row(
                area,
                f"repeated save (cached plans) vs every file generated anew ({procs} processes, "
                f"{size})",
                _s(mpi["repeated"]),
                _s(mpi["no_cache"]),
                _x(mpi["no_cache"] / mpi["repeated"]),
            )
        )
        rows.append(
            _row(
                area,
                f"repeated save vs one process, MirroredStrategy({procs}) ({procs} processes)",
                _s(mpi["repeated"]),
                _s(one["repeated"]),
                _x(one["repeated"] / mpi["repeated"]),
            )
        )
    return rows


_SCALING_OPS = {
    "save": "Checkpoint.save",
    "restore": "Checkpoint.restore + assert_consumed",
    "step": "strategy.run(step), Adam apply_gradients",
    "gather": "save gather (graph, records; no writing)",
}


def _rows_scaling(d: dict[str, Any]) -> list[list[str]]:
    p, runs, growth = d["params"], d["runs"], d["growth"]
    counts = [int(c) for c in p["counts"]]
    rows = []
    for a, b in itertools.pairwise(counts):
        for op, text in _SCALING_OPS.items():
            ta, tb = runs[str(a)]["times"][op], runs[str(b)]["times"][op]
            target = d["targets"].get(f"{op}_growth_{a}_{b}")
            rows.append(
                _row(
                    "scaling",
                    f"{text}: time at {b:,} vs {a:,} variables, same {p['params']:,} params "
                    f"({ta / a * 1e6:.0f} -> {tb / b * 1e6:.0f} us per variable)",
                    _s(tb),
                    _s(ta),
                    _x(growth[op][f"{a}->{b}"]),
                    _target(target),
                )
            )
    if p.get("peer"):
        top = str(counts[-1])
        t, n = runs[top]["times"], runs[top]["tensors"]
        for ours, peer, text in (
            ("save", "peer_save", "save vs safetensors save_file"),
            ("restore", "peer_load", "restore vs safetensors load_file"),
        ):
            rows.append(
                _row(
                    "scaling",
                    f"{text}, same tensors ({int(top):,} variables, {n:,} tensors)",
                    _s(t[ours]),
                    _s(t[peer]),
                    _x(t[peer] / t[ours]),
                )
            )
    return rows


def _rows_paths_commands(d: dict[str, Any]) -> list[list[str]]:
    rows = []
    for size in d["commands"]:
        label = f"{size['variables']:,} vars x 2{' + Adam' if size['adam'] else ''}"
        for command, r in size["commands"].items():
            if "failed" in r:
                rows.append(_row("commands", f"{command} ({label}): failed", "—", "—", "—"))
                continue
            rss = r["targets"]["peak_rss"]
            cpu = f"cpu {r['cpu_ratio']:.2f}x, " if "cpu_ratio" in r else ""
            rows.append(
                _row(
                    "commands",
                    f"{command} vs safetensors ({label}; {cpu}{r['per_variable_us']:.0f} us/entry, "
                    f"peak RSS {r['peak_rss'] / MB:.0f} MB, bound {rss['value'] / MB:.0f} MB: "
                    f"{'met' if rss['met'] else 'not met'})",
                    _s(r["seconds"]),
                    _s(r["baseline_seconds"]),
                    _x(r["ratio"]),
                    _target(r["targets"]["ratio"]),
                )
            )
    return rows


def _rows_paths_save(d: dict[str, Any]) -> list[list[str]]:
    rows = []
    for label, r in d.get("first", {}).items():
        if "error" in r:
            rows.append(_row("paths save", f"first save ({label}): failed", NONE, NONE, NONE))
            continue
        rows.append(
            _row(
                "paths save",
                f"first Checkpoint.write in a fresh process vs safetensors save_file + fsync "
                f"({label}, {r['entries']:,} entries, "
                f"{1e6 * r['first_s'] / r['entries']:.0f} us/entry)",
                _s(r["first_s"]),
                _s(r["safetensors_s"]),
                _x(r["ratio_first"]),
                ("<= 1.5x", "yes" if r["ratio_first"] <= 1.5 else "no"),
            )
        )
        if "walk_s" in r:
            rows.append(
                _row(
                    "paths save",
                    f"floor of a first save in Python: graph walk + records vs safetensors "
                    f"({label}, {1e6 * r['walk_s'] / r['entries']:.0f} us/entry)",
                    _s(r["walk_s"]),
                    _s(r["safetensors_s"]),
                    _x(r["ratio_walk"]),
                )
            )
            rows.append(
                _row(
                    "paths save",
                    f"first save's peak RSS above the model's ({label})",
                    f"{r['first_extra_mb']:.0f} MB",
                    NONE,
                    NONE,
                    (
                        "<= 256 MB + largest",
                        "yes" if r["first_extra_mb"] <= 256 + 1 else "no",
                    ),
                )
            )
    m = d.get("mirrored")
    if m and "error" not in m:
        rows.append(
            _row(
                "paths save",
                "4-device mirrored model's file vs the 1-device one (2,000 x 2,500, Adam)",
                f"{m['file_4_mb']:.1f} MB",
                f"{m['file_1_mb']:.1f} MB",
                _x(m["ratio_size"]),
                ("<= 1.05x", "yes" if m["ratio_size"] <= 1.05 else "no"),
            )
        )
        rows.append(
            _row(
                "paths save",
                "4-device mirrored model's save vs the 1-device one",
                _s(m["save_4_s"]),
                _s(m["save_1_s"]),
                _x(m["ratio_save"]),
                ("<= 1.2x", "yes" if m["ratio_save"] <= 1.2 else "no"),
            )
        )
    for label, r in d.get("training", {}).items():
        if "error" in r:
            continue
        for k, text in (
            ("first", "first save"),
            ("repeated", "repeated save"),
            ("nonblocking_whole", "non-blocking save, whole"),
            ("nonblocking_again_whole", "second non-blocking save, whole"),
        ):
            if f"ratio_{k}" not in r:
                continue
            # the target's rate: per stored byte (raw writes the bytes the file holds)
            stored = "raw_stored_s" in r
            rate = 1 / r[f"stored_ratio_{k}" if stored else f"ratio_{k}"]
            rows.append(
                _row(
                    "paths save",
                    f"{text} vs raw tofile + fsync of the "
                    f"{'bytes the file holds' if stored else 'same bytes'} ({label}), rate ratio",
                    _s(r[f"{k}_s"]),
                    _s(r["raw_stored_s" if stored else "raw_write_s"]),
                    _x(rate),
                    (">= 0.7x", "yes" if rate >= 0.7 else "no"),
                )
            )
            if stored:  # (every live byte: mirrored replicas too, which the file holds once)
                rows.append(
                    _row(
                        "paths save",
                        f"{text} vs raw tofile + fsync of every live byte ({label}), rate ratio",
                        _s(r[f"{k}_s"]),
                        _s(r["raw_write_s"]),
                        _x(1 / r[f"ratio_{k}"]),
                    )
                )
        rows.append(
            _row(
                "paths save",
                f"restore vs raw readinto of the same bytes ({label})",
                _s(r["restore_s"]),
                _s(r["raw_read_s"]),
                _x(r["ratio_restore"]),
            )
        )
        if "first_extra_mb" in r:
            largest = r["largest_component"] / 2**20
            snap = r["bytes"] / 2**20
            rows.append(
                _row(
                    "paths save",
                    f"first save's peak RSS above the model's ({label})",
                    f"{r['first_extra_mb']:.0f} MB",
                    f"{256 + largest:.0f} MB",
                    NONE,
                    (
                        "<= 256 MB + largest",
                        "yes" if r["first_extra_mb"] <= 256 + largest else "no",
                    ),
                )
            )
            rows.append(
                _row(
                    "paths save",
                    f"non-blocking save's peak RSS above the model's vs the bytes it snapshots "
                    f"({label})",
                    f"{r['nonblocking_extra_mb']:.0f} MB",
                    f"{snap:.0f} MB",
                    _x(r["nonblocking_extra_mb"] / snap),
                    ("<= 1x", "yes" if r["nonblocking_extra_mb"] <= snap else "no"),
                )
            )
    return rows


def _rows_generate(d: dict[str, Any]) -> list[list[str]]:
    rows = []
    for r in d["results"]:
        if "failed" in r:
            rows.append(_row("generate", f"plan + image ({r['label']}): failed", NONE, NONE, NONE))
            continue
        n = r["entries"]
        total = r["plan_s"] + r["image_s"]
        rows.append(
            _row(
                "generate",
                f"native file's plan + image vs safetensors save, CPU time ({r['label']}, "
                f"{n:,} entries, {1e6 * total / n:.1f} us/entry; plan holds "
                f"{r['held_mb'] * MB / n:.0f} B/entry, peak {r['peak_mb']:.1f} MB)",
                _s(total),
                _s(r["st_s"]),
                _x(total / max(r["st_s"], 1e-9)),
            )
        )
    return rows


ROWS = {
    "update": _rows_update,
    "train_step": _rows_train_step,
    "checkpoint": _rows_checkpoint,
    "checkpoint_peers": _rows_checkpoint_peers,
    "async_save": _rows_async_save,
    "convert": _rows_convert,
    "tf_read": _rows_tf_read,
    "strategy": _rows_strategy,
    "mpi": _rows_mpi,
    "mpi_checkpoint": _rows_mpi_checkpoint,
    "scaling": _rows_scaling,
    "paths_commands": _rows_paths_commands,
    "paths_save": _rows_paths_save,
    "generate": _rows_generate,
}


def rows_for(name: str, result: dict[str, Any]) -> list[list[str]]:
    """The table rows of one benchmark's result.

    Args:
        name: the benchmark's name (a key of ``ROWS``).
        result: ``{"status": "ok", "data": <its JSON>}``, or ``{"status": "failed" | "timeout",
            "detail": str}``.

    Returns:
        Rows of ``COLUMNS``; a failed or timed-out benchmark, or one whose JSON lacks a figure,
        gives one row saying so.
    """
    area = name.replace("_", " ")
    status = result.get("status")
    if status == "ok":
        try:
            return ROWS[name](result["data"])
        except (KeyError, TypeError, ValueError, ZeroDivisionError) as exc:
            return [
                _row(
                    area,
                    f"unreadable figures: {type(exc).__name__}: {exc}",
                    NONE,
                    NONE,
                    NONE,
                    (NONE, "no"),
                )
            ]
    what = "timed out" if status == "timeout" else "failed"
    detail = result.get("detail") or ""
    return [_row(area, f"{what}: {detail}".rstrip(": "), NONE, NONE, NONE, (NONE, "no"))]


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def build_table(results: dict[str, dict[str, Any]]) -> str:
    """A markdown table of every benchmark's rows, in the order of ``results``."""
    lines = [
        "| " + " | ".join(COLUMNS) + " |",
        "|" + "|".join(["---"] * 2 + ["---:"] * 3 + ["---"] * 2) + "|",
    ]
    for name, result in results.items():
        for row in rows_for(name, result):
            lines.append("| " + " | ".join(_cell(c) for c in row) + " |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# The machine


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory() -> str:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return f"{int(line.split()[1]) / (1 << 20):.1f} GiB"
    except OSError:
        pass
    return "unknown"


def _version(module: str) -> str:
    try:
        return str(__import__(module).__version__)
    except ImportError:
        return "not installed"


def _git_commit() -> str:
    try:
        head = subprocess.run(
            ["git", "-C", REPO, "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        )
        dirty = subprocess.run(
            ["git", "-C", REPO, "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        )
        return head.stdout.strip() + (" plus uncommitted changes" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def machine() -> dict[str, str]:
    """Where and when the run happens (read before the first benchmark starts)."""
    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
        "cpu": _cpu_model(),
        "cores": str(os.cpu_count()),
        "memory": _memory(),
        "load average at start (1, 5, 15 min)": ", ".join(f"{x:.2f}" for x in load),
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "numpy": _version("numpy"),
        "h5py": _version("h5py"),
        "commit": _git_commit(),
    }


# ---------------------------------------------------------------------------------------------
# Running


def run_one(bench: Benchmark, full: bool, tmp: str, timeout: float) -> dict[str, Any]:
    """Run one benchmark in its own process and collect its JSON; never raises for its failure."""
    out = os.path.join(tmp, f"{bench.name}.json")
    script = os.path.join("bench", bench.script)
    cmd = [sys.executable, script, *bench.base, *(() if full else bench.quick), "--json", out]
    shown = f"{shlex.join(cmd[:-1])} $TMP/{bench.name}.json"
    print(f"running {bench.name}: {shown}", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    result: dict[str, Any] = {"command": shown}
    try:
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        result.update(
            status="timeout",
            detail=f"after {timeout:.0f} s",
            output=_text(exc.stdout) + _text(exc.stderr),
            seconds=time.perf_counter() - t0,
        )
        return result
    result.update(
        seconds=time.perf_counter() - t0,
        returncode=proc.returncode,
        output=proc.stdout + (f"\n[stderr]\n{proc.stderr}" if proc.stderr.strip() else ""),
    )
    try:
        with open(out) as f:
            result.update(status="ok", data=json.load(f))
    except (OSError, ValueError) as exc:
        last = (proc.stderr.strip().splitlines() or proc.stdout.strip().splitlines() or [str(exc)])[
            -1
        ]
        result.update(status="failed", detail=f"exit {proc.returncode}: {last}")
    print(
        f"  {bench.name}: {result['status']} in {result['seconds']:.1f} s (exit {proc.returncode})",
        file=sys.stderr,
        flush=True,
    )
    return result


def _text(data: str | bytes | None) -> str:
    if data is None:
        return ""
    return data.decode(errors="replace") if isinstance(data, bytes) else data


def render(info: dict[str, str], results: dict[str, dict[str, Any]], full: bool, raw: bool) -> str:
    """The markdown report: machine, commands, the table and (``raw``) each benchmark's output."""
    lines = [
        "# Benchmark results",
        "",
        "Written by `python bench/run_all.py" + (" --full" if full else "") + "`; "
        "ratios are against a baseline measured in the same run, on this machine.",
        "",
        "## Machine",
        "",
    ]
    lines += [f"- {k}: {v}" for k, v in info.items()]
    lines += [
        "",
        "## Commands",
        "",
        "Run from the repository root; `$TMP` is a temporary folder.",
        "",
        "```",
    ]
    for name, r in results.items():
        took = f"{r['seconds']:.1f} s" if "seconds" in r else "?"
        code = r.get("returncode", NONE)
        lines.append(f"{r.get('command', name)}   # {r.get('status')}, exit {code}, {took}")
    lines += [
        "```",
        "",
        "## Results",
        "",
        build_table(results),
        "",
        "`ratio` is baseline time / our time (higher is better: how many times faster ours "
        "is) in every row but these, where it is ours / baseline (lower is better): core vs "
        "roofline, the train step (and with gradient buffers) vs the core alone, run() vs "
        "plain loop, peak RSS vs budget, scaling's time at more variables vs fewer (10x "
        "the variables: 10x is linear), the checkpoint's save and restore vs safetensors, and "
        "the non-blocking save vs a blocking write. `met` is n/a where the issue "
        "sets no target; a benchmark that failed or timed out shows `no`.",
    ]
    if raw:
        lines += ["", "## Output of each benchmark", ""]
        for name, r in results.items():
            lines += [f"### {name}", "", "```", (r.get("output") or "").rstrip(), "```", ""]
    return "\n".join(lines).rstrip() + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--full", action="store_true", help="every benchmark at its default (the issue's) sizes"
    )
    parser.add_argument(
        "--out",
        default=os.path.join(BENCH_DIR, "RESULTS.md"),
        help="markdown file to write (default bench/RESULTS.md)",
    )
    parser.add_argument(
        "--only",
        nargs="+",
        choices=[b.name for b in BENCHMARKS],
        metavar="NAME",
        help="run only these benchmarks: " + ", ".join(b.name for b in BENCHMARKS),
    )
    parser.add_argument(
        "--timeout", type=float, default=900.0, help="seconds per benchmark (default 900)"
    )
    args = parser.parse_args(argv)

    info = machine()
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="pv_bench_") as tmp:
        for bench in BENCHMARKS:
            if args.only and bench.name not in args.only:
                continue
            results[bench.name] = run_one(bench, args.full, tmp, args.timeout)
    print(render(info, results, args.full, raw=False))
    with open(args.out, "w") as f:
        f.write(render(info, results, args.full, raw=True))
    print(f"written to {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
