"""How a parallel variable saves, and the rules for restoring it onto M devices.

N is the number of components in the file, M the number of the live variable.

=============  ===============================================================================
live kind      what it receives
=============  ===============================================================================
single         the logical value (mirrored: primary; on-read: aggregate; sharded: full value)
mirrored       component-wise when the file has a mirrored variable of N == M components,
               else the logical value on every component
on_read        component-wise when the file has an on-read variable of N == M components and
               the same aggregation; else SUM: the total in the primary and zeros elsewhere
               (exact for every dtype), MEAN / ONLY_FIRST_REPLICA: the value on every component
independent   component-wise; only from the same number of components (else DeviceCountError)
sharded       the full value, re-split by the live variable's own shards (reads go straight
               into the right rows, so re-sharding costs nothing extra)
=============  ===============================================================================

The decision is the core's one rule table (:mod:`parallelvars._aggregate`,
``spread_plan``), which ``formats.reshard`` consults too. An on-read variable saved with
aggregation ``none`` has no single value either: it restores only component by component.

An independent-buffers variable in the file has no single logical value, so it restores only
onto a variable with the same number of components, or onto a plain (single) variable, which
receives component 0 (saved under the plain key for that reason, as in the seed
parallel_device_saving); the other components are then reported unmatched by the load status
(``assert_consumed()`` fails, ``expect_partial()`` accepts it).
"""

from __future__ import annotations

import functools
import itertools
import operator
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from parallelvars import _aggregate
from parallelvars._dtypes import dtype_name
from parallelvars._fileio import byte_view, checksum, checksum_combine
from parallelvars._geometry import shard_bounds
from parallelvars._threads import run_partitioned
from parallelvars.checkpoint.entry import Entry
from parallelvars.checkpoint.h5io import read as _read
from parallelvars.checkpoint.h5io import staging
from parallelvars.checkpoint.h5io.stored import StoredVariable
from parallelvars.checkpoint.registry import (
    Saveable,
    SaveRecord,
    component_name,
    get_saveable,
    register_saveable,
)
from parallelvars.errors import (
    CheckpointError,
    ChecksumMismatchError,
    ConcurrentWriteError,
    CorruptCheckpointError,
    DtypeMismatchError,
    ShapeMismatchError,
)
from parallelvars.variables import ParallelVariable, RankShardedVariable, ShardedVariable

if TYPE_CHECKING:
    from parallelvars.checkpoint.h5io.index_table import IndexTable
    from parallelvars.checkpoint.h5io.read import H5Reader

__all__ = [
    "DirectRestore",
    "ParallelVariableSaveable",
    "commit_plans",
    "plan_direct",
    "read_logical_into",
]


def _reader(stored: Entry, cast: bool) -> Callable[[int, np.ndarray], None]:
    """``read(i, out)``: component ``i`` of ``stored`` into ``out``, cast to ``out``'s dtype
    when ``cast`` (the native reader casts as it reads; other entries through a copy)."""
    if isinstance(stored, StoredVariable):
        native = stored

        def read_native(i: int, out: np.ndarray) -> None:
            native.read_component_into(i, out, cast=cast)

        return read_native

    def read(i: int, out: np.ndarray) -> None:
        if out.dtype == stored.dtype:
            stored.read_component_into(i, out)
        else:  # allowed by the plan: allow_cast
            out[...] = stored.component(i)

    return read


def read_logical_into(stored: Entry, out: np.ndarray, *, file: str, cast: bool) -> None:
    """Read the logical value of ``stored`` into ``out`` (checksums verified by the reader)."""
    _aggregate.read_logical_into(stored, out, file=file, read=_reader(stored, cast))


# The most bytes read up front to check that a counter's saved values convert exactly.
_EXACT_CHECK_BYTES = 1 << 16


