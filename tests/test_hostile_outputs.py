"""Outputs: a write never replaces a file of its own source, and every output is all or
nothing (a shard set, a TF checkpoint, an npz, a ``.keras``): a kill at any step leaves the
old content or the new, never a mix that verifies."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from parallelvars import formats
from parallelvars.cli import main
from parallelvars.errors import CorruptCheckpointError, InvalidArgumentError


def entries(value: float, n: int = 6) -> dict[str, formats.ArrayEntry]:
    return {
        f"w{i}": formats.ArrayEntry(f"w{i}", [np.full(16, value + i, np.float32)]) for i in range(n)
    }


def snapshot(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


# ------------------------------------------------------------------ the destination guard


def test_convert_over_a_shard_or_the_index_of_its_own_source_is_refused(tmp_path: Path) -> None:
    d = tmp_path / "set"
    index = formats.write_checkpoint(
        str(d) + "/", entries(1.0), format="safetensors", max_shard_size=100
    )
    before = snapshot(d)
    shards = sorted(n for n in before if n.endswith(".safetensors"))
    assert len(shards) > 1
    for dst in (d / shards[0], Path(index)):
        with pytest.raises(InvalidArgumentError, match="a file of the source checkpoint"):
            formats.convert(str(d), str(dst))
        assert main(["convert", str(d), str(dst)]) == 2
        assert main(["reshard", str(d), str(dst), "--devices", "2"]) == 2
    assert snapshot(d) == before


def test_convert_over_its_own_tf_data_shard_is_refused(tmp_path: Path) -> None:
    prefix = str(tmp_path / "ckpt-1")
    formats.write_checkpoint(prefix, entries(1.0), format="tf")
    before = snapshot(tmp_path)
    with pytest.raises(InvalidArgumentError, match="a file of the source checkpoint"):
        formats.convert(prefix + ".index", prefix, to_format="tf")
    assert snapshot(tmp_path) == before


# ------------------------------------------------------------------------------ names

LONE = "a\ud800"


def _safetensors_file(path: Path, name_json: str) -> Path:
    import struct

    entry = '{"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}'
    header = f'{{"{name_json}": {entry}}}'.encode()
    header += b" " * (-len(header) % 8)
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\0\0\x80\x3f")
    return path


def test_a_lone_surrogate_name_is_refused_at_open_as_the_reference_does(tmp_path: Path) -> None:
    from safetensors.numpy import load_file

    bad = _safetensors_file(tmp_path / "bad.safetensors", "a\\ud800")
    from safetensors import SafetensorError

    with pytest.raises(SafetensorError, match="hex escape"):  # the reference's verdict
        load_file(str(bad))
    with pytest.raises(CorruptCheckpointError, match="not valid Unicode") as info:
        formats.open_checkpoint(str(bad))
    assert info.value.file == str(bad)
    assert main(["convert", str(bad), str(tmp_path / "out.npz")]) == 2
    # a surrogate pair is one character: both read it
    good = _safetensors_file(tmp_path / "good.safetensors", "a\\ud83d\\ude00")
    assert list(load_file(str(good))) == ["a\U0001f600"]
    with formats.open_checkpoint(str(good)) as view:
        assert list(view) == ["a\U0001f600"]


def test_a_lone_surrogate_in_the_native_index_is_refused_at_open(tmp_path: Path) -> None:
    import json

    import h5py
    from _columns_support import write_columns

    import parallelvars as pv
    from parallelvars.checkpoint.h5io import INDEX_DATASET, H5Reader
    from parallelvars.testing import write_json as _write_json

    path = tmp_path / "n.h5"
    pv.Checkpoint(w=pv.Variable(np.arange(4, dtype=np.float32), name="w")).write(str(path))
    with h5py.File(path, "r+") as f:
        doc = json.loads(f[INDEX_DATASET][()])
        doc[LONE] = doc.pop("w")
        del f[INDEX_DATASET]
        _write_json(f, INDEX_DATASET, doc)
    write_columns(str(path))
    with pytest.raises(CorruptCheckpointError, match="not valid Unicode"):
        H5Reader(str(path)).close()


@pytest.mark.parametrize("where", ["key", "value", "nested"])
@pytest.mark.parametrize("keep_entries", [True, False])
def test_a_lone_surrogate_in_the_object_graph_is_refused_however_it_is_opened(
    tmp_path: Path, where: str, keep_entries: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    # A reader that does not keep the object graph (the commands, the format views) decodes it
    # dropping each JSON object: the surrogate check then saw no string, and verify passed a
    # file that a restore refuses.
    import json

    import h5py

    import parallelvars as pv
    from parallelvars.checkpoint.h5io import H5Reader
    from parallelvars.checkpoint.h5io.layout import GRAPH_DATASET
    from parallelvars.testing import write_json as _write_json

    path = tmp_path / "g.h5"
    pv.Checkpoint(w=pv.Variable(np.arange(4, dtype=np.float32), name="w")).write(str(path))
    with h5py.File(path, "r+") as f:
        graph = json.loads(f[GRAPH_DATASET][()])
        if where == "key":
            graph[LONE] = 1
        elif where == "value":
            graph["bad"] = LONE
        else:
            graph["bad"] = [{"deeper": {"x": [LONE]}}]
        del f[GRAPH_DATASET]
        _write_json(f, GRAPH_DATASET, graph)
    with pytest.raises(CorruptCheckpointError, match="not valid Unicode"):
        H5Reader(str(path), keep_entries=keep_entries).close()
    assert main(["verify", str(path)]) == 1
    assert "not valid Unicode" in capsys.readouterr().out


def test_a_tf_key_that_is_not_utf8_is_refused_at_open(tmp_path: Path) -> None:
    from parallelvars.formats.tf import BundleWriter

    with BundleWriter(str(tmp_path / "ckpt")) as w:
        w.add(b"a\xff/.ATTRIBUTES/VARIABLE_VALUE", np.ones(2, np.float32))
    with pytest.raises(CorruptCheckpointError, match="not UTF-8 text"):
        formats.open_checkpoint(str(tmp_path / "ckpt"))


@pytest.mark.parametrize("fmt", ["safetensors", "npz", "tf", "hdf5", "keras"])
def test_writers_refuse_a_lone_surrogate_name_as_our_error(tmp_path: Path, fmt: str) -> None:
    from parallelvars.errors import InvalidEntryError

    suffix = {"safetensors": ".safetensors", "npz": ".npz", "tf": "", "hdf5": ".h5"}
    path = str(tmp_path / f"out{suffix.get(fmt, '.weights.h5')}")
    bad = {LONE: formats.ArrayEntry(LONE, [np.ones(2, np.float32)])}
    with pytest.raises(InvalidEntryError, match="not valid Unicode") as info:
        formats.write_checkpoint(path, bad, format=fmt)
    str(info.value).encode("utf-8")  # the message itself prints
    assert not [p for p in tmp_path.iterdir()]


@pytest.mark.parametrize("where", ["attribute", "list", "dict", "slot"])
@pytest.mark.parametrize("how", ["write", "save", "manager"])
def test_native_saves_refuse_a_lone_surrogate_name_before_writing(
    tmp_path: Path, where: str, how: str
) -> None:
    import parallelvars as pv
    from parallelvars.errors import InvalidEntryError

    w = pv.Variable(np.ones(2, np.float32), name="w")
    model = pv.Module()
    model.ok = pv.Variable(np.zeros(2, np.float32), name="ok")  # names before the bad one too
    if where == "attribute":
        setattr(model, LONE, w)
    elif where == "list":
        model.layers = pv.TrackedList([w])
        model.layers.append(pv.Module())
        setattr(model.layers[1], LONE, pv.Variable(np.ones(1, np.float32)))
    elif where == "dict":
        model.table = pv.TrackedDict({LONE: w})
    else:  # an optimizer slot named with a lone surrogate

        class Slots(pv.Module):
            def _checkpoint_slots(self) -> list[Any]:
                return [(w, LONE, self.m)]

        model.w = w
        model.opt = Slots()
        model.opt.m = pv.Variable(np.zeros(2, np.float32))
        # (the same slot variable is also reached as an attribute: the slot entry names it)
    ckpt = pv.Checkpoint(model=model)
    folder = tmp_path / "out"
    folder.mkdir()
    with pytest.raises(InvalidEntryError, match="not valid Unicode") as info:
        if how == "write":
            ckpt.write(str(folder / "c.h5"))
        elif how == "save":
            ckpt.save(str(folder / "c"))
        else:
            pv.CheckpointManager(ckpt, str(folder / "m"), max_to_keep=2).save()
    str(info.value).encode("utf-8")  # the message itself prints
    assert info.value.variable is not None and "\\ud800" in ascii(info.value.variable)
    assert not [p for p in folder.rglob("*.h5*")]
    assert int(ckpt.save_counter) == 0


# ------------------------------------------------------------------- all-or-nothing outputs
# A write is killed (os._exit, as SIGKILL: no cleanup runs) at each of its steps that changes
# the folder (a rename or an unlink: the files before are temporaries or new names), in a
# forked child; the destination must then read back exactly the old content or the new one.

_STEPS = ("replace", "rename", "unlink", "remove")


def _write_killed_at(step: int, write: Callable[[], object]) -> bool:
    """Run ``write`` in a forked child killed at its ``step``-th folder change; whether it
    finished before that step."""
    pid = os.fork()
    if pid == 0:  # the child: never returns
        code = 0
        try:
            count = [0]
            for name in _STEPS:
                original = getattr(os, name)

                def killing(*args: Any, _original: Any = original, **kw: Any) -> Any:
                    count[0] += 1
                    if count[0] == step:
                        os._exit(9)
                    return _original(*args, **kw)

                setattr(os, name, killing)
            write()
        except BaseException:
            code = 1
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status), status
    code = os.WEXITSTATUS(status)
    assert code in (0, 9), f"the write failed in the child (exit {code})"
    return code == 0


def _values(path: str) -> dict[str, list[float]]:
    with formats.open_checkpoint(path) as view:
        return {k: view[k].value().tolist() for k in view}


# (name, how to write it: (destination, entries) -> the path to read back)
_OUTPUTS: dict[str, Callable[[Path, dict[str, formats.ArrayEntry]], str]] = {
    "safetensors set": lambda d, e: (
        formats.write_checkpoint(str(d) + "/", e, format="safetensors", max_shard_size=200)
        and str(d)
    ),
    "safetensors set to file": lambda d, e: (
        formats.write_checkpoint(
            str(d) + "/", e, format="safetensors", max_shard_size=None if len(e) > 6 else 200
        )
        and str(d)
    ),
    "tf": lambda d, e: formats.write_checkpoint(str(d / "ckpt"), e, format="tf") and str(d),
    "npz": lambda d, e: formats.write_checkpoint(str(d / "w.npz"), e),
    "hdf5": lambda d, e: formats.write_checkpoint(str(d / "w.h5"), e),
}


def _leftovers(d: Path, path: str) -> list[str]:
    """Files of ``d`` that are neither the output at ``path`` nor a temporary of a killed write
    (``.NAME.tmp-PID-HEX``, TensorFlow's ``*.tempstate*``)."""
    with formats.open_checkpoint(path) as view:
        mine = {os.path.basename(f) for f in view.files}
    return sorted(
        n for n in os.listdir(d) if n not in mine and not n.startswith(".") and "tempstate" not in n
    )


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork")
@pytest.mark.parametrize("kind", list(_OUTPUTS))
def test_a_kill_at_any_step_leaves_the_old_output_or_the_new(kind: str, tmp_path: Path) -> None:
    write = _OUTPUTS[kind]
    old, new = entries(1.0, 6), entries(2.0, 8)  # another number of tensors and of shards
    (tmp_path / "old").mkdir()
    (tmp_path / "new").mkdir()
    want_old = _values(write(tmp_path / "old", old))
    want_new = _values(write(tmp_path / "new", new))
    seen = set()
    step = 1
    while True:
        d = tmp_path / f"step{step}"
        d.mkdir()
        path = write(d, old)
        finished = _write_killed_at(step, lambda d=d: write(d, new))
        got = _values(path)
        if finished:
            assert got == want_new, kind
            break
        assert got in (want_old, want_new), (kind, step)  # never a mix
        seen.add("new" if got == want_new else "old")
        assert main(["-q", "verify", path]) == 0, (kind, step)
        # the next write over what the kill left is whole, and leaves no file of the old one
        assert _values(write(d, new)) == want_new, (kind, step)
        assert _leftovers(d, path) == [], (kind, step)
        step += 1
    assert "old" in seen  # kills landed inside the write
    if kind.startswith(("safetensors", "tf")):
        assert "new" in seen  # and between its commit and the cleanup of the old files
