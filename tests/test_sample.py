"""The default sample of a wide parametrisation (tests/_sample.py) meets every pair of values
and leaves no combination out of the slow step."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from _sample import Args, pairwise


def _slow(param: Any) -> bool:
    return any(m.name == "slow" for m in param.marks)


@pytest.mark.parametrize("sizes", [(2,), (3, 2), (5, 2, 2), (2, 3, 2, 4, 2), (3, 5, 4, 2)])
def test_every_pair_of_values_runs_by_default_and_every_combination_in_the_slow_step(
    sizes: tuple[int, ...],
) -> None:
    axes = [{f"a{i}v{k}": (i, k) for k in range(n)} for i, n in enumerate(sizes)]
    params = pairwise(*axes)
    combos = [tuple(p.values) for p in params]
    assert combos == list(itertools.product(*(list(a.values()) for a in axes)))
    assert [p.id for p in params] == ["-".join(f"a{i}v{k}" for i, k in combo) for combo in combos]
    default = [tuple(p.values) for p in params if not _slow(p)]
    for x, y in itertools.combinations(range(len(sizes)), 2):
        met = {(c[x], c[y]) for c in default}
        assert len(met) == sizes[x] * sizes[y], (x, y)
    assert {c[0] for c in default} == set(axes[0].values())
    if len(sizes) > 2:
        assert len(default) < len(params)
    assert pairwise(*axes) == params  # the same sample every time


def test_args_fill_several_arguments() -> None:
    params = pairwise({"x": 1, "y": 2}, {"p": Args((3, 4))})
    assert [(p.values, p.id) for p in params] == [((1, 3, 4), "x-p"), ((2, 3, 4), "y-p")]
