"""MultiWorkerMirroredStrategy under a real ``mpiexec`` (the mpich of the ``[mpi]`` extra).

Every launch has a timeout. The worker scenarios live in ``_mpi_worker.py``; the one-process
reference runs the same training code (``_mpi_model.py``) under ``MirroredStrategy``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest

pytest.importorskip("mpi4py", reason="the MPI tests need the [mpi] extra (mpi4py and mpich)")

import _mpi_model as model_code

import parallelvars as pv
from parallelvars.checkpoint.h5io import H5Reader
from parallelvars.errors import ChecksumMismatchError

# Real MPI runs: each test starts 2-4 processes (2-4 s each); CI runs them (.ci/run, -m slow).
pytestmark = pytest.mark.slow

WORKER = Path(__file__).parent / "_mpi_worker.py"
LAUNCH_TIMEOUT = 60


def _mpiexec() -> str:
    for candidate in (
        Path(sys.executable).parent / "mpiexec",
        Path(sys.prefix) / "bin" / "mpiexec",
    ):
        if candidate.exists():
            return str(candidate)
    found = shutil.which("mpiexec")
    if found is None:
        pytest.fail(
            "mpi4py is installed but no mpiexec was found next to the interpreter or on PATH"
        )
    return found


def launch(n: int, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    # Oversubscribed ranks (4 on 2 cores) should yield the CPU while they wait.
    env.setdefault("MPIR_CVAR_CH4_OFI_ENABLE_PROGRESS_THREAD", "0")
    env.setdefault("MPIR_CVAR_POLLS_BEFORE_YIELD", "100")
    proc = subprocess.run(
        [_mpiexec(), "-n", str(n), sys.executable, str(WORKER), *args],
        capture_output=True,
        text=True,
        timeout=LAUNCH_TIMEOUT,
        env=env,
    )
    if check and proc.returncode != 0:
        pytest.fail(
            f"mpiexec -n {n} {args} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
        )
    return proc


def load(out: Path, scenario: str, n: int) -> list[dict[str, Any]]:
    results = []
    for r in range(n):
        with np.load(out / f"{scenario}-rank{r}.npz") as f:
            results.append({k: f[k] for k in f.files})
    return results


def _bits(a: Any) -> np.ndarray:
    arr = np.ascontiguousarray(a)
    return arr.view(np.dtype(f"u{arr.dtype.itemsize}")) if arr.dtype.kind in "fiu" else arr


def assert_bit_equal(a: dict[str, Any], b: dict[str, Any], keys: Any = None) -> None:
    for k in keys if keys is not None else a:
        assert np.asarray(a[k]).dtype == np.asarray(b[k]).dtype, k
        assert np.array_equal(_bits(a[k]), _bits(b[k])), k


@pytest.mark.parametrize("n", [2, 4])
def test_training_equals_mirrored_in_one_process(tmp_path: Path, n: int) -> None:
    launch(n, "train", str(tmp_path))
    ranks = load(tmp_path, "train", n)
    for r in ranks[1:]:
        assert_bit_equal(ranks[0], r)  # bit-identical replicas, every collective agrees

    ref_model, ref_opt, ref_losses = model_code.train(pv.MirroredStrategy(n), steps=3, seed=0)
    expected = model_code.state(ref_model, ref_opt)
    assert set(expected) <= set(ranks[0])
    assert len(expected) == 3 + 6 + 1  # variables, Adam's m and v slots, iterations
    assert_bit_equal(ranks[0], expected, expected)
    assert int(ranks[0]["iterations"]) == 3
    np.testing.assert_array_equal(ranks[0]["losses"], np.asarray(ref_losses))
    assert int(ranks[0]["seen"]) == int(ref_model.seen.read_value()) == 3 * n * model_code.BATCH

    # Cross-replica API on values that differ per rank, against the same sums done here.
    mine = [np.arange(5, dtype=np.float32) * (r + 1) + np.float32(0.1) * r for r in range(n)]
    strategy = pv.MirroredStrategy(n)
    with strategy.scope():
        assert_bit_equal(
            ranks[0], {"merge_sum": strategy.reduce("sum", pv.PerReplica(mine))}, ["merge_sum"]
        )
        uneven = pv.PerReplica([np.full((r + 1, 2), r + 1.0) for r in range(n)])
        np.testing.assert_array_equal(
            ranks[0]["axis_mean"], strategy.reduce("mean", uneven, axis=0)
        )
    np.testing.assert_array_equal(ranks[0]["broadcast"], np.full(3, 7.0))  # rank 0's value
    np.testing.assert_array_equal(ranks[0]["batch_0"], np.full((2, 2), n * (n + 1) // 2, np.int32))
    assert ranks[0]["batch_0"].dtype == np.int32
    np.testing.assert_array_equal(ranks[0]["batch_1"], np.full(3, 0.5 * n * (n - 1) / 2))
    assert float(ranks[0]["batch_2"]) == n * (n - 1) / 2
    # In-place writes in a replica function, merged: SUM of each rank's doubled-and-more
    # value, MEAN of each rank's item.
    np.testing.assert_array_equal(ranks[0]["inplace_scaled"], np.full(3, n * (n - 1) / 2 + 2 * n))
    np.testing.assert_array_equal(ranks[0]["inplace_items"], [(n - 1) / 2, 0.0, 0.0])


def test_checkpoint_of_four_ranks_restores_in_two_and_in_one_process(tmp_path: Path) -> None:
    launch(4, "save", str(tmp_path))
    saved = load(tmp_path, "save", 4)
    path = str(saved[0]["path"])
    assert all(str(s["path"]) == path for s in saved)
    assert all(bool(s["index_exists"]) for s in saved)  # committed before save() returned
    parts = sorted(os.listdir(path + ".parts"))
    assert parts == [f"rank-{r:05d}-of-00004.h5" for r in range(4)]

    # Plain h5py sees every component of the one logical checkpoint through the links.
    with h5py.File(path, "r") as f:
        grp = f["model/w"]
        assert grp.attrs["kind"] == "mirrored" and int(grp.attrs["num_components"]) == 4
        assert [x.decode() if isinstance(x, bytes) else x for x in grp.attrs["devices"]] == [
            "cpu:0",
            "cpu:1",
            "cpu:2",
            "cpu:3",
        ]
        assert isinstance(grp.get("parallel_component_3", getlink=True), h5py.ExternalLink)
        for i, name in enumerate(
            ["primary", "parallel_component_1", "parallel_component_2", "parallel_component_3"]
        ):
            np.testing.assert_array_equal(grp[name][()], saved[i]["w"])
        seen = f["model/seen"]
        assert seen.attrs["kind"] == "on_read"
        total = sum(int(seen[k][()]) for k in seen)
        assert total == 2 * 4 * model_code.BATCH

    with H5Reader(path) as reader:
        assert reader.verify_all() == []
        assert reader["optimizer/iterations"].num_components == 4

    # One plain process, no MPI: a mirrored restore gives the primary; slots wait for the step.
    strategy = pv.MirroredStrategy(3)
    with strategy.scope():
        model = model_code.Model(seed=7)
        opt = pv.optimizers.Adam(0.05)
    status = pv.Checkpoint(model=model, optimizer=opt).restore(path)
    for name in ("w", "b", "c"):
        for comp in getattr(model, name).components:
            np.testing.assert_array_equal(comp, saved[0][name])
    assert int(model.seen.read_value()) == 2 * 4 * model_code.BATCH  # on-read total preserved
    strategy.run(
        model_code.replica_step,
        args=(model, opt, pv.PerReplica([model_code.batches(0, 1).values[0]] * 3)),
    )
    status.assert_consumed()

    # Two ranks restore and take one step; the same in one process with MirroredStrategy(2).
    launch(2, "restore", str(tmp_path), path)
    restored = load(tmp_path, "restore", 2)
    for r in restored:
        # 4 components saved, 2 processes now: the SUM total is kept, not doubled.
        assert int(r["seen_restored"]) == 2 * 4 * model_code.BATCH
        # MEAN of the writes +1 (rank 0) and +2 (rank 1) on 5.0: 6.5 in every process.
        assert float(r.pop("mean_var")) == 6.5
        r.pop("seen_restored")
    assert_bit_equal(restored[0], restored[1])
    ref = pv.MirroredStrategy(2)
    with ref.scope():
        ref_model = model_code.Model(seed=5)
        ref_opt = pv.optimizers.Adam(0.05)
    ref_status = pv.Checkpoint(model=ref_model, optimizer=ref_opt).restore(path)
    ref.run(model_code.replica_step, args=(ref_model, ref_opt, model_code.batches(0, 2)))
    ref_status.assert_consumed()
    expected = model_code.state(ref_model, ref_opt)
    assert_bit_equal(restored[0], expected, expected)
    assert int(restored[0]["iterations"]) == 3

    # A damaged rank file is caught by the checksum recorded in the index. The mirrored w is
    # written once in the job: every component links to the one rank file that holds it.
    holders = []
    for r in range(4):
        with h5py.File(os.path.join(path + ".parts", f"rank-{r:05d}-of-00004.h5"), "r") as f:
            if "model/w" in f:
                holders.append(r)
    assert len(holders) == 1
    with h5py.File(os.path.join(path + ".parts", f"rank-{holders[0]:05d}-of-00004.h5"), "r+") as f:
        f["model/w/primary"][0, 0] += 1
    with H5Reader(path) as reader:
        problems = reader.verify_all()
    assert problems and all("model/w/" in p for p in problems), problems
    with pytest.raises(ChecksumMismatchError):
        pv.Checkpoint(model=model, optimizer=opt).restore(path)


def _all_values(path: str) -> dict[str, Any] | None:
    """Every component and logical value through our reader; None when verify finds a problem."""
    with H5Reader(path) as reader:
        if reader.verify_all():
            return None
        out: dict[str, Any] = {}
        for name, var in reader.items():
            out[name] = (
                var.kind,
                dict(var.attrs),
                [var.component(i) for i in range(var.num_components)],
                var.value(),
            )
        return out


def test_the_index_file_is_written_by_the_checksummed_layout_writer(tmp_path: Path) -> None:
    launch(2, "save", str(tmp_path))
    path = str(load(tmp_path, "save", 2)[0]["path"])
    with open(path, "rb") as fh:
        head = fh.read(9)
    assert head[8] >= 2  # superblock version 2 or 3: the newest file format, checksummed metadata
    with h5py.File(path, "r") as f:
        index = f["_parallelvars/index"]
        assert index.dtype.kind == "S" and "crc32c" in index.attrs  # fixed length, own checksum
        assert [d.decode() for d in f.attrs["parallelvars_documents"]] == [
            "_parallelvars/index",
            "_parallelvars/object_graph",
        ]
        assert int(f.attrs["processes"]) == 2
        assert isinstance(f["model/w"].get("parallel_component_1", getlink=True), h5py.ExternalLink)
    good = _all_values(path)
    assert good is not None and good["model/seen"][3] == 2 * 2 * model_code.BATCH

    # Flip one bit at a seeded sample of positions of the index file: every flip is either
    # harmless (every value and attribute read back the same) or one of our errors.
    raw = Path(path).read_bytes()
    rng = np.random.default_rng(16)
    damaged = Path(path).parent / "flip.h5"  # beside it: the links name the parts folder
    caught = 0
    for pos in rng.choice(len(raw), size=min(len(raw), 150), replace=False):
        data = bytearray(raw)
        data[pos] ^= 1 << int(rng.integers(8))
        damaged.write_bytes(bytes(data))
        try:
            found = _all_values(str(damaged))
        except pv.ParallelVarsError:
            found = None
        if found is None:
            caught += 1
            continue
        assert found.keys() == good.keys(), pos
        for name, (kind, attrs, comps, value) in good.items():
            fkind, fattrs, fcomps, fvalue = found[name]
            assert (fkind, fattrs) == (kind, attrs), (pos, name)
            assert all(np.array_equal(a, b) for a, b in zip(fcomps, comps, strict=True)), (
                pos,
                name,
            )
            assert np.array_equal(fvalue, value), (pos, name)
    assert caught > 0


def test_a_raising_rank_aborts_the_job(tmp_path: Path) -> None:
    start = time.monotonic()
    proc = launch(2, "raise", str(tmp_path), check=False)
    elapsed = time.monotonic() - start
    assert proc.returncode != 0, proc.stderr
    assert "boom on purpose in rank 1" in proc.stderr, proc.stderr
    assert "[rank 1 of 2]" in proc.stderr, proc.stderr
    assert not (tmp_path / "raise-rank0.npz").exists()
    assert elapsed < LAUNCH_TIMEOUT  # rank 0 did not stay blocked in its collective


def test_importing_parallelvars_does_not_import_mpi4py() -> None:
    code = "import sys, parallelvars as pv; pv.MirroredStrategy(2); assert 'mpi4py' not in sys.modules; print(pv.MultiWorkerMirroredStrategy.__name__)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.strip() == "MultiWorkerMirroredStrategy"


def test_single_process_without_mpiexec(tmp_path: Path, helper_env: dict[str, str]) -> None:
    # One process (a singleton MPI world) is a valid job: everything works without launching.
    code = (
        "import sys, os, _mpi_model as m, parallelvars as pv\n"
        "s = pv.MultiWorkerMirroredStrategy()\n"
        "model, opt, losses = m.train(s, steps=2)\n"
        "ref_model, ref_opt, ref_losses = m.train(pv.MirroredStrategy(1), steps=2)\n"
        "a, b = m.state(model, opt), m.state(ref_model, ref_opt)\n"
        "assert all((a[k] == b[k]).all() for k in b) and losses == ref_losses\n"
        "p = pv.Checkpoint(model=model).save(os.path.join(sys.argv[1], 'one'))\n"
        "print(p)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
        env=helper_env,
    )
    assert out.returncode == 0, out.stderr
    path = out.stdout.strip()
    with H5Reader(path) as reader:
        assert reader.verify_all() == []
        assert reader["model/w"].num_components == 1


def test_sparse_gradients_in_a_single_process_without_mpiexec(tmp_path: Path) -> None:
    code = (
        "import numpy as np, parallelvars as pv\n"
        "s = pv.MultiWorkerMirroredStrategy()\n"
        "with s.scope():\n"
        "    v = pv.Variable(np.zeros((4, 2), np.float32), name='v'); opt = pv.optimizers.SGD(0.5)\n"
        "    t = pv.Variable(np.zeros((4, 2), np.float32), name='t', shard_axis=0)\n"
        "g = pv.IndexedSlices(np.ones((2, 2), np.float32), np.array([1, 1]), (4, 2))\n"
        "s.run(lambda: opt.apply_gradients([(g, v), (g, t)]))\n"
        "print(np.asarray(v)[:, 0].tolist(), np.asarray(t)[:, 0].tolist())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[0] == "[0.0, -1.0, 0.0, 0.0] [0.0, -1.0, 0.0, 0.0]"


def test_checkpoint_manager_across_processes(tmp_path: Path) -> None:
    """Each process runs a manager on one directory: one lock, one state, old rank files removed."""
    launch(2, "manager", str(tmp_path))
    results = load(tmp_path, "manager", 2)
    for r in results:
        assert bool(r["async_refused"])
        assert str(r["rank_plan"]) == "Prepared"  # the rank file's generated metadata, kept
        assert [os.path.basename(str(k)) for k in r["kept"]] == ["ckpt-2.h5", "ckpt-3.h5"]
        assert os.path.basename(str(r["latest"])) == "ckpt-3.h5"
    assert str(results[0]["index_plan"]) == "Prepared"  # and the index file's
    listing = [str(x) for x in results[0]["listing"]]
    # The first checkpoint and its per-rank files are gone; no temporaries are left behind.
    assert "ckpt-1.h5" not in listing and "ckpt-1.h5.parts" not in listing
    assert {
        "ckpt-2.h5",
        "ckpt-2.h5.parts",
        "ckpt-3.h5",
        "ckpt-3.h5.parts",
        "checkpoint.json",
    } <= set(listing)
    assert not [x for x in listing if ".tmp-" in x]
    # The latest checkpoint restores in one plain process to the values the ranks hold.
    latest = str(tmp_path / "managed" / "ckpt-3.h5")
    with pv.MirroredStrategy(2).scope():
        model = model_code.Model(seed=9)
    pv.Checkpoint(model=model).restore(latest).expect_partial()
    for name in ("w", "b", "c"):
        np.testing.assert_array_equal(getattr(model, name).components[1], results[1][name])


def test_saving_again_with_fewer_processes_leaves_no_stale_rank_files(tmp_path: Path) -> None:
    launch(4, "save", str(tmp_path))
    path = str(load(tmp_path, "save", 4)[0]["path"])
    launch(2, "save", str(tmp_path))
    assert str(load(tmp_path, "save", 2)[0]["path"]) == path  # the same checkpoint, rewritten
    assert sorted(os.listdir(path + ".parts")) == [f"rank-{r:05d}-of-00002.h5" for r in range(2)]
    with H5Reader(path) as reader:
        assert reader.verify_all() == []


def test_checkpoint_copied_without_its_parts_folder_says_what_is_missing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    launch(2, "save", str(tmp_path))
    path = str(load(tmp_path, "save", 2)[0]["path"])
    alone = tmp_path / "copied.h5"
    shutil.copy(path, alone)  # the index only, as a user copying one file would
    from parallelvars.errors import CorruptCheckpointError

    with H5Reader(str(alone)) as reader, pytest.raises(CorruptCheckpointError) as info:
        for key in reader:
            reader[key].component(0)
    message = str(info.value)
    assert ".parts/" in message and "parallelvars convert" in message
    # verify says it once, not once per component
    from parallelvars.cli import main

    capsys.readouterr()
    assert main(["verify", str(alone)]) == 1
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("problem:")]
    assert len(lines) == 1 and ".parts/" in lines[0], lines  # was: one line per component
    # What the message proposes works where the folder is: a standalone file.

    standalone = tmp_path / "standalone.h5"
    assert main(["convert", path, str(standalone)]) == 0
    (tmp_path / "far").mkdir()
    shutil.copy(standalone, tmp_path / "far" / "standalone.h5")
    assert main(["verify", str(tmp_path / "far" / "standalone.h5")]) == 0


def test_a_restore_lands_what_every_rank_checked_or_nothing_anywhere(tmp_path: Path) -> None:
    """The read-once landing across processes: two ranks restore a checkpoint whose rank
    files rank 0 rewrites (another save's bytes) or cuts. Once every check passed on every
    rank, the change lands nothing: each rank copies the bytes it checked. Before the
    components are read, it is an error on every rank (the others' checks passed: the
    restore's agreement tells them), and no rank changes a variable."""
    launch(2, "landing_save", str(tmp_path / "a"), "1")
    launch(2, "landing_save", str(tmp_path / "b"), "2")
    saved = load(tmp_path / "a", "landing_save", 2)[0]
    path_a = Path(str(saved["path"]))
    path_b = str(load(tmp_path / "b", "landing_save", 2)[0]["path"])
    for how in ("rewritten-after", "truncated-after", "rewritten-before", "truncated-before"):
        run = tmp_path / how
        run.mkdir()
        path = run / path_a.name
        shutil.copyfile(path_a, path)
        shutil.copytree(f"{path_a}.parts", f"{path}.parts")
        launch(2, "landing_restore", str(run), str(path), how, path_b)
        for rank, got in enumerate(load(run, "landing_restore", 2)):
            if how.endswith("after"):
                assert "error" not in got, (how, rank, got.get("error"))
                for name in ("w", "b", "c", "big"):
                    np.testing.assert_array_equal(got[name], saved[name], err_msg=f"{how}:{rank}")
            else:
                assert "error" in got, (how, rank)
                assert "ConcurrentWriteError" not in str(got["error"]), (how, rank)
                assert bool(got["unchanged"]), (how, rank, str(got["error"]))
