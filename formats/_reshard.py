"""Rewrite a checkpoint for another number of devices, lazily, following DESIGN.md's restore table.

What each of the M new components holds is decided by the core's one restore rule table
(:mod:`parallelvars._aggregate`, :func:`~parallelvars._aggregate.spread_plan`),
the same decision a restore into live variables makes:

====================================  ==========================================================
kind (N components in the source)     what each of the M new components holds
====================================  ==========================================================
single                                unchanged (or the value on all M, kind ``mirrored``, with
                                      ``mirror_single=True``)
mirrored                              the primary, on all M
on_read, aggregation ``sum``          the total (the aggregate of the N components) in
                                      component 0 and zeros elsewhere, so the sum of the
                                      components is preserved exactly
on_read, aggregation ``mean``         the mean, on all M
on_read, ``only_first_replica``       the primary, on all M
on_read, aggregation ``none``         cannot be redistributed: M == N required
independent                           cannot be redistributed: M == N required, else
                                      :class:`~parallelvars.errors.DeviceCountError`
sharded (axis k)                      the full value re-split into M shards along k with
                                      ``numpy.array_split`` sizes (10 rows over 4 devices:
                                      3, 3, 2, 2)
====================================  ==========================================================

When M == N every parallel variable is left as it is. The new entries carry ``devices``
``["cpu:0", ..., "cpu:M-1"]`` and, for sharded ones, the new ``shard_offsets``. Nothing is read
until a component is asked for; a sharded component reads only the source shards it overlaps.

Example:
    >>> import numpy as np
    >>> from parallelvars.formats import ArrayEntry, DictView, reshard
    >>> e = ArrayEntry("e", [np.arange(5), np.arange(5, 10)], kind="sharded",
    ...                shape=(10,), attrs={"shard_axis": 0, "shard_offsets": [0, 5]})
    >>> r = reshard(DictView([e]), 4)["e"]
    >>> [r.component(i).tolist() for i in range(4)]
    [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]]
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np

from parallelvars._aggregate import Spread, aggregation_of, logical_value, spread_plan
from parallelvars._geometry import overlapping_shards, shard_bounds, shard_index, shard_offsets
from parallelvars.checkpoint.entry import (
    MAX_COMPONENTS,
    Entry,
    ForwardingEntry,
    check_entry,
)
from parallelvars.errors import InvalidArgumentError

from ._view import CheckpointView, check_summary_layout, checked_summary

__all__ = ["ReshardedView", "reshard", "split_offsets"]


def split_offsets(length: int, parts: int) -> list[int]:
    """Start offsets of ``numpy.array_split(range(length), parts)``: the first
    ``length % parts`` parts get one row more (see :mod:`parallelvars._geometry`)."""
    return shard_offsets(length, parts)


@functools.lru_cache(maxsize=8)
def _device_names(m: int) -> tuple[str, ...]:
    return tuple(f"cpu:{i}" for i in range(m))


def _devices(m: int) -> list[str]:
    """The device list of a variable rewritten for ``m`` devices (a list of its own)."""
    return list(_device_names(m))


class _Cache:
    """Holds the one value computed last, so M broadcast components cost one source read."""

    def __init__(self) -> None:
        self.owner: object = None
        self.value: np.ndarray | None = None

    def get(self, owner: object, compute: Callable[[], np.ndarray]) -> np.ndarray:
        if self.owner is not owner or self.value is None:
            self.value = None  # free the previous value before computing the next
            self.value = compute()
            self.owner = owner
        return self.value


class _Rewritten(ForwardingEntry):
    """An entry of the resharded view; components computed from the source on demand.

    Its layout is valid by construction, so writers do not check it again: the name, kind,
    shape, dtype and aggregation are the source's (checked by :func:`_rewrite`; the kind may
    become ``mirrored``), M is within 1 .. ``MAX_COMPONENTS`` (checked by :func:`reshard`),
    the ``devices`` are M names ``cpu:0 ..`` and shards are split by :func:`split_offsets`."""

    layout_checked = True

    def __init__(self, source: Entry, kind: str, m: int, attrs: dict[str, Any]) -> None:
        # (ForwardingEntry's fields, set once: ``attrs`` is the caller's new dict, kept)
        self.source = source
        self.path = source.path
        self.dtype = np.dtype(source.dtype)
        self.shape = tuple(map(int, source.shape))
        self.kind = kind
        self.num_components = m
        self.attrs = attrs

    def component_shape(self, i: int) -> tuple[int, ...]:
        return Entry.component_shape(self, i)

    def component(self, i: int) -> np.ndarray:
        out = np.empty(self.component_shape(i), self.dtype)
        self.read_component_into(i, out)
        return out


class _Broadcast(_Rewritten):
    """The same value on every component (primary or aggregate of the source)."""

    def __init__(
        self,
        source: Entry,
        kind: str,
        m: int,
        attrs: dict[str, Any],
        compute: Callable[[], np.ndarray],
        cache: _Cache,
    ) -> None:
        super().__init__(source, kind, m, attrs)
        self._compute = compute
        self._cache = cache

    def read_component_into(self, i: int, out: np.ndarray) -> None:
        self._check_index(i)
        # The values are assigned: another dtype would be cast. (Every component has the
        # entry's shape: an ``out`` of exactly that shape and dtype needs no other check.)
        if out.dtype != self.dtype or out.shape != self.shape:
            self.check_out(i, out)
        out[...] = self._cache.get(self, self._compute)

    def value(self) -> np.ndarray:
        return np.array(self._cache.get(self, self._compute), copy=True)


class _TotalFirst(_Rewritten):
    """on_read SUM: the total in component 0, zeros in the others."""

    def read_component_into(self, i: int, out: np.ndarray) -> None:
        self._check_index(i)
        if out.dtype != self.dtype or out.shape != self.shape:  # (as _Broadcast checks it)
            self.check_out(i, out)  # the values are assigned: another dtype would be cast
        if i == 0:
            out[...] = logical_value(self.source)
        else:
            out[...] = np.zeros((), self.dtype)

    def value(self) -> np.ndarray:
        return logical_value(self.source)


class _Resplit(_Rewritten):
    """sharded: component i is rows ``offsets[i]:offsets[i+1]`` of the source's full value."""

    def read_component_into(self, i: int, out: np.ndarray) -> None:
        self._check_index(i)
        self.check_out(i, out)  # the values are assigned: another dtype would be cast
        axis = int(self.attrs["shard_axis"])
        lo = int(self.attrs["shard_offsets"][i])
        hi = lo + self.component_shape(i)[axis]
        src = self.source
        length = int(self.shape[axis])
        src_offsets = [int(o) for o in src.attrs["shard_offsets"]]
        bounds = shard_bounds(src_offsets, length)
        for j, a, b in overlapping_shards(src_offsets, length, lo, hi):
            start, stop = bounds[j], bounds[j + 1]
            dst = out[shard_index(out.ndim, axis, a - lo, b - lo)]
            if a == start and b == stop:
                src.read_component_into(j, dst)  # a whole source shard: read it in place
            else:
                shard = src.component(j)
                dst[...] = shard[shard_index(shard.ndim, axis, a - start, b - start)]
                del shard

    def value(self) -> np.ndarray:
        return logical_value(self.source)


