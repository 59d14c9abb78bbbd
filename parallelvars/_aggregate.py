"""The logical value of a saved variable, and the restore rule table, in one place.

DESIGN.md's "Variable kinds and what a restore onto M devices does" as one table in code
(:data:`RESTORE_RULES`): for each kind (and, for on-read variables, aggregation) how its one
logical value is read (:attr:`Rule.value`), and what M components receive when the value is
spread over another number of devices than it was saved with (:attr:`Rule.spread`):

====================================  =============================  ============================
kind (N components saved)             logical value                  onto M != N components
====================================  =============================  ============================
single                                the value                      the value on all M
mirrored                              the primary                    the primary on all M
on_read, aggregation ``sum``          the sum, in device order       the total in component 0,
                                                                     zeros elsewhere (the sum is
                                                                     kept exactly)
on_read, aggregation ``mean``         the mean                       the mean on all M
on_read, ``only_first_replica``       the primary                    the primary on all M
on_read, aggregation ``none``         none (N > 1)                   M == N required
independent                           none (N > 1)                   M == N required
sharded (axis k)                      the shards stitched together   the value re-split into M
                                                                     shards along k
====================================  =============================  ============================

A variable with one component always has a logical value: that component. An on-read
variable with aggregation ``none`` has no single value, as in TensorFlow (a SyncOnRead
variable with aggregation NONE cannot be read in a cross-replica context): restore, re-shard,
``Entry.value()``, ``convert --components primary`` and ``extract`` refuse it unless it goes
component by component onto the same number of devices.

:func:`spread_plan` is the one decision both pipelines make, restoring into live variables
(:mod:`parallelvars.checkpoint._restore`) and rewriting a file for M devices
(``parallelvars.formats.reshard``): component by component, or the logical value spread by
the target's rule, or a refusal naming the variable.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from parallelvars import _geometry
from parallelvars.enums import Aggregation
from parallelvars.errors import CheckpointError, DeviceCountError, InvalidEntryError


class Entry(Protocol):
    """What the rules read of a saved variable (a
    :class:`~parallelvars.checkpoint.entry.Entry`, which sits above this module and calls it)."""

    @property
    def path(self) -> str: ...

    @property
    def kind(self) -> str: ...

    @property
    def dtype(self) -> np.dtype: ...

    @property
    def shape(self) -> tuple[int, ...]: ...

    @property
    def num_components(self) -> int: ...

    @property
    def attrs(self) -> Mapping[str, Any]: ...

    def component(self, i: int) -> np.ndarray: ...

    def component_shape(self, i: int) -> tuple[int, ...]: ...

    def read_component_into(self, i: int, out: np.ndarray) -> None: ...


__all__ = [
    "RESTORE_RULES",
    "Rule",
    "aggregate_parts",
    "aggregation_of",
    "has_logical_value",
    "logical_value",
    "no_value_error",
    "no_value_what",
    "read_logical_into",
    "rule_for",
    "spread_plan",
]


@dataclass(frozen=True)
class Rule:
    """One row of the restore table.

    Attributes:
        kind: the variable kind.
        aggregation: for on-read variables, the aggregation; else None.
        value: how the logical value of N > 1 components is read: ``"primary"``, ``"sum"``,
            ``"mean"`` or ``"stitch"``; None when there is no single value.
        spread: what M components receive from the logical value: ``"all"`` (the value on
            every component), ``"first"`` (the value in component 0, zeros elsewhere) or
            ``"resplit"`` (the value's rows by the new shard layout); None when only the same
            number of components, component by component, will do.
    """

    kind: str
    aggregation: str | None
    value: str | None
    spread: str | None


RESTORE_RULES: dict[tuple[str, str | None], Rule] = {
    (r.kind, r.aggregation): r
    for r in (
        Rule("single", None, "primary", "all"),
        Rule("mirrored", None, "primary", "all"),
        Rule("on_read", "sum", "sum", "first"),
        Rule("on_read", "mean", "mean", "all"),
        Rule("on_read", "only_first_replica", "primary", "all"),
        Rule("on_read", "none", None, None),
        Rule("independent", None, None, None),
        Rule("sharded", None, "stitch", "resplit"),
    )
}


def aggregation_of(kind: str, attrs: Any) -> str | None:
    """The aggregation that decides an on-read variable's rule (``"sum"`` when the attribute
    is absent, as formats without one save totals); None for the other kinds."""
    if kind != "on_read":
        return None
    return str((attrs or {}).get("aggregation", "sum")).lower()


def rule_for(kind: str, attrs: Any) -> Rule:
    """The row of :data:`RESTORE_RULES` for a variable of ``kind`` with ``attrs`` (an on-read
    variable with an aggregation outside the documented ones has no value and no spread)."""
    agg = aggregation_of(kind, attrs)
    rule = RESTORE_RULES.get((kind, agg))
    return rule if rule is not None else Rule(kind, agg, None, None)


def aggregate_parts(
    out: np.ndarray, rest: Iterable[np.ndarray], n: int, aggregation: Aggregation | str
) -> np.ndarray:
    """The aggregate of an on-read variable's ``n`` parts, computed in ``out``; returns it.

    The one arithmetic for live reads, restores and format conversions: ``out`` holds part 0
    and ``rest`` gives parts ``1 .. n-1`` in device order (so a sum has the same bits on every
    run); ONLY_FIRST_REPLICA is part 0 (``rest`` is not consumed), MEAN is the sum divided by
    ``n`` in the parts' dtype (integers round down), any other aggregation the sum. Which
    variables have an aggregate at all is the table's business (:func:`rule_for`).
    """
    agg = aggregation.value if isinstance(aggregation, Aggregation) else str(aggregation).lower()
    if agg == Aggregation.ONLY_FIRST_REPLICA.value or n == 1:
        return out
    with np.errstate(over="ignore", invalid="ignore"):  # inf + -inf is nan, as it should be
        for part in rest:
            np.add(out, part, out=out)
    if agg == Aggregation.MEAN.value:
        if out.dtype.kind in "iub":
            np.floor_divide(out, n, out=out, casting="unsafe")
        else:
            np.divide(out, n, out=out, casting="unsafe")
    return out


def has_logical_value(entry: Entry) -> bool:
    """True when ``entry`` has one logical value (see the table)."""
    return entry.num_components == 1 or rule_for(entry.kind, entry.attrs).value is not None


def no_value_what(entry: Entry) -> str:
    """What ``entry`` holds instead of one value: ``"2 independent components"``, ``"2 on-read
    components with aggregation 'none'"``."""
    n = int(entry.num_components)
    if entry.kind == "independent":
        return f"{n} independent components"
    return f"{n} on-read components with aggregation {aggregation_of(entry.kind, entry.attrs)!r}"


