"""The update core: runs over shared arenas, block walking, scratch reuse."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from parallelvars import update_core
from parallelvars._storage import Arena, Placement


def _axpy(var: Any, slots: Any, g: Any, hp: Any, tmp: Any, gtmp: Any) -> None:
    # var -= lr * g; slot += g  (a toy kernel that leaves a trace of every column it sees)
    np.multiply(g, hp, out=gtmp[0])
    np.subtract(var, gtmp[0], out=var)
    np.add(slots[0], g, out=slots[0])


def _arena_with(sizes: list[int], n: int = 3) -> tuple[Arena, list[Placement]]:
    arena = Arena(n, np.dtype(np.float32), 80000)
    return arena, [Placement(arena, arena.try_allocate(s), s) for s in sizes]


def test_runs_cover_only_neighbours() -> None:
    _, pls = _arena_with([5, 7, 16, 3])
    # variables 0, 1 and 3 are updated; 2 sits between 1 and 3 and must split the run.
    runs = update_core.plan_runs([(0, pls[0]), (1, pls[1]), (3, pls[3])], lambda a: [a.shadow("s")])
    assert [(r.lo, r.hi) for r in runs] == [
        (pls[0].offset, pls[1].offset + 7),
        (pls[3].offset, pls[3].offset + 3),
    ]
    assert [m[0] for m in runs[0].members] == [0, 1]
    with pytest.raises(ValueError, match="twice"):
        update_core.plan_runs([(0, pls[0]), (1, pls[0])], lambda a: [])


@pytest.mark.parametrize("n", [1, 4])
def test_apply_runs_matches_per_variable_update(n: int) -> None:
    rng = np.random.default_rng(1)
    sizes = [3, 5000, 1, 70000, 64]
    arena, pls = _arena_with(sizes, n)
    arena.buffer[...] = rng.normal(size=arena.buffer.shape)
    before = arena.buffer.copy()
    grads = [rng.normal(size=s).astype(np.float32) for s in sizes]
    shadow = arena.shadow("acc")
    runs = update_core.plan_runs(list(enumerate(pls)), lambda a: [a.shadow("acc")])
    assert len(runs) == 1
    update_core.apply_runs(runs, grads, _axpy, 0.5, lambda dt: update_core.UpdateScratch(dt))
    for pl, g in zip(pls, grads, strict=True):
        cols = slice(pl.offset, pl.offset + pl.size)
        np.testing.assert_array_equal(arena.buffer[:, cols], before[:, cols] - np.float32(0.5) * g)
        np.testing.assert_array_equal(shadow.buffer[:, cols], np.broadcast_to(g, (n, pl.size)))
    # Padding columns saw a zero gradient: unchanged, and nothing beyond the last variable moved.
    end = pls[-1].offset + pls[-1].size
    mask = np.ones(arena.capacity, bool)
    for pl in pls:
        mask[pl.offset : pl.offset + pl.size] = False
    np.testing.assert_array_equal(arena.buffer[:, mask], before[:, mask])
    assert not shadow.buffer[:, end:].any()


def test_scratch_is_reused() -> None:
    s = update_core.UpdateScratch(np.float64)
    tmp, gtmp = s.take(4, 100)
    tmp2, _ = s.take(2, 50)
    assert tmp2[0].base is tmp[0].base and tmp2[0].shape == (2, 50) and gtmp[0].shape == (1, 100)
    tmp3, _ = s.take(8, 10)
    assert tmp3[0].shape == (8, 10)


def test_scratch_views_kept_per_shape_follow_the_buffers_when_they_grow() -> None:
    import ml_dtypes

    s = update_core.UpdateScratch(np.dtype(ml_dtypes.bfloat16))
    small = s.take(1, 10)
    assert s.take(1, 10) is small  # kept: the same views, not made again
    lines = s.add_lines((1, 10))
    assert s.add_lines((1, 10)) is lines
    assert np.shares_memory(lines[3], lines[0]) and lines[3].dtype == np.uint32
    wide = s.widened_all(3, 1, 10)
    assert s.widened_all(3, 1, 10) is wide
    # Larger requests reallocate: what is handed out for the small shapes again is a view of
    # the new buffers, apart from the old ones (nothing stale is kept).
    big = s.take(4, 5000)
    again = s.take(1, 10)
    assert again is not small and np.shares_memory(again[0][0], big[0][0])
    assert not np.shares_memory(again[0][0], small[0][0])
    s.add_lines((1, 5000))
    assert not np.shares_memory(s.add_lines((1, 10))[0], lines[0])
    s.widened(1, 2, 5000)
    fresh = s.widened_all(3, 1, 10)
    assert np.shares_memory(fresh[0], wide[0]) and not np.shares_memory(fresh[1], wide[1])
    # Three views of the same size stay apart.
    assert not any(np.shares_memory(fresh[i], fresh[j]) for i in range(3) for j in range(i))


def test_block_width_keeps_blocks_cache_sized() -> None:
    w = update_core.block_width(4, np.dtype(np.float32))
    assert w % 64 == 0 and 4 * w * 4 <= update_core.BLOCK_BYTES
    assert update_core.block_width(10**6, np.dtype(np.float64)) == 1024
    # A dtype computed in float32: blocks twice float32's width (see block_width).
    import ml_dtypes

    wide = update_core.block_width(1, np.dtype(ml_dtypes.bfloat16))
    assert wide == 2 * update_core.block_width(1, np.dtype(np.float32))


def test_row_view_is_a_view() -> None:
    a = np.zeros((2, 3, 4))
    v = update_core.row_view(a)
    v[1, 5] = 1
    assert a[1, 1, 1] == 1
    with pytest.raises(ValueError):
        update_core.row_view(np.zeros((2, 6, 4))[:, ::2])


@pytest.mark.parametrize("replicate", [False, True])
def test_replicas_lines_packed_or_gathered_give_the_add_n_bits(replicate: bool) -> None:
    from parallelvars.strategy._reduce import add_n

    rng = np.random.default_rng(7)
    sizes = [3, 5000, 1, 70000, 64]
    grads = [[(rng.normal(size=s) * 10.0**r).astype(np.float32) for s in sizes] for r in range(4)]
    outs = []
    for how in ("summed", "packed", "gathered"):
        arena, pls = _arena_with(sizes, 2)
        arena.buffer[:] = 1.0
        runs = update_core.plan_runs(
            [(i, pl, replicate) for i, pl in enumerate(pls)], lambda a: [a.shadow("s")]
        )
        layout = update_core.layout_lines(runs)
        assert sorted(layout.views) == list(range(len(sizes)))
        scratch = update_core.UpdateScratch(np.float32)
        scratch_of = lambda dt, s=scratch: s  # noqa: E731
        if how == "summed":
            reduced = [add_n([g[i] for g in grads]) for i in range(len(sizes))]
            update_core.apply_runs(runs, reduced, _axpy, 0.5, scratch_of)
        elif how == "packed":
            parts = [layout.buffers() for _ in grads]
            for g, part in zip(grads, parts, strict=True):
                update_core.pack_lines(runs, layout, g, part)
            update_core.apply_lines(runs, layout, parts, _axpy, 0.5, scratch_of)
        else:
            plan = update_core.plan_gather(runs)
            # The 5,000-element variable is gathered next to its neighbours across its
            # alignment padding; the 70,000-element one is read in place, and so is the last,
            # alone after it.
            (direct, blocks), *_ = plan.walks
            assert [m[0] for m in direct] == [3, 4] and len(blocks) == 1 and plan.tail
            update_core.apply_gathered(plan, grads, _axpy, 0.5, scratch_of)
        outs.append((arena.buffer.copy(), arena.shadow("s").buffer.copy()))
    for var, slot in outs[1:]:
        assert np.array_equal(var.view(np.uint32), outs[0][0].view(np.uint32))
        assert np.array_equal(slot.view(np.uint32), outs[0][1].view(np.uint32))


def test_pack_lines_refuses_to_cast() -> None:
    _, pls = _arena_with([3, 4])
    runs = update_core.plan_runs([(0, pls[0]), (1, pls[1])], lambda a: [])
    layout = update_core.layout_lines(runs)
    with pytest.raises(TypeError):
        update_core.pack_lines(runs, layout, [np.ones(3), np.ones(4)], layout.buffers())


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # overflow to inf, on both sides
def test_bfloat16_sums_in_float32_have_the_bits_of_its_own_addition() -> None:
    # Every bfloat16 value (infinities, NaNs, subnormals included) against random partners:
    # widened, added in float32 and rounded once is ml_dtypes' own addition, bit for bit.
    import ml_dtypes

    from parallelvars.update_core import UpdateScratch, _sum

    def _add(x: np.ndarray, y: np.ndarray, out: np.ndarray, sc: UpdateScratch) -> None:
        total = _sum(x, lambda: [y], out, sc)
        out[...] = total  # a float32 sum holds a bfloat16 value exactly

    bf16 = np.dtype(ml_dtypes.bfloat16)
    a = np.arange(1 << 16, dtype=np.uint16).view(bf16).reshape(1, -1)
    sc = UpdateScratch(bf16)
    assert sc.add_wide
    rng = np.random.default_rng(0)
    for _ in range(4):
        b = rng.integers(0, 1 << 16, a.shape, dtype=np.uint16).view(bf16)
        want = np.add(a, b)
        got = np.empty_like(a)
        _add(a, b, got, sc)
        assert np.array_equal(got.view(np.uint16), want.view(np.uint16))
    # NaN plus NaN (which one's sign and payload survives differs between loops), every size
    # around numpy's vector widths.
    nans = np.array([0x7FC0, 0xFFC0, 0x7F81, 0xFF81, 0x7FFF, 0xFFFF, 0x7F80, 0xFF80], np.uint16)
    for n in range(1, 40):
        for _ in range(10):
            x = rng.choice(nans, (1, n)).view(bf16)
            y = rng.choice(nans, (1, n)).view(bf16)
            got = np.empty_like(x)
            _add(x, y, got, sc)
            assert np.array_equal(got.view(np.uint16), np.add(x, y).view(np.uint16))
    # Sums of several terms, every value first, as add_n adds them (each addition rounded).
    for _ in range(4):
        more = [rng.integers(0, 1 << 16, a.shape, dtype=np.uint16).view(bf16) for _ in range(3)]
        want = np.add(np.add(np.add(a, more[0]), more[1]), more[2])
        out = np.empty_like(a)
        got = np.asarray(_sum(a, lambda more=more: more, out, sc)).astype(bf16)
        assert np.array_equal(got.view(np.uint16), want.view(np.uint16))
