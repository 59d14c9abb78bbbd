"""TensorFlow checkpoints to our HDF5 layout and back, and HDF5 to TensorFlow and back."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from parallelvars.checkpoint.h5io import H5Reader, write_h5
from parallelvars.formats import ArrayEntry, DictView, open_checkpoint, write_checkpoint
from parallelvars.formats.tf import BundleReader

DATA = Path(__file__).parent / "data" / "tf"
FOLDERS = {
    "plain": "ckpt-1",
    "parallel": "ckpt-1",
    "mirrored": "ckpt-1",
    "tf1": "model.ckpt-3",
    "many": "ckpt-1",
    "sharded": "ckpt-1",
}


def _keys(prefix: str) -> set[bytes]:
    with BundleReader(prefix) as r:
        return {k for k in r.entries if k not in r.slice_keys}


def _same_entries(a, b) -> None:  # type: ignore[no-untyped-def]
    assert list(sorted(a)) == list(sorted(b))
    for path in a:
        x, y = a[path], b[path]
        assert (x.kind, x.dtype, tuple(x.shape), x.num_components) == (
            y.kind,
            y.dtype,
            tuple(y.shape),
            y.num_components,
        ), path
        assert dict(x.attrs) == dict(y.attrs), path
        for i in range(x.num_components):
            cx, cy = x.component(i), y.component(i)
            if cx.dtype.kind == "O":
                assert cx.tolist() == cy.tolist(), (path, i)
            else:
                assert cx.tobytes() == cy.tobytes() and cx.shape == cy.shape, (path, i)


@pytest.mark.parametrize("folder", sorted(FOLDERS))
def test_tf_to_hdf5_to_tf_keeps_every_key_and_value(folder: str, tmp_path: Path) -> None:
    source = str(DATA / folder / FOLDERS[folder])
    with open_checkpoint(source) as view:
        h5 = write_h5(tmp_path / "x.h5", view, metadata=view.metadata)
        with H5Reader(h5) as stored:
            _same_entries(view, stored)
            prefix = write_checkpoint(tmp_path / "back" / FOLDERS[folder], stored, format="tf")
        assert _keys(prefix) == _keys(source)
        with open_checkpoint(prefix) as back:
            _same_entries(view, back)


def test_hdf5_to_tf_to_hdf5_loses_nothing(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    devices = ["cpu:0", "cpu:1", "cpu:2"]
    entries = [
        ArrayEntry(
            "model/w",
            [rng.normal(size=(4, 3)).astype(np.float32)] * 3,
            kind="mirrored",
            attrs={
                "devices": devices,
                "aggregation": "none",
                "synchronization": "on_write",
                "trainable": True,
                "name": "w",
            },
        ),
        ArrayEntry(
            "model/count",
            [np.int64(i) for i in range(3)],
            kind="on_read",
            attrs={
                "devices": devices,
                "aggregation": "sum",
                "synchronization": "on_read",
                "trainable": False,
            },
        ),
        ArrayEntry(
            "model/buffers",
            [rng.normal(size=2) for _ in range(3)],
            kind="independent",
            attrs={"devices": devices},
        ),
        ArrayEntry(
            "model/emb",
            [rng.normal(size=(2, 5)), rng.normal(size=(2, 5)), rng.normal(size=(1, 5))],
            kind="sharded",
            shape=(5, 5),
            attrs={"shard_axis": 0, "shard_offsets": [0, 2, 4], "devices": devices},
        ),
        ArrayEntry("model/bf", [np.array([1.5, -2.0], ml_dtypes.bfloat16)]),
        ArrayEntry(
            "opt/slots/model/w/m",
            [np.zeros((4, 3), np.float32)] * 3,
            kind="mirrored",
            attrs={"slot_of": "model/w", "slot_name": "m", "devices": devices},
        ),
        ArrayEntry("opt/iterations", [np.int64(12)]),
    ]
    first = write_h5(tmp_path / "a.h5", DictView(entries), metadata={"step": 12})
    with H5Reader(first) as stored:
        prefix = write_checkpoint(tmp_path / "tf" / "ckpt-12", stored, format="tf")
        with open_checkpoint(tmp_path / "tf") as view:
            assert view.metadata["step"] == 12
            second = write_h5(tmp_path / "b.h5", view, metadata=view.metadata)
        with H5Reader(second) as again:
            _same_entries(stored, again)
            assert again.metadata["step"] == 12
    # and TensorFlow sees ordinary variables: the primaries under VARIABLE_VALUE
    keys = _keys(prefix)
    assert b"model/w/.ATTRIBUTES/VARIABLE_VALUE" in keys
    assert b"model/w/.OPTIMIZER_SLOT/opt/m/.ATTRIBUTES/parallel_component_2" in keys


@pytest.mark.skipif(
    importlib.util.find_spec("parallelvars.formats.hdf5") is None,
    reason="the hdf5 format adapter is not installed",
)
def test_through_the_format_registry(tmp_path: Path) -> None:
    with open_checkpoint(DATA / "parallel") as view:
        write_checkpoint(tmp_path / "x.h5", view)
    with open_checkpoint(tmp_path / "x.h5") as stored:
        assert stored["model/w"].num_components == 3
        prefix = write_checkpoint(tmp_path / "tf" / "ckpt-1", stored, format="tf")
    assert _keys(prefix) == _keys(str(DATA / "parallel" / "ckpt-1"))
