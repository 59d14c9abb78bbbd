"""Matching a saved graph with the live one: a container's children are matched together, and
anything unusual among them (a mismatch, a child not yet made, a node reached twice) is met as a
walk node by node meets it; the children of lists, dicts and tuples as before; the load status
after the saved graph is dropped."""

from __future__ import annotations

import numpy as np
import pytest

import parallelvars as pv
from parallelvars import errors
from parallelvars.tracking import TrackedDict, TrackedList, children_of


def _model(count: int) -> pv.Module:
    model = pv.Module()
    model.vars = [pv.Variable(np.full(3, i, np.float32), name=f"v{i}") for i in range(count)]
    return model


def _values(model: pv.Module) -> list[list[float]]:
    return [np.asarray(v).tolist() for v in model.vars]


def _zero(model: pv.Module) -> None:
    for v in model.vars:
        v.assign(np.zeros(3, np.float32))


def test_kinds_differ_inside_a_list_names_the_variable_and_writes_nothing(tmp_path) -> None:
    model = _model(600)
    path = pv.Checkpoint(model=model).write(str(tmp_path / "c.h5"))
    _zero(model)
    inner = pv.Module()
    inner.w = pv.Variable(np.zeros(3, np.float32), name="w")
    model.vars[300] = inner  # a container where the file has a variable
    with pytest.raises(errors.RestoreMismatchError, match="object kinds differ") as info:
        pv.Checkpoint(model=model).restore(path)
    assert "model/vars/300" in str(info.value)
    assert all(np.asarray(v).tolist() == [0.0] * 3 for k, v in enumerate(model.vars) if k != 300)


def test_the_first_mismatch_in_breadth_first_order_is_raised(tmp_path) -> None:
    model = pv.Module()
    model.a = [pv.Variable(np.zeros(2, np.float32), name="a0")]
    model.b = pv.Variable(np.zeros(2, np.float32), name="b")
    path = pv.Checkpoint(model=model).write(str(tmp_path / "c.h5"))
    deep = pv.Module()
    deep.x = pv.Variable(np.zeros(2, np.float32), name="x")
    model.a = [deep]  # deeper in the graph than model/b
    shallow = pv.Module()
    shallow.y = pv.Variable(np.zeros(2, np.float32), name="y")
    model.b = shallow
    with pytest.raises(errors.RestoreMismatchError) as info:
        pv.Checkpoint(model=model).restore(path)
    assert "model/b" in str(info.value) and "model/a" not in str(info.value)


def test_children_not_made_yet_are_restored_when_appended(tmp_path) -> None:
    model = _model(700)
    path = pv.Checkpoint(model=model).write(str(tmp_path / "c.h5"))
    saved = _values(model)
    fresh = pv.Module()
    fresh.vars = [pv.Variable(np.zeros(3, np.float32), name=f"v{i}") for i in range(650)]
    status = pv.Checkpoint(model=fresh).restore(path)
    assert _values(fresh) == saved[:650]
    with pytest.raises(errors.CheckpointError):
        status.assert_consumed()
    for i in range(650, 700):
        fresh.vars.append(pv.Variable(np.zeros(3, np.float32), name=f"v{i}"))
    assert _values(fresh) == saved
    status.assert_consumed()
    assert status.unrestored_paths == []


def test_a_variable_reached_twice_is_restored_once(tmp_path) -> None:
    model = _model(600)
    model.again = list(model.vars[:300])  # the same objects under a second list
    path = pv.Checkpoint(model=model).write(str(tmp_path / "c.h5"))
    saved = _values(model)
    _zero(model)
    status = pv.Checkpoint(model=model).restore(path)
    status.assert_consumed()
    assert _values(model) == saved
    assert len(status.restored_paths) == 600 + 1  # and the checkpoint's save_counter


def test_load_status_after_the_graph_is_dropped(tmp_path) -> None:
    model = _model(600)
    path = pv.Checkpoint(model=model).write(str(tmp_path / "c.h5"))
    bigger = _model(601)
    status = pv.Checkpoint(model=bigger).restore(path)
    assert status._session.nodes == []  # released: only the paths are kept
    assert status.unrestored_paths == []  # every saved value found its variable
    with pytest.raises(errors.RestoreMismatchError, match="model/vars/600"):
        status.assert_existing_objects_matched()
    assert status.unmatched_live_paths == ["model/vars/600"]
    assert len(status.restored_paths) == 601
    smaller = _model(599)
    status = pv.Checkpoint(model=smaller).restore(path)
    status.expect_partial()
    assert status._session.nodes != []  # a child pending: the graph is kept
    assert status.unrestored_paths == ["model/vars/599"]


def test_list_and_dict_children_skip_what_is_not_trackable() -> None:
    a = pv.Variable(np.zeros(2, np.float32), name="a")
    b = pv.Variable(np.ones(2, np.float32), name="b")
    items = TrackedList([a, 3, "x", b, None, [b], (), {"k": a}, {"n": 1}])
    children = items._trackable_children()
    assert list(children) == ["0", "3", "5", "7"]
    assert children["0"] is a and children["3"] is b
    nodes = children_of(items)
    assert nodes["0"] is a and nodes["3"] is b
    assert children_of(nodes["5"]) == {"0": b}  # a plain list inside: a node of its own
    assert children_of(nodes["7"]) == {"k": a}
    mapping = TrackedDict({"x": a, 1: b, "n": 4})
    assert list(mapping._trackable_children()) == ["x", "1"]
    assert list(TrackedList([1, 2])._trackable_children()) == []
    assert children_of(TrackedList([])) == {}


@pytest.mark.parametrize("change", ["append", "replace", "none"])
def test_the_load_status_sees_the_live_objects_as_they_are_now(tmp_path, change) -> None:
    # The status reuses the checkpoint's graph of the live objects while it is unchanged: a
    # variable added or replaced after the save (or after an earlier assertion) is seen.
    model = pv.Module()
    model.layers = TrackedList([pv.Variable(np.ones(2, np.float32), name="a")])
    ckpt = pv.Checkpoint(model=model)
    path = ckpt.write(str(tmp_path / "c.h5"))
    status = ckpt.restore(path).assert_consumed()
    assert status.unmatched_live_paths == []
    if change == "append":
        model.layers.append(pv.Variable(np.ones(3, np.float32), name="b"))
    elif change == "replace":
        model.layers[0] = pv.Variable(np.ones(2, np.float32), name="a2")
    if change == "none":
        status.assert_existing_objects_matched()
    else:
        with pytest.raises(errors.RestoreMismatchError, match="live variables have no value"):
            status.assert_existing_objects_matched()
        assert status.unmatched_live_paths == [
            "model/layers/1" if change == "append" else "model/layers/0"
        ]
    # the save that follows writes the live objects as they are now
    ckpt.write(path)
    again = pv.Checkpoint(model=model).restore(path)
    again.assert_consumed()
