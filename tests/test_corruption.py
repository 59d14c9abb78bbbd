"""Damaged checkpoints: every byte flip or truncation is detected or proven harmless.

Reads of damaged files run in a worker subprocess (tools/fuzz_readers.py), so that a crash of
a C library is counted as a failure instead of taking the test run down, and a hang is cut by a
timeout. "Harmless" is proven by a value check: a digest of every path, kind, dtype, shape,
attribute and component byte (and the object graph) equal to the clean file's.
"""

from __future__ import annotations

import os
import sys

import h5py
import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))

import fuzz_readers

import parallelvars as pv
from parallelvars.checkpoint.h5io import H5Reader
from parallelvars.errors import ChecksumMismatchError, CorruptCheckpointError, TruncatedFileError

FORMATS = fuzz_readers.available_formats()


@pytest.mark.parametrize("fmt", FORMATS)
def test_damage_never_crashes_hangs_or_overallocates(fmt, tmp_path, worker):
    """The part every reader meets already: at worst an exception, never a dead process."""
    sizes = fuzz_readers.sample_sizes(fuzz_readers.write_sample(fmt, str(tmp_path)))
    mutations = list(fuzz_readers.random_mutations(sizes, DEFAULT_CASES, seed=8))
    counts, failures = fuzz_readers.run_campaign(fmt, str(tmp_path), mutations, worker=worker)
    report(fmt, counts, failures)
    assert counts["crash"] == counts["hang"] == counts["alloc"] == 0, failures
CASES = {"hdf5": 160}  # other formats: DEFAULT_CASES
DEFAULT_CASES = 120


@pytest.fixture(scope="module")
def worker():
    with fuzz_readers.ReaderWorker(timeout=30) as w:
        yield w


