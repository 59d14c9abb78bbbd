"""Keras adapters: golden files, structural round trips checked with plain h5py."""

from __future__ import annotations

import pathlib

import h5py
import ml_dtypes
import numpy as np
import pytest
from formats_testlib import KERAS, assert_same_view, h5_structure, keras_expected, same_bits

from parallelvars.errors import (
    ChecksumMismatchError,
    CorruptCheckpointError,
    NotACheckpointError,
    UnsupportedDtypeError,
)
from parallelvars.formats import ArrayEntry, DictView, detect_format
from parallelvars.formats.keras import (
    RESERVED,
    open_keras,
    open_keras_legacy,
    write_keras,
    write_keras_legacy,
)
from parallelvars.formats.testing import attr_to_python, keras_write

# model order -> dataset of model.weights.h5 (Keras names list items by snake_case class)
KERAS3_PATHS = [
    "layers/dense/vars/0",
    "layers/dense/vars/1",
    "layers/batch_normalization/vars/0",
    "layers/batch_normalization/vars/1",
    "layers/batch_normalization/vars/2",
    "layers/batch_normalization/vars/3",
    "layers/dense_1/vars/0",
    "layers/dense_1/vars/1",
]


def test_keras3_golden_values() -> None:
    with open_keras(KERAS / "model.weights.h5") as view:
        assert sorted(view) == sorted(KERAS3_PATHS)
        for path, (_, want) in zip(KERAS3_PATHS, keras_expected(), strict=True):
            assert same_bits(view[path].value(), want), path
    assert detect_format(KERAS / "model.weights.h5") == "keras"


def test_keras3_round_trip_is_structurally_identical(tmp_path) -> None:
    with open_keras(KERAS / "model.weights.h5") as view:
        out = write_keras(tmp_path / "copy.weights.h5", view)
    assert h5_structure(out) == h5_structure(KERAS / "model.weights.h5")


def test_legacy_golden_values() -> None:
    with open_keras_legacy(KERAS / "model_legacy.h5") as view:
        expected = keras_expected()
        assert list(view) == [path for path, _ in expected]  # layer order, weight order
        for path, want in expected:
            assert same_bits(view[path].value(), want), path
    assert detect_format(KERAS / "model_legacy.h5") == "keras-legacy"


def test_legacy_round_trip_is_structurally_identical(tmp_path) -> None:
    with open_keras_legacy(KERAS / "model_legacy.h5") as view:
        out = write_keras_legacy(tmp_path / "copy.h5", view)
    assert h5_structure(out) == h5_structure(KERAS / "model_legacy.h5")


def test_keras3_from_other_paths_layout(tmp_path) -> None:
    rng = np.random.default_rng(0)
    kernel = rng.standard_normal((3, 2)).astype(np.float32)
    bias = np.zeros(2, np.float32)
    view = DictView(
        [
            ArrayEntry("model/dense/kernel", [kernel]),
            ArrayEntry("model/dense/bias", [bias]),
            ArrayEntry("step", [np.array(3, np.int64)]),
        ]
    )
    out = write_keras(tmp_path / "m.weights.h5", view)
    with h5py.File(out, "r") as f:
        assert sorted(f["model/dense/vars"]) == ["0", "1"]
        assert same_bits(f["model/dense/vars/0"][()], kernel)
        assert attr_to_python(f["model/dense/vars"].attrs["name"]) == "dense"
        assert same_bits(f["vars/0"][()], np.array(3, np.int64))
    with open_keras(out) as back:
        assert_same_view(back, view)


def test_bfloat16_is_opaque_with_dtype_attribute(tmp_path) -> None:
    bits = np.arange(6, dtype=np.uint16).reshape(2, 3)
    view = DictView([ArrayEntry("layers/dense/vars/0", [bits.view(ml_dtypes.bfloat16)])])
    out = write_keras(tmp_path / "bf.weights.h5", view)
    with h5py.File(out, "r") as f:
        ds = f["layers/dense/vars/0"]
        assert ds.dtype == np.dtype("V2")
        assert ds.id.get_type().get_class() == h5py.h5t.OPAQUE
        assert ds.attrs["dtype"] == "bfloat16"
        assert same_bits(ds[()].view(np.uint16), bits)
    with open_keras(out) as back:
        assert_same_view(back, view)


