"""Keras 3 weights exported as a legacy Keras HDF5 file list their layers in the model's order,
which Keras' legacy loader matches by position: from the model's ``.keras`` archive (``like=``,
``--like``), refused without one when the order is not in the weights."""

from __future__ import annotations

import json
import pathlib
import zipfile

import h5py
import numpy as np
import pytest

from parallelvars import formats
from parallelvars.cli import main
from parallelvars.errors import InvalidArgumentError, InvalidEntryError
from parallelvars.formats import ArrayEntry

KERAS = pathlib.Path(__file__).parent / "data" / "keras"
WEIGHTS = (
    KERAS / "model.weights.h5"
)  # Keras 3.15.1: Dense hidden, BatchNormalization bn, Dense logits
LEGACY = KERAS / "model_legacy.h5"  # the same model saved by Keras as a legacy full-model file


def config(*layers: tuple[str, str]) -> str:
    """A Sequential model's config.json as Keras 3 writes it (the fields read here)."""
    return json.dumps(
        {
            "class_name": "Sequential",
            "config": {
                "name": "sequential",
                "layers": [
                    {"class_name": "InputLayer", "config": {"name": "input_layer"}},
                    *({"class_name": c, "config": {"name": n}} for c, n in layers),
                ],
            },
        }
    )


MODEL = (("Dense", "hidden"), ("BatchNormalization", "bn"), ("Dense", "logits"))


def archive(path: pathlib.Path, cfg: str, weights: pathlib.Path = WEIGHTS) -> str:
    """A ``.keras`` archive laid out as Keras 3's ``model.save`` writes one."""
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("metadata.json", json.dumps({"keras_version": "3.15.1"}))
        z.writestr("config.json", cfg)
        z.write(weights, "model.weights.h5")
    return str(path)


def _text(name: object) -> str:
    return name.decode() if isinstance(name, bytes) else str(name)


def layer_names(path: str) -> list[str]:
    with h5py.File(path, "r") as h5:
        return [_text(n) for n in h5.attrs["layer_names"]]


def test_layers_go_out_in_the_models_order_as_keras_writes_them(tmp_path: pathlib.Path) -> None:
    template = archive(tmp_path / "model.keras", config(*MODEL))
    out = tmp_path / "legacy.h5"
    formats.convert(WEIGHTS, out, to_format="keras-legacy", like=template)
    with h5py.File(LEGACY, "r") as keras_file:  # Keras' own legacy file of the same model
        want = [_text(n) for n in keras_file["model_weights"].attrs["layer_names"]]
        shapes = {
            layer: [
                keras_file["model_weights"][layer][w].shape
                for w in [
                    _text(x) for x in keras_file["model_weights"][layer].attrs["weight_names"]
                ]
            ]
            for layer in want
        }
    assert layer_names(str(out)) == want == ["hidden", "bn", "logits"]  # was: bn, hidden, logits
    with h5py.File(out, "r") as h5, formats.open_checkpoint(WEIGHTS) as src:
        for layer, group in zip(want, ["dense", "batch_normalization", "dense_1"], strict=True):
            names = [_text(n) for n in h5[layer].attrs["weight_names"]]
            assert [h5[layer][n].shape for n in names] == shapes[layer]
            for i, n in enumerate(names):
                np.testing.assert_array_equal(
                    h5[layer][n][()], src[f"layers/{group}/vars/{i}"].value()
                )


def test_the_cli_takes_the_template_with_like(tmp_path: pathlib.Path) -> None:
    template = archive(tmp_path / "model.keras", config(*MODEL))
    out = tmp_path / "legacy.h5"
    argv = ["convert", str(WEIGHTS), str(out), "--to", "keras-legacy", "--like", template]
    assert main(argv) == 0
    assert layer_names(str(out)) == ["hidden", "bn", "logits"]


def test_without_a_template_several_classes_are_refused_naming_the_way_out(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "legacy.h5"
    with pytest.raises(InvalidArgumentError, match=r"legacy\.h5.*layer order.*--like"):
        formats.convert(WEIGHTS, out, to_format="keras-legacy")  # was: written, bn first
    assert not out.exists()
    assert main(["convert", str(WEIGHTS), str(out), "--to", "keras-legacy"]) != 0
    assert "--like" in capsys.readouterr().err
    assert not out.exists()


def test_a_layer_the_template_does_not_have_is_refused(tmp_path: pathlib.Path) -> None:
    template = archive(tmp_path / "model.keras", config(("Dense", "hidden"), ("Dense", "logits")))
    with pytest.raises(InvalidEntryError, match="bn"):
        formats.convert(WEIGHTS, tmp_path / "x.h5", to_format="keras-legacy", like=template)


def test_layers_of_one_class_go_out_in_their_numbered_order(tmp_path: pathlib.Path) -> None:
    # Keras 3 numbers the groups of one class in the model's order: dense, dense_1, ... dense_10
    entries = {
        p: ArrayEntry(p, [np.full((2,), i, np.float32)])
        for i, p in enumerate(f"layers/dense{'' if i == 0 else f'_{i}'}/vars/0" for i in range(12))
    }
    out = formats.write_checkpoint(
        tmp_path / "x.h5", dict(sorted(entries.items())), format="keras-legacy"
    )
    assert layer_names(out) == ["dense"] + [
        f"dense_{i}" for i in range(1, 12)
    ]  # was: dense_10 third
    with h5py.File(out, "r") as h5:
        for i, name in enumerate(layer_names(out)):
            (weight,) = [_text(n) for n in h5[name].attrs["weight_names"]]
            assert h5[name][weight][0] == i


def test_a_config_without_layers_is_our_error(tmp_path: pathlib.Path) -> None:
    template = archive(tmp_path / "model.keras", json.dumps({"class_name": "Sequential"}))
    with pytest.raises(InvalidArgumentError, match=r"model\.keras.*no layers"):
        formats.convert(WEIGHTS, tmp_path / "x.h5", to_format="keras-legacy", like=template)


def test_a_legacy_file_goes_into_a_keras_archive_as_into_a_weights_file(
    tmp_path: pathlib.Path,
) -> None:
    template = archive(tmp_path / "model.keras", config(*MODEL))
    weights = formats.convert(LEGACY, tmp_path / "w.weights.h5")
    out = formats.convert(LEGACY, tmp_path / "out.keras", like=template)  # was: refused
    with formats.open_checkpoint(weights) as a, formats.open_checkpoint(out) as b:
        assert list(a) == list(b)
        for key in a:
            np.testing.assert_array_equal(a[key].value(), b[key].value(), err_msg=key)
    with zipfile.ZipFile(out) as z, h5py.File(z.open("model.weights.h5"), "r") as h5:
        assert _text(h5["layers/dense/vars"].attrs["name"]) == "hidden"  # Keras 3's own names
        assert h5["layers/batch_normalization/vars/3"].shape == (8,)