def report(fmt: str, counts, failures) -> None:
    print(f"\n{fmt}: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    for what, detail in failures[:10]:
        print(f"  {what}: {detail}")


@pytest.mark.parametrize("fmt", FORMATS)
def test_random_flips_and_truncations_are_detected_or_harmless(fmt, tmp_path, worker):
    sizes = fuzz_readers.sample_sizes(fuzz_readers.write_sample(fmt, str(tmp_path)))
    mutations = list(fuzz_readers.random_mutations(sizes, CASES.get(fmt, DEFAULT_CASES), seed=7))
    counts, failures = fuzz_readers.run_campaign(fmt, str(tmp_path), mutations, worker=worker)
    report(fmt, counts, failures)
    assert failures == []
    assert sum(counts.values()) == len(mutations)
    assert counts["detected"] > len(mutations) // 10  # the damage was real


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_truncation_of_the_head_and_tail(fmt, tmp_path, worker):
    """Files cut inside the header and inside the last bytes (metadata often lives there)."""
    sizes = fuzz_readers.sample_sizes(fuzz_readers.write_sample(fmt, str(tmp_path)))
    mutations = [
        fuzz_readers.Mutation(truncate_to=n, target=t)
        for t, size in enumerate(sizes)
        for n in sorted({*range(0, min(size, 64), 3), *range(max(0, size - 48), size, 4)})
    ]
    counts, failures = fuzz_readers.run_campaign(fmt, str(tmp_path), mutations, worker=worker)
    report(fmt, counts, failures)
    assert failures == []
    assert counts["detected"] >= len(mutations) - 2


def test_string_tensors_in_the_global_heap(tmp_path, worker):
    """Byte-string variables live in HDF5's unchecksummed global heap; our CRC covers them."""
    size = os.path.getsize(fuzz_readers.write_sample("hdf5", str(tmp_path), string_variable=True))
    mutations = list(fuzz_readers.random_mutations(size, 60, seed=11))
    counts, failures = fuzz_readers.run_campaign(
        "hdf5", str(tmp_path), mutations, worker=worker, string_variable=True
    )
    report("hdf5+strings", counts, failures)
    assert failures == []


def test_worker_counts_crashes_and_hangs(tmp_path):
    """The harness itself: a reader that dies or stalls is reported, not survived silently."""
    clean = fuzz_readers.write_sample("hdf5", str(tmp_path))
    with fuzz_readers.ReaderWorker(timeout=5) as w:
        assert w.check(clean, clean, "hdf5")["outcome"] == "harmless"
        res = w.check(clean, clean, "hdf5", selftest="segfault")
        assert res["outcome"] == "crash" and "-11" in res["detail"]
        assert w.check(clean, clean, "hdf5")["outcome"] == "harmless"  # restarted
    with fuzz_readers.ReaderWorker(timeout=1) as w:
        assert w.check(clean, clean, "hdf5", selftest="hang")["outcome"] == "hang"


# ----------------------------------------------------------------------------- targeted damage
def sample_model():
    with pv.MirroredStrategy(2).scope():
        w = pv.Variable(np.arange(12, dtype=np.float32).reshape(3, 4), name="w")
        e = pv.Variable(np.arange(8, dtype=np.int64).reshape(4, 2), name="e", shard_axis=0)
    m = pv.Module()
    m.w, m.e = w, e
    return pv.Checkpoint(model=m), w, e


def data_offset(path, dataset: str) -> int:
    with h5py.File(path, "r") as f:
        return int(f[dataset].id.get_offset())


@pytest.mark.parametrize(
    ("dataset", "variable"),
    [("model/w/parallel_component_1", "model/w/parallel_component_1"), ("model/e/primary", "model/e/primary")],
)
def test_checksum_mismatch_names_the_variable_and_restores_nothing(tmp_path, dataset, variable):
    ckpt, _w, _e = sample_model()
    path = ckpt.write(tmp_path / "c.h5")
    with open(path, "r+b") as f:
        f.seek(data_offset(path, dataset) + 5)
        byte = f.read(1)[0]
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte ^ 0x10]))

    ckpt2, w2, e2 = sample_model()
    w2.assign(np.full((3, 4), -1, np.float32))
    e2.assign(np.full((4, 2), -1, np.int64))
    with pytest.raises(ChecksumMismatchError, match=variable) as info:
        ckpt2.restore(path)
    assert "crc32c" in str(info.value) and str(path) in str(info.value)
    for c in w2.components:  # all or nothing: not even the sound variables were written
        np.testing.assert_array_equal(c, np.full((3, 4), -1, np.float32))
    np.testing.assert_array_equal(np.asarray(e2), np.full((4, 2), -1, np.int64))
    with H5Reader(path) as r:
        problems = r.verify_all()
    assert len(problems) == 1 and variable in problems[0]


def test_truncated_data_is_an_error_naming_the_variable(tmp_path):
    ckpt, *_ = sample_model()
    path = ckpt.write(tmp_path / "c.h5")
    cut = data_offset(path, "model/w/primary") + 4
    with open(path, "r+b") as f:
        f.truncate(cut)
    with pytest.raises(CorruptCheckpointError):
        sample_model()[0].restore(path)


def test_a_hostile_shape_is_refused_before_any_allocation(tmp_path):
    """A header may claim terabytes: the reader compares with the bytes stored first."""
    path = str(tmp_path / "huge.h5")
    with h5py.File(path, "w", libver="latest") as f:
        f.attrs["parallelvars_format"] = 1
        for name, kwargs in (("plain", {}), ("zipped", {"chunks": (1024, 1024), "compression": "gzip"})):
            g = f.create_group(name)
            g.attrs.update({"kind": "single", "dtype": "float32", "shape": [1 << 20, 1 << 20], "num_components": 1})
            ds = g.create_dataset("primary", shape=(1 << 20, 1 << 20), dtype="f4", **kwargs)
            ds.attrs["crc32c"] = 0
    with H5Reader(path) as r:
        for name in ("plain", "zipped"):
            with pytest.raises(TruncatedFileError, match=f"{name}/primary"):
                r[name].component(0)
            with pytest.raises(TruncatedFileError, match="fewer bytes"):
                r[name].value()
        assert len(r.verify_all()) == 2