def _rewrite(
    entry: Entry, m: int, mirror_single: bool, cache: _Cache, file: str | None, view: ReshardedView
) -> Entry:
    check_entry(entry, file)
    kind = entry.kind
    if kind == "single":
        if not mirror_single:
            return entry
        attrs = dict(entry.attrs or {})
        attrs["devices"] = _devices(m)
        return _Broadcast(entry, "mirrored", m, attrs, lambda: entry.component(0), cache)
    n = int(entry.num_components)
    if m == n:
        return entry
    attrs = dict(entry.attrs or {})
    spread = view._spread(entry)
    attrs["devices"] = _devices(m)
    if spread.how == "first":
        return _TotalFirst(entry, kind, m, attrs)
    if spread.how == "resplit":
        attrs["shard_offsets"] = shard_offsets(int(entry.shape[int(attrs["shard_axis"])]), m)
        return _Resplit(entry, kind, m, attrs)
    return _Broadcast(entry, kind, m, attrs, lambda: logical_value(entry), cache)


class _Header:
    """A variable as its view's summary describes it (no entry made): what the checks and
    :func:`~parallelvars._aggregate.spread_plan` read."""

    __slots__ = ("attrs", "dtype", "kind", "num_components", "path", "shape")

    def __init__(self, path: str, summary: tuple[Any, ...]) -> None:
        self.path = path
        self.kind, self.dtype, self.shape, self.num_components, _, self.attrs = summary