def test_parallel_components_stay_out_of_keras_vars(tmp_path) -> None:
    w = np.arange(6, dtype=np.float32).reshape(2, 3)
    view = DictView(
        [
            ArrayEntry(
                "layers/dense/vars/0",
                [w, w * 2],
                kind="on_read",
                attrs={"aggregation": "sum", "devices": ["cpu:0", "cpu:1"]},
            ),
            ArrayEntry(
                "layers/dense/vars/1",
                [w[:1], w[1:]],
                kind="sharded",
                shape=(2, 3),
                attrs={"shard_axis": 0, "shard_offsets": [0, 1]},
            ),
        ]
    )
    for write, open_, name in (
        (write_keras, open_keras, "p.weights.h5"),
        (write_keras_legacy, open_keras_legacy, "p.h5"),
    ):
        out = write(tmp_path / name, view)
        with h5py.File(out, "r") as f:
            assert f"{RESERVED}/layers/dense/vars/0/parallel_component_1" in f
            assert "parallelvars" in f.attrs
            if write is write_keras:
                assert sorted(f["layers/dense/vars"]) == ["0", "1"]  # Keras counts these
                assert same_bits(f["layers/dense/vars/1"][()], w)  # sharded: the full value
        with open_(out) as back:
            assert_same_view(back, view)


def test_legacy_generic_layout_and_split_names(tmp_path, monkeypatch) -> None:
    # Keras splits name lists that overflow the 64 KB object header; shrink the limit so a
    # small file shows the split (3 names per part: the names are fixed-length, 7 bytes each).
    monkeypatch.setattr(keras_write, "_HEADER_LIMIT", 3 * len(b"layer00"))
    view = DictView(
        [ArrayEntry(f"layer{i:02d}/kernel", [np.full(2, i, np.int32)]) for i in range(8)]
        + [ArrayEntry("step", [np.array(1)])]
    )
    out = write_keras_legacy(tmp_path / "many.h5", view)
    with h5py.File(out, "r") as f:
        assert "layer_names" not in f.attrs
        assert [attr_to_python(f.attrs[f"layer_names{i}"]) for i in range(3)] == [
            ["layer00", "layer01", "layer02"],
            ["layer03", "layer04", "layer05"],
            ["layer06", "layer07"],
        ]
        assert attr_to_python(f["top_level_model_weights"].attrs["weight_names"]) == ["step"]
        assert attr_to_python(f["layer07"].attrs["weight_names"]) == ["layer07/kernel"]
    with open_keras_legacy(out) as back:
        assert list(back)[:2] == ["layer00/kernel", "layer01/kernel"]
        assert_same_view(back, view)


def test_keras2_names_lose_their_suffix(tmp_path) -> None:
    path = tmp_path / "k2.h5"
    with h5py.File(path, "w") as f:
        f.attrs["layer_names"] = np.array([b"d1"])
        f.attrs["keras_version"] = b"2.21.0"
        g = f.create_group("d1")
        g.attrs["weight_names"] = np.array([b"d1/kernel:0", b"d1/bias:0"])
        g["d1/kernel:0"] = np.ones((2, 2), np.float32)
        g["d1/bias:0"] = np.zeros(2, np.float32)
    with open_keras_legacy(path) as view:
        assert list(view) == ["d1/kernel", "d1/bias"]
        out = write_keras_legacy(tmp_path / "again.h5", view)
    assert h5_structure(out) == h5_structure(path)


# ------------------------------------------------------------------------------------------
# bad input


def test_non_keras_hdf5_is_refused(tmp_path) -> None:
    path = tmp_path / "other.h5"
    with h5py.File(path, "w") as f:
        f["some/data"] = np.zeros(3)
    with pytest.raises(NotACheckpointError) as err:
        open_keras(path)
    assert str(path) in str(err.value)
    with pytest.raises(NotACheckpointError, match="layer_names"):
        open_keras_legacy(path)


def test_not_hdf5_at_all(tmp_path) -> None:
    path = tmp_path / "x.weights.h5"
    path.write_bytes(b"plain text" * 100)
    with pytest.raises(NotACheckpointError, match="not an HDF5 file"):
        open_keras(path)


