"""`parallelvars demo`: the main job trains, checkpoints, restarts elsewhere, converts, inspects."""

from __future__ import annotations

import json
import os

import numpy as np
from safetensors.numpy import load_file

from parallelvars import formats
from parallelvars.cli import main
from parallelvars.cli.testing import MLP, loss_and_grads, make_blobs


def test_demo_end_to_end(tmp_path, capsys) -> None:
    assert main(["demo", "--devices", "4", "--steps", "40", "--dir", str(tmp_path), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["devices"] == [4, 2]
    assert result["restart_restored"] and result["restart_values_equal"]
    assert result["resumed_at_step"] == 20
    assert result["loss_last"] < result["loss_first"]
    assert result["examples_seen"] == 40 * 256  # the on-read counter survived the restart
    final = result["checkpoints"][-1]
    assert os.path.basename(final) == "ckpt-40.h5" and len(result["checkpoints"]) <= 3
    # The converted files hold the final weights.
    with formats.open_checkpoint(final) as view:
        w1 = view["model/w1"].component(0)
    np.testing.assert_array_equal(load_file(result["safetensors"])["model.w1"], w1)  # dotted names
    with formats.open_checkpoint(result["tf_checkpoint"], format="tf") as view:
        np.testing.assert_array_equal(view["model/w1"].component(0), w1)


def test_demo_rejects_bad_arguments(tmp_path, capsys) -> None:
    assert main(["demo", "--devices", "0", "--dir", str(tmp_path)]) == 2
    assert "--devices" in capsys.readouterr().err


def test_mlp_gradients_match_finite_differences() -> None:
    x, y = make_blobs(12, 5, 3, seed=1)
    model = MLP(5, 7, 3, seed=2)
    _, grads = loss_and_grads(model, x, y, len(y))
    eps = 1e-3
    for var, grad in zip(model.params, grads, strict=True):
        flat = np.asarray(var).reshape(-1)
        for k in range(0, flat.size, max(1, flat.size // 5)):
            old = float(flat[k])
            flat_v = np.asarray(var).copy().reshape(-1)
            flat_v[k] = old + eps
            var.assign(flat_v.reshape(var.shape))
            up, _ = loss_and_grads(model, x, y, len(y))
            flat_v[k] = old - eps
            var.assign(flat_v.reshape(var.shape))
            down, _ = loss_and_grads(model, x, y, len(y))
            flat_v[k] = old
            var.assign(flat_v.reshape(var.shape))
            assert abs((up - down) / (2 * eps) - grad.reshape(-1)[k]) < 2e-2


def test_demo_counts_in_words(tmp_path, capsys) -> None:
    assert main(["demo", "--devices", "1", "--steps", "4", "--dir", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "on 1 device," in text and "1 devices" not in text
