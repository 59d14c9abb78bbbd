"""convert: golden files through our HDF5 and back, options, progress, failure safety."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
from formats_testlib import (
    DATA,
    KERAS,
    TORCH,
    assert_same_view,
    h5_structure,
    keras_expected,
    same_bits,
    torch_expected,
)
from safetensors.numpy import load_file

from parallelvars.errors import InvalidEntryError, UnsupportedDtypeError
from parallelvars.formats import (
    ArrayEntry,
    DictView,
    convert,
    format_for_path,
    from_key,
    open_checkpoint,
    write_checkpoint,
)

TORCH_SOURCES = {
    "model.safetensors": "safetensors",
    "sharded": "safetensors",
    "torch_expected.npz": "npz",
}


@pytest.mark.parametrize("source", sorted(TORCH_SOURCES))
def test_torch_golden_files_through_hdf5_and_back(tmp_path, source) -> None:
    fmt = TORCH_SOURCES[source]
    mid = convert(TORCH / source, tmp_path / "mid.h5")
    back = convert(mid, tmp_path / ("back.safetensors" if fmt == "safetensors" else "back.npz"))
    expected = torch_expected()
    names = "dotted" if fmt == "safetensors" else "slash"
    for path in (mid, back):
        with open_checkpoint(path) as view:
            assert len(view) == len(expected)
            for key, want in expected.items():
                assert same_bits(view[from_key(key, names)].value(), want), (path, key)
    if fmt == "safetensors":  # a plain reader sees the original names again
        assert sorted(json.loads(_header(back))) == sorted([*expected, "__metadata__"])


def _header(path: str) -> bytes:
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        return f.read(n)


@pytest.mark.parametrize(
    ("source", "fmt", "suffix"),
    [("model.weights.h5", "keras", ".weights.h5"), ("model_legacy.h5", "keras-legacy", ".h5")],
)
def test_keras_golden_files_through_hdf5_and_back(tmp_path, source, fmt, suffix) -> None:
    mid = convert(KERAS / source, tmp_path / "mid.h5", from_format=fmt)
    back = convert(mid, tmp_path / f"back{suffix}", to_format=fmt)
    assert h5_structure(back) == h5_structure(KERAS / source)
    with open_checkpoint(mid) as view:
        values = [view[p].value() for p in view]
        assert sorted(v.tobytes() for v in values) == sorted(
            v.tobytes() for _, v in keras_expected()
        )


def test_safetensors_golden_through_npz_and_safetensors(tmp_path) -> None:
    a = convert(TORCH / "model.safetensors", tmp_path / "a.npz")
    b = convert(a, tmp_path / "b.safetensors")
    c = convert(b, tmp_path / "c.safetensors", max_shard_size=100)
    with open_checkpoint(TORCH / "model.safetensors") as src:
        for path in (a, b, c):
            with open_checkpoint(path) as view:
                assert_same_view(view, src)


def _parallel_view() -> DictView:
    full = np.arange(24, dtype=np.float32).reshape(8, 3)
    return DictView(
        [
            ArrayEntry(
                "m/w", [full[:2], full[:2]], kind="mirrored", attrs={"devices": ["cpu:0", "cpu:1"]}
            ),
            ArrayEntry(
                "m/e",
                [full[:5], full[5:]],
                kind="sharded",
                shape=(8, 3),
                attrs={"shard_axis": 0, "shard_offsets": [0, 5], "devices": ["cpu:0", "cpu:1"]},
            ),
            ArrayEntry(
                "m/n",
                [np.array([1.0, 2.0]), np.array([3.0, 4.0])],
                kind="on_read",
                attrs={"aggregation": "sum", "devices": ["cpu:0", "cpu:1"]},
            ),
            ArrayEntry("m/i", [np.zeros(2, np.int8), np.ones(2, np.int8)], kind="independent"),
        ],
        metadata={"step": 7},
    )


def test_components_primary(tmp_path) -> None:
    view = _parallel_view()
    src = write_checkpoint(tmp_path / "p.h5", view)
    # Independent buffers have no single value: refused, as `extract` refuses them.
    with pytest.raises(InvalidEntryError, match="m/i"):
        convert(src, tmp_path / "refused.safetensors", components="primary")
    assert not (tmp_path / "refused.safetensors").exists()
    src = write_checkpoint(tmp_path / "q.h5", {k: view[k] for k in view if k != "m/i"})
    out = convert(src, tmp_path / "p.safetensors", components="primary")
    plain = load_file(out)
    assert sorted(plain) == ["m.e", "m.n", "m.w"]
    assert same_bits(plain["m.e"], np.arange(24, dtype=np.float32).reshape(8, 3))
    assert same_bits(plain["m.n"], np.array([4.0, 6.0]))
    with open_checkpoint(out) as view:
        assert all(e.kind == "single" and "devices" not in e.attrs for e in view.values())


@pytest.mark.parametrize("target", ["x.h5", "x.safetensors", "x.npz", "x.weights.h5"])
def test_all_components_survive(tmp_path, target) -> None:
    src = write_checkpoint(tmp_path / "p.h5", _parallel_view())
    out = convert(src, tmp_path / target)
    with open_checkpoint(out) as view:
        assert_same_view(view, _parallel_view())
        assert str(view.metadata["step"]) == "7"


def test_progress_reports_bytes(tmp_path) -> None:
    calls: list[tuple[int, int]] = []
    src = write_checkpoint(tmp_path / "p.h5", _parallel_view())
    convert(src, tmp_path / "p.npz", progress=lambda done, total: calls.append((done, total)))
    total = sum(e.nbytes for e in _parallel_view().values())
    assert calls and all(t == total for _, t in calls)
    dones = [d for d, _ in calls]
    assert dones == sorted(dones) and dones[-1] == total
    assert calls[0] == (0, total)  # the total comes before the first tensor is read


def test_names_option(tmp_path) -> None:
    src = write_checkpoint(tmp_path / "p.h5", _parallel_view())
    for names, key in (
        ("slash", "m/w"),
        ("dotted", "m.w"),
        ("tf", "m/w/.ATTRIBUTES/VARIABLE_VALUE"),
    ):
        out = convert(src, tmp_path / f"{names}.safetensors", names=names)
        assert key in load_file(out)
        with open_checkpoint(out) as view:
            assert sorted(view) == sorted(_parallel_view())
    with pytest.raises(ValueError, match="no key style"):
        convert(src, tmp_path / "x.h5", names="dotted")
    with pytest.raises(ValueError, match="unknown name style"):
        convert(src, tmp_path / "x.npz", names="camel")
    with pytest.raises(ValueError, match="max_shard_size"):
        convert(src, tmp_path / "x.npz", max_shard_size=10)


def test_convert_with_devices(tmp_path) -> None:
    view = DictView([e for e in _parallel_view().values() if e.kind != "independent"])
    src = write_checkpoint(tmp_path / "p.h5", view)
    out = convert(src, tmp_path / "r.h5", devices=3)
    with open_checkpoint(out) as back:
        assert back["m/e"].attrs["shard_offsets"] == [0, 3, 6]
        assert back["m/w"].num_components == 3
        assert same_bits(back["m/n"].component(0), np.array([4.0, 6.0]))


def test_failed_convert_leaves_no_file(tmp_path) -> None:
    view = DictView(
        [ArrayEntry("a", [np.zeros(3)]), ArrayEntry("s", [np.array([b"x"], dtype=object)])]
    )
    src = write_checkpoint(tmp_path / "s.npz", view)
    target = tmp_path / "out.safetensors"
    target.write_bytes(b"previous")
    with pytest.raises(UnsupportedDtypeError, match="'s'"):
        convert(src, target)
    assert target.read_bytes() == b"previous"
    assert sorted(os.listdir(tmp_path)) == ["out.safetensors", "s.npz"]


def test_format_for_path_and_errors(tmp_path) -> None:
    assert format_for_path("a/model.weights.h5") == "keras"
    assert format_for_path("run.h5") == "hdf5"
    assert format_for_path("m.safetensors.index.json") == "safetensors"
    assert format_for_path("x.npz") == "npz"
    assert format_for_path("x.bin") is None
    shutil.copy(TORCH / "model.safetensors", tmp_path / "m.safetensors")
    with pytest.raises(ValueError, match="cannot tell the output format"):
        convert(tmp_path / "m.safetensors", tmp_path / "out.bin")
    with pytest.raises(ValueError, match="components"):
        convert(tmp_path / "m.safetensors", tmp_path / "out.npz", components="some")


@pytest.mark.parametrize("suffix", ["h5", "safetensors", "npz", "weights.h5"])
@pytest.mark.parametrize("folder", ["parallel", "sharded", "plain"])
def test_tensorflow_checkpoints_into_every_format(tmp_path, folder, suffix) -> None:
    src = DATA / "tf" / folder
    out = convert(src, tmp_path / f"x.{suffix}")
    with open_checkpoint(src) as want, open_checkpoint(out) as got:
        assert_same_view(got, want)


def test_tensorflow_strings_need_a_format_that_holds_them(tmp_path) -> None:
    src = DATA / "tf" / "many"
    with pytest.raises(UnsupportedDtypeError, match="'big/text'"):
        convert(src, tmp_path / "x.safetensors")
    out = convert(src, tmp_path / "x.npz")
    with open_checkpoint(src) as want, open_checkpoint(out) as got:
        assert_same_view(got, want)
