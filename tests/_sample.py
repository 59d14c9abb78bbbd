"""A small default sample of a wide parametrisation, the whole of it in CI's slow step.

``pairwise`` takes the axes of a product (each a mapping of test id to value, in the order of
the parametrize argument names) and returns every combination as a ``pytest.param`` with the
ids pytest gives stacked ``parametrize`` decorators (joined by ``-``). The combinations needed
for every pair of values of two axes to meet at least once run by default; the others are
marked ``slow`` (left out of the default run, run by ``.ci/run``'s ``-m slow`` step). The
choice is greedy and deterministic: the same sample on every run and every machine.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import Any

import pytest


def _pairs(combo: tuple[int, ...]) -> set[tuple[int, int, int, int]]:
    """The pairs of values ``combo`` covers (each value with itself too: one axis alone)."""
    return {
        (i, combo[i], j, combo[j])
        for i, j in itertools.combinations_with_replacement(range(len(combo)), 2)
    }


class Args(tuple[Any, ...]):
    """The values of one axis that fills several arguments: ``Args((var_dtype, grad_dtype))``."""


def pairwise(*axes: Mapping[str, Any]) -> list[Any]:
    """Every combination of ``axes`` as a ``pytest.param``; those outside a pairwise-covering
    sample marked ``slow``. A value that is an ``Args`` fills as many arguments as it holds."""
    items = [list(axis.items()) for axis in axes]
    product = list(itertools.product(*(range(len(axis)) for axis in items)))
    uncovered = set().union(*(_pairs(combo) for combo in product))
    chosen: set[tuple[int, ...]] = set()
    while uncovered:
        best = max(product, key=lambda combo: len(_pairs(combo) & uncovered))
        chosen.add(best)
        uncovered -= _pairs(best)
    return [
        pytest.param(
            *itertools.chain.from_iterable(
                v if isinstance(v, Args) else (v,)
                for v in (items[axis][k][1] for axis, k in enumerate(combo))
            ),
            id="-".join(items[axis][k][0] for axis, k in enumerate(combo)),
            marks=() if combo in chosen else pytest.mark.slow,
        )
        for combo in product
    ]