class ReshardedView(CheckpointView):
    """The view :func:`reshard` returns: each entry rewritten from the source's when asked for
    and not held (a writer's plan reads the variables' :meth:`summary`, then each entry while
    its components are written), so a reshard holds no entry per variable. Every variable is
    checked and its spread decided when the view is made (a refusal raised then, naming it);
    the number of components of each is noted then too (:attr:`source_counts`,
    :attr:`spread_count`)."""

    #: Its summaries describe variables checked when the view was made (a rewritten layout
    #: is valid by construction, as :class:`_Rewritten`'s): a writer need not check them again.
    summaries_checked = True

    def __init__(self, view: Mapping[str, Entry], m: int, mirror_single: bool) -> None:
        self._view, self._m, self._mirror_single = view, m, mirror_single
        self._cache = _Cache()
        self._file: str | None = getattr(view, "path", None)
        self._spreads: dict[tuple[Any, ...], Spread] = {}
        self.format = getattr(view, "format", "memory")
        self.path = getattr(view, "path", "<memory>")
        self.metadata = dict(getattr(view, "metadata", None) or {})
        self.files = tuple(getattr(view, "files", ()))
        graph = getattr(view, "object_graph", None)
        if graph is not None:
            self.object_graph = graph  # (the HDF5 writer may keep it)
        self._summary = getattr(view, "summary", None)
        # (a source's entries and summaries that cannot differ are rewritten by one rule)
        self.summaries_match_entries = bool(getattr(view, "summaries_match_entries", False))
        counts: set[int] = set()
        spread = 0
        checked = bool(getattr(view, "summaries_checked", False))  # (as entries' layout_checked)
        for key in view:
            known = self._summary(key) if self._summary is not None else None
            if known is not None:
                known = checked_summary(known, self._file, key)
            if known is None:
                source = view[key]
                n = int(source.num_components)
                spread += int(self._rewrite(source).num_components) > 1
            elif checked:
                head = _Header(key, known)
                n = int(head.num_components)
                spread += self._rewritten_count(head) > 1
            else:  # (the checks of _rewrite, on the description)
                head = _Header(key, known)
                check_summary_layout(
                    key, head.kind, head.shape, int(head.num_components), head.attrs, self._file
                )
                n = int(head.num_components)
                spread += self._rewritten_count(head) > 1
            counts.add(n)
        #: The source variables' numbers of components (each number once).
        self.source_counts = sorted(counts)
        #: How many variables the rewrite puts on more than one device.
        self.spread_count = spread

    def _spread(self, entry: Any) -> Spread:
        """The decision for ``entry``'s kind, N and aggregation: made once for each (a
        refusal is raised for every variable it refuses, naming it)."""
        # (keyed on exactly what spread_plan reads: an absent aggregation and an explicit
        # None differ)
        kind, n = entry.kind, int(entry.num_components)
        aggregation = aggregation_of(kind, entry.attrs)
        key = (kind, n, aggregation)
        spread = self._spreads.get(key)
        if spread is None:
            spread = spread_plan(entry, kind, aggregation, self._m, file=self._file, rewriting=True)
            self._spreads[key] = spread
        return spread

    def _rewritten_count(self, head: _Header) -> int:
        """The number of components ``head``'s variable is rewritten with (its spread
        decided)."""
        n = int(head.num_components)
        if head.kind == "single":
            return self._m if self._mirror_single else n
        if n != self._m:
            self._spread(head)
        return self._m

    def _rewrite(self, entry: Entry) -> Entry:
        return _rewrite(entry, self._m, self._mirror_single, self._cache, self._file, self)

    def __getitem__(self, key: str) -> Entry:
        return self._rewrite(self._view[key])

    def __iter__(self) -> Iterator[str]:
        return iter(self._view)

    def __len__(self) -> int:
        return len(self._view)

    def summary(self, key: str) -> tuple[str, Any, tuple[int, ...], int, int, Any] | None:
        """The rewritten variable at ``key`` as the source's summary describes it (kind,
        dtype, shape, components, bytes, attributes; no entry made), or None where the source
        has none (``self[key]`` then)."""
        known = self._summary(key) if self._summary is not None else None
        if known is None:
            return None
        kind, dtype, shape, n, nbytes, attrs = checked_summary(known, self._file, key)
        m = self._m
        if kind == "single":
            if not self._mirror_single:
                return known
            how, kind = "all", "mirrored"
        elif n == m:
            return known
        else:
            how = self._spread(_Header(key, known)).how
        attrs = dict(attrs or {})
        attrs["devices"] = _devices(m)
        if how == "resplit":
            attrs["shard_offsets"] = shard_offsets(int(shape[int(attrs["shard_axis"])]), m)
            return kind, dtype, shape, m, nbytes, attrs
        return kind, dtype, shape, m, math.prod(shape) * np.dtype(dtype).itemsize * m, attrs


def reshard(
    view: Mapping[str, Entry], devices: int, *, mirror_single: bool = False
) -> ReshardedView:
    """A lazy view of ``view`` rewritten for ``devices`` devices (see the module table).

    Args:
        view: any checkpoint view or mapping of entries.
        devices: the new number of devices M, 1 to ``MAX_COMPONENTS`` (65536).
        mirror_single: also turn single variables into mirrored ones on all M devices.

    Returns:
        A :class:`CheckpointView` with the same paths, format, file and metadata; each
        entry made when asked for (every variable checked now).

    Raises:
        InvalidArgumentError: ``devices`` is not an integer from 1 to ``MAX_COMPONENTS``.
        DeviceCountError: an independent (or aggregation ``none`` on-read) variable was saved
            for another number of devices; the message names it.
    """
    if isinstance(devices, bool) or not isinstance(devices, (int, np.integer)) or devices < 1:
        raise InvalidArgumentError(f"devices must be a positive integer, got {devices!r}")
    if devices > MAX_COMPONENTS:  # (no reader opens a variable of more components)
        raise InvalidArgumentError(
            f"devices must be at most {MAX_COMPONENTS} (the most components a variable can "
            f"have), got {int(devices)}"
        )
    return ReshardedView(view, int(devices), mirror_single)