def _exactly_representable(stored: Any, dtype: np.dtype) -> bool:
    """Whether every saved component of ``stored`` converts to ``dtype`` and back unchanged.

    For an optimizer's non-slot counters (a step count, beta powers), which are scalars: a
    TensorFlow checkpoint keeps beta powers in float32, ours are float64; a value that converts
    exactly is taken without ``allow_cast``. Larger values are not checked (not exact).
    """
    if stored.dtype.kind not in "biuf" or np.dtype(dtype).kind not in "biuf":
        return False
    if stored.nbytes > _EXACT_CHECK_BYTES:
        return False
    for i in range(stored.num_components):
        saved = np.empty(stored.component_shape(i), stored.dtype)
        stored.read_component_into(i, saved)
        with np.errstate(all="ignore"):
            back = saved.astype(dtype).astype(stored.dtype)
        if not np.array_equal(back, saved, equal_nan=saved.dtype.kind == "f"):
            return False
    return True


def _logical_shape(obj: ParallelVariable) -> tuple[int, ...]:
    """The whole variable's shape: a process's shard of a variable sharded across processes
    knows it; any other variable's is its buffer's (no attribute lookup through the proxy,
    which would read an on-read variable's value)."""
    if isinstance(obj, RankShardedVariable):
        return tuple(obj.full_shape)
    return tuple(obj.__wrapped__.shape)


# The properties gather reads, and the state each returns (as ParallelVariable and
# ShardedVariable define them; RankShardedVariable's shape is _logical_shape's).
_FACTS = ("name", "devices", "synchronization", "aggregation", "trainable", "kind", "components")
_SHARD_FACTS = ("shard_axis", "shard_offsets")
# The proxy's own dict (wrapt 2's name for it; without it, the state is read name by name).
_SELF_DICT = "__self_dict__"
# The proxy state those properties return.
_STATE = (
    "_self_name",
    "_self_device",
    "_self_synchronization",
    "_self_aggregation",
    "_self_trainable",
    "_self_kind",
    "_self_components",
)


@functools.cache
def _plain_facts(cls: type) -> bool:
    """Whether the variables of ``cls`` give :meth:`ParallelVariableSaveable.gather` their
    facts through the base classes' properties (so they can be read from the state those
    return): a subclass that overrides one is gathered one variable at a time."""
    if not issubclass(cls, ParallelVariable):
        return False
    same = all(getattr(cls, p) is getattr(ParallelVariable, p) for p in _FACTS)
    if issubclass(cls, ShardedVariable):
        same = same and all(getattr(cls, p) is getattr(ShardedVariable, p) for p in _SHARD_FACTS)
    return same and "__wrapped__" not in cls.__dict__


