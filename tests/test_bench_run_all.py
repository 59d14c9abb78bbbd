"""The results table of bench/run_all.py, built from synthetic benchmark figures (nothing is run)."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest

_PATH = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "run_all.py"
)
_spec = importlib.util.spec_from_file_location("bench_run_all", _PATH)
assert _spec is not None and _spec.loader is not None
run_all = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = run_all  # dataclasses look their module up there
_spec.loader.exec_module(run_all)


def _t(op: str, value: float, met: bool) -> dict:
    return {"op": op, "value": value, "met": met}


def _update() -> dict:
    def model(vars_: int, core: float, loop: float, roof: float, targets: dict) -> dict:
        return {
            "vars": vars_,
            "params": vars_ * 10,
            "times": {"core_s": core, "loop_s": loop, "roofline_s": roof},
            "ratios": {"loop_over_core": loop / core, "core_over_roofline": core / roof},
            "targets": targets,
        }

    return {
        "params": {"replicas": 4},
        "models": {
            "A": model(
                200,
                0.1,
                0.5,
                0.05,
                {"loop_over_core": _t(">=", 4.0, True), "core_over_roofline": _t("<=", 2.5, True)},
            ),
            # Model B's one target is the roofline's (the core is only ~9-10x the loop there).
            "B": model(2000, 0.02, 0.1, 0.004, {"core_over_roofline": _t("<=", 2.5, False)}),
        },
    }


def _results() -> dict:
    ok = lambda data: {"status": "ok", "data": data}  # noqa: E731
    return {
        "update": ok(_update()),
        "checkpoint": ok(
            {
                "params": {"variables": 200, "devices": 4},
                "bytes": 400e6,
                "times": {
                    f"{k}_{w}_s": 1.0
                    for k in ("save", "restore_warm", "restore_evicted")
                    for w in ("raw", "ours")
                },
                "ratios": {"save": 0.8, "restore_warm": 0.5, "restore_evicted": 0.9},
                "targets": {
                    "save": _t(">=", 0.7, True),
                    "restore_warm": _t(">=", 0.7, False),
                    "restore_evicted": _t(">=", 0.7, True),
                },
            }
        ),
        "convert": {"status": "failed", "detail": "exit 1: MemoryError"},
        "tf_read": {"status": "timeout", "detail": "after 900 s"},
        "strategy": ok(
            {
                "params": {"replicas": 8},
                "times": {
                    "overhead_s_per_step": 150e-6,
                    "run_s_per_step": 250e-6,
                    "loop_s_per_step": 100e-6,
                },
                "ratios": {"run_over_loop": 2.5},
                "targets": {"overhead_s_per_step": _t("<", 200e-6, True)},
            }
        ),
        "mpi": ok(
            {
                "runs": {
                    "2": {
                        "vars": 200,
                        "bytes_per_step": 20e6,
                        "times": {"fused_s": 0.04, "per_variable_s": 0.06},
                        "ratios": {"per_variable_over_fused": 1.5},
                    },
                    "4": {"procs": 4, "error": "Command '...' returned non-zero exit status 1."},
                }
            }
        ),
    }


def _rows(table: str) -> list[list[str]]:
    lines = table.splitlines()
    assert lines[0] == "| area | measurement | ours | baseline | ratio | target | met |"
    return [[c.strip() for c in line.strip("|").split(" | ")] for line in lines[2:]]


def test_table_has_one_row_per_figure_with_its_target_and_verdict():
    rows = _rows(run_all.build_table(_results()))
    assert all(len(r) == 7 for r in rows)
    by_area: dict[str, list[list[str]]] = {}
    for r in rows:
        by_area.setdefault(r[0], []).append(r)
    assert [
        len(by_area[a]) for a in ("update", "checkpoint", "convert", "tf read", "strategy", "mpi")
    ] == [4, 3, 1, 1, 2, 2]

    loop_a, roof_a, loop_b, roof_b = by_area["update"]
    assert loop_a[2:] == ["100.0 ms", "500.0 ms", "5.00x", ">= 4x", "yes"]
    assert roof_a[2:] == ["100.0 ms", "50.0 ms", "2.00x", "<= 2.5x", "yes"]
    assert loop_b[4:] == ["5.00x", "—", "n/a"]  # model B has no target against the loop
    assert roof_b[4:] == ["5.00x", "<= 2.5x", "no"]
    assert "model B" in loop_b[1]

    assert [r[6] for r in by_area["checkpoint"]] == ["yes", "no", "yes"]
    assert by_area["checkpoint"][1][4] == "0.50x"

    overhead, ratio = by_area["strategy"]
    assert overhead[2] == "150.0 us" and overhead[5:] == ["< 200 us", "yes"]
    assert ratio[2:] == ["250.0 us", "100.0 us", "2.50x", "—", "n/a"]

    two, four = by_area["mpi"]
    assert two[2:5] == ["40.0 ms", "60.0 ms", "1.50x"] and "2 processes" in two[1]
    assert four[1].startswith("4 processes: failed") and four[6] == "no"


@pytest.mark.parametrize(
    ("name", "result", "words"),
    [
        (
            "convert",
            {"status": "failed", "detail": "exit 1: MemoryError"},
            "failed: exit 1: MemoryError",
        ),
        ("tf_read", {"status": "timeout", "detail": "after 900 s"}, "timed out: after 900 s"),
        ("strategy", {"status": "ok", "data": {"times": {}}}, "unreadable figures: KeyError"),
        (
            "mpi",
            {"status": "ok", "data": {"skipped": "mpi4py is not installed"}},
            "skipped: mpi4py",
        ),
    ],
)
def test_a_benchmark_without_figures_is_one_row_saying_why(name, result, words):
    (row,) = _rows(run_all.build_table({name: result}))
    assert words in row[1]
    assert row[2:5] == ["—", "—", "—"]
    assert row[6] == ("n/a" if name == "mpi" else "no")


def test_mpi_checkpoint_rows() -> None:
    best = {
        "mpi": {"first": 6.0, "repeated": 0.25, "no_cache": 5.0},
        "one_process": {"first": 2.0, "repeated": 0.1, "no_cache": 2.0},
    }
    data = {
        "params": {"vars": 5000, "params": 5e6},
        "runs": {"2": {"procs": 2, "best_s": best}, "4": {"procs": 4, "error": "exit 1"}},
    }
    rows = _rows(run_all.build_table({"mpi_checkpoint": {"status": "ok", "data": data}}))
    skel, one, failed = rows
    assert skel[2:5] == ["0.250 s", "5.000 s", "20.00x"] and "2 processes" in skel[1]
    assert "5000 vars, 20 MB per replica" in skel[1]
    assert one[2:5] == ["0.250 s", "0.100 s", "0.40x"] and "MirroredStrategy(2)" in one[1]
    assert failed[1].startswith("4 processes: failed") and failed[6] == "no"


def test_torch_row_only_where_torch_ran():
    data = _update()
    model = data["models"]["B"]
    model["times"]["torch_s"] = 0.06
    model["ratios"]["torch_over_core"] = 3.0
    rows = _rows(run_all.build_table({"update": {"status": "ok", "data": data}}))
    assert len(rows) == 5
    assert "torch" in rows[-1][1] and rows[-1][2:] == ["20.0 ms", "60.0 ms", "3.00x", "—", "n/a"]


def test_pipes_in_a_message_do_not_break_the_table():
    (row,) = _rows(run_all.build_table({"convert": {"status": "failed", "detail": "a | b\nc"}}))
    assert row[1] == "failed: a \\| b c"


def test_train_step_rows():
    def model(vars_: int, met: bool) -> dict:
        times = {"run_s": 0.012, "core_s": 0.01, "buffers_s": 0.011, "loop_s": 0.15}
        ratios = {"run_over_core": 1.2, "buffers_over_core": 1.1, "loop_over_run": 12.5}
        targets = {"run_over_core": _t("<=", 1.5, met)}
        return {
            "vars": vars_,
            "params": vars_ * 10,
            "times": times,
            "ratios": ratios,
            "targets": targets,
        }

    data = {"params": {"replicas": 4}, "models": {"A": model(200, False), "B": model(2000, True)}}
    rows = _rows(run_all.build_table({"train_step": {"status": "ok", "data": data}}))
    assert len(rows) == 6 and all(r[0] == "train step" for r in rows)
    run_a, bufs_a, loop_a = rows[:3]
    assert run_a[2:] == ["12.0 ms", "10.0 ms", "1.20x", "<= 1.5x", "no"] and "model A" in run_a[1]
    assert bufs_a[2:] == ["11.0 ms", "10.0 ms", "1.10x", "—", "n/a"]
    assert loop_a[4:] == ["12.50x", "—", "n/a"]  # the loop is no target of the in-run step
    assert rows[3][6] == "yes"
    assert any(b.name == "train_step" for b in run_all.BENCHMARKS)


def test_train_step_rows_of_sharded_and_sparse_steps():
    times = {"run_s": 0.010, "core_s": 0.008, "buffers_s": 0.009, "loop_s": 0.1}
    times.update(sharded_s=0.012, sparse_s=0.025, run2d_s=0.0125, bf16_s=0.02, bf16_floor_s=0.01)
    ratios = {
        "run_over_core": 1.25,
        "buffers_over_core": 1.1,
        "loop_over_run": 10.0,
        "sharded_over_run": 1.2,
        "sparse_over_run2d": 2.0,
        "bf16_over_run": 2.0,
        "bf16_floor_over_run": 2.0,
        "loop_over_sparse": 4.0,
    }
    targets = {
        "sharded_over_run": _t("<=", 1.5, True),
        "sparse_over_run2d": _t("<=", 2.0, True),
        "bf16_over_run": _t("<=", 1.5, False),
    }
    model = {"vars": 2000, "params": 20000, "times": times, "ratios": ratios, "targets": targets}
    data = {"params": {"replicas": 4}, "models": {"B": model}}
    rows = _rows(run_all.build_table({"train_step": {"status": "ok", "data": data}}))
    sharded = [r for r in rows if "sharded" in r[1]]
    sparse = [r for r in rows if "IndexedSlices" in r[1]]
    assert sharded[0][2:] == ["12.0 ms", "10.0 ms", "1.20x", "<= 1.5x", "yes"]
    # The sparse step against the dense step of the same 2-D variables, not the 1-D one.
    assert sparse[0][2:] == ["25.0 ms", "12.5 ms", "2.00x", "<= 2x", "yes"]
    assert sparse[1][2:] == ["25.0 ms", "100.0 ms", "4.00x", "—", "n/a"] and "loop" in sparse[1][1]
    conversions = [r for r in rows if "conversions alone" in r[1]]
    assert conversions[0][2:] == ["20.0 ms", "10.0 ms", "2.00x", "—", "n/a"]
    assert not any("floor" in r[1] for r in rows)


def _scaling(peer: bool = True) -> dict:
    def run(count: int, unit: float) -> dict:
        times = {op: unit * count for op in ("step", "gather", "save", "restore", "step_first")}
        if peer:
            times.update(peer_save=unit * count / 4, peer_load=unit * count / 2)
        return {"variables": count, "tensors": count * 6, "times": times}

    runs = {"500": run(500, 1e-3), "5000": run(5000, 1.1e-3), "50000": run(50000, 1.1e-3)}
    growth = {
        op: {"500->5000": 11.0, "5000->50000": 10.0}
        for op in ("step", "gather", "save", "restore", "step_first")
    }
    growth["save"]["500->5000"] = 13.0
    return {
        "params": {
            "counts": [500, 5000, 50000],
            "params": 4_000_000,
            "devices": 2,
            "peer": "safetensors" if peer else None,
        },
        "runs": runs,
        "growth": growth,
        "ratios": {},
        "targets": {
            "save_growth_500_5000": _t("<=", 12.0, False),
            "restore_growth_500_5000": _t("<=", 12.0, True),
            "step_growth_500_5000": _t("<=", 12.0, True),
        },
    }


def test_scaling_rows_show_growth_per_step_of_counts_and_the_peer():
    rows = _rows(run_all.build_table({"scaling": {"status": "ok", "data": _scaling()}}))
    assert len(rows) == 2 * 4 + 2
    save = next(r for r in rows if r[1].startswith("Checkpoint.save: time at 5,000 vs 500"))
    assert save[2:] == ["5.500 s", "0.500 s", "13.00x", "<= 12x", "no"]
    assert "1000 -> 1100 us per variable" in save[1]
    later = next(r for r in rows if r[1].startswith("Checkpoint.save: time at 50,000 vs 5,000"))
    assert later[4:] == ["10.00x", "—", "n/a"]  # the issue sets no target past 5,000
    peer = next(r for r in rows if "safetensors save_file" in r[1])
    assert "50,000 variables, 300,000 tensors" in peer[1] and peer[4] == "0.25x"
    no_peer = _rows(
        run_all.build_table({"scaling": {"status": "ok", "data": _scaling(peer=False)}})
    )
    assert len(no_peer) == 8 and not any("safetensors" in r[1] for r in no_peer)


def test_every_benchmark_has_a_row_function():
    assert {b.name for b in run_all.BENCHMARKS} == set(run_all.ROWS)


def test_checkpoint_peers_rows_show_each_sizes_targets():
    def size(name: str, tensors: int, mb: float, targets: dict) -> dict:
        times = {
            k: 1.0
            for k in (
                "ours_save",
                "safetensors_save",
                "ours_restore",
                "safetensors_restore",
                "raw_save",
                "ours_restore_evicted",
                "raw_restore_evicted",
            )
        }
        times["ours_restore"] = 2.0
        ratios = {
            "save_vs_safetensors": 0.5,
            "restore_vs_safetensors": 2.0,
            "save_vs_raw": 1.2,
            "restore_evicted_vs_raw": 0.8,
        }
        return {
            "size": name,
            "tensors": tensors,
            "bytes": mb * 1e6,
            "times": times,
            "ratios": ratios,
            "targets": targets,
        }

    data = {
        "sizes": [
            size(
                "50k",
                50_000,
                20,
                {
                    "save_vs_safetensors": _t("<=", 1.5, True),
                    "restore_vs_safetensors": _t("<=", 1.5, False),
                },
            ),
            size("large", 800, 400, {"restore_evicted_vs_raw": _t(">=", 0.9, False)}),
        ]
    }
    rows = _rows(run_all.build_table({"checkpoint_peers": {"status": "ok", "data": data}}))
    save, restore, evicted = rows
    assert "50,000 tensors, 20 MB" in save[1] and "safetensors save_file" in save[1]
    assert save[2:] == ["1.000 s", "1.000 s", "0.50x", "<= 1.5x", "yes"]
    assert restore[2:] == ["2.000 s", "1.000 s", "2.00x", "<= 1.5x", "no"]
    assert "pages evicted" in evicted[1] and "800 tensors, 400 MB" in evicted[1]
    assert evicted[4:] == ["0.80x", ">= 0.9x", "no"]


def test_async_save_rows():
    data = {
        "sizes": [
            {
                "variables": 50_000,
                "times": {"async_call": 0.01, "async_total": 0.2, "blocking": 0.16},
                "ratios": {"call_vs_blocking": 0.0625, "total_vs_blocking": 1.25},
            }
        ]
    }
    call, total = _rows(run_all.build_table({"async_save": {"status": "ok", "data": data}}))
    assert call[2:5] == ["0.010 s", "0.160 s", "0.06x"] and "50,000 vars" in call[1]
    assert total[2:5] == ["0.200 s", "0.160 s", "1.25x"] and "wait()" in total[1]


def test_peers_run_with_their_mode_in_quick_and_full_runs(monkeypatch, tmp_path):
    (peers,) = [b for b in run_all.BENCHMARKS if b.name == "checkpoint_peers"]
    seen = []

    def fake_run(cmd, **kwargs):
        seen.append(cmd)
        raise run_all.subprocess.TimeoutExpired(cmd, 1)

    monkeypatch.setattr(run_all.subprocess, "run", fake_run)
    for full in (False, True):
        run_all.run_one(peers, full, str(tmp_path), 1)
    quick, full_cmd = seen
    assert "--peers" in quick and "--peers" in full_cmd
    assert quick[quick.index("--sizes") + 1] == "5k,50k" and "--sizes" not in full_cmd


def test_command_rows_show_each_command_against_safetensors_with_memory():
    def command(seconds: float, base: float, rss: int, bound: int) -> dict:
        ratio = seconds / base
        return {
            "seconds": seconds,
            "baseline_seconds": base,
            "ratio": ratio,
            "per_variable_us": seconds / 5000 * 1e6,
            "peak_rss": rss,
            "targets": {
                "ratio": _t("<=", 3.0, ratio <= 3.0),
                "peak_rss": _t("<=", bound, rss <= bound),
            },
        }

    mb = 1 << 20
    data = {
        "commands": [
            {
                "variables": 5000,
                "adam": True,
                "commands": {
                    "inspect --json": command(0.5, 0.25, 100 * mb, 256 * mb),
                    "verify": command(2.0, 0.25, 300 * mb, 256 * mb),
                },
            }
        ]
    }
    rows = _rows(run_all.build_table({"paths_commands": {"status": "ok", "data": data}}))
    assert len(rows) == 2
    inspect, verify = rows
    assert "inspect --json" in inspect[1] and "5,000 vars x 2 + Adam" in inspect[1]
    assert inspect[4:] == ["2.00x", "<= 3x", "yes"]
    assert "bound 256 MB: not met" in verify[1] and verify[4:] == ["8.00x", "<= 3x", "no"]


def test_mpi_sharded_rows_say_whether_their_targets_are_met() -> None:
    figures = {
        "step_2": {
            "procs": 2,
            "table_bytes": 64e6,
            "sent": {"sharded": 32e6, "mirrored": 64e6},
            "times": {"sharded": 0.1, "mirrored": 0.2},
        },
        "save_3": {"procs": 3, "save_s": 0.5, "one_process_s": 0.25},
        "restore_3_to_2": {"procs": 2, "reads": [[45e6, 32e6], [44e6, 32e6]], "worst": 1.41},
    }
    rows = run_all._rows_mpi_sharded(figures)
    assert [r[0] for r in rows] == ["mpi sharded"] * 4
    assert rows[0][-2:] == ["<= 0.6x", "yes"]
    assert rows[-1][-2:] == ["<= 1.2x + metadata", "no"]
    assert run_all._rows_mpi_sharded({"error": "boom"})[0][-1] == "no"


def test_generate_rows_show_each_structure_against_safetensors():
    ok = {"entries": 10000, "plan_s": 0.02, "image_s": 0.01, "held_mb": 1.0, "peak_mb": 3.0}
    data = {
        "load": 1.0,
        "results": [
            {"label": "5000 layered +Adam", **ok, "st_s": 0.015},
            {"label": "5000 flat", "failed": "boom"},
        ],
    }
    rows = _rows(run_all.build_table({"generate": {"status": "ok", "data": data}}))
    assert len(rows) == 2
    done, failed = rows
    assert "5000 layered +Adam" in done[1] and "10,000 entries" in done[1]
    assert "105 B/entry" in done[1] and done[4] == "2.00x"
    assert "5000 flat" in failed[1] and "failed" in failed[1]
