"""The one JSON converter of metadata writers and the CLI: strict JSON out of numpy values."""

from __future__ import annotations

import json
import math
import pathlib

import ml_dtypes
import numpy as np
import pytest

from parallelvars.formats import ArrayEntry, DictView, open_checkpoint, write_checkpoint
from parallelvars.formats._json import dumps, jsonable


def test_values_become_strict_json() -> None:
    data = {1: np.float32(1.5), "t": (1, 2), "s": frozenset({3}), "a": np.arange(2),
            "z": np.array(7), "dt": np.dtype(ml_dtypes.bfloat16), "o": np.dtype(object),
            "p": pathlib.Path("x/y"), "n": None, "b": np.bool_(False)}  # fmt: skip
    assert jsonable(data) == {"1": 1.5, "t": [1, 2], "s": [3], "a": [0, 1], "z": 7,
                              "dt": "bfloat16", "o": "bytes", "p": "x/y", "n": None, "b": False}  # fmt: skip
    json.dumps(jsonable(data), allow_nan=False)  # strict


# The copies this converter replaces disagreed on these two: metadata writers refused a NaN with
# a bare ValueError and decoded bad UTF-8 with lone surrogates that cannot be encoded again.
@pytest.mark.parametrize(("value", "text"), [(math.nan, "nan"), (np.float64(np.inf), "inf"),
                                             (-math.inf, "-inf"), (np.float16(-np.inf), "-inf")])  # fmt: skip
def test_non_finite_floats_are_strings(value: float, text: str) -> None:
    assert jsonable(value) == text


def test_bytes_that_are_not_utf8_are_escaped() -> None:
    assert jsonable(b"ok \xc3\xa9") == "ok \u00e9"
    assert jsonable(bytearray(b"\xffx")) == "\\xffx"
    dumps(jsonable({"b": b"\xff\xfe"})).encode("utf-8")


@pytest.mark.parametrize(
    ("fmt", "name"), [("safetensors", "m.safetensors"), ("npz", "m.npz"), ("keras", "m.weights.h5")]
)
def test_metadata_with_nan_and_raw_bytes_is_written(
    tmp_path: pathlib.Path, fmt: str, name: str
) -> None:
    view = DictView(
        {"w": ArrayEntry("w", [np.ones(3, np.float32)])},
        metadata={"loss": float("nan"), "tag": b"\xffab", "lr": 0.5},
    )
    path = write_checkpoint(str(tmp_path / name), view, format=fmt)
    with open_checkpoint(path, format=fmt) as back:
        meta = dict(back.metadata)
    assert {k: str(meta[k]).strip('"') for k in ("loss", "tag", "lr")} == {
        "loss": "nan",
        "tag": "\\\\xffab" if fmt == "safetensors" else "\\xffab",
        "lr": "0.5",
    }