class ParallelVariableSaveable(Saveable):
    """Saves ``primary`` and ``parallel_component_1..N-1``; restores by the table above."""

    def gather(self, obj: ParallelVariable) -> SaveRecord:
        # (``_value_``: an enum member's value without the descriptor call of ``.value``)
        attrs: dict[str, Any] = {
            "name": obj.name,
            "devices": list(obj.devices),
            "synchronization": obj.synchronization._value_,
            "aggregation": obj.aggregation._value_,
            "trainable": obj.trainable,
        }
        if isinstance(obj, ShardedVariable):
            attrs["shard_axis"] = obj.shard_axis
            attrs["shard_offsets"] = list(obj.shard_offsets)
        return SaveRecord(
            kind=obj.kind,
            components=obj.components,
            # a process's shard of a variable sharded across processes: the whole shape
            shape=_logical_shape(obj),
            attrs=attrs,
        )

    def gather_all(self, objs: Sequence[ParallelVariable]) -> list[SaveRecord]:
        """:meth:`gather` of each of ``objs``: the same records, each variable's facts read
        from the proxy's own dict (what its properties return; a read through the proxy costs
        its ``__getattr__`` hook, a few hundred ns), the attributes of every record as
        :meth:`gather` makes them, in its order. A subclass that overrides :meth:`gather`,
        variables whose facts are not the base classes' properties, and variables missing a
        piece of that state are gathered one at a time, by :meth:`gather`."""
        types = set(map(type, objs))
        if type(self).gather is not ParallelVariableSaveable.gather or not all(
            map(_plain_facts, types)
        ):
            return list(map(self.gather, objs))
        try:
            return self._gather_state(objs, types)
        except (KeyError, AttributeError):  # (a piece of the state missing: gather says what)
            return list(map(self.gather, objs))

    def _gather_state(self, objs: Sequence[ParallelVariable], types: set[type]) -> list[SaveRecord]:
        """:meth:`gather_all`'s records read from the proxies' own state (their types' facts
        are the base classes' properties)."""
        get = object.__getattribute__  # (the proxy's own state, without its hook)
        if all(hasattr(t, _SELF_DICT) for t in types):  # (wrapt >= 2: the proxy's own dict)
            states = list(map(get, objs, itertools.repeat(_SELF_DICT)))
        else:
            states = [{k: get(obj, k) for k in _STATE} for obj in objs]
        # (the records of one device share its list of names: read by the writers, never
        # changed, one list less a record)
        devices: dict[int, list[str]] = {}
        attrs = []
        for state in states:
            device = state["_self_device"]
            names = devices.get(id(device))
            if names is None:
                names = devices[id(device)] = list(device.components)
            attrs.append(
                {
                    "name": state["_self_name"],
                    "devices": names,
                    "synchronization": state["_self_synchronization"]._value_,
                    "aggregation": state["_self_aggregation"]._value_,
                    "trainable": state["_self_trainable"],
                }
            )
        kinds = list(map(operator.itemgetter("_self_kind"), states))
        components = list(map(operator.itemgetter("_self_components"), states))
        wrapped = list(map(get, objs, itertools.repeat("__wrapped__")))
        if any(issubclass(t, RankShardedVariable) for t in types):
            shapes = [_logical_shape(o) for o in objs]
        else:
            # (records of one shape share its tuple: numpy makes one each time it is asked)
            known: dict[tuple[int, ...], tuple[int, ...]] = {}
            shapes = [known.setdefault(s, s) for s in map(tuple, map(_SHAPE, wrapped))]
        if any(issubclass(t, ShardedVariable) for t in types):
            for attr, obj in zip(attrs, objs, strict=True):
                if issubclass(type(obj), ShardedVariable):  # (isinstance asks the proxy)
                    attr["shard_axis"] = get(obj, "_self_shard_axis")
                    attr["shard_offsets"] = list(get(obj, "_self_shard_offsets"))
        return SaveRecord.made(kinds, components, shapes, attrs)

    def plan_restore(
        self, obj: ParallelVariable, stored: Entry, *, file: str, path: str, allow_cast: bool
    ) -> Callable[[], None]:
        shape = _logical_shape(obj)
        if tuple(stored.shape) != shape:
            raise ShapeMismatchError(
                "shape mismatch",
                file=file,
                variable=path,
                expected=shape,
                found=tuple(stored.shape),
            )
        cast = allow_cast
        if stored.dtype != obj.dtype and not allow_cast:
            if not (obj._self_exact_cast and _exactly_representable(stored, obj.dtype)):
                raise DtypeMismatchError(
                    "dtype mismatch"
                    + (" (values not exactly representable)" if obj._self_exact_cast else ""),
                    file=file,
                    variable=path,
                    expected=dtype_name(obj.dtype),
                    found=dtype_name(stored.dtype),
                    hint="restore with allow_cast=True to convert",
                )
            cast = True  # a counter whose saved values convert exactly (float32 beta powers)
        if stored.dtype != obj.dtype and (stored.dtype.kind == "O") != (obj.dtype.kind == "O"):
            raise DtypeMismatchError(
                "cannot cast between byte strings and numbers",
                file=file,
                variable=path,
                expected=dtype_name(obj.dtype),
                found=dtype_name(stored.dtype),
            )
        # m counts the whole variable's components; this process holds those of `indices`
        # (all of them, except under a multi-process strategy).
        m, n = obj.global_num_components, stored.num_components
        indices = obj.component_indices
        live, skind = obj.kind, stored.kind
        comps = obj.components
        read = _reader(stored, cast)
        if skind == "independent" and n > 1 and live == "single" and m == 1:
            # The seed (parallel_device_saving) saves component 0 under the plain key so that a
            # non-parallel variable restores from it; the other components stay unmatched.
            target = comps[0]

            def first_component() -> None:
                read(0, target)

            first_component.unmatched = [  # type: ignore[attr-defined]
                f"{path}/{component_name(i)}" for i in range(1, n)
            ]
            return first_component
        if isinstance(obj, RankShardedVariable):
            # This process's rows of the logical value: only the saved shards holding them.
            _aggregate.spread_plan(stored, "sharded", None, m, file=file, variable=path)
            local, axis = obj.__wrapped__, obj.shard_axis
            rows = obj.local_slice()[axis]
            needed = _aggregate.region_components(stored, axis, rows.start, rows.stop)
            if needed is None:  # not sharded along this axis: the logical value, verified

                def logical_rows() -> None:
                    _aggregate.read_region_into(
                        stored, local, axis, rows.start, rows.stop, file=file, read=read
                    )

                return logical_rows
            if axis == 0 and isinstance(stored, StoredVariable) and stored.dtype.kind != "O":
                return _rows_with_pieces(stored, local, rows.start, rows.stop, needed, path)
            # The saved shards holding these rows, read (and verified) once, now: the check
            # verifies nothing more of this variable (``needed``: no other component), and
            # the restore copies from them.
            held: dict[int, np.ndarray] = {}
            for j in needed:
                held[j] = np.empty(stored.component_shape(j), local.dtype)
                read(j, held[j])

            def region() -> None:
                _aggregate.read_region_into(
                    stored,
                    local,
                    axis,
                    rows.start,
                    rows.stop,
                    file=file,
                    read=lambda j, out: np.copyto(out, held[j]),
                )

            region.needed = ()  # type: ignore[attr-defined]
            return region
        if isinstance(obj, ShardedVariable):
            # "resplit" (or a refusal): the full value, read straight into the shards' rows
            _aggregate.spread_plan(stored, "sharded", None, m, file=file, variable=path)
            full = obj.__wrapped__
            return lambda: read_logical_into(stored, full, file=file, cast=cast)

        spread = _aggregate.spread_plan(
            stored, live, obj.aggregation.value, m, file=file, variable=path
        )
        if spread.how == "componentwise":

            def componentwise() -> None:
                same = _same_bytes(stored, indices)  # (every location known by now)
                for i, c, first in zip(indices, comps, same, strict=True):
                    if first is None:
                        read(i, c)
                    else:  # the bytes of an earlier component (one dataset): checked there
                        np.copyto(c, comps[first])

            return componentwise

        # spread "first" (on-read SUM): the total goes to global component 0 only.
        zero = spread.how == "first"
        targets = [c for i, c in zip(indices, comps, strict=True) if not (zero and i != 0)]
        zeros = [c for i, c in zip(indices, comps, strict=True) if zero and i != 0]

        def logical() -> None:
            if targets:
                read_logical_into(stored, targets[0], file=file, cast=cast)
                for c in targets[1:]:
                    np.copyto(c, targets[0])
            for c in zeros:
                c[...] = 0

        return logical


