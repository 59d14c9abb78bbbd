"""The native HDF5 adapter (a wrapper over h5io): golden data through it, plain h5py as client."""

from __future__ import annotations

import pathlib

import h5py
import ml_dtypes
import numpy as np
import pytest
from formats_testlib import KERAS, TORCH, assert_same_view, h5_structure, same_bits, torch_expected

from parallelvars.checkpoint.graph import graph_from_paths
from parallelvars.errors import CorruptCheckpointError, NotACheckpointError, TruncatedFileError
from parallelvars.formats import ArrayEntry, DictView, detect_format, open_checkpoint
from parallelvars.formats.hdf5 import open_hdf5, write_hdf5
from parallelvars.formats.safetensors import open_safetensors


def test_golden_safetensors_through_hdf5(tmp_path) -> None:
    with open_safetensors(TORCH / "model.safetensors") as src:
        out = write_hdf5(tmp_path / "t.h5", src)
        with open_hdf5(out) as back:
            assert back.format == "hdf5"
            assert_same_view(back, src)
            assert back.verify_all() == []
            assert back.metadata["seed"] == "0"
    assert detect_format(out) == "hdf5"
    # plain h5py finds every value as an ordinary dataset
    with h5py.File(out, "r") as f:
        for key, want in torch_expected().items():
            ds = f[f"{key.replace('.', '/')}/primary"]
            got = ds[()]
            if want.dtype in (np.dtype(ml_dtypes.bfloat16), np.dtype(ml_dtypes.float8_e4m3fn)):
                got = got.view(want.dtype)
            assert same_bits(np.asarray(got).reshape(want.shape), want), key


def test_parallel_kinds_and_object_graph(tmp_path) -> None:
    full = np.arange(30, dtype=np.float32).reshape(10, 3)
    view = DictView(
        [
            ArrayEntry(
                "m/w",
                [full[:2], full[:2] + 1],
                kind="mirrored",
                attrs={"devices": ["cpu:0", "cpu:1"]},
            ),
            ArrayEntry(
                "m/e",
                [full[:4], full[4:7], full[7:]],
                kind="sharded",
                shape=(10, 3),
                attrs={"shard_axis": 0, "shard_offsets": [0, 4, 7]},
            ),
            ArrayEntry(
                "m/n",
                [np.array(1, np.int64), np.array(2, np.int64)],
                kind="on_read",
                attrs={"aggregation": "sum"},
            ),
            ArrayEntry("s", [np.array([b"ab", b"", b"\xffc"], dtype=object)]),
        ]
    )
    graph = {"version": 1, "nodes": graph_from_paths(sorted(view))}
    out = write_hdf5(tmp_path / "p.h5", view, object_graph=graph)
    with open_hdf5(out) as back:
        assert_same_view(back, view)
        assert back.object_graph == graph
        again = write_hdf5(tmp_path / "again.h5", back)  # the graph travels with the view
    with open_hdf5(again) as third:
        assert third.object_graph == graph
        # A view that no longer matches its source's graph (one entry dropped) carries none.
        subset = DictView({k: e for k, e in third.items() if k != "s"}, format="hdf5")
        subset.object_graph = graph  # type: ignore[attr-defined]
        with open_hdf5(write_hdf5(tmp_path / "subset.h5", subset)) as fourth:
            assert fourth.object_graph is None
        # A view that no longer matches its source's graph (here: one entry dropped) carries none.
        subset = DictView({k: e for k, e in third.items() if k != "s"}, format="hdf5")
        subset.object_graph = graph  # type: ignore[attr-defined]
        with open_hdf5(write_hdf5(tmp_path / "subset.h5", subset)) as fourth:
            assert fourth.object_graph is None
        assert_same_view(third, view)
    with h5py.File(out, "r") as f:
        assert same_bits(f["m/e/value"][()], full)  # the virtual dataset stitches the shards


def test_keras_layout_survives_a_trip_through_hdf5(tmp_path) -> None:
    from parallelvars.formats.keras import open_keras, write_keras

    with open_keras(KERAS / "model.weights.h5") as src:
        mid = write_hdf5(tmp_path / "mid.h5", src)
    with open_hdf5(mid) as view:
        out = write_keras(tmp_path / "back.weights.h5", view)
    assert h5_structure(out) == h5_structure(KERAS / "model.weights.h5")


def test_non_checkpoint_hdf5_file(tmp_path) -> None:
    path = tmp_path / "data.h5"
    with h5py.File(path, "w") as f:
        f["x"] = np.zeros(3)
    with pytest.raises(NotACheckpointError) as err:
        open_checkpoint(path)  # detection falls back to the .h5 suffix
    assert str(path) in str(err.value) and "parallelvars_format" in str(err.value)


def test_truncated_hdf5_file(tmp_path) -> None:
    view = DictView([ArrayEntry("w", [np.arange(100000, dtype=np.float64)])])
    out = write_hdf5(tmp_path / "w.h5", view)
    raw = pathlib.Path(out).read_bytes()
    cut = tmp_path / "cut.h5"
    cut.write_bytes(raw[: len(raw) // 2])
    with pytest.raises((TruncatedFileError, CorruptCheckpointError)) as err, open_hdf5(cut) as v:
        v["w"].value()
    assert str(cut) in str(err.value)
