"""Real clients load our exports strictly: a model read from the library's own file, trained
here (4 devices, Adam), exported for the library and loaded back by it, values compared.

Each test is skipped when its library is not installed (tests/_interop.py); `.ci/run`'s interop
step installs Keras, the CPU build of PyTorch, transformers and TensorFlow and runs this file,
where a missing library fails.
"""

from __future__ import annotations

import json
import os
import pathlib
from typing import Any

import numpy as np
import pytest

os.environ.setdefault("KERAS_BACKEND", "torch")

from _interop import need

import parallelvars as pv
from parallelvars import formats
from parallelvars.cli import main

DATA = pathlib.Path(__file__).parent / "data"


pytestmark = pytest.mark.filterwarnings(
    "ignore:__array__ implementation doesn't accept a copy keyword:DeprecationWarning"
)


def ours_from(path: str | os.PathLike[str]) -> tuple[Any, dict[str, Any], dict[str, Any]]:
    """Variables shaped like every entry of ``path`` on 4 devices, nested by path, restored from
    it with every assertion: (strategy, roots, {path: variable})."""
    with formats.open_checkpoint(path) as view:
        specs = {k: (tuple(view[k].shape), view[k].dtype) for k in view}
    roots: dict[str, Any] = {}
    flat: dict[str, Any] = {}
    with pv.MirroredStrategy(4).scope() as strategy:
        for key, (shape, dtype) in specs.items():
            *parents, leaf = key.split("/")
            node = roots
            for name in parents:
                node = node.setdefault(name, {})
            node[leaf] = flat[key] = pv.Variable(np.zeros(shape, dtype), name=key)
    ckpt = pv.Checkpoint(**roots)
    ckpt.restore(os.fspath(path)).assert_consumed()  # no save_counter in it: not counted
    return strategy, roots, flat


def train(strategy: Any, flat: dict[str, Any], keys: list[str], steps: int = 2) -> Any:
    """``steps`` Adam steps on ``keys`` with fixed gradients; returns the optimizer."""
    opt = pv.optimizers.Adam(0.05)
    rng = np.random.default_rng(0)
    grads = {k: rng.standard_normal(flat[k].shape).astype(flat[k].dtype) for k in keys}
    for _ in range(steps):
        opt.distributed_apply(strategy, [(grads[k], flat[k]) for k in keys])
    return opt


def value(var: Any) -> np.ndarray:
    return np.asarray(var.components[0])


def export(run_h5: str, dst: pathlib.Path, *extra: str) -> None:
    argv = ["convert", run_h5, str(dst), "--components", "logical", "--model-only", *extra]
    assert main(argv) == 0


# --- PyTorch -------------------------------------------------------------------------------------


def test_torch_loads_our_export_strictly(tmp_path: pathlib.Path) -> None:
    torch = need("torch")
    storch = need("safetensors.torch")
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    start = tmp_path / "start.safetensors"
    storch.save_file({k: v.contiguous() for k, v in net.state_dict().items()}, str(start))
    strategy, roots, flat = ours_from(start)  # keys 0.weight ... -> paths 0/weight ...
    opt = train(strategy, flat, sorted(flat))
    run_h5 = pv.Checkpoint(model=roots, optimizer=opt).write(tmp_path / "run.h5")
    out = tmp_path / "net.safetensors"
    export(run_h5, out, "--root", "model", "--names", "dotted")
    fresh = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    fresh.load_state_dict(storch.load_file(str(out)), strict=True)  # was: save_counter, ...
    x = np.linspace(-1, 1, 15, dtype=np.float32).reshape(5, 3)
    h = np.tanh(x @ value(flat["0/weight"]).T + value(flat["0/bias"]))
    y = h @ value(flat["2/weight"]).T + value(flat["2/bias"])
    with torch.no_grad():
        got = fresh(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(got, y, rtol=1e-5, atol=1e-6)
    assert not np.allclose(value(flat["0/weight"]), net.state_dict()["0.weight"].numpy())


# --- Keras ---------------------------------------------------------------------------------------

# tests/data/keras/model.weights.h5 (Keras 3.15.1): its groups in the model's weight order.
KERAS_ORDER = [
    "layers/dense/vars/0",
    "layers/dense/vars/1",
    "layers/batch_normalization/vars/0",
    "layers/batch_normalization/vars/1",
    "layers/batch_normalization/vars/2",
    "layers/batch_normalization/vars/3",
    "layers/dense_1/vars/0",
    "layers/dense_1/vars/1",
]
TRAINABLE = [k for k in KERAS_ORDER if not k.endswith(("/vars/2", "/vars/3"))]


def keras_model(keras: Any) -> Any:
    """The architecture that wrote tests/data/keras/model.weights.h5."""
    return keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(8, activation="relu", name="hidden"),
            keras.layers.BatchNormalization(name="bn"),
            keras.layers.Dense(3, name="logits"),
        ]
    )