def no_value_error(
    entry: Entry,
    *,
    file: str | None = None,
    error: type[CheckpointError] = InvalidEntryError,
    expected: Any = None,
    found: Any = None,
    hint: str | None = None,
    variable: str | None = None,
) -> CheckpointError:
    """The error for reading one value of ``entry``, which has none."""
    return error(
        f"holds {no_value_what(entry)} and no single logical value",
        file=file,
        variable=variable if variable is not None else entry.path,
        expected=expected,
        found=found,
        hint=hint or "read each component instead",
    )


def read_logical_into(
    entry: Entry,
    out: np.ndarray,
    *,
    file: str | None = None,
    read: Callable[[int, np.ndarray], None] | None = None,
) -> None:
    """Read the logical value of ``entry`` into ``out`` (its shape; its dtype, or the one
    ``read`` casts to).

    ``read(i, out)`` reads component ``i`` into ``out`` (default: the entry's
    ``read_component_into``). Sums go in device order, so the result has the same bits on
    every run; ``inf + -inf`` is ``nan``, as it should be. An entry with no logical value
    raises :class:`~parallelvars.errors.DeviceCountError` naming ``file`` and the variable.
    """
    read = read or entry.read_component_into
    n = int(entry.num_components)
    rule = rule_for(entry.kind, entry.attrs)
    if entry.kind == "sharded":
        axis = int(entry.attrs["shard_axis"])
        for i, index in enumerate(
            _geometry.shard_slices(out.shape, axis, entry.attrs["shard_offsets"])
        ):
            read(i, out[index])
        return
    if n == 1 or rule.value == "primary":
        read(0, out)
        return
    if rule.value is None:
        raise no_value_error(
            entry,
            file=file,
            error=DeviceCountError,
            expected=f"{n} components, restored one by one",
            found="a single value asked for",
        )
    read(0, out)

    def rest() -> Iterator[np.ndarray]:  # parts 1 .. n-1 in device order, one scratch
        scratch = np.empty_like(out)
        for i in range(1, n):
            read(i, scratch)
            yield scratch

    aggregate_parts(out, rest(), n, rule.value)


def region_components(entry: Entry, axis: int, lo: int, hi: int) -> tuple[int, ...] | None:
    """The components :func:`read_region_into` reads for rows ``lo:hi`` along ``axis``; None
    when it reads the whole logical value."""
    if entry.kind != "sharded" or int(entry.attrs["shard_axis"]) != axis:
        return None
    length = int(entry.shape[axis])
    return tuple(
        j for j, _, _ in _geometry.overlapping_shards(entry.attrs["shard_offsets"], length, lo, hi)
    )


