"""Property tests: every writer -> reader pair keeps kinds, components, attrs and bits."""

from __future__ import annotations

import os
import tempfile

import numpy as np
import pytest
from formats_testlib import EXTRA_DTYPES, NUMERIC_DTYPES, assert_same_view, entries
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from parallelvars.formats import ArrayEntry, DictView, convert, get_format, open_checkpoint

# (format, file name, writer options)
TARGETS = [
    ("hdf5", "c.h5", {}),
    ("safetensors", "c.safetensors", {}),
    ("safetensors", "c.safetensors", {"names": "slash"}),
    ("safetensors", "sharded.safetensors", {"max_shard_size": 64}),
    ("npz", "c.npz", {}),
    ("npz", "c.npz", {"names": "tf"}),
    ("keras", "c.weights.h5", {}),
    ("keras-legacy", "c.h5", {}),
]
_SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _round_trip(fmt: str, name: str, options: dict, view: DictView) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        out = get_format(fmt).write(os.path.join(tmp, name), view, **options)
        with open_checkpoint(out, format=fmt) as back:
            assert back.format == fmt
            assert_same_view(back, view)


@pytest.mark.parametrize(
    ("fmt", "name", "options"), TARGETS, ids=[f"{t[0]}-{t[2]}" for t in TARGETS]
)
@_SETTINGS
@given(view=entries(dtypes=NUMERIC_DTYPES + EXTRA_DTYPES))
def test_writer_reader_pairs(fmt: str, name: str, options: dict, view: DictView) -> None:
    _round_trip(fmt, name, options, view)


@pytest.mark.parametrize("fmt", ["hdf5", "npz"])
@settings(max_examples=15, deadline=None)
@given(
    data=st.lists(
        st.binary(max_size=5).filter(lambda b: not b.endswith(b"\0") and b"\0" not in b),
        min_size=0,
        max_size=6,
    )
)
def test_string_tensors(fmt: str, data: list[bytes]) -> None:
    value = np.empty(len(data), object)
    value[:] = data
    name = {"hdf5": "s.h5", "npz": "s.npz"}[fmt]
    _round_trip(fmt, name, {}, DictView([ArrayEntry("s", [value])]))


@_SETTINGS
@given(
    view=entries(max_vars=3),
    hops=st.lists(
        st.sampled_from(["h5", "safetensors", "npz", "weights.h5"]), min_size=2, max_size=4
    ),
)
def test_conversion_chains(view: DictView, hops: list[str]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        current = get_format("hdf5").write(os.path.join(tmp, "start.h5"), view)
        for i, suffix in enumerate(hops):
            current = convert(current, os.path.join(tmp, f"hop{i}.{suffix}"))
        with open_checkpoint(current) as back:
            assert_same_view(back, view)
