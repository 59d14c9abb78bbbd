"""Which components of a save share a dataset (``h5raw.component_bytes._checksummed``): the
entries are sorted out all at once, and the answer must be the one the rule gives each entry
alone: a component shares the dataset of the first earlier one of the same shape, dtype and
bytes, for a variable that is not sharded and not of byte strings, when equal components are
shared; replicas that differ are never hidden."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import crc32c
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from parallelvars.checkpoint.h5raw import component_bytes

_DTYPES = [np.dtype(np.float32), np.dtype(np.int8), np.dtype(np.float64), np.dtype(object)]


def _expected(e: Any, share_equal: bool) -> tuple[list[int] | None, Any]:
    """The rule, one entry alone: each component's dataset (None: each its own) and the
    entry's part of the sharing pattern."""
    cs = [np.ascontiguousarray(c) for c in e.components]
    n = len(cs)
    if n and cs[0].dtype.kind == "O":
        return None, ("bytes", *(tuple(map(bytes, c.reshape(-1).tolist())) for c in cs))
    if n < 2 or not share_equal or e.kind == "sharded":
        return None, None
    out: list[int] = []
    for i, c in enumerate(cs):
        j = next(
            (
                k
                for k in range(i)
                if out[k] == k
                and cs[k].shape == c.shape
                and cs[k].dtype == c.dtype
                and cs[k].tobytes() == c.tobytes()
            ),
            i,
        )
        out.append(j)
    if out == list(range(n)):
        return None, None
    return out, tuple(out)


@st.composite
def _entry(draw: Any) -> Any:
    n = draw(st.integers(0, 5))
    kind = draw(st.sampled_from(["mirrored", "on_read", "independent", "sharded"]))
    dtype = draw(st.sampled_from(_DTYPES))
    size = draw(st.sampled_from([0, 1, 3, 17, 20_000]))  # (20,000 float64: past 64 KiB)
    shape: tuple[int, ...] = draw(st.sampled_from([(size,), (), (1, size)]))
    if dtype.kind == "O":
        base = np.array([b"a%d" % k for k in range(int(np.prod(shape)))], object).reshape(shape)
    else:
        base = np.arange(int(np.prod(shape)), dtype=dtype).reshape(shape)
    components: list[Any] = []
    for _ in range(n):
        how = draw(st.sampled_from(["same", "copy", "differ", "strided", "shape", "dtype"]))
        if how == "same":
            c = base
        elif how == "copy":
            c = base.copy()
        elif how == "differ" and base.size and dtype.kind != "O":
            c = base.copy()
            c.reshape(-1)[draw(st.integers(0, base.size - 1))] += 1
        elif how == "strided" and base.ndim == 1 and base.size > 1:
            c = np.repeat(base, 2)[::2]  # (the same values, not C-contiguous)
        elif how == "shape" and base.size:
            c = base.reshape(-1, 1)
        elif how == "dtype" and dtype.kind != "O":
            c = base.view(np.uint8) if dtype.itemsize == 1 else base.astype(np.int32)
        else:
            c = base.copy()
        components.append(c)
    container = draw(st.sampled_from([tuple, list]))
    return SimpleNamespace(path="v", kind=kind, components=container(components))


@settings(max_examples=300, deadline=None)
@given(st.lists(_entry(), max_size=6), st.booleans(), st.booleans())
def test_sharing_is_each_entry_alone(items: list[Any], share_equal: bool, deferred: bool) -> None:
    comps, crcs, shared, pattern = component_bytes._checksummed(
        items, share_equal, deferred=deferred
    )
    assert len(comps) == len(crcs) == len(shared) == len(pattern) == len(items)
    for e, cs, sh, part in zip(items, comps, shared, pattern, strict=True):
        want, want_part = _expected(e, share_equal)
        assert (None if sh is None else list(sh)) == want, (e.components, share_equal)
        assert part == want_part
        assert len(cs) == len(e.components)
        for c, live in zip(cs, e.components, strict=True):
            assert c.flags.c_contiguous
            assert c.shape == np.shape(live) and c.dtype == live.dtype
            assert c.tobytes() == np.ascontiguousarray(live).tobytes()
    for cc, cs in zip(component_bytes.settle(crcs, shared, comps), comps, strict=True):
        assert cc == [component_bytes._crc(c) for c in cs]


def test_replicas_that_differ_in_one_byte_are_written_apart() -> None:
    a = np.zeros(100, np.float32)
    b = a.copy()
    b.view(np.uint8)[399] = 1
    items = [
        SimpleNamespace(path="w", kind="mirrored", components=(a, a.copy())),
        SimpleNamespace(path="x", kind="mirrored", components=(a, b)),
        SimpleNamespace(path="y", kind="mirrored", components=(a, a.copy(), b, b.copy())),
    ]
    _, crcs, shared, pattern = component_bytes._checksummed(items, True)
    assert shared == [[0, 0], None, [0, 0, 2, 2]]
    assert pattern == ((0, 0), None, (0, 0, 2, 2))
    assert crcs[1] == [crc32c.crc32c(a.tobytes()), crc32c.crc32c(b.tobytes())]


def test_a_strided_first_component_is_written_contiguous_and_shared() -> None:
    a = np.arange(20, dtype=np.float32)
    strided = np.repeat(a, 2)[::2]
    items = [SimpleNamespace(path="w", kind="mirrored", components=(strided, a.copy()))]
    comps, _, shared, pattern = component_bytes._checksummed(items, True)
    assert comps[0][0].flags.c_contiguous and comps[0][0].tobytes() == a.tobytes()
    assert shared == [[0, 0]] and pattern == ((0, 0),)