def _same_bytes(stored: Entry, indices: Sequence[int]) -> list[int | None]:
    """For each of ``indices`` (saved components), the position in ``indices`` of an earlier
    one whose bytes it is (the same dataset: a mirrored variable's components stored once,
    with the same checksum), else None: those are copied from it instead of read again."""
    out: list[int | None] = [None] * len(indices)
    if not isinstance(stored, StoredVariable) or stored._index_offsets is None:
        return out
    crcs = stored.stored_checksums
    seen: dict[tuple[int, int, int | None], int] = {}
    for k, i in enumerate(indices):
        loc = stored._location(i)
        if loc is None or loc[1] == 0:
            continue
        out[k] = seen.setdefault((*loc, crcs[i]), k)
        if out[k] == k:
            out[k] = None
    return out


class Piece(NamedTuple):
    """Bytes ``start : start + nbytes`` of saved component ``component`` of ``path`` that one
    process read, with their CRC-32C, and the whole component's size and stored checksum."""

    path: str
    component: int
    start: int
    nbytes: int
    crc32c: int
    total: int
    expected: int | None


def _rows_with_pieces(
    stored: StoredVariable,
    local: np.ndarray,
    lo: int,
    hi: int,
    needed: tuple[int, ...],
    path: str,
) -> Callable[[], None]:
    """Rows ``lo:hi`` (axis 0) of a saved sharded variable for a process's shard, reading only
    those rows' bytes.

    A saved shard inside the rows is read whole and verified against its checksum. Of a shard
    that the rows cover partly only the rows are read (an HDF5 hyperslab), and their CRC-32C
    is kept as a :class:`Piece`: the processes that restore the other rows of that shard read
    the rest, and the restore's agreement (``Checkpoint.restore`` under a multi-process
    strategy) combines every process's pieces into the shard's checksum before anything is
    written (:func:`verify_pieces`). Every byte is thus read once in the job and verified.
    """
    offsets = stored.attrs["shard_offsets"]
    bounds = shard_bounds(offsets, int(stored.shape[0]))
    held: list[tuple[int, int, np.ndarray]] = []
    pieces: list[Piece] = []
    expected = stored.stored_checksums
    for j in needed:
        start, stop = bounds[j], bounds[j + 1]
        a, b = max(lo, start), min(hi, stop)
        if (a, b) == (start, stop):
            whole = np.empty(stored.component_shape(j), stored.dtype)
            stored.read_component_into(j, whole)  # verified
            held.append((a, b, whole))
            continue
        part = stored.read_rows(j, a - start, b - start)
        row_bytes = part.nbytes // max(b - a, 1)
        pieces.append(
            Piece(
                path,
                j,
                (a - start) * row_bytes,
                part.nbytes,
                checksum(part),
                stored.component_nbytes(j),
                expected[j],
            )
        )
        held.append((a, b, part))

    def rows() -> None:
        for a, b, data in held:
            local[a - lo : b - lo] = data

    rows.needed = ()  # type: ignore[attr-defined]
    rows.pieces = pieces  # type: ignore[attr-defined]
    return rows