@pytest.fixture
def keras_trained(tmp_path: pathlib.Path) -> tuple[Any, str, dict[str, Any]]:
    keras = need("keras")
    strategy, roots, flat = ours_from(DATA / "keras" / "model.weights.h5")
    opt = train(strategy, flat, TRAINABLE)
    run_h5 = pv.Checkpoint(**roots, optimizer=opt).write(tmp_path / "run.h5")
    return keras, run_h5, flat


def assert_keras_has(model: Any, flat: dict[str, Any]) -> None:
    assert len(model.weights) == len(KERAS_ORDER)
    for w, key in zip(model.weights, KERAS_ORDER, strict=True):
        np.testing.assert_array_equal(np.asarray(w), value(flat[key]), err_msg=key)


def test_keras_loads_our_weights_h5(keras_trained: Any, tmp_path: pathlib.Path) -> None:
    keras, run_h5, flat = keras_trained
    out = tmp_path / "model.weights.h5"
    export(run_h5, out)
    model = keras_model(keras)
    model.load_weights(out)  # was: "Layer 'functional' expected 0 variables, but received 1"
    assert_keras_has(model, flat)


def test_keras_loads_our_keras_archive(keras_trained: Any, tmp_path: pathlib.Path) -> None:
    keras, run_h5, flat = keras_trained
    template = tmp_path / "template.keras"
    keras_model(keras).save(template)
    out = tmp_path / "trained.keras"
    export(run_h5, out, "--like", str(template))  # was: refused, optimizer/vars/0 ...
    assert_keras_has(keras.saving.load_model(out), flat)


def test_keras_loads_our_legacy_h5(keras_trained: Any, tmp_path: pathlib.Path) -> None:
    keras, run_h5, flat = keras_trained
    template = tmp_path / "template.keras"
    keras_model(keras).save(template)  # its config: the layers' order, which legacy files need
    out = tmp_path / "legacy.h5"
    export(run_h5, out, "--to", "keras-legacy", "--like", str(template))  # was: bn first
    model = keras_model(keras)
    model.load_weights(out)
    assert_keras_has(model, flat)


# --- Hugging Face transformers -------------------------------------------------------------------


def test_transformers_loads_our_gpt2_folder(tmp_path: pathlib.Path) -> None:
    transformers = need("transformers")
    need("torch")
    config = transformers.GPT2Config(
        vocab_size=32, n_positions=16, n_embd=8, n_layer=1, n_head=2, tie_word_embeddings=True
    )
    start = tmp_path / "start"
    transformers.GPT2LMHeadModel(config).save_pretrained(start, safe_serialization=True)
    strategy, roots, flat = ours_from(start)  # a Hugging Face folder restores as it is
    float_keys = sorted(k for k in flat if flat[k].dtype == np.float32)
    opt = train(strategy, flat, float_keys)
    run_h5 = pv.Checkpoint(**roots, optimizer=opt).write(tmp_path / "run.h5")
    folder = tmp_path / "exported"  # made by the export, config.json carried from --like
    export(run_h5, folder / "model.safetensors", "--names", "dotted", "--like", str(start))
    model, info = transformers.GPT2LMHeadModel.from_pretrained(folder, output_loading_info=True)
    assert not info["unexpected_keys"]  # was: 276 of them (counters, slots)
    assert set(info["missing_keys"]) <= {"lm_head.weight"}  # tied to wte, never saved
    assert next(model.parameters()).dtype == transformers.GPT2LMHeadModel(config).dtype
    state = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    for key in float_keys:
        np.testing.assert_array_equal(state[key.replace("/", ".")], value(flat[key]), err_msg=key)
    assert (folder / "config.json").read_bytes() == (start / "config.json").read_bytes()
    assert json.loads((folder / "generation_config.json").read_text())  # carried as well
    again = tmp_path / "again"  # a Hugging Face folder converted: its files go along by itself
    assert main(["convert", str(folder), f"{again}/", "--to", "safetensors"]) == 0
    reloaded = transformers.GPT2LMHeadModel.from_pretrained(again)
    for key, tensor in reloaded.state_dict().items():
        np.testing.assert_array_equal(tensor.detach().numpy(), state[key], err_msg=key)


# --- TensorFlow ----------------------------------------------------------------------------------


