"""Property tests of every reader's header and metadata parsing on random and mutated inputs.

Only the library's documented exceptions may escape, and no read may allocate more than the
file can hold (numpy allocations traced in the reader process). Reads run in the isolated
worker of tools/fuzz_readers.py: a crash or a hang fails the property instead of the run.
The long version: ``python tools/fuzz_readers.py --seconds 600``.
"""

from __future__ import annotations

import os

import fuzz_readers
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

FORMATS = fuzz_readers.available_formats()
FUZZ = settings(
    max_examples=30,
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
HEAD = 1024  # headers and metadata: the first and last bytes of each file


@pytest.fixture(scope="module")
def worker():
    with fuzz_readers.ReaderWorker(timeout=30) as w:
        yield w


@pytest.fixture(scope="module")
def samples(tmp_path_factory):
    out = {}
    for fmt in FORMATS:
        d = str(tmp_path_factory.mktemp(fmt.replace("-", "_")))
        clean = fuzz_readers.write_sample(fmt, d)
        files = fuzz_readers.checkpoint_files(clean)
        damaged = os.path.join(d, "fuzzed")
        out[fmt] = (
            clean,
            [open_bytes(f) for f in files],
            fuzz_readers.copy_checkpoint(clean, damaged),
            damaged,
        )
    return out


def open_bytes(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def damaged_name(samples, fmt: str) -> str:
    clean, _, files, damaged = samples[fmt]
    return damaged if not os.path.isfile(clean) else files[0]


def check(worker, samples, fmt: str, target: int, data: bytes) -> None:
    clean, originals, files, _ = samples[fmt]
    target %= len(files)
    try:
        with open(files[target], "wb") as f:
            f.write(data)
        res = worker.check(damaged_name(samples, fmt), clean, fmt)
    finally:
        with open(files[target], "wb") as f:
            f.write(originals[target])
    assert res["outcome"] not in ("undocumented", "crash", "hang", "alloc"), res


edits = st.lists(
    st.tuples(st.integers(0, 2 * HEAD - 1), st.integers(1, 255)), min_size=1, max_size=6
)


@pytest.mark.parametrize("fmt", FORMATS)
def test_mutated_headers_raise_only_documented_errors(fmt, worker, samples):
    @FUZZ
    @given(target=st.integers(0, 7), edits=edits, cut=st.one_of(st.none(), st.integers(0, 1 << 16)))
    def prop(target, edits, cut):
        original = samples[fmt][1][target % len(samples[fmt][1])]
        data = bytearray(original)
        for pos, mask in edits:  # positions in the first HEAD bytes, then the last HEAD bytes
            offset = pos if pos < HEAD else len(data) - (pos - HEAD) - 1
            if 0 <= offset < len(data):
                data[offset] ^= mask
        if cut is not None:
            del data[cut:]
        check(worker, samples, fmt, target, bytes(data))

    prop()


@pytest.mark.parametrize("fmt", FORMATS)
def test_random_bytes_behind_the_magic_raise_only_documented_errors(fmt, worker, samples):
    @FUZZ
    @given(target=st.integers(0, 7), keep=st.integers(0, 64), tail=st.binary(max_size=2048))
    def prop(target, keep, tail):
        original = samples[fmt][1][target % len(samples[fmt][1])]
        check(worker, samples, fmt, target, original[:keep] + tail)

    prop()