def verify_pieces(pieces: Iterable[Piece], file: str) -> None:
    """Check that the pieces every process read of each partly read component cover it
    exactly and that their CRC-32Cs combine into its stored checksum.

    Raises:
        ChecksumMismatchError: a component whose pieces' checksum differs from the stored one.
        CorruptCheckpointError: pieces that do not cover their component exactly once.
    """
    by_component: dict[tuple[str, int], list[Piece]] = {}
    for p in pieces:
        by_component.setdefault((p.path, p.component), []).append(p)
    for (path, index), parts in sorted(by_component.items()):
        parts.sort(key=operator.attrgetter("start"))
        name = f"{path}/{component_name(index)}"
        at, crc = 0, 0
        for p in parts:
            if p.start != at:
                raise CorruptCheckpointError(
                    "the processes' reads do not cover the saved shard",
                    file=file,
                    variable=name,
                    expected=f"bytes from {at}",
                    found=f"bytes from {p.start}",
                )
            crc = p.crc32c if at == 0 else checksum_combine(crc, p.crc32c, p.nbytes)
            at += p.nbytes
        total, stored = parts[0].total, parts[0].expected
        if at != total:
            raise CorruptCheckpointError(
                "the processes' reads do not cover the saved shard",
                file=file,
                variable=name,
                expected=f"{total} bytes",
                found=f"{at} bytes",
            )
        if stored is not None and crc != stored:
            raise ChecksumMismatchError(
                "checksum mismatch: the stored bytes are damaged",
                file=file,
                variable=name,
                expected=f"crc32c {stored:#010x}",
                found=f"crc32c {crc:#010x}",
            )


_SAVEABLE = ParallelVariableSaveable()
register_saveable(ParallelVariable, _SAVEABLE)


def _tracked(plan: Callable[[], None], path: str, done: list[str]) -> None:
    plan()
    done.append(path)  # (list.append is atomic: the plans run on several threads)


def commit_plans(
    plans: list[Callable[[], None]],
    paths: list[str],
    sizes: list[int],
    *,
    file: str,
    written: list[str],
) -> None:
    """Run a restore's copies (``plans``, of the variables at ``paths``), every byte of which
    was verified by the restore's first pass and is checked again as it lands
    (``StoredVariable.read_component_into``); ``written``: the variables already copied from
    verified memory (the bulk path).

    A failure now means the file changed after it was verified (rewritten or cut by another
    process): nothing unchecked lands, but the restore is no longer all or nothing, so the
    error is a :class:`~parallelvars.errors.ConcurrentWriteError` naming the variables
    already written, never a silent partial restore.
    """
    done: list[str] = []
    calls = list(map(functools.partial, itertools.repeat(_tracked), plans, paths))
    try:
        run_partitioned([functools.partial(c, done) for c in calls], sizes)
    except CheckpointError as exc:
        written = [*written, *done]
        shown = ", ".join(written[:10]) + (
            f", ... ({len(written)} in all)" if len(written) > 10 else ""
        )
        raise ConcurrentWriteError(
            f"the file changed after it was verified ({exc.what})",
            file=file,
            variable=exc.variable,
            expected=exc.expected,
            found=exc.found,
            hint=(
                f"variables already restored: {shown}; the one named may be restored in part"
                if written
                else "no variable was written but the one named, maybe in part"
            )
            + "; restore again once the file is no longer being written",
        ) from exc


