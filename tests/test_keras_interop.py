"""Real Keras loads the `.weights.h5` files we write (Keras 3, any backend; torch here).

Skipped when Keras is not installed (tests/_interop.py); `.ci/run`'s interop step installs
Keras with the CPU build of PyTorch as its backend and runs this file, where a missing Keras
fails.
"""

from __future__ import annotations

import os
import pathlib

import numpy as np
import pytest
from _interop import need

os.environ.setdefault("KERAS_BACKEND", "torch")
keras = need("keras")  # a skip, but a failure in CI's interop step (tests/_interop.py)

from parallelvars import formats  # noqa: E402

DATA = pathlib.Path(__file__).parent / "data" / "keras"

# Raised inside Keras' torch backend about its own numpy interop, not by our code.
pytestmark = pytest.mark.filterwarnings(
    "ignore:__array__ implementation doesn't accept a copy keyword:DeprecationWarning"
)


def fixture_model():
    """The architecture that wrote tests/data/keras/model.weights.h5 (Keras 3.15.1)."""
    return keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(8, activation="relu", name="hidden"),
            keras.layers.BatchNormalization(name="bn"),
            keras.layers.Dense(3, name="logits"),
        ]
    )


def assert_keras_loads(path, expected) -> None:
    """Keras loads ``path`` into the fixture's architecture: same weights, same predictions."""
    model = fixture_model()
    model.load_weights(path)
    np.testing.assert_allclose(model.predict(expected["x"], verbose=0), expected["y"], atol=1e-6)
    for i, w in enumerate(model.weights):
        key = next(k for k in expected if k.startswith(f"{i}:"))
        np.testing.assert_array_equal(np.asarray(w), expected[key])


@pytest.fixture(scope="module")
def expected():
    with np.load(DATA / "keras_expected.npz") as f:
        return {k: f[k] for k in f.files}


def test_keras_loads_the_fixture_as_a_baseline(expected) -> None:
    model = fixture_model()
    model.load_weights(DATA / "model.weights.h5")
    np.testing.assert_allclose(model.predict(expected["x"], verbose=0), expected["y"], atol=1e-6)


@pytest.mark.parametrize("via", ["direct", "hdf5", "safetensors"])
def test_keras_loads_what_we_write(tmp_path, expected, via) -> None:
    src = DATA / "model.weights.h5"
    if via != "direct":  # through another format first: nothing may be lost on the way
        middle = tmp_path / ("mid.h5" if via == "hdf5" else "mid.safetensors")
        formats.convert(src, middle)
        src = middle
    out = tmp_path / "ours.weights.h5"
    formats.convert(src, out, to_format="keras")
    assert_keras_loads(out, expected)


def test_keras_legacy_writer_is_loadable_by_keras(tmp_path, expected) -> None:
    out = tmp_path / "legacy.h5"
    formats.convert(DATA / "model_legacy.h5", out, to_format="keras-legacy")
    model = fixture_model()
    model.load_weights(out)  # Keras 3 reads the legacy layout by layer order
    np.testing.assert_allclose(model.predict(expected["x"], verbose=0), expected["y"], atol=1e-6)


def test_legacy_file_converted_to_keras3_loads_in_keras(tmp_path, expected) -> None:
    out = tmp_path / "from_legacy.weights.h5"
    formats.convert(DATA / "model_legacy.h5", out)  # keras-legacy -> keras, by suffix
    assert_keras_loads(out, expected)


@pytest.mark.parametrize("via", ["hdf5", "safetensors", "npz"])
def test_keras_loads_a_keras_archive_we_write(tmp_path, expected, via) -> None:
    """A .keras archive of Keras' own, through another format and back with --like: Keras
    loads the result as the whole model (architecture from the template, weights from us)."""
    template = tmp_path / "model.keras"
    model = fixture_model()
    model.load_weights(DATA / "model.weights.h5")
    model.save(template)
    middle = formats.convert(template, tmp_path / {"hdf5": "mid.h5"}.get(via, f"mid.{via}"))
    out = formats.convert(middle, tmp_path / "ours.keras", like=template)
    loaded = keras.saving.load_model(out)
    np.testing.assert_allclose(loaded.predict(expected["x"], verbose=0), expected["y"], atol=1e-6)
    for mine, theirs in zip(loaded.weights, model.weights, strict=True):
        np.testing.assert_array_equal(np.asarray(mine), np.asarray(theirs))


def test_keras_archive_from_a_mismatched_model_is_refused(tmp_path) -> None:
    template = tmp_path / "model.keras"
    fixture_model().save(template)
    other = keras.Sequential([keras.Input((6,)), keras.layers.Dense(4, name="hidden")])
    other.save_weights(tmp_path / "other.weights.h5")
    with pytest.raises(ValueError, match="do not fit the template"):
        formats.convert(tmp_path / "other.weights.h5", tmp_path / "bad.keras", like=template)
    assert not (tmp_path / "bad.keras").exists()
