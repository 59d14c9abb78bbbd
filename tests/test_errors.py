"""The error boundary: every error the library raises derives from ``ParallelVarsError`` and
from the builtin a caller would catch.

Two halves: public entry points called with bad arguments (each must raise ours *and* the
builtin), and a scan of the source for ``raise <builtin>(...)`` so that the boundary stays true
as code is added.
"""

from __future__ import annotations

import ast
import builtins
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import parallelvars as pv
from parallelvars import errors
from parallelvars.errors import ParallelVarsError

ROOT = Path(__file__).resolve().parent.parent


# ------------------------------------------------------------------------------- fixtures


def _variable(n: int = 3) -> Any:
    with pv.MirroredStrategy(2).scope():
        return pv.Variable(np.arange(n, dtype=np.float32), name="w")


def _checkpoint_file(tmp: Path) -> tuple[Any, str]:
    ckpt = pv.Checkpoint(w=_variable())
    return ckpt, ckpt.write(str(tmp / "run.h5"))


def _manager(tmp: Path, **kwargs: Any) -> Any:
    return pv.CheckpointManager(pv.Checkpoint(w=_variable()), str(tmp / "m"), **kwargs)


def _del_item(tmp: Path) -> None:
    v = _variable()
    del v[0]


def _resize(tmp: Path) -> None:
    v = _variable()
    v.resize((1, 3))


def _imatmul(tmp: Path) -> None:
    with pv.MirroredStrategy(2).scope():
        v = pv.Variable(np.eye(2, dtype=np.float32))
    v @= np.eye(2, dtype=np.float32)


def _ufunc_two_outs(tmp: Path) -> None:
    v = _variable()
    np.add.accumulate(np.ones(3, np.float32), out=v)


def _array_no_copy(tmp: Path) -> None:
    v = _variable()
    v.__array__(np.float64, copy=False)


def _threads(tmp: Path) -> None:
    ckpt, path = _checkpoint_file(tmp)
    os.environ["PARALLELVARS_THREADS"] = "many"
    try:
        ckpt.restore(path)  # (a restore spreads its checks over the threads it is given)
    finally:
        del os.environ["PARALLELVARS_THREADS"]


def _register_twice(tmp: Path) -> None:
    from parallelvars.checkpoint.registry import get_saveable, register_saveable

    class Thing:
        pass

    saveable = get_saveable(_variable())
    register_saveable(Thing, saveable)
    register_saveable(Thing, saveable)


def _convert(tmp: Path, dst: str, **kwargs: Any) -> None:
    from parallelvars.formats import convert

    _, path = _checkpoint_file(tmp)
    convert(path, str(tmp / dst), **kwargs)


def _convert_missing(tmp: Path) -> None:
    from parallelvars.formats import convert

    convert(str(tmp / "missing"), str(tmp / "out.h5"))


def _view_component(tmp: Path) -> None:
    from parallelvars.formats import convert, open_checkpoint

    _, path = _checkpoint_file(tmp)
    with open_checkpoint(convert(path, str(tmp / "out.npz"))) as view:
        view["w"].component(5)


def _closed_view(tmp: Path, suffix: str) -> None:
    from parallelvars.formats import convert, open_checkpoint

    _, path = _checkpoint_file(tmp)
    out = path if suffix == ".h5" else convert(path, str(tmp / f"out{suffix}"))
    view = open_checkpoint(out)
    entry = view["w"]
    view.close()
    entry.component(0)


def _reshard(tmp: Path) -> None:
    from parallelvars.formats import open_checkpoint, reshard

    _, path = _checkpoint_file(tmp)
    with open_checkpoint(path) as view:
        reshard(view, 0)


def _write_entries(tmp: Path, name: str) -> None:
    from parallelvars.formats import open_checkpoint, write_checkpoint

    _, path = _checkpoint_file(tmp)
    with open_checkpoint(path) as view:
        write_checkpoint(str(tmp / name), dict(view))