class DirectRestore:
    """The restore of many variables that take the file's components one for one, in bulk.

    :func:`plan_direct` picks them, :meth:`read` reads and verifies every component they take
    (:meth:`H5Reader.read_bulk`) and :meth:`commit` copies each into its live buffer: per
    component, one byte view made for the copy and one copy; no plan object per variable.
    (The targets are the live arrays, which the cyclic collector does not track; a memoryview
    per component held from planning to commit would be, and at many variables its
    collections would cost more than the copies.)
    """

    __slots__ = ("at", "buffer", "nbytes", "rows", "taken", "targets")

    def __init__(self, taken: list[int], rows: list[int], targets: list[np.ndarray]) -> None:
        self.taken = taken  # the position of each variable taken in the list planned
        self.rows = rows  # its row of the index table
        self.targets = targets  # each live component (contiguous, writable), variable by variable
        self.buffer: np.ndarray | None = None
        self.at: list[int] = []
        self.nbytes: list[int] = []

    def read(self, reader: H5Reader) -> list[int]:
        """Read and verify every component; the variables with a component whose bytes do
        not match its checksum are dropped from this restore and returned (their positions:
        the general path then reads them, from where HDF5 places a dataset whose indexed
        offset is stale, or raising the error that names the damage)."""
        table = reader.table
        assert table is not None
        rows = np.array(self.rows, np.int64)
        slots = table.component_slots(rows)
        buffer, at, bad = reader.read_bulk(slots, staged=True)
        reader.hold(buffer.nbytes)
        nbytes = table.nbytes[slots]
        failed: list[int] = []
        if bad:
            counts = table.first[rows + 1] - table.first[rows]
            owner = np.repeat(np.arange(rows.size), counts)
            dropped = sorted(set(owner[bad].tolist()))
            failed = [self.taken[k] for k in dropped]
            keep = ~np.isin(owner, dropped)
            kept = np.ones(rows.size, bool)
            kept[dropped] = False
            self.taken = np.array(self.taken, np.int64)[kept].tolist()
            self.rows = rows[kept].tolist()
            self.targets = [t for t, ok in zip(self.targets, keep.tolist(), strict=True) if ok]
            at, nbytes = at[keep], nbytes[keep]
        self.buffer, self.at, self.nbytes = buffer, at.tolist(), nbytes.tolist()
        return failed

    def commit(self) -> None:
        """Copy every verified component into its live buffer.

        A component under :data:`COPY_CHUNK` bytes is copied here, one slice assignment each;
        the larger ones are spread over the cores, and the components copied from the same
        bytes (a mirrored variable's, stored once) are copied together, a ``COPY_CHUNK`` of
        the source into each of them in turn, so the source is read from memory once, while it
        is in the CPU's cache.
        """
        if self.buffer is None:
            return
        buffer = self.buffer
        whole = memoryview(buffer)  # type: ignore[arg-type]
        targets, ats, sizes = self.targets, self.at, self.nbytes
        calls: list[Callable[[], None]] = []
        weights: list[int] = []
        k, count = 0, len(targets)
        while k < count:
            at, n = ats[k], sizes[k]
            if n < COPY_CHUNK:
                _bytes_of(targets[k])[:] = whole[at : at + n]
                k += 1
                continue
            j = k + 1
            while j < count and ats[j] == at and sizes[j] == n:
                j += 1
            calls.append(functools.partial(_copy_into, buffer[at : at + n], targets[k:j]))
            weights.append(n * (j - k))
            k = j
        run_partitioned(calls, weights)
        self.release()

    def release(self, recycle: bool = True) -> None:
        """Drop the bytes read: their staging memory is given back for the next restore once
        committed; freed when ``recycle`` is false (the restore failed or was interrupted:
        never handed to another restore while something may still write into it)."""
        buffer, self.buffer, self.targets = self.buffer, None, []
        if recycle:
            staging.give(buffer)