def read_region_into(
    entry: Entry,
    out: np.ndarray,
    axis: int,
    lo: int,
    hi: int,
    *,
    file: str | None = None,
    read: Callable[[int, np.ndarray], None] | None = None,
) -> None:
    """Read rows ``lo:hi`` along ``axis`` of the logical value of ``entry`` into ``out`` (a
    process's shard of a variable sharded across processes).

    A sharded entry split along ``axis`` reads only the saved shards holding those rows: a
    shard inside the rows straight into ``out``, one that overlaps them partly whole into a
    scratch buffer (each component is read whole, so its checksum is verified) and then its
    overlap copied. Any other entry: its logical value, then the rows.
    """
    read = read or entry.read_component_into
    shape = tuple(int(d) for d in entry.shape)
    if entry.kind == "sharded" and int(entry.attrs["shard_axis"]) == axis:
        offsets = entry.attrs["shard_offsets"]
        bounds = _geometry.shard_bounds(offsets, shape[axis])
        for j, a, b in _geometry.overlapping_shards(offsets, shape[axis], lo, hi):
            target = out[_geometry.shard_index(out.ndim, axis, a - lo, b - lo)]
            start, stop = bounds[j], bounds[j + 1]
            if (a, b) == (start, stop):
                read(j, target)
                continue
            scratch = np.empty(entry.component_shape(j), out.dtype)
            read(j, scratch)
            target[...] = scratch[_geometry.shard_index(out.ndim, axis, a - start, b - start)]
        return
    full = np.empty(shape, out.dtype)
    read_logical_into(entry, full, file=file, read=read)
    out[...] = full[_geometry.shard_index(out.ndim, axis, lo, hi)]


def logical_value(entry: Entry) -> np.ndarray:
    """The value a restore onto one device gives (see the table): a new array.

    Raises:
        InvalidEntryError: ``entry`` has no single value (independent buffers, or an on-read
            variable with aggregation ``none``, of more than one component).
    """
    if not has_logical_value(entry):
        raise no_value_error(entry)
    if entry.kind != "sharded" and (
        entry.num_components == 1 or rule_for(entry.kind, entry.attrs).value == "primary"
    ):
        return entry.component(0)
    out = np.empty(tuple(int(s) for s in entry.shape), np.dtype(entry.dtype))
    read_logical_into(entry, out)
    return out


@dataclass(frozen=True)
class Spread:
    """How M target components are filled from a saved variable of N components.

    ``how`` is ``"componentwise"`` (component i from component i), or the target rule's
    spread of the logical value: ``"all"``, ``"first"`` or ``"resplit"``.
    """

    how: str


def spread_plan(
    source: Entry,
    target_kind: str,
    target_aggregation: str | None,
    m: int,
    *,
    file: str | None,
    variable: str | None = None,
    rewriting: bool = False,
) -> Spread:
    """The one decision of restore and re-shard: how a saved ``source`` of N components fills
    M components of a variable of ``target_kind`` (with ``target_aggregation`` when on-read).

    Component by component when the layouts agree (same N, same kind, same aggregation, not
    sharded; onto independent buffers of M == N, whatever was saved); else the logical value
    of ``source`` spread by the target's rule. Refused, with
    :class:`~parallelvars.errors.DeviceCountError` naming the variable, when the target must
    have M == N (independent buffers, on-read ``none``) and does not, or when ``source`` has no
    single value and cannot go component by component. ``rewriting``: the target is a file
    rewritten for M devices (re-shard), not a live variable (restore); only the wording of a
    refusal differs.
    """
    n = int(source.num_components)
    name = variable if variable is not None else source.path
    skind = source.kind
    srule = rule_for(skind, source.attrs)
    trule = rule_for(target_kind, {"aggregation": target_aggregation or "sum"})
    if skind == "independent" and n > 1 and n != m:
        if rewriting:  # the file's layout is what the new one must match
            raise DeviceCountError(
                "independent buffers cannot be redistributed onto another number of devices",
                file=file,
                variable=name,
                expected=f"{n} devices",
                found=f"{m} devices",
            )
        raise DeviceCountError(
            "independent buffers restore only onto the same number of devices",
            file=file,
            variable=name,
            expected=f"{m} devices",
            found=f"{n} devices in the file",
        )
    if target_kind == "independent" and m > 1 and n != m:
        raise DeviceCountError(
            "an independent-buffers variable needs one saved component per device",
            file=file,
            variable=name,
            expected=f"{m} components",
            found=f"{n} components",
        )
    same = n == m and skind == target_kind and skind != "sharded"
    if same and skind == "on_read":  # saved with the same aggregation, named in the file
        same = str((source.attrs or {}).get("aggregation")).lower() == trule.aggregation
    if target_kind == "independent" and n == m:
        same = skind != "sharded"
    if same:
        return Spread("componentwise")
    if n > 1 and srule.value is None:
        hint = "it goes only component by component onto as many devices (independent buffers)"
        raise no_value_error(
            source,
            file=file,
            error=DeviceCountError,
            expected=f"{n} components taken one by one",
            found=f"a {target_kind} variable of {m} component{'s' if m != 1 else ''}",
            hint=hint,
            variable=name,
        )
    if trule.spread is None and m > 1:
        raise DeviceCountError(
            f"this {target_kind} variable with aggregation {trule.aggregation!r} takes only the "
            "same number of components, saved with the same aggregation",
            file=file,
            variable=name,
            expected=f"{m} components saved with the same aggregation",
            found=f"{n} components, {skind}",
        )
    return Spread(trule.spread or "all")