def _h5_written_twice(tmp: Path) -> None:
    from parallelvars.checkpoint.h5io import write_h5
    from parallelvars.formats import open_checkpoint

    _, path = _checkpoint_file(tmp)
    with open_checkpoint(path) as view:
        entry = view["w"]
        write_h5(str(tmp / "twice.h5"), [entry, entry])


#: (id, call, the builtin the error must also be). Every call is a public entry point handed
#: a bad argument; the error must be ours and that builtin.
CASES: list[tuple[str, Callable[[Path], Any], type[BaseException]]] = [
    ("adam-beta1", lambda t: pv.optimizers.Adam(0.1, beta1=2.0), ValueError),
    ("rmsprop-decay", lambda t: pv.optimizers.RMSProp(0.1, decay=-1.0), ValueError),
    (
        "adagrad-accumulator",
        lambda t: pv.optimizers.Adagrad(0.1, initial_accumulator_value=0.0),
        ValueError,
    ),
    ("checkpoint-root-none", lambda t: pv.Checkpoint(x=None), ValueError),
    ("checkpoint-save-counter", lambda t: pv.Checkpoint(save_counter=_variable()), ValueError),
    ("manager-not-a-checkpoint", lambda t: pv.CheckpointManager(object(), str(t)), TypeError),  # type: ignore[arg-type]
    ("manager-max-to-keep", lambda t: _manager(t, max_to_keep=0), ValueError),
    ("manager-interval-no-counter", lambda t: _manager(t, checkpoint_interval=5), ValueError),
    (
        "manager-interval-negative",
        lambda t: _manager(t, checkpoint_interval=-1, step_counter=_variable(1)),
        ValueError,
    ),
    ("manager-name", lambda t: _manager(t, checkpoint_name="a/b"), ValueError),
    ("manager-number", lambda t: _manager(t).save(checkpoint_number=-1), ValueError),
    ("threads-env", _threads, ValueError),
    ("register-saveable-twice", _register_twice, ValueError),
    ("variable-del-item", _del_item, TypeError),
    ("variable-resize", _resize, TypeError),
    ("variable-imatmul", _imatmul, TypeError),
    ("variable-ufunc-accumulate", _ufunc_two_outs, TypeError),
    ("variable-array-no-copy", _array_no_copy, ValueError),
    (
        "restore-missing",
        lambda t: pv.Checkpoint(w=_variable()).restore(str(t / "nope.h5")),
        FileNotFoundError,
    ),
    ("restore-directory", lambda t: pv.Checkpoint(w=_variable()).restore(str(t)), ValueError),
    ("convert-components", lambda t: _convert(t, "o.h5", components="some"), ValueError),
    ("convert-no-suffix", lambda t: _convert(t, "out.unknown"), ValueError),
    ("convert-names-hdf5", lambda t: _convert(t, "o.h5", names="keras"), ValueError),
    ("convert-shard-npz", lambda t: _convert(t, "o.npz", max_shard_size="1MB"), ValueError),
    ("convert-bad-size", lambda t: _convert(t, "o.safetensors", max_shard_size="lots"), ValueError),
    ("convert-unknown-format", lambda t: _convert(t, "o.h5", to_format="zip"), ValueError),
    ("convert-missing-source", lambda t: _convert_missing(t), FileNotFoundError),
    ("write-no-suffix", lambda t: _write_entries(t, "out.unknown"), ValueError),
    ("h5-written-twice", _h5_written_twice, ValueError),
    ("view-component-index", _view_component, IndexError),
    ("view-closed-h5", lambda t: _closed_view(t, ".h5"), ValueError),
    ("view-closed-npz", lambda t: _closed_view(t, ".npz"), ValueError),
    ("view-closed-safetensors", lambda t: _closed_view(t, ".safetensors"), ValueError),
    ("reshard-devices", _reshard, ValueError),
]