#: The bytes of the source copied into each of the targets in turn (:func:`_copy_into`).
COPY_CHUNK = 256 << 10


def _copy_into(source: np.ndarray, targets: list[np.ndarray]) -> None:
    """Copy ``source`` (bytes) into every one of ``targets`` (contiguous arrays of its size),
    a :data:`COPY_CHUNK` at a time into each, so the source stays in the CPU's cache."""
    views = list(map(byte_view, targets))
    if len(views) == 1 or source.size <= COPY_CHUNK:
        for view in views:
            np.copyto(view, source)
        return
    for lo in range(0, source.size, COPY_CHUNK):
        piece = source[lo : lo + COPY_CHUNK]
        for view in views:
            np.copyto(view[lo : lo + COPY_CHUNK], piece)


def _writable_bytes(components: Iterable[Any]) -> bool:
    """Whether every array gives a writable flat byte view through the buffer protocol (each
    view is dropped as soon as it is checked)."""
    try:
        return not any(map(_READONLY, map(_CAST_BYTES, map(_MEMORYVIEW, components))))
    except (TypeError, ValueError):
        return False


def _raw_writable(components: Iterable[np.ndarray]) -> bool:
    """:func:`_writable_bytes` for dtypes the buffer protocol cannot export (bfloat16 and the
    other extension dtypes), which are written through a uint8 view (``byte_view``)."""
    return all(a.flags.c_contiguous and a.flags.writeable for a in components)


def _bytes_of(a: np.ndarray) -> memoryview:
    """A writable flat byte view of a contiguous array (:func:`_writable_bytes` or
    :func:`_raw_writable` said it has one)."""
    try:
        return memoryview(a).cast("B")  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return memoryview(byte_view(a))  # type: ignore[arg-type]


_MEMORYVIEW: Callable[[Any], memoryview] = memoryview
_CAST_BYTES = operator.methodcaller("cast", "B")
_READONLY = operator.attrgetter("readonly")


#: The fewest components the bulk path takes; below, every variable goes the general way.
#: (Its reads are spread over the restore's threads in file order, so it is the faster path
#: at any count.)
DIRECT_MIN_COMPONENTS = 1


