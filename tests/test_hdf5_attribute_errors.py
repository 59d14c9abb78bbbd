"""Attributes (of a variable, or of the file: its metadata) an HDF5 checkpoint of ours cannot hold are refused by the HDF5 writer with our
documented error, naming the file, the variable and expected versus found, before anything is
written (they used to escape as bare ``TypeError``/``AttributeError`` from deep in the writer)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from parallelvars.errors import InvalidEntryError
from parallelvars.formats import ArrayEntry, open_checkpoint, write_checkpoint


def _write(path: str, attrs: dict) -> None:
    entry = ArrayEntry("a/w", [np.ones(3, np.float32)], attrs=attrs)
    write_checkpoint(path, {"a/w": entry})


@pytest.mark.parametrize(
    ("attrs", "found"),
    [
        ({"note": b"xy"}, "a value of type bytes"),
        ({"note": [np.int64(1), 2.5]}, "a value of type list"),
        ({"note": np.array(["a"], dtype=object)}, "a value of type ndarray"),
        ({1: "a"}, "a name of type int"),
    ],
)
def test_an_attribute_the_file_cannot_hold_is_refused_and_the_last_good_file_kept(
    tmp_path, attrs, found
):
    path = str(tmp_path / "o.h5")
    _write(path, {"note": "kept"})
    before = (tmp_path / "o.h5").read_bytes()
    with pytest.raises(InvalidEntryError) as info:
        _write(path, attrs)
    err = info.value
    assert err.file == path and err.variable == "a/w"
    assert err.found == found and err.expected
    assert (tmp_path / "o.h5").read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["o.h5"]


@pytest.mark.parametrize(
    "value",
    [(1, "a"), {"a": [1, None]}, np.float32(2), np.arange(3), [1.5, 2], "text", True, ["a", "b"]],
)
def test_attributes_the_file_can_hold_are_written_as_before(tmp_path, value):
    path = str(tmp_path / "o.h5")
    _write(path, {"note": value})
    got = open_checkpoint(path)["a/w"].attrs["note"]
    expected = value.tolist() if isinstance(value, (np.ndarray, np.generic)) else value
    assert got == (list(expected) if isinstance(expected, tuple) else expected)


@pytest.mark.parametrize("value", [b"xy", [np.int64(1), 2.5], np.array(["a"], dtype=object)])
def test_metadata_the_file_cannot_hold_is_refused_and_the_last_good_file_kept(tmp_path, value):
    path = str(tmp_path / "o.h5")
    _write(path, {"note": "kept"})
    before = (tmp_path / "o.h5").read_bytes()
    entry = ArrayEntry("a/w", [np.ones(3, np.float32)])
    with pytest.raises(InvalidEntryError) as info:
        write_checkpoint(path, {"a/w": entry}, metadata={"step_note": value})
    err = info.value
    assert err.file == path and "step_note" in str(err) and err.found.startswith("a value of type")
    assert (tmp_path / "o.h5").read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["o.h5"]


def test_metadata_the_file_can_hold_is_written_as_before(tmp_path):
    path = str(tmp_path / "o.h5")
    entry = ArrayEntry("a/w", [np.ones(3, np.float32)])
    write_checkpoint(path, {"a/w": entry}, metadata={"note": [np.int64(1), 2], "n": 3})
    view = open_checkpoint(path)
    assert list(view.metadata["note"]) == [1, 2] and view.metadata["n"] == 3