def test_tensorflow_restores_our_export_with_assert_consumed(tmp_path: pathlib.Path) -> None:
    tf = need("tensorflow")
    with pv.MirroredStrategy(4).scope() as strategy:
        kernel = pv.Variable(np.ones((3, 2), np.float32), name="dense/kernel")
        bias = pv.Variable(np.zeros(2, np.float32), name="dense/bias")
    model = {"kernel": kernel, "bias": bias}
    opt = train(strategy, {"kernel": kernel, "bias": bias}, ["kernel", "bias"])
    run_h5 = pv.Checkpoint(model=model, optimizer=opt).write(tmp_path / "run.h5")
    prefix = tmp_path / "tf" / "ckpt-1"
    export(run_h5, prefix, "--to", "tf")  # tf/ is made
    tf_model = tf.Module()
    tf_model.kernel = tf.Variable(np.zeros((3, 2), np.float32))
    tf_model.bias = tf.Variable(np.zeros(2, np.float32))
    tf.train.Checkpoint(model=tf_model).restore(str(prefix)).assert_consumed()
    np.testing.assert_array_equal(tf_model.kernel.numpy(), value(kernel))
    np.testing.assert_array_equal(tf_model.bias.numpy(), value(bias))


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_tensorflow1_saver_and_adam_continue_our_training(
    tmp_path: pathlib.Path, dtype: type
) -> None:
    """TF 1.x graph mode: a Saver restores every variable, Adam slot and beta power of our
    export (``--names tf1``), and one more AdamOptimizer step there is the step we take here.
    TF1's Adam keeps its beta powers in float32, beside float16 variables too."""
    tf = need("tensorflow")
    v1 = tf.compat.v1
    rng = np.random.default_rng(3)
    start = {"dense/kernel": rng.standard_normal((3, 2)), "dense/bias": rng.standard_normal(2)}
    start = {k: v.astype(dtype) for k, v in start.items()}
    with pv.MirroredStrategy(4).scope() as strategy:
        flat = {k: pv.Variable(v, name=k) for k, v in start.items()}
    opt = train(strategy, flat, sorted(flat), steps=3)
    model = {"kernel": flat["dense/kernel"], "bias": flat["dense/bias"]}
    run_h5 = pv.Checkpoint(model=model, optimizer=opt).write(tmp_path / "run.h5")
    prefix = tmp_path / "tf1" / "model.ckpt"
    argv = ["convert", run_h5, str(prefix), "--to", "tf", "--names", "tf1"]
    assert main([*argv, "--components", "logical"]) == 0
    grads = {k: rng.standard_normal(v.shape).astype(dtype) for k, v in start.items()}
    graph = tf.Graph()
    with graph.as_default():
        tf_vars = {
            k: v1.get_variable(
                k, shape=v.shape, dtype=tf.as_dtype(dtype), initializer=v1.zeros_initializer()
            )
            for k, v in start.items()
        }
        adam = v1.train.AdamOptimizer(0.05)  # our Adam's defaults: beta 0.9, 0.999, eps 1e-8
        step = adam.apply_gradients([(tf.constant(grads[k]), tf_vars[k]) for k in sorted(start)])
        saver = v1.train.Saver()  # every global variable: the model, its slots, beta powers
        slots = {(k, s): adam.get_slot(tf_vars[k], s) for k in start for s in ("m", "v")}
        powers = adam._get_beta_accumulators()
        with v1.Session(graph=graph) as sess:
            saver.restore(sess, str(prefix))  # was: object-based names only, no TF1 slot names
            for k in start:
                np.testing.assert_array_equal(sess.run(tf_vars[k]), value(flat[k]), err_msg=k)
                for s in ("m", "v"):
                    ours = value(opt.get_slot(flat[k], s))
                    np.testing.assert_array_equal(sess.run(slots[k, s]), ours, err_msg=(k, s))
            b1, b2 = sess.run(powers)
            assert b1.dtype == np.float32 and b2.dtype == np.float32  # whatever the variables'
            assert b1 == np.float32(0.9**4) and b2 == np.float32(0.999**4)  # beta^t, next t=4
            sess.run(step)
            after = {k: sess.run(tf_vars[k]) for k in start}
    opt.distributed_apply(strategy, [(grads[k], flat[k]) for k in sorted(start)])
    tol = {"rtol": 1e-6, "atol": 1e-7} if dtype == np.float32 else {"rtol": 2e-3, "atol": 1e-3}
    for k in start:
        np.testing.assert_allclose(after[k], value(flat[k]), err_msg=k, **tol)
        assert not np.array_equal(after[k], start[k])