def plan_direct(
    table: IndexTable, lives: list[Any], paths: list[str]
) -> tuple[DirectRestore | None, list[int]]:
    """Split the live objects ``lives``, to restore from the saved ``paths``, into the common
    case, restored in bulk, and the rest (their positions, returned), each planned by its
    saveable's :meth:`plan_restore` as before.

    The common case is the one :meth:`ParallelVariableSaveable.plan_restore` restores
    component by component with nothing to check but the bytes: a (not sharded) parallel
    variable of this process whose file entry has its kind, dtype, shape, number of components
    and, on-read, aggregation, and whose components the index places (a direct row of
    ``table``), up to ``RESTORE_KEEP_LIMIT`` stored bytes in all (a dataset stored once under
    several names counted once), into contiguous writable buffers; and at
    least ``DIRECT_MIN_COMPONENTS`` such components, else none is taken. Decided column by column (C loops over the variables' own fields, never through the
    proxy); everything else (another saveable, a cast, a re-shard, an aggregate, a refusal, a
    multi-process variable) goes the general way, unchanged.
    """
    count = len(lives)
    missing = len(table.names)  # (a row past the last: not in the file)
    rows = list(map(table.rows.get, paths, itertools.repeat(missing)))
    direct = [*table.direct, False]
    types = list(map(type, lives))
    plain = {  # per type: a variable that our saveable restores component by component
        cls: issubclass(cls, ParallelVariable)
        and not issubclass(cls, ShardedVariable)
        and get_saveable(lives[types.index(cls)]) is _SAVEABLE
        for cls in set(types)
    }
    pick = list(
        itertools.compress(
            range(count),
            map(operator.and_, map(direct.__getitem__, rows), map(plain.__getitem__, types)),
        )
    )
    cand = list(map(lives.__getitem__, pick))
    rows = list(map(rows.__getitem__, pick))
    kinds = list(map(table.kinds.__getitem__, rows))
    comps = list(map(_COMPONENTS, cand))
    wrapped = list(map(_WRAPPED, cand))
    # Column by column, what the file has against what the variables are: one comparison of
    # two lists when they agree (the usual case), else value by value. (Lists compare their
    # items by identity first: numpy's builtin dtypes are singletons.)
    ok = _agree(list(map(_GLOBAL, cand)), [None] * len(cand))
    for saved, live in (
        (kinds, list(map(_KIND, cand))),
        (list(map(table.counts.__getitem__, rows)), list(map(len, comps))),
        (list(map(table.shapes.__getitem__, rows)), list(map(_SHAPE, wrapped))),
        (list(map(table.dtypes.__getitem__, rows)), list(map(_DTYPE, wrapped))),
    ):
        ok = _both(ok, _agree(saved, live))
    if ok is None:
        ok = [True] * len(cand)
    if "on_read" in kinds:  # component by component only from the same aggregation
        lowered, aggregations = table.lowered, table.aggregations
        for k, (kind, row) in enumerate(zip(kinds, rows, strict=True)):
            if kind == "on_read" and ok[k]:
                ok[k] = lowered[aggregations[row]] == cand[k]._self_aggregation.value
    # What the bulk read holds: each row's stored bytes (a dataset stored once under several
    # names counted once), the first rows first, to what a restore may hold.
    limit = _read.RESTORE_KEEP_LIMIT
    sizes = _stored_nbytes(table, rows)
    if sum(itertools.compress(sizes, ok)) > limit:
        ok = ((np.cumsum(np.where(ok, sizes, 0)) <= limit) & np.array(ok, bool)).tolist()
    keep = list(itertools.compress(range(len(cand)), ok))
    views = list(itertools.chain.from_iterable(map(comps.__getitem__, keep)))
    if not _writable_bytes(views):  # one not contiguous or not writable: find it, one by one
        views = []
        for k in list(keep):
            if _writable_bytes(comps[k]) or _raw_writable(comps[k]):
                views.extend(comps[k])
            else:
                keep.remove(k)
    if len(views) < DIRECT_MIN_COMPONENTS:
        return None, list(range(count))
    taken = list(map(pick.__getitem__, keep))
    rest = sorted(set(range(count)).difference(taken))
    if not taken:
        return None, rest
    return DirectRestore(taken, list(map(rows.__getitem__, keep)), views), rest


def _stored_nbytes(table: IndexTable, rows: list[int]) -> list[int]:
    """The bytes each of ``rows`` has in the file: a component whose offset is its
    predecessor's in the row (a mirrored variable's components stored once) is not counted
    again."""
    if not rows:
        return []
    index = np.array(rows, np.int64)
    first, last = table.first[index], table.first[index + 1]
    counts = last - first
    slots = table.component_slots(index)
    offsets = table.offsets[slots]
    again = np.zeros(slots.size, bool)
    again[1:] = offsets[1:] == offsets[:-1]
    heads = np.zeros(len(rows), np.int64)
    np.cumsum(counts[:-1], out=heads[1:])
    again[heads] = False
    repeated = np.add.reduceat(again, heads) if slots.size else np.zeros(len(rows), np.int64)
    sizes = np.array(list(map(table.row_nbytes.__getitem__, rows)), np.int64)
    return (sizes // np.maximum(counts, 1) * (counts - repeated)).tolist()


def _agree(saved: list[Any], live: list[Any]) -> list[bool] | None:
    """Whether each saved value equals its live one; None when all do."""
    return None if saved == live else list(map(operator.eq, saved, live))


def _both(a: list[bool] | None, b: list[bool] | None) -> list[bool] | None:
    """Element-wise ``a and b`` of two :func:`_agree` results (None: all true)."""
    if a is None or b is None:
        return b if a is None else a
    return list(map(operator.and_, a, b))


_COMPONENTS = operator.attrgetter("_self_components")
_WRAPPED = operator.attrgetter("__wrapped__")
_GLOBAL = operator.attrgetter("_self_global")
_KIND = operator.attrgetter("_self_kind")
_SHAPE = operator.attrgetter("shape")
_DTYPE = operator.attrgetter("dtype")