def test_truncated_keras_file(tmp_path) -> None:
    raw = (KERAS / "model.weights.h5").read_bytes()
    path = tmp_path / "cut.weights.h5"
    path.write_bytes(raw[: len(raw) // 2])
    with pytest.raises((CorruptCheckpointError, NotACheckpointError)) as err:
        open_keras(path)
    assert str(path) in str(err.value)


def test_dataset_outside_vars_and_missing_weights(tmp_path) -> None:
    path = tmp_path / "odd.weights.h5"
    with h5py.File(path, "w") as f:
        f.create_group("vars")
        f["layers/dense/vars/0"] = np.zeros(2)
        f["layers/dense/extra"] = np.zeros(2)
    with pytest.raises(CorruptCheckpointError, match="'layers/dense/extra'"):
        open_keras(path)
    path = tmp_path / "odd.h5"
    with h5py.File(path, "w") as f:
        f.attrs["layer_names"] = np.array([b"d"])
        f.create_group("d").attrs["weight_names"] = np.array([b"d/kernel:0"])
    with pytest.raises(CorruptCheckpointError, match="no dataset"):
        open_keras_legacy(path)


def test_strings_are_refused(tmp_path) -> None:
    view = DictView([ArrayEntry("s", [np.array([b"x"], dtype=object)])])
    with pytest.raises(UnsupportedDtypeError, match="'s'"):
        write_keras(tmp_path / "s.weights.h5", view)


# ------------------------------------------------------------------------------------------
# integrity: files we write carry CRC-32Cs that Keras ignores


def _integrity_sample() -> DictView:
    w = np.arange(12, dtype=np.float32).reshape(4, 3)
    return DictView(
        [
            ArrayEntry("model/dense/kernel", [w, w + 1], kind="mirrored"),
            ArrayEntry("model/dense/bias", [np.zeros(3, np.float32)]),
            ArrayEntry("step", [np.array(7, np.int64)]),
        ]
    )


def _flip_dataset_byte(path, name: str) -> None:
    with h5py.File(path, "r") as f:
        offset = f[name].id.get_offset()
    with open(path, "r+b") as fh:
        fh.seek(offset + 2)
        b = fh.read(1)[0]
        fh.seek(offset + 2)
        fh.write(bytes([b ^ 0x10]))


WRITERS = [
    (write_keras, open_keras, "m.weights.h5", "model/dense/vars/0"),
    (write_keras_legacy, open_keras_legacy, "m.h5", "dense/model/dense/kernel"),
]


@pytest.mark.parametrize(("write", "open_", "name", "dataset"), WRITERS)
def test_our_files_carry_checksums_and_no_global_heap(
    tmp_path, write, open_, name, dataset
) -> None:
    out = write(tmp_path / name, _integrity_sample())
    with h5py.File(out, "r") as f:
        assert f.id.get_create_plist().get_version()[0] >= 2  # a superblock with a checksum
        assert "parallelvars_crc32c" in f.attrs and "crc32c" in f[dataset].attrs
        vlen: list[str] = []
        f.visititems(
            lambda n, o: vlen.extend(
                f"{n}@{k}" for k in o.attrs if h5py.check_vlen_dtype(o.attrs.get_id(k).dtype)
            )
        )
        assert vlen == []  # no string in HDF5's unchecksummed global heap
    with open_(out) as back:
        assert_same_view(back, _integrity_sample())


@pytest.mark.parametrize(("write", "open_", "name", "dataset"), WRITERS)
def test_a_flipped_data_byte_names_the_dataset(tmp_path, write, open_, name, dataset) -> None:
    out = write(tmp_path / name, _integrity_sample())
    _flip_dataset_byte(out, dataset)
    with open_(out) as view, pytest.raises(ChecksumMismatchError, match="crc32c"):
        view["model/dense/kernel"].component(0)  # the path kept in the parallel info


@pytest.mark.parametrize(
    ("write", "open_", "name", "attr"),
    [
        (write_keras, open_keras, "m.weights.h5", ("model/dense/vars", "name", b"other")),
        (
            write_keras_legacy,
            open_keras_legacy,
            "m.h5",
            ("dense", "weight_names", np.array([b"model/dense/bias", b"model/dense/kernel"])),
        ),
    ],
)
def test_a_changed_structure_is_detected(tmp_path, write, open_, name, attr) -> None:
    out = write(tmp_path / name, _integrity_sample())
    group, key, value = attr
    with h5py.File(out, "r+") as f:
        f[group].attrs[key] = value  # swapped weight order, or another layer name
    with pytest.raises(ChecksumMismatchError, match="structure"):
        open_(out)


def test_h5py_errors_on_damaged_structure_are_ours(tmp_path) -> None:
    out = write_keras_legacy(tmp_path / "m.h5", _integrity_sample())
    data = bytearray(pathlib.Path(out).read_bytes())
    at = data.index(b"OHDR", 100)  # an object header after the root's: its checksum fails
    data[at + 8] ^= 0x40
    pathlib.Path(out).write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError), open_keras_legacy(out) as view:
        for entry in view.values():
            entry.value()
