"""The commands' side of a native reader, in bulk: every variable's summary from the index's
table, the components of many variables read where the index places them (inspect's
comparison of mirrored components, diff and convert), and ``verify``.

:class:`BulkReads` is a base of :class:`~parallelvars.checkpoint.h5io.read.H5Reader`: these
methods read through the reader's table and its bulk read (``read_bulk``, the restore path's
rule), and open nothing one by one.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, ValuesView
from typing import TYPE_CHECKING, Any

import h5py
import numpy as np

from parallelvars._spans import BULK_BYTES, batches
from parallelvars.checkpoint import _h5policy
from parallelvars.checkpoint.h5io._global_heap import GlobalHeapCheck
from parallelvars.checkpoint.h5io.attributes import _read_json
from parallelvars.checkpoint.h5io.columns import _ABSENT, ColumnEntries, _same, _short
from parallelvars.checkpoint.h5io.layout import _H5_ERRORS, COLUMNS_DATASET, INDEX_DATASET
from parallelvars.checkpoint.h5raw.links import data_addresses, reached_members
from parallelvars.checkpoint.h5raw.source import Refused, WindowSource
from parallelvars.checkpoint.registry import component_index, component_name
from parallelvars.errors import CorruptCheckpointError

if TYPE_CHECKING:
    from parallelvars.checkpoint.h5io.index_table import IndexTable
    from parallelvars.checkpoint.h5io.stored import StoredVariable

__all__ = ["BULK_BYTES", "LINK_CHECKS", "BulkReads"]

#: Components a reader checks name by name (:meth:`BulkReads._reached`) before it lists every
#: link of the file once instead (about 10 us a link, a few times less than one lookup).
LINK_CHECKS = 256
# Dataset headers walked together by :meth:`BulkReads._list_links` (a bound on its memory).
_HEADER_BATCH = 1 << 15


class BulkReads:
    """Summaries, bulk component reads and ``verify`` over an open native file (the base of
    :class:`~parallelvars.checkpoint.h5io.read.H5Reader`, which provides what is declared
    here)."""

    path: str
    file_size: int
    table: IndexTable | None
    _metas: Mapping[str, Any]
    _variables: dict[str, StoredVariable]
    _columns: bool
    _checked_groups: set[str]
    # The names reached by hard links only (see _reached), once listed: whether each
    # component of the table is (its slots), or every name HDF5's walk lists.
    _reached_slots: np.ndarray | None = None
    _hard_names: set[bytes] | None = None
    _unlisted = False  # (the names could not be listed: not tried again for every name)
    _all_listed = False  # (every component name of the table is reached by hard links)
    _link_checks = 0

    if TYPE_CHECKING:

        def _h5(self) -> h5py.File: ...

        def _fd(self) -> int: ...

        def read_bulk(
            self, slots: np.ndarray, *, staged: bool = False
        ) -> tuple[np.ndarray, np.ndarray, list[int]]: ...

        def __getitem__(self, key: str) -> StoredVariable: ...

        def values(self) -> ValuesView[StoredVariable]: ...

    def _reached(self, name: str) -> bool:
        """Whether the object ``name`` (a component's path) exists and is reached from the
        root by hard links only: the indirection policy's rule (``_h5policy.check_path``)
        for a component read where the index places it, without opening its dataset.

        A link out of the file on the way raises as when the dataset is opened; a name that is
        missing, or reached some other way (an external link into the checkpoint's parts),
        is False: the caller opens it the general way. The first names are checked one by
        one; past :data:`LINK_CHECKS`, the links on the way to every component are listed
        once (:meth:`_list_links`) and each name looked up there.
        """
        if self._reached_slots is not None:
            return self._slot_reached(name)
        hard = self._hard_names
        if hard is not None:
            return name.encode() in hard and self._placed_by_h5(name)
        self._link_checks += 1
        f = self._h5()
        if self._link_checks > LINK_CHECKS:
            if not self._list_links():
                return False
            return self._reached(name)
        path = f"/{name}"
        if _h5policy.check_path(f.id, path, self.path, checked=self._checked_groups) is not None:
            return False
        try:
            return bool(f.id.links.exists(path.encode())) and self._placed_by_h5(name)
        except _H5_ERRORS:
            return False

    def _placed_by_h5(self, name: str) -> bool:
        """Whether the dataset ``name`` leads to (HDF5 opens it) holds its data where the
        index places the component, when the index places it (else True: nothing to agree
        with). A component whose link was re-pointed to another dataset is then read where
        HDF5 reads it, and checked against its own checksum there."""
        table = self.table
        if table is None:
            return True
        parent, _, leaf = name.rpartition("/")
        row = table.rows.get(parent)
        i = component_index(leaf)
        if row is None or i is None or i >= table.counts[row]:
            return True
        slot = int(table.first[row]) + i
        if not table.located[slot] or not table.nbytes[slot]:
            return True
        try:
            offset = h5py.h5d.open(self._h5().id, f"/{name}".encode()).get_offset()
        except _H5_ERRORS:
            return False
        return offset is not None and int(offset) == int(table.offsets[slot])

    def _slot_reached(self, name: str) -> bool:
        """:meth:`_reached` from :attr:`_reached_slots`: a name that is not one of the
        table's components is not listed there (False: opened the general way)."""
        table, slots = self.table, self._reached_slots
        assert table is not None and slots is not None
        parent, _, leaf = name.rpartition("/")
        row = table.rows.get(parent)
        if row is None:
            return False
        i = component_index(leaf)
        if i is None or i >= table.counts[row]:
            return False
        return bool(slots[int(table.first[row]) - int(table.first[0]) + i])

    def _list_links(self) -> bool:
        """List once which names of the file are reached from the root by hard links only;
        False when they cannot be listed.

        With a table, whether each of its components is (:attr:`_reached_slots`), found by
        our own walk of the groups on their way
        (:func:`~parallelvars.checkpoint.h5raw.links.reached_members`: each group's header
        checked as HDF5 would, no name made per component), and whether the dataset each
        component's link leads to holds its data where the index places it
        (:func:`~parallelvars.checkpoint.h5raw.links.data_addresses`: the datasets' headers
        read and walked together): a link re-pointed to another dataset is not read at the
        index's offset, but where HDF5 reads it, and checked there against its own checksum,
        so every reader of the file reads the same bytes. Any other name is not listed (the
        caller opens it the general way). A file that walk does not read (not written the
        way our writers write), or without a table: every name, by HDF5's link walk
        (:attr:`_hard_names`)."""
        if self._reached_slots is not None or self._hard_names is not None:
            return True
        if self._unlisted:
            return False
        table = self.table
        if table is not None:
            try:
                first = np.asarray(table.first, np.int64)
                members = [component_name(i).encode() for i in range(max(table.counts, default=0))]
                source = WindowSource(self._fd(), self.file_size)
                lo, hi = int(first[0]), int(first[len(table.names)])
                targets = np.full(hi - lo, -1, np.int64)
                reached = reached_members(
                    source,
                    [name.encode() for name in table.names],
                    members,
                    np.diff(first[: len(table.names) + 1]),
                    targets=targets,
                )
                # Where the data of the dataset each reached component leads to lies; a
                # component the index does not place, or of no bytes, has nothing to agree.
                found = np.full(hi - lo, -1, np.int64)
                heads = targets[reached]
                # (in batches: each header's first bytes are read for the walk, and those of
                # 300,000 datasets at once would be a transient of ~100 MB)
                found[reached] = np.concatenate(
                    [
                        data_addresses(source, heads[k : k + _HEADER_BATCH])
                        for k in range(0, heads.size, _HEADER_BATCH)
                    ]
                    or [heads]
                )
                located = table.located[lo:hi] & (table.nbytes[lo:hi] > 0)
                self._reached_slots = reached & (~located | (found == table.offsets[lo:hi]))
                # (every component of the table reached: nothing left to look up one by one)
                self._all_listed = bool(self._reached_slots.all())
                return True
            except (Refused, UnicodeEncodeError):  # (a name that is not text: HDF5's walk)
                pass
        names: set[bytes] = set()
        add, kind = names.add, h5py.h5l.TYPE_HARD

        def visit(link: bytes, info: Any) -> None:
            if info.type == kind:
                add(link)

        try:
            self._h5().id.links.visit(visit, info=True)
        except _H5_ERRORS:
            self._unlisted = True  # (each name is then opened the general way, which names it)
            return False
        self._hard_names = names
        return True

    def _all_reached(self, paths: list[str], counts: list[int]) -> list[bool]:
        """For each variable (``paths[k]`` of ``counts[k]`` components): whether every
        component's name is reached by hard links only (:meth:`_reached`, for many at once:
        past :data:`LINK_CHECKS` names, the links are listed once (:meth:`_list_links`) and
        each name looked up there). A link out of the file on the way is False here (the
        general path, which opens the dataset, names it)."""
        if sum(counts) <= LINK_CHECKS:
            out = []
            for path, n in zip(paths, counts, strict=True):
                try:
                    out.append(all(self._reached(f"{path}/{component_name(i)}") for i in range(n)))
                except CorruptCheckpointError:
                    out.append(False)
            return out
        if not self._list_links():
            return [False] * len(paths)
        if self._all_listed:  # (``paths`` are rows of the table, whose names are all reached)
            return [True] * len(paths)
        slots = self._reached_slots
        table = self.table
        if slots is not None and table is not None:
            return [
                (row := table.rows.get(path)) is not None
                and n <= table.counts[row]
                and bool(slots[(s := int(table.first[row]) - int(table.first[0])) : s + n].all())
                for path, n in zip(paths, counts, strict=True)
            ]
        hard = self._hard_names or set()
        suffixes = [f"/{component_name(i)}".encode() for i in range(max(counts, default=0))]
        return [
            all(
                path.encode() + suffixes[i] in hard
                and self._placed_by_h5(f"{path}/{component_name(i)}")
                for i in range(n)
            )
            for path, n in zip(paths, counts, strict=True)
        ]

    def _in_bulk(self, row: int) -> bool:
        """Whether the commands read the row ``row`` of :attr:`table` in bulk: a row the bulk
        read takes (``table.direct``, the restore's rule too) whose bytes fit one batch of
        :data:`BULK_BYTES` (a larger variable is read the general way, a chunk at a time, so a
        command's memory stays bounded whatever a variable's size)."""
        table = self.table
        return table is not None and table.direct[row] and table.row_nbytes[row] <= BULK_BYTES

    def summaries(
        self,
    ) -> dict[str, tuple[str, np.dtype, tuple[int, ...], int, int, dict[str, Any]]] | None:
        """Every variable's kind, dtype, shape, number of components, bytes and attributes
        (a dict of each variable's own, its list values shared with the index: read them, do
        not change them),
        from the index's table, validated at open: no
        :class:`~parallelvars.checkpoint.h5io.stored.StoredVariable` made for a variable that
        does not have one yet. None for a file read entry by entry (no table)."""
        if self.table is None:
            return None
        out = {}
        for name in self.table.names:
            known = self.summary(name)
            if known is not None:
                out[name] = known
        return out

    def summary(
        self, name: str
    ) -> tuple[str, np.dtype, tuple[int, ...], int, int, dict[str, Any]] | None:
        """One variable's entry of :meth:`summaries`, made when asked for (None: no table,
        no such variable, or a name that is not Unicode text: made as an entry, it names the
        error)."""
        table = self.table
        if table is None:
            return None
        row = table.rows.get(name)
        if row is None:
            return None
        if not name.isascii():
            try:
                name.encode("utf-8")
            except UnicodeEncodeError:
                return None
        kind, dtype = table.kinds[row], table.dtypes[row]
        if kind == "sharded" or dtype.kind == "O":  # (made at open: shards' own sizes)
            var = self._variables.get(name) or self[name]
            return (kind, dtype, table.shapes[row], table.counts[row], var.nbytes, dict(var.attrs))
        metas = self._metas
        attrs = (
            metas.attrs_of(row, shared=True)
            if isinstance(metas, ColumnEntries)
            else dict(metas[name]["attrs"])
        )
        return kind, dtype, table.shapes[row], table.counts[row], table.row_nbytes[row], attrs

    def differing_components(self, paths: Iterable[str]) -> dict[str, list[int]]:
        """For each variable at ``paths`` that the bulk path reads, the components whose bytes
        differ from component 0 (empty: all equal, bit for bit).

        The restore path's rule, in bulk: rows of :attr:`table` whose components the index
        places (:meth:`read_bulk`: read in file order in a few large reads, each checked
        against its checksum), every component's name reached by hard links only
        (:meth:`_reached`), at most :data:`BULK_BYTES` bytes held at a time. A variable
        missing from the result (another layout, a name reached otherwise, bytes that do not
        match their checksum) is for the caller to read component by component, which names
        any damage as before.
        """
        table = self.table
        if table is None:
            return {}
        candidates = [
            row for row in map(table.rows.get, paths) if row is not None and self._in_bulk(row)
        ]
        reached = self._all_reached(
            [table.names[row] for row in candidates], [table.counts[row] for row in candidates]
        )
        rows = [row for row, ok in zip(candidates, reached, strict=True) if ok]
        out: dict[str, list[int]] = {}
        offsets, crcs = table.offsets, table.crcs
        for batch in batches(rows, table.row_nbytes, BULK_BYTES):
            slots = table.component_slots(np.array(batch, np.int64))
            buf, at, bad = self.read_bulk(slots)
            whole = memoryview(buf)  # type: ignore[arg-type]
            broken = {table._row_of(int(slots[k])) for k in bad}
            places = at.tolist()
            slot_list = slots.tolist()
            k = 0
            for row in batch:
                n = table.counts[row]
                if row not in broken:
                    size = int(table.nbytes[slot_list[k]])
                    first = places[k]
                    primary = whole[first : first + size]
                    differing = []
                    for i in range(1, n):
                        s0, si = slot_list[k], slot_list[k + i]
                        if offsets[si] == offsets[s0]:
                            continue  # one dataset under both names (stored once)
                        # Checksums that differ: bytes that differ; equal ones: compared.
                        if (
                            crcs[si] != crcs[s0]
                            or whole[places[k + i] : places[k + i] + size] != primary
                        ):
                            differing.append(i)
                    out[table.names[row]] = differing
                k += n
        return out

    def bulk_components(
        self, paths: Iterable[str]
    ) -> Iterator[tuple[str, list[np.ndarray] | None]]:
        """Each of ``paths`` in turn with its components, read in bulk: the restore path's rule
        (:meth:`read_bulk`: rows of :attr:`table` whose components the index places, read in
        file order in a few large reads and each checked against its checksum; every name
        reached by hard links only), at most :data:`BULK_BYTES` bytes read at a time.

        The arrays are read-only views of the batch's buffer (it is freed when they are).
        None for a variable the bulk path does not take (another layout, a name reached
        otherwise, bytes that do not match their checksum): the caller reads it the general
        way (:meth:`__getitem__`), which names any damage.
        """
        table = self.table
        paths = list(paths)
        if table is None:
            for path in paths:
                yield path, None
            return
        rows = [table.rows.get(path) for path in paths]
        candidates = [r for r in rows if r is not None and self._in_bulk(r)]
        reached = self._all_reached(
            [table.names[r] for r in candidates], [table.counts[r] for r in candidates]
        )
        taken = {r for r, ok in zip(candidates, reached, strict=True) if ok}
        k = 0
        while k < len(paths):
            if rows[k] not in taken:
                yield paths[k], None
                k += 1
                continue
            run = k  # the next run of taken rows, read in batches of at most BULK_BYTES
            while k < len(paths) and rows[k] in taken:
                k += 1
            for batch in batches(rows[run:k], table.row_nbytes, BULK_BYTES):  # type: ignore[arg-type]
                yield from self._bulk_batch(batch)

    def _bulk_batch(self, batch: list[int]) -> Iterator[tuple[str, list[np.ndarray] | None]]:
        """The rows ``batch`` of :attr:`table` with their components, read at once."""
        table = self.table
        assert table is not None
        slots = table.component_slots(np.array(batch, np.int64))
        buf, at, bad = self.read_bulk(slots)
        buf.flags.writeable = False
        broken = {table._row_of(int(slots[j])) for j in bad}
        places = at.tolist()
        j = 0
        for row in batch:
            n = table.counts[row]
            if row in broken:
                yield table.names[row], None
            else:
                dtype, shape = table.dtypes[row], table.shapes[row]
                size = int(table.nbytes[slots[j]])
                yield (
                    table.names[row],
                    [
                        buf[places[j + i] : places[j + i] + size].view(dtype).reshape(shape)
                        for i in range(n)
                    ],
                )
            j += n

    def verify_all(self) -> list[str]:
        """Check every variable; the problems found (empty when sound).

        Every component's bytes against its checksum, and the file's structure as any HDF5
        reader sees it: each variable's group and attributes (equal to the index; the global
        heap objects of variable-length values validated by our own parser first), each
        component dataset read through HDF5 (its bytes again against the checksum) and a
        sharded variable's ``value`` (equal to its shards), so a file that h5py or ``extract``
        cannot read never passes.
        """
        if self._columns:
            # A file the generator wrote: its metadata regenerated from its index and compared
            # byte for byte, every checksum in bulk (nothing left for the walk below to find).
            from parallelvars.checkpoint.h5io.regenerated import sound_as_generated

            if sound_as_generated(self):
                return []
        problems = self._columns_problems() if self._columns else []
        sizes = self._h5().id.get_create_plist().get_sizes()
        heap = GlobalHeapCheck(self._fd(), self.file_size, self.path, *map(int, sizes))
        for var in self.values():
            try:
                var.verify_group(heap)
            except CorruptCheckpointError as exc:
                problems.append(str(exc))
                continue
            sound = True
            for i in range(var.num_components):
                try:
                    var.verify(i)
                    var.verify_through_h5(i)
                except CorruptCheckpointError as exc:
                    problems.append(str(exc))
                    sound = False
            if sound and var.kind == "sharded":
                try:
                    var.verify_stitched_value(heap)
                except CorruptCheckpointError as exc:
                    problems.append(str(exc))
        return problems

    def _columns_problems(self) -> list[str]:
        """Where the columns document (which the reader took) and the index disagree: each
        variable and field whose values differ, or the index's own damage."""
        try:
            index = _read_json(self._h5(), INDEX_DATASET, self.path, required=True)
        except (CorruptCheckpointError, *_H5_ERRORS) as exc:
            return [str(exc)]
        if not isinstance(index, dict):
            return [f"{self.path}: the index is not a mapping ({type(index).__name__})"]
        problems = []
        columns = self._metas

        def differ(variable: str, field: str, said: Any, says: Any) -> None:
            problems.append(
                str(
                    CorruptCheckpointError(
                        f"the columns and the index disagree on {field!r}",
                        file=self.path,
                        variable=variable,
                        expected=f"the index's {_short(said)}",
                        found=f"the columns' {_short(says)}",
                    )
                )
            )

        if list(index) != list(columns):
            extra = [p for p in columns if p not in index]
            missing = [p for p in index if p not in columns]
            for path in missing:
                differ(path, "paths", "listed", "not listed")
            for path in extra:
                differ(path, "paths", "not listed", "listed")
            if not extra and not missing:
                differ(COLUMNS_DATASET, "paths", "its order", "another order")
        for path, said in index.items():
            if path not in columns:
                continue
            says = columns[path]
            if _same(said, says):
                continue
            if not isinstance(said, dict):
                differ(path, "entry", said, says)
                continue
            for field in dict.fromkeys([*said, *says]):
                mine, theirs = said.get(field, _ABSENT), says.get(field, _ABSENT)
                if field == "attrs" and isinstance(mine, dict) and isinstance(theirs, dict):
                    for key in dict.fromkeys([*mine, *theirs]):
                        if not _same(mine.get(key, _ABSENT), theirs.get(key, _ABSENT)):
                            differ(path, f"attrs.{key}", mine.get(key), theirs.get(key))
                    if list(mine) != list(theirs):
                        differ(path, "attrs (order)", list(mine), list(theirs))
                elif not _same(mine, theirs):
                    differ(path, field, mine, theirs)
            if list(said) != list(says):
                differ(path, "entry (order)", list(said), list(says))
        return problems
