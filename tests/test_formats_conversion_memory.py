"""What a conversion out of our HDF5 layout holds while it streams the tensors: the parallel
info's objects (the source's object graph among them: 77 MB at 50,000 variables with Adam's
slots) are let go once their text is made, so they are not alive beside the run buffers."""

from __future__ import annotations

import gc
from typing import Any

import numpy as np
import pytest

import parallelvars as pv
from parallelvars.formats import convert


def _graphs_alive() -> int:
    """How many object graphs (a dict with a ``nodes`` list of node dicts) are alive."""
    return sum(
        1
        for o in gc.get_objects()
        if type(o) is dict
        and type(o.get("nodes")) is list
        and o["nodes"]
        and type(o["nodes"][0]) is dict
        and "children" in o["nodes"][0]
    )


def _checkpoint(path: str) -> None:
    m = pv.Module()
    with pv.MirroredStrategy(2).scope():
        m.w = [pv.Variable(np.arange(4, dtype=np.float32) + k, name=f"w{k}") for k in range(3)]
    pv.Checkpoint(model=m).write(path)


@pytest.mark.parametrize(
    ("out", "hook"),
    [
        ("o.safetensors", "parallelvars.formats.safetensors._writer.DataWriter"),
        ("o.npz", "parallelvars.formats.npz.read_batches"),
    ],
)
def test_the_object_graph_is_let_go_before_the_tensors_stream(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, out: str, hook: str
) -> None:
    src = str(tmp_path / "a.h5")
    _checkpoint(src)
    gc.collect()
    before = _graphs_alive()  # (the checkpoint's own, and any other test's left over)
    seen: list[int] = []
    module, _, name = hook.rpartition(".")
    original = getattr(__import__(module, fromlist=[name]), name)

    def watched(*args: Any, **kwargs: Any) -> Any:
        seen.append(_graphs_alive())  # (when the tensors start: the header or record written)
        return original(*args, **kwargs)

    monkeypatch.setattr(hook, watched)
    convert(src, str(tmp_path / out))
    assert seen and seen == [before] * len(seen)
    with pv.formats.open_checkpoint(str(tmp_path / out)) as view:  # (the graph was carried)
        assert view.object_graph is not None
