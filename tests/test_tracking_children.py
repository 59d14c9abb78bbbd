"""A module's children: its attributes not named ``_pv_...`` whose values are trackable, in
order, and a graph built from them that notices a plain list becoming trackable."""

from __future__ import annotations

import numpy as np

import parallelvars as pv
from parallelvars.checkpoint.graph import build_object_graph
from parallelvars.tracking import type_decides_isinstance


def test_module_children_filter_private_and_untrackable_attributes():
    with pv.MirroredStrategy(2).scope():
        m = pv.Module()
        m.a = pv.Variable(np.zeros(2, np.float32), name="a")
        m.number = 3
        m._pv_hidden = pv.Variable(np.ones(2, np.float32), name="hidden")
        m.empty = []
        m.vs = [pv.Variable(np.ones(2, np.float32), name="v")]
        m.sub = pv.Module()
        m.text = "x"
    assert list(m._trackable_children()) == ["a", "empty", "vs", "sub"]  # (a TrackedList)
    only_variables = pv.Module()
    only_variables.w = m.a
    assert list(only_variables._trackable_children()) == ["w"]


def test_a_plain_list_that_becomes_trackable_changes_the_graph():
    with pv.MirroredStrategy(2).scope():
        m = pv.Module()
        m.a = pv.Variable(np.zeros(2, np.float32), name="a")
        m.b = pv.Variable(np.zeros(2, np.float32), name="b")
        plain: list = []
        object.__setattr__(m, "later", (plain,))  # a tuple holding a plain list
        graph = build_object_graph(pv.Checkpoint(m=m))
        assert graph.unchanged()
        plain.append(pv.Variable(np.ones(2, np.float32), name="c"))
    assert not graph.unchanged()


def test_which_types_decide_isinstance():
    class Proxy:
        @property
        def __class__(self):  # type: ignore[override]
            return list

    with pv.MirroredStrategy(2).scope():
        v = pv.Variable(np.zeros(2, np.float32))
    assert type_decides_isinstance(type(v)) and type_decides_isinstance(int)
    assert type_decides_isinstance(list) and type_decides_isinstance(pv.tracking.TrackedDict)
    assert not type_decides_isinstance(Proxy) and isinstance(Proxy(), list)
