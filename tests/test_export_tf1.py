"""``names="tf1"``: a TensorFlow checkpoint under the keys ``tf.compat.v1.train.Saver`` and
TF 1.x's optimizers use (formats/tf/_tf1.py), the inverse of the mapping a restore reads. The
real TF 1.x client (Saver, AdamOptimizer) is tests/test_export_interop.py's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import parallelvars as pv
from parallelvars import errors, formats
from parallelvars.cli import main
from parallelvars.formats import ArrayEntry, DictView


def _trained(tmp_path: Path, opt: Any, devices: int = 4) -> tuple[str, dict[str, Any], Any]:
    with pv.MirroredStrategy(devices).scope() as strategy:
        kernel = pv.Variable(np.arange(6, dtype=np.float32).reshape(3, 2), name="dense/kernel")
        bias = pv.Variable(np.ones(2, np.float32), name="dense/bias")
        free = pv.Variable(np.ones(4, np.float32))  # no name given: Variable_<n>
    flat = {"kernel": kernel, "bias": bias, "free": free}
    for _ in range(2):
        opt.distributed_apply(
            strategy, [(np.full(v.shape, 0.5, np.float32), v) for v in flat.values()]
        )
    path = pv.Checkpoint(model=flat, optimizer=opt).write(tmp_path / "run.h5")
    return path, flat, strategy


def _keys(prefix: str) -> dict[str, Any]:
    with formats.open_checkpoint(prefix) as view:
        return {k: (view[k].dtype, tuple(view[k].shape)) for k in view}


@pytest.mark.parametrize(
    ("make", "slot_keys"),
    [
        (lambda: pv.optimizers.Adam(0.1), ["Adam", "Adam_1"]),
        (lambda: pv.optimizers.Momentum(0.1, 0.9), ["Momentum"]),
        (lambda: pv.optimizers.Adagrad(0.1), ["Adagrad"]),
        (lambda: pv.optimizers.RMSProp(0.1, momentum=0.5), ["RMSProp", "RMSProp_1"]),
        (
            lambda: pv.optimizers.RMSProp(0.1, momentum=0.5, centered=True),
            ["RMSProp", "RMSProp_1", "RMSProp_2"],
        ),
    ],
    ids=["adam", "momentum", "adagrad", "rmsprop", "rmsprop-centered"],
)
def test_tf1_names_and_a_restore_back_into_ours(
    tmp_path: Path, make: Any, slot_keys: list[str]
) -> None:
    opt = make()
    run_h5, flat, _ = _trained(tmp_path, opt)
    prefix = str(tmp_path / "tf1" / "model.ckpt")
    argv = ["convert", run_h5, prefix, "--to", "tf", "--names", "tf1", "--components", "logical"]
    assert main(argv) == 0
    keys = _keys(prefix)
    free = flat["free"].name
    variables = ["dense/kernel", "dense/bias", free]
    want = {*variables, *(f"{v}/{s}" for v in variables for s in slot_keys)}
    want |= {"optimizer/iterations", "save_counter"}
    if isinstance(opt, pv.optimizers.Adam):
        want |= {"beta1_power", "beta2_power"}
    assert set(keys) == want
    with pv.MirroredStrategy(2).scope():
        again = {
            k: pv.Variable(np.zeros(v.shape, np.float32), name=v.name) for k, v in flat.items()
        }
    fresh = make()
    status = pv.Checkpoint(model=again, optimizer=fresh).restore(prefix)
    status.assert_consumed()
    if isinstance(opt, pv.optimizers.Adam):  # float32 in the file, exact back in ours
        for power in ("beta1_power", "beta2_power"):
            got = np.asarray(getattr(fresh, power).components[0])
            assert got.dtype == np.float64
            assert got == np.asarray(getattr(opt, power).components[0])
    for k, v in flat.items():
        np.testing.assert_array_equal(
            np.asarray(again[k].components[1]), np.asarray(v.components[0])
        )
        for slot in opt.get_slot_names():
            np.testing.assert_array_equal(
                np.asarray(fresh.get_slot(again[k], slot).components[0]),
                np.asarray(opt.get_slot(v, slot).components[0]),
                err_msg=f"{k}/{slot}",
            )


def test_adam_beta_powers_are_float32_under_tf1_names(tmp_path: Path) -> None:
    from parallelvars.formats.tf import BundleReader

    run_h5, _, _ = _trained(tmp_path, pv.optimizers.Adam(0.1))
    prefix = formats.convert(
        run_h5, tmp_path / "m.ckpt", to_format="tf", names="tf1", components="logical"
    )
    with BundleReader(prefix) as b:
        dtypes = {k.decode(): e.dtype for k, e in b.entries.items()}
    assert dtypes["beta1_power"] == dtypes["dense/kernel/Adam"] == 1  # DT_FLOAT


def _slot(path: str, of: str, name: str, value: Any = 0.0) -> ArrayEntry:
    return ArrayEntry(
        path, [np.full(2, value, np.float32)], attrs={"slot_of": of, "slot_name": name}
    )


def _var(path: str, name: str | None = None) -> ArrayEntry:
    return ArrayEntry(path, [np.ones(2, np.float32)], attrs={"name": name} if name else {})


@pytest.mark.parametrize(
    ("entries", "match"),
    [
        (  # AMSGrad's third slot: TF1's Adam has none
            [_var("w"), _slot("opt/slots/w/m", "w", "m"), _slot("opt/slots/w/v", "w", "v"),
             _slot("opt/slots/w/vhat", "w", "vhat")],
            "no TF1 optimizer's",
        ),
        (  # two optimizers: TF1 names the second one's slots otherwise
            [_var("w"), _var("u"), _slot("a/slots/w/momentum", "w", "momentum"),
             _slot("b/slots/u/momentum", "u", "momentum")],
            "2 optimizers",
        ),
        ([_slot("opt/slots/w/momentum", "w", "momentum")], "variable is not written"),
        ([_var("a", "same"), _var("b", "same")], "same key 'same'"),
    ],
    ids=["amsgrad", "two-optimizers", "slot-without-variable", "two-variables-one-name"],
)  # fmt: skip
def test_what_tf1_would_not_name_so_is_refused(tmp_path: Path, entries: list, match: str) -> None:
    target = tmp_path / "x.ckpt"
    with pytest.raises(errors.InvalidEntryError, match=match) as info:
        formats.write_checkpoint(target, DictView(entries), format="tf", names="tf1")
    assert str(target) in str(info.value)
    assert not list(tmp_path.iterdir())  # nothing written


def test_names_other_styles_for_tf_and_tf1_elsewhere(tmp_path: Path) -> None:
    view = DictView([_var("model/w", "dense/w")])
    slash = formats.write_checkpoint(tmp_path / "a", view, format="tf", names="slash")
    assert set(_keys(slash)) == {"model/w"}
    tf1 = formats.write_checkpoint(tmp_path / "b", view, format="tf", names="tf1")
    assert set(_keys(tf1)) == {"dense/w"}
    with pytest.raises(errors.InvalidArgumentError, match="names='tf', 'slash' or 'tf1'"):
        formats.write_checkpoint(tmp_path / "c", view, format="tf", names="dotted")
    with pytest.raises(errors.InvalidArgumentError, match="not both"):
        formats.write_checkpoint(tmp_path / "c", view, format="tf", names="tf1", naming="name")
    with pytest.raises(errors.InvalidArgumentError, match="only a TensorFlow checkpoint"):
        formats.write_checkpoint(tmp_path / "d.safetensors", view, names="tf1")
    with pytest.raises(errors.InvalidEntryError, match="components='logical'"):
        formats.write_checkpoint(
            tmp_path / "e", DictView([ArrayEntry("w", [np.ones(2)] * 2)]), format="tf", names="tf1"
        )