@pytest.mark.parametrize(("call", "builtin"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_arguments_raise_our_error_and_the_builtin(
    call: Callable[[Path], Any], builtin: type[BaseException], tmp_path: Path
) -> None:
    with pytest.raises(ParallelVarsError) as info:
        call(tmp_path)
    assert isinstance(info.value, builtin), type(info.value).__mro__
    assert str(info.value)


def test_messages_keep_naming_what_was_wrong(tmp_path: Path) -> None:
    with pytest.raises(errors.InvalidArgumentError, match=r"max_to_keep .* got 0"):
        _manager(tmp_path, max_to_keep=0)
    with pytest.raises(errors.UnsupportedOperationError, match=r"variable 'w'.*cannot be deleted"):
        _del_item(tmp_path)
    with pytest.raises(errors.ComponentIndexError, match="'w' has 2 components, no component 5"):
        _view_component(tmp_path)


def test_not_found_is_an_os_error_with_errno_and_filename(tmp_path: Path) -> None:
    path = str(tmp_path / "nope.h5")
    with pytest.raises(errors.CheckpointNotFoundError) as info:
        pv.Checkpoint(w=_variable()).restore(path)
    assert info.value.errno == 2 and info.value.filename == path and info.value.file == path
    assert str(info.value).startswith(path)


# ----------------------------------------------------------- restore of a foreign checkpoint


@pytest.mark.parametrize(
    ("make", "label"),
    [
        ("manager-dir", "a checkpoint directory"),
        ("empty-dir", "a directory"),
    ],
)
def test_restore_of_a_directory_names_it_and_says_how(
    make: str, label: str, tmp_path: Path
) -> None:
    ckpt, _ = _checkpoint_file(tmp_path)
    if make == "manager-dir":
        pv.CheckpointManager(ckpt, str(tmp_path / "m")).save()
        target = str(tmp_path / "m")
    else:
        target = str(tmp_path / "empty")
        os.mkdir(target)
    with pytest.raises(ParallelVarsError) as info:
        ckpt.restore(target)
    err = info.value
    assert isinstance(err, errors.NotACheckpointError | errors.CheckpointNotFoundError)
    assert isinstance(err, ValueError | FileNotFoundError)
    message = str(err)
    assert message.startswith(target) and label in message, message
    if make == "manager-dir":
        assert "latest_checkpoint" in message and "ckpt-1.h5" in message


def test_restore_of_a_fifo_is_refused_without_blocking(tmp_path: Path) -> None:
    fifo = str(tmp_path / "pipe.h5")
    os.mkfifo(fifo)
    with pytest.raises(errors.NotACheckpointError, match="FIFO"):
        pv.Checkpoint(w=_variable()).restore(fifo)


# ------------------------------------------------------------------ every class is documented


def test_every_error_class_is_exported_documented_and_ours() -> None:
    for name in errors.__all__:
        cls = getattr(errors, name)
        assert issubclass(cls, ParallelVarsError), name
        assert cls.__doc__ and cls.__doc__.strip(), name
        if cls not in (ParallelVarsError, errors.CheckpointError):  # the two bases
            builtins_ = [
                b
                for b in cls.__mro__
                if b.__module__ == "builtins" and b not in (Exception, BaseException, object)
            ]
            assert builtins_, f"{name} derives from no standard exception"


# ---------------------------------------------------------------------------- the AST scan

#: Builtin exceptions the library may raise as they are, each with why. Keyed by
#: (file relative to the repository root, exception name, enclosing function): a new raise of a
#: builtin anywhere else fails the scan.
ALLOWED: dict[tuple[str, str, str], str] = {
    # Python's attribute protocol: hasattr() and getattr(obj, name, default) need a plain
    # AttributeError from module and instance __getattr__, and numpy falls back from
    # __array_interface__ / __array_struct__ on AttributeError.
    ("parallelvars/__init__.py", "AttributeError", "__getattr__"): "attribute protocol",
    ("parallelvars/strategy/__init__.py", "AttributeError", "__getattr__"): "attribute protocol",
    ("parallelvars/_values.py", "AttributeError", "__getattr__"): "attribute protocol",
    (
        "parallelvars/_proxy.py",
        "AttributeError",
        "_interface_array",
    ): "numpy falls back to __array__",
    ("parallelvars/_proxy.py", "AttributeError", "__getattr__"): "attribute protocol",
    (
        "parallelvars/_sharded.py",
        "AttributeError",
        "stacked",
    ): "property: hasattr(v, 'stacked') is False",
    (
        "parallelvars/checkpoint/checkpoint.py",
        "AttributeError",
        "__getattr__",
    ): "attribute protocol",
    # An abstract method a subclass must override: a bug in the subclass, not bad input.
    ("parallelvars/optimizers/_base.py", "NotImplementedError", "_kernel"): "abstract method",
    ("parallelvars/optimizers/_slots.py", "NotImplementedError", "_info"): "abstract method",
    # A missing optional dependency (mpi4py): ImportError is what callers and the CLI test for.
    ("parallelvars/strategy/_mpi.py", "ImportError", "_import_mpi"): "optional dependency",
    # Our own invariants, unreachable from any input: HDF5 broke its contract, a header we
    # just sized changed length, a branch the argument parser makes impossible.
    (
        "parallelvars/checkpoint/h5io/write.py",
        "RuntimeError",
        "_write_entry",
    ): "HDF5 allocated no storage",
    (
        "formats/safetensors/_writer.py",
        "AssertionError",
        "_write_one",
    ): "a header we sized changed length",
    ("cli/_common.py", "AssertionError", "*"): "unreachable branch",
    # Raised and caught inside the same reader, which re-raises our CorruptCheckpointError.
    ("formats/tf/_state.py", "ValueError", "c_unescape"): "caught by read_state",
    ("formats/tf/_bundle.py", "ValueError", "find_overlap"): "caught by the bundle reader",
}

_BUILTIN_EXCEPTIONS = {
    name
    for name, obj in vars(builtins).items()
    if isinstance(obj, type) and issubclass(obj, BaseException)
}


def _builtin_raises(path: Path) -> list[tuple[str, str, int]]:
    """(exception name, enclosing function, line) of every ``raise <builtin>`` in ``path``."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    found: list[tuple[str, str, int]] = []

    def visit(node: ast.AST, func: str) -> None:
        for child in ast.iter_child_nodes(node):
            name = func
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                name = child.name
            if isinstance(child, ast.Raise) and child.exc is not None:
                exc = child.exc.func if isinstance(child.exc, ast.Call) else child.exc
                if isinstance(exc, ast.Name) and exc.id in _BUILTIN_EXCEPTIONS:
                    found.append((exc.id, func, child.lineno))
            visit(child, name)

    visit(tree, "<module>")
    return found


def _allowed(rel: str, exc: str, func: str) -> bool:
    return (rel, exc, func) in ALLOWED or (rel, exc, "*") in ALLOWED


def test_no_builtin_raise_outside_the_allow_list() -> None:
    offenders = []
    seen: set[tuple[str, str, str]] = set()
    for top in ("parallelvars", "formats", "cli"):
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            for exc, func, line in _builtin_raises(path):
                if _allowed(rel, exc, func):
                    seen.add((rel, exc, func) if (rel, exc, func) in ALLOWED else (rel, exc, "*"))
                else:
                    offenders.append(f"{rel}:{line}: raise {exc} in {func}()")
    assert offenders == [], "raise an error from parallelvars.errors instead:\n" + "\n".join(
        offenders
    )
    # A stale entry would let a future raise through unnoticed.
    assert sorted(set(ALLOWED) - seen) == []


def test_the_scan_can_fail(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("def f(x):\n    if x:\n        raise ValueError('no')\n    raise KeyError\n")
    assert _builtin_raises(bad) == [("ValueError", "f", 3), ("KeyError", "f", 4)]
