"""On-read variables in flat exports: the aggregate under the plain key, every part under
``parallel_component_<i>`` (0 included), and a bit-exact way back."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest
from safetensors.numpy import load_file

import parallelvars as pv
from parallelvars import formats
from parallelvars.formats import part_key

PARTS = [30, 40, 50, 18]  # SUM 138


def _model(strategy: pv.MirroredStrategy) -> pv.Module:
    with strategy.scope():
        m = pv.Module()
        m.n = pv.Variable(np.int64(0), name="n", synchronization="on_read", aggregation="sum")
        m.a = pv.Variable(
            np.zeros(2, np.float32), name="a", synchronization="on_read", aggregation="mean"
        )
        m.f = pv.Variable(
            np.float32(0), name="f", synchronization="on_read", aggregation="only_first_replica"
        )
    return m


@pytest.fixture
def saved(tmp_path: pathlib.Path) -> str:
    m = _model(pv.MirroredStrategy(4))
    for c, p in zip(m.n.components, PARTS, strict=True):
        c[...] = p
    for i, c in enumerate(m.a.components):
        c[...] = [i, 2 * i]
    for i, c in enumerate(m.f.components):
        c[...] = i + 1
    return pv.Checkpoint(model=m).write(tmp_path / "run.h5")


def test_part_keys() -> None:
    assert part_key("m/n", 0, "slash") == "m/n/parallel_component_0"
    assert part_key("m/n", 2, "dotted") == "m.n/parallel_component_2"
    assert part_key("m/n", 0, "tf") == "m/n/.ATTRIBUTES/parallel_component_0"


def test_safetensors_and_npz_store_the_aggregate_under_the_plain_key(saved, tmp_path) -> None:
    formats.convert(saved, tmp_path / "m.safetensors")
    formats.convert(saved, tmp_path / "m.npz")
    st = {k: v.tolist() for k, v in load_file(tmp_path / "m.safetensors").items()}
    with np.load(tmp_path / "m.npz") as z:
        npz = {k: z[k].tolist() for k in z.files if not k.startswith("__")}
    for got, sep in ((st, "."), (npz, "/")):
        assert got[f"model{sep}n"] == 138  # what a plain consumer reads: the total
        assert [got[f"model{sep}n/parallel_component_{i}"] for i in range(4)] == PARTS
        assert got[f"model{sep}a"] == [1.5, 3.0]  # the mean
        assert got[f"model{sep}a/parallel_component_0"] == [0.0, 0.0]
        # ONLY_FIRST_REPLICA: the first part is the value, stored as before.
        assert got[f"model{sep}f"] == 1.0 and f"model{sep}f/parallel_component_0" not in got
        assert got[f"model{sep}f/parallel_component_3"] == 4.0


@pytest.mark.parametrize("name", ["m.safetensors", "m.npz", "m.weights.h5"])
def test_flat_exports_read_back_the_parts_bit_exact(saved, tmp_path, name) -> None:
    out = formats.convert(saved, tmp_path / name)
    view = formats.open_checkpoint(out)
    try:
        n = view["model/n"]
        assert (n.kind, n.num_components) == ("on_read", 4)
        assert [int(n.component(i)) for i in range(4)] == PARTS and int(n.value()) == 138
        assert view["model/a"].value().tolist() == [1.5, 3.0]
    finally:
        view.close()
    back = formats.convert(out, tmp_path / "back.h5")
    m = _model(pv.MirroredStrategy(4))
    pv.Checkpoint(model=m).restore(back).assert_consumed()
    assert m.n.stacked.tolist() == PARTS and int(m.n) == 138
    assert m.a.stacked.tolist() == [[i, 2 * i] for i in range(4)]
    assert m.f.stacked.tolist() == [1.0, 2.0, 3.0, 4.0]


@pytest.mark.parametrize("components", ["logical", "primary"])
def test_components_logical_writes_each_kinds_logical_value(saved, tmp_path, components) -> None:
    from parallelvars.cli import main

    out = tmp_path / f"{components}.npz"
    assert main(["convert", str(saved), str(out), "--components", components]) == 0
    with np.load(out) as z:
        got = {k: z[k].tolist() for k in z.files if not k.startswith("__")}
    assert got == {"model/n": 138, "model/a": [1.5, 3.0], "model/f": 1.0, "save_counter": 0}


def test_tf_checkpoint_keeps_the_aggregate_under_variable_value(saved, tmp_path) -> None:
    from parallelvars.formats.tf import BundleReader

    prefix = formats.convert(saved, tmp_path / "tf" / "ckpt-1", to_format="tf")
    bundle = BundleReader(prefix)
    try:

        def read(key: str) -> list:
            return bundle.read(key.encode()).tolist()

        assert read("model/n/.ATTRIBUTES/VARIABLE_VALUE") == 138  # what TensorFlow reads
        parts = [read(f"model/n/.ATTRIBUTES/parallel_component_{i}") for i in range(4)]
        assert parts == PARTS
        assert read("model/a/.ATTRIBUTES/VARIABLE_VALUE") == [1.5, 3.0]
        assert read("model/f/.ATTRIBUTES/VARIABLE_VALUE") == 1.0  # ONLY_FIRST: the first part
    finally:
        bundle.close()
    view = formats.open_checkpoint(prefix)
    try:
        n = view["model/n"]
        assert (n.kind, n.num_components, n.attrs["aggregation"]) == ("on_read", 4, "sum")
        assert [int(n.component(i)) for i in range(4)] == PARTS and int(n.value()) == 138
    finally:
        view.close()
    back = formats.convert(prefix, tmp_path / "back.h5")
    m = _model(pv.MirroredStrategy(4))
    pv.Checkpoint(model=m).restore(back).assert_consumed()
    assert m.n.stacked.tolist() == PARTS
    assert m.a.stacked.tolist() == [[i, 2 * i] for i in range(4)]


@pytest.mark.parametrize(
    ("kind", "keys", "what"),
    [
        ("on_read", ["n", "n/parallel_component_0"], "wrong number"),  # 2 parts, 1 listed
        ("mirrored", ["n", "n/parallel_component_0", "n/parallel_component_1"], "wrong number"),
        ("on_read", ["n/parallel_component_0", "n", "missing"], "missing"),
    ],
)
def test_a_crafted_aggregate_record_is_a_corrupt_checkpoint(tmp_path, kind, keys, what) -> None:
    import json

    from safetensors.numpy import save_file

    tensors = {
        "n": np.array(3, np.int64),
        "n/parallel_component_0": np.array(1, np.int64),
        "n/parallel_component_1": np.array(2, np.int64),
    }
    info = {
        "format": "parallelvars",
        "version": 1,
        "names": "slash",
        "variables": {
            "n": {
                "kind": kind,
                "dtype": "int64",
                "shape": [],
                "num_components": 2,
                "layout": "aggregate",
                "keys": keys,
                "attrs": {"aggregation": "sum"},
            }
        },
    }
    path = tmp_path / "crafted.safetensors"
    save_file(tensors, str(path), metadata={"parallelvars": json.dumps(info)})
    with pytest.raises(pv.errors.CorruptCheckpointError, match=what):
        formats.open_checkpoint(path).close()
