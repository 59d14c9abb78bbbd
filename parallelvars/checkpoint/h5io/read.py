"""Opening a native checkpoint file: :class:`H5Reader` (the index, the object graph, one
:class:`~parallelvars.checkpoint.h5io.stored.StoredVariable` per variable) and
:func:`is_native_checkpoint`. The index is parsed into a table by
:mod:`~parallelvars.checkpoint.h5io.index_table`, from the columns document by
:mod:`~parallelvars.checkpoint.h5io.columns`.
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import json
import os
import threading
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import crc32c as _crc32c
import h5py
import numpy as np

from parallelvars._spans import coalesce
from parallelvars._threads import run_in_order
from parallelvars.checkpoint import _h5policy
from parallelvars.checkpoint.h5io import staging
from parallelvars.checkpoint.h5io.attributes import _decode, _read_json
from parallelvars.checkpoint.h5io.bulk import BulkReads
from parallelvars.checkpoint.h5io.columns import ColumnEntries, _columns_table, _copied
from parallelvars.checkpoint.h5io.index_table import IndexTable, _index_table
from parallelvars.checkpoint.h5io.layout import (
    _H5_ERRORS,
    COLUMNS_DATASET,
    DOCUMENTS_ATTR,
    FORMAT_VERSION,
    GRAPH_DATASET,
    HDF5_SIGNATURE,
    INDEX_DATASET,
    META_GROUP,
    STAGE_COMPONENT,
    STAGE_GAP,
    STAGE_LIMIT,
    STAGE_MIN_COMPONENTS,
)
from parallelvars.checkpoint.h5io.stored import StoredVariable
from parallelvars.errors import (
    CheckpointNotFoundError,
    ClosedCheckpointError,
    CorruptCheckpointError,
    FormatVersionError,
    NotACheckpointError,
    TruncatedFileError,
    UnsupportedDtypeError,
)

# The object graph of a reader that does not keep it (see H5Reader.keep_entries).
_NOT_KEPT = object()
# What a JSON object of the graph decodes to when the graph is not kept.
_AN_OBJECT = object()


def _an_object(_pairs: list[tuple[str, Any]]) -> object:
    return _AN_OBJECT


def is_native_checkpoint(path: str | os.PathLike[str]) -> bool:
    """True when ``path`` is an HDF5 file with our root attribute (any version)."""
    p = os.fspath(path)
    try:
        if not os.path.isfile(p) or not h5py.is_hdf5(p):
            return False
        with h5py.File(p, "r") as f:
            return "parallelvars_format" in f.attrs
    except _H5_ERRORS:
        return False


#: Bytes read per system call when a component's checksum is taken as it is read (1 MiB: the
#: chunk is still in the CPU's cache when its CRC-32C runs).
CHECK_CHUNK = 1 << 20


#: The most bytes a restore holds in memory between checking them against their checksums and
#: copying them into the variables (docs/checkpoints.md, "A restore lands only checked
#: bytes"): the bulk path's buffer, the small components' read-ahead and the larger
#: components kept, each stored dataset counted once (the components of a mirrored variable
#: stored once are held once, and copied from there into every live component). Within it a
#: restore reads every byte once and is all or nothing whatever happens to the file after its
#: checks; past it, the rest is verified in a first pass and read again when it is copied,
#: checked there before it lands (a file changed in between is then a ConcurrentWriteError
#: naming the variables already restored). 0: nothing held, every component read twice.
RESTORE_KEEP_LIMIT = 1 << 30

#: The bytes of one task of a bulk read (:meth:`H5Reader.read_bulk`): whole components read
#: with one pread and checksummed while they are in the CPU's cache, the tasks taken in file
#: order by the restore's threads.
BULK_PIECE = 4 << 20


#: The bytes at the start of a file a restore asks the kernel for before it opens it
#: (:func:`_read_ahead`): the disk reads the first components while the index is parsed and
#: the restore planned (about 10 ms: 10 MB at 1 GB/s); a partial restore reads at most this
#: much more than it needs.
RESTORE_READ_AHEAD = 32 << 20

#: The bytes at the end of a file asked for with them: where our writers put the index, the
#: columns and the object graph, which the open reads first.
_TAIL = 1 << 20


def _read_ahead(fd: int, file_size: int, nbytes: int) -> None:
    """Ask the kernel to start reading the file's last :data:`_TAIL` bytes and its first
    ``nbytes`` into the page cache (asynchronously: nothing waits for them)."""
    tail = max(0, file_size - _TAIL)
    os.posix_fadvise(fd, tail, file_size - tail, os.POSIX_FADV_WILLNEED)
    os.posix_fadvise(fd, 0, min(nbytes, tail), os.POSIX_FADV_WILLNEED)


class H5Reader(BulkReads, Mapping[str, StoredVariable]):
    """A checkpoint file in the native layout, opened read-only: a Mapping path -> variable.

    Raises:
        FileNotFoundError: no such file.
        NotACheckpointError: not HDF5, or HDF5 without our layout.
        FormatVersionError: written by a newer, incompatible layout version.
        TruncatedFileError / CorruptCheckpointError: damaged file.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        map_file: bool = False,
        keep_entries: bool = True,
        read_ahead: int = 0,
    ) -> None:
        self.path = os.fspath(path)
        self._file: h5py.File | None = None
        self._raw_fd: int | None = None
        # map_file: accepted for compatibility; the file is never memory-mapped (a mapped file
        # truncated by another process kills the reader with SIGBUS): every read is a pread.
        del map_file
        self._local = threading.local()
        self._lock = threading.RLock()
        self._own_name: bytes | None = None
        # Parts of a multi-process checkpoint (reached by external link), opened by us.
        self._parts: dict[str, h5py.File] = {}
        self._checked_groups: set[str] = set()
        self._hard_names: set[bytes] | None = None  # (see BulkReads._reached)
        # Whether the file has empty components whose sharing verify must guess (regenerated.py)
        self._empty_shared_ambiguous = False
        self._link_checks = 0
        #: Whether a variable made from the index's table when first asked for is kept (the
        #: same object every time: a restore verifies, then copies), and the decoded object
        #: graph; a reader that walks every variable once (the commands, the format views)
        #: keeps neither (the graph is checked at open and decoded again when asked for), so
        #: its memory stays that of the index's table, whatever the number of variables.
        self.keep_entries = keep_entries
        self._graph: Any = None
        #: What the stored object graph is, checked at open: "parallelvars" (a mapping),
        #: "other" (another JSON value), or None (the file has none).
        self.graph_kind: str | None = None
        # The index's entries (path -> decoded entry) and, when they are all in our writers'
        # form, the same as arrays; a StoredVariable is made when a path is first asked for.
        self._metas: Mapping[str, Any] = {}
        self._names: list[str] = []
        # Whether the entries come from the columns document (docs/FORMAT.md).
        self._columns = False
        self.table: IndexTable | None = None
        # Small components read ahead in a few large reads (see stage()): the start of each
        # staged span, its end, and its bytes.
        self._staged: tuple[list[int], list[int], list[np.ndarray]] | None = None
        # A restore's larger components, read and verified once and kept until they are copied
        # (file offset -> bytes and their CRC-32C), the memory set aside for them (see
        # stage()), and the components read through HDF5 kept the same way ((path, component)
        # -> value).
        self._kept: dict[int, tuple[np.ndarray, int]] = {}
        self._slots: dict[int, tuple[int, int]] = {}  # offset -> (place in the arena, bytes)
        self._arena: np.ndarray | None = None
        self._kept_values: dict[tuple[str, int], np.ndarray] = {}
        self._crcs_seen: dict[int, tuple[int, int]] = {}  # offset -> (bytes, CRC-32C)
        self._reading_locks: dict[int, threading.Lock] = {}  # (see _reading)
        # The bytes a restore holds now (the bulk path's buffer, the read-ahead, the kept
        # components), against RESTORE_KEEP_LIMIT.
        self._held = 0
        self._restoring = False  # between stage() and unstage()
        # The components of a converter's next batch, read in bulk and verified (prefetch()):
        # path -> its components (read-only views of one buffer).
        self._prefetched: dict[str, list[np.ndarray]] = {}
        if not os.path.exists(self.path):
            raise CheckpointNotFoundError("no such checkpoint file", file=self.path)
        if os.path.isdir(self.path):
            raise NotACheckpointError("is a directory, not a checkpoint file", file=self.path)
        self.file_size = _h5policy.check_regular_file(self.path).st_size  # a FIFO would block
        with open(self.path, "rb") as fh:
            if read_ahead > 0 and hasattr(os, "posix_fadvise"):
                _read_ahead(fh.fileno(), self.file_size, read_ahead)
            head = fh.read(8)
        if not h5py.is_hdf5(self.path):
            raise NotACheckpointError(
                "not an HDF5 file",
                file=self.path,
                expected=f"HDF5 signature {HDF5_SIGNATURE!r}",
                found=f"{head!r}",
            )
        try:
            self._file = h5py.File(self.path, "r")
        except _H5_ERRORS as exc:
            msg = str(exc)
            if "truncated" in msg.lower():
                raise TruncatedFileError("file is truncated", file=self.path, found=msg) from None
            raise CorruptCheckpointError(
                "HDF5 file cannot be opened", file=self.path, found=msg
            ) from None
        try:
            self._load()
        except BaseException:
            self.close()
            raise

    def _load(self) -> None:
        f = self._file
        assert f is not None
        try:
            version = f.attrs.get("parallelvars_format")
        except _H5_ERRORS as exc:
            raise CorruptCheckpointError(
                "root attributes unreadable", file=self.path, found=str(exc)
            ) from None
        if version is None:
            raise NotACheckpointError(
                "an HDF5 file, but not a parallelvars checkpoint",
                file=self.path,
                expected="root attribute 'parallelvars_format'",
                found="none",
            )
        try:
            version = int(version)
        except (TypeError, ValueError):
            raise CorruptCheckpointError(
                "bad format version attribute", file=self.path, found=repr(version)
            ) from None
        if version > FORMAT_VERSION:
            raise FormatVersionError(
                "checkpoint written by a newer layout version",
                file=self.path,
                expected=f"version <= {FORMAT_VERSION}",
                found=f"version {version}",
                hint="upgrade parallelvars to read it",
            )
        self.format_version = version
        try:
            self.metadata: dict[str, Any] = {k: _decode(v) for k, v in f.attrs.items()}
            listed = self.metadata.pop(
                DOCUMENTS_ATTR, None
            )  # layout bookkeeping, not user metadata
            required = set(listed) if isinstance(listed, list) else set()
            # The object graph first: a reader that does not keep it has let its objects go
            # before the index's are made (its memory is then the larger of the two, not
            # their sum).
            # A reader that does not keep it checks that it decodes, and what it is, without
            # making its objects (each JSON object is dropped as it is decoded: at 50,000
            # variables with Adam's slots, a 14 MB graph took 110 MB to hold).
            graph = _read_json(
                f,
                GRAPH_DATASET,
                self.path,
                required=GRAPH_DATASET in required,
                object_pairs_hook=None if self.keep_entries else _an_object,
            )
            self.graph_kind = (
                None
                if graph is None
                else "parallelvars"
                if graph is _AN_OBJECT or isinstance(graph, dict)
                else "other"
            )
            self._graph = graph if graph is None or self.keep_entries else _NOT_KEPT
            del graph
            # A file that lists its columns is opened from them: the index is not decoded.
            if COLUMNS_DATASET in required and self._open_columns(
                _read_json(f, COLUMNS_DATASET, self.path, required=True)
            ):
                pass
            elif (
                metas := _read_json(f, INDEX_DATASET, self.path, required=INDEX_DATASET in required)
            ) is not None:
                if not isinstance(metas, dict):
                    raise CorruptCheckpointError("index is not a mapping", file=self.path)
                self._open_index(metas)
            else:
                groups = {
                    name: obj
                    for name, obj in _h5policy.walk(f, self.path, own_virtual="value")
                    if isinstance(obj, h5py.Group)
                    and "kind" in obj.attrs
                    and not name.startswith(META_GROUP)
                }
                self._variables = {
                    name: StoredVariable.from_group(self, name, groups[name])
                    for name in sorted(groups)
                }
                self._names = list(self._variables)
        except (CorruptCheckpointError, UnsupportedDtypeError):
            raise
        except (*_H5_ERRORS, json.JSONDecodeError, UnicodeDecodeError, AttributeError) as exc:
            raise CorruptCheckpointError(
                "damaged file structure", file=self.path, found=str(exc)
            ) from None

    @property
    def object_graph(self) -> dict[str, Any] | None:
        """The stored object graph (None: the file has none)."""
        graph = self._graph
        if graph is _NOT_KEPT:  # checked at open, not kept (keep_entries False): read again
            try:
                graph = _read_json(self._h5(), GRAPH_DATASET, self.path, required=True)
            except (*_H5_ERRORS, json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise CorruptCheckpointError(
                    "damaged file structure", file=self.path, found=str(exc)
                ) from None
        return graph

    @object_graph.setter
    def object_graph(self, graph: dict[str, Any] | None) -> None:
        self._graph = graph

    def _open_index(self, metas: dict[str, Any]) -> None:
        """Take the index: in bulk (:class:`IndexTable`) when every entry is in our writers'
        form, its unusual rows (sharded, byte strings) as StoredVariables now; otherwise one
        StoredVariable per entry, each validated as it is made (the first bad one raises)."""
        self._take(metas, _index_table(metas, self.path, self.file_size))

    def _open_columns(self, doc: Any) -> bool:
        """Take the columns document instead of the index (False: a later version of it,
        which this reader does not know; the index is read instead)."""
        built = _columns_table(doc, self.path)
        if built is None:
            return False
        table, entries = built
        self._take(entries, table)
        self._columns = True
        return True

    def _take(self, metas: Mapping[str, Any], table: IndexTable | None) -> None:
        """Take the index's entries (``metas``) and their table (None: entry by entry)."""
        self._metas = metas
        if table is None:
            self._variables = {
                name: StoredVariable(self, name, metas[name]) for name in sorted(metas)
            }
            self._names = list(self._variables)
            return
        self._names = sorted(table.names)
        self._variables = {}
        general = [
            (name, row)
            for row, (name, direct, kind, dtype) in enumerate(
                zip(table.names, table.direct, table.kinds, table.dtypes, strict=True)
            )
            if not direct and (kind == "sharded" or dtype.kind == "O")
        ]
        by_row = metas.entry if isinstance(metas, ColumnEntries) else None
        for name, row in sorted(general):  # (the first bad one in path order raises, as before)
            meta = metas[name] if by_row is None else by_row(row)  # (no lookup by path)
            self._variables[name] = StoredVariable(self, name, meta)
        if table.check_placement(self.path, self.file_size):
            self.table = table

    def _open_dataset(self, path: str, dtype: np.dtype) -> Any:
        """The dataset id at ``path`` under the indirection policy (see ``_h5policy``), its
        stored type checked for ``dtype``; None when there is no such dataset.

        A component that is an external link into this checkpoint's own ``.parts`` folder (a
        multi-process save) is opened in that part by us, after the link is validated; no
        other link is ever followed.
        """
        f = self._h5()
        link = _h5policy.check_path(
            f.id, path, self.path, checked=self._checked_groups, last_external=True
        )
        if link is None:
            try:  # the low-level open: a fraction of the cost of Group.__getitem__
                dsid = h5py.h5d.open(f.id, path.encode())
            except _H5_ERRORS:
                return None
            _h5policy.check_dataset(dsid, self.path, path.lstrip("/"), dtype=dtype)
            return dsid
        part_path = _h5policy.part_file(self.path, link, path.lstrip("/"))
        with self._lock:
            part = self._parts.get(part_path)
            if part is None:
                try:
                    part = self._parts[part_path] = h5py.File(part_path, "r")
                except _H5_ERRORS as exc:
                    raise CorruptCheckpointError(
                        "a part of the checkpoint cannot be opened",
                        file=self.path,
                        variable=path.lstrip("/"),
                        found=f"{part_path}: {exc}",
                    ) from None
        return _h5policy.open_dataset(part.id, os.fsdecode(link[1]), part_path, dtype=dtype)

    def _holds(self, dsid: Any) -> bool:
        """Whether a dataset lives in this file (not behind an external link: those are read
        through HDF5, not from this file's map)."""
        if self._own_name is None:
            self._own_name = h5py.h5f.get_name(self._h5().id)
        try:
            return bool(h5py.h5f.get_name(dsid) == self._own_name)
        except _H5_ERRORS:
            return False

    def _h5(self) -> h5py.File:
        if self._file is None:
            raise ClosedCheckpointError("the reader is closed", file=self.path)
        return self._file

    # Components may be verified and copied from several threads at once (a restore does):
    # the lazily opened descriptor is made under a lock, the read buffers are per thread.
    def _buffer(self, nbytes: int) -> np.ndarray:
        """``nbytes`` bytes to read a component into: this thread's reused buffer, or a fresh
        one for a component over 64 MiB (so a reader does not keep that much memory)."""
        if nbytes > 64 << 20:
            return np.empty(nbytes, np.uint8)
        buf: np.ndarray | None = getattr(self._local, "component", None)
        if buf is None or len(buf) < nbytes:
            buf = self._local.component = np.empty(max(nbytes, 1 << 16), np.uint8)
        return buf[:nbytes]

    def _chunk(self, nbytes: int) -> np.ndarray:
        """A reusable buffer for streamed checks: the component's size, at most 8 MiB."""
        want = min(nbytes, 8 << 20)
        buf: np.ndarray | None = getattr(self._local, "chunk", None)
        if buf is None or len(buf) < want:
            buf = self._local.chunk = np.empty(want, np.uint8)
        return buf

    def _fd(self) -> int:
        """A read-only descriptor of the file, for the reads with pread."""
        if self._raw_fd is None:
            with self._lock:
                if self._raw_fd is None:
                    fd = os.open(self.path, os.O_RDONLY)
                    if hasattr(os, "posix_fadvise"):  # read front to back: a larger readahead
                        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
                    self._raw_fd = fd
        return self._raw_fd

    def _read_fully(
        self, view: memoryview, offset: int, variable: str | None = None, *, crc: bool = False
    ) -> int:
        """Fill ``view`` with the file's bytes from ``offset`` on (a file that ends first, cut
        by someone else since it was opened, is a :class:`TruncatedFileError` naming
        ``variable``, the component read, when given). With ``crc``, the bytes are read in
        chunks of ``CHECK_CHUNK`` and their CRC-32C is taken as each chunk arrives, while it is
        in the CPU's cache, and returned (else 0)."""
        end, fd = offset + len(view), self._fd()
        step = CHECK_CHUNK if crc else len(view)
        value = 0
        while len(view):
            n = os.preadv(fd, [view[:step]], offset)
            if n <= 0:
                raise TruncatedFileError(
                    "file ends inside the data",
                    file=self.path,
                    variable=variable,
                    expected=f"{end} bytes",
                    found=f"{self.file_size} bytes",
                )
            if crc:
                value = _crc32c.crc32c(view[:n], value)
            view, offset = view[n:], offset + n
        return value

    def _crc_of(self, buf: memoryview, offset: int, nbytes: int) -> int:
        """The CRC-32C of the file's ``nbytes`` bytes at ``offset``, read into ``buf`` a
        ``len(buf)`` bytes at a time (a verify's memory stays one buffer, whatever the size)."""
        value = 0
        while nbytes:
            n = min(nbytes, len(buf))
            self._read_fully(buf[:n], offset)
            value = _crc32c.crc32c(buf[:n], value)
            offset, nbytes = offset + n, nbytes - n
        return value

    def stage(self, variables: Iterable[StoredVariable]) -> set[tuple[str, int]]:
        """Prepare a restore of ``variables``: read their small components now
        (:meth:`_stage_small`, whose verified components are returned), and set aside the
        memory the larger ones are kept in between their verification and their copy.

        The components whose place the index gives and that are not staged get a slot of one
        buffer (one allocation), first ones first, each stored dataset once (the names of a
        dataset stored once share its slot), within what ``RESTORE_KEEP_LIMIT`` leaves after
        the bytes this restore holds already (:meth:`hold`: the bulk path's);
        :meth:`StoredVariable.verify` reads each into its slot, verifies it there and keeps
        it, and the copy into the variable takes those bytes. Past the limit, a component is
        read again when it is copied and checked before it lands.
        """
        variables = list(variables)
        verified = self._stage_small(variables)
        left = RESTORE_KEEP_LIMIT - self._held
        slots: dict[int, tuple[int, int]] = {}
        total = 0
        for var in variables:
            if var.dtype.kind == "O" or var._index_offsets is None:
                continue
            for i in range(var.num_components):
                nbytes = var.component_nbytes(i)
                if nbytes == 0 or total + nbytes > left:
                    continue
                loc = var._location(i)
                if loc is None or loc[0] in slots:
                    continue
                if self._staged_bytes(loc[0], nbytes) is not None:
                    continue
                slots[loc[0]] = (total, nbytes)
                total += nbytes
        with self._lock:
            self._kept = {}
            self._slots = slots
            self._arena = staging.take(total) if total else None
            self._held += total
            self._restoring = True
        return verified

    def hold(self, nbytes: int) -> None:
        """Count ``nbytes`` more bytes held by this restore (against ``RESTORE_KEEP_LIMIT``)."""
        with self._lock:
            self._held += nbytes

    def _slot(self, offset: int, nbytes: int) -> np.ndarray | None:
        """The memory set aside for the component at ``offset`` (:meth:`stage`), or None."""
        slot = self._slots.get(offset)
        arena = self._arena
        if slot is None or arena is None or slot[1] != nbytes:
            return None
        return arena[slot[0] : slot[0] + nbytes]

    def _keep(self, offset: int, data: np.ndarray, crc: int) -> None:
        """Keep ``data``, the verified bytes at ``offset`` (their CRC-32C ``crc``), for the
        copy."""
        with self._lock:
            self._kept[offset] = (data, crc)

    def _kept_crc(self, offset: int, nbytes: int) -> int | None:
        """The CRC-32C of the ``nbytes`` bytes at ``offset`` when this restore read them
        already (another name of the same dataset: kept, or checked as they streamed past),
        else None."""
        kept = self._kept.get(offset)
        if kept is not None and kept[0].size == nbytes:
            return kept[1]
        seen = self._crcs_seen.get(offset)
        return seen[1] if seen is not None and seen[0] == nbytes else None

    def _reading(self, offset: int) -> contextlib.AbstractContextManager[object]:
        """During a restore, the lock of the dataset at ``offset``: held while one of its
        names reads and checks it, so another name verified on another thread meanwhile
        waits and takes that read's checksum (:meth:`_kept_crc`) instead of reading the
        same bytes again (into the same slot, or streamed past the limit)."""
        if not self._restoring:
            return contextlib.nullcontext()
        with self._lock:
            lock = self._reading_locks.get(offset)
            if lock is None:
                lock = self._reading_locks[offset] = threading.Lock()
        return lock

    def _note_crc(self, offset: int, nbytes: int, crc: int) -> None:
        """During a restore, remember the CRC-32C of the ``nbytes`` bytes at ``offset``, read
        and not kept (:meth:`_kept_crc`)."""
        if self._restoring:
            self._crcs_seen[offset] = (nbytes, crc)

    def _keep_copy(self, offset: int, data: np.ndarray, crc: int) -> None:
        """Keep a copy of ``data``, the verified bytes at ``offset`` (their CRC-32C ``crc``)
        read into a reused buffer, for the copy, when the restore may still hold them (a
        component found where HDF5 places it, its indexed offset stale: no memory was set
        aside for it there)."""
        if not self._restoring:
            return
        with self._lock:
            if offset in self._kept or self._held + data.nbytes > RESTORE_KEEP_LIMIT:
                return
            self._held += data.nbytes
            self._kept[offset] = (data.reshape(-1).view(np.uint8).copy(), crc)

    def _keep_value(self, key: tuple[str, int], value: np.ndarray) -> None:
        """Keep ``value``, a component read through HDF5 and verified, for the copy, when the
        restore may still hold its bytes (:meth:`stage`)."""
        if not self._restoring:
            return  # a verify, a command: nothing is kept
        size = sum(map(len, value.reshape(-1))) if value.dtype.kind == "O" else value.nbytes
        with self._lock:
            if self._held + size <= RESTORE_KEEP_LIMIT:
                self._kept_values[key] = value
                self._held += size

    def _kept_value(self, key: tuple[str, int]) -> np.ndarray | None:
        """The value :meth:`_keep_value` kept for ``key``, or None."""
        return self._kept_values.get(key)

    def _stage_small(self, variables: list[StoredVariable]) -> set[tuple[str, int]]:
        """Read the small components of ``variables`` now, with a few large reads.

        A restore of many small variables would otherwise pay two system calls per component
        (one to verify it, one to copy it). With at least ``STAGE_MIN_COMPONENTS`` of them
        (fewer save little, and one thread reading them from a cold disk can cost more than the
        restore's threads reading them in place), components under ``STAGE_COMPONENT`` bytes whose
        offsets the index gives are sorted by offset and read in spans (neighbours less than
        ``STAGE_GAP`` apart share one read), at most ``STAGE_LIMIT`` bytes in all (and what
        ``RESTORE_KEEP_LIMIT`` leaves of the bytes the restore holds); copies then
        work from memory, on the bytes that were read once. Released by :meth:`unstage`.

        The staged components whose checksums the index gives are verified here, in one pass
        over the spans (a component's crc32c over its own bytes inside the span), and marked
        verified; the returned set names them as ``(variable path, component)``, so a restore
        does not check them again. A component whose bytes do not match is left unverified:
        :meth:`StoredVariable.verify` then raises for it (or reads it where HDF5 places it,
        when the index's offset is stale), as without staging.
        """
        ranges: list[tuple[int, int, StoredVariable | None, int]] = []
        total = 0
        limit = min(STAGE_LIMIT, RESTORE_KEEP_LIMIT - self._held)
        for var in variables:
            if var.dtype.kind == "O" or var._index_offsets is None:
                continue
            crcs = var._crcs  # from the index; None: each dataset's attribute (checked later)
            for i in range(var.num_components):
                nbytes = var.component_nbytes(i)
                if 0 < nbytes < STAGE_COMPONENT and total + nbytes <= limit:
                    loc = var._location(i)  # checked against the file's size
                    if loc is not None and i in var._from_index:
                        checked = var if crcs is not None and crcs[i] is not None else None
                        ranges.append((loc[0], nbytes, checked, i))
                        total += nbytes
        if len(ranges) < STAGE_MIN_COMPONENTS:  # a few syscalls saved; serial reads would cost more
            return set()
        ranges.sort(key=lambda r: r[0])
        starts: list[int] = []
        ends: list[int] = []
        for offset, nbytes, _, _ in ranges:
            if starts and offset - ends[-1] <= STAGE_GAP and offset >= starts[-1]:
                ends[-1] = max(ends[-1], offset + nbytes)
            else:
                starts.append(offset)
                ends.append(offset + nbytes)
        if hasattr(os, "posix_fadvise"):  # every span asked for at once: the disk reads in parallel
            for start, end in zip(starts, ends, strict=True):
                os.posix_fadvise(self._fd(), start, end - start, os.POSIX_FADV_WILLNEED)
        bufs = []
        for start, end in zip(starts, ends, strict=True):
            buf = np.empty(end - start, np.uint8)
            self._read_fully(memoryview(buf), start)  # type: ignore[arg-type]
            bufs.append(buf)
        self._staged = (starts, ends, bufs)
        self.hold(sum(end - start for start, end in zip(starts, ends, strict=True)))
        # Every staged component against its checksum, span by span (ranges are in file order).
        verified: set[tuple[str, int]] = set()
        k = 0
        for offset, nbytes, owner, i in ranges:
            while offset >= ends[k]:
                k += 1
            if owner is None:
                continue
            at = offset - starts[k]
            if _crc32c.crc32c(bufs[k][at : at + nbytes]) == owner._crcs[i]:  # type: ignore[index, arg-type]
                owner._verified[i] = None
                verified.add((owner.path, i))
        return verified

    def read_bulk(
        self, slots: np.ndarray, *, staged: bool = False
    ) -> tuple[np.ndarray, np.ndarray, list[int]]:
        """Read the components at ``slots`` of :attr:`table` (direct rows' components) into
        one buffer and verify each against its checksum.

        The components are placed in file order, neighbours less than ``STAGE_GAP`` apart in
        one span of the buffer (the gaps are HDF5's object headers); the kernel is asked to
        read every span ahead at once, and the restore's threads take tasks of about
        :data:`BULK_PIECE` bytes of whole components in file order, each read with one pread
        (a larger component in chunks of ``CHECK_CHUNK``) and checksummed while it is in the
        CPU's cache. The names of a dataset stored once (a mirrored variable's components)
        sit side by side in file order: their bytes are read and checksummed once, and each
        name still answers for its own indexed checksum. Returns the buffer, where each
        slot's bytes start in it, and the positions in ``slots`` of the components whose
        bytes do not match (the caller reads those the general way: a stale offset, or the
        error naming the damage). With ``staged`` (a restore, which copies out of the buffer
        and gives it back), the buffer is staging memory (:mod:`.staging`: kept faulted in
        from one restore to the next).
        """
        table = self.table
        assert table is not None
        offsets = table.offsets[slots]
        nbytes = table.nbytes[slots]
        spans_of = coalesce(offsets, nbytes, gap=STAGE_GAP)
        order, span_starts, spans = spans_of.order, spans_of.starts, spans_of.sizes
        span_of, at_sorted = spans_of.span_of, spans_of.at
        starts, sizes = offsets[order], nbytes[order]
        ends = np.maximum.accumulate(starts + sizes)
        fd = self._fd()
        if hasattr(os, "posix_fadvise"):  # every span asked for at once: the disk reads ahead
            for start, size in zip(span_starts.tolist(), spans.tolist(), strict=True):
                os.posix_fadvise(fd, start, size, os.POSIX_FADV_WILLNEED)
        # (after the ask: new staging memory is faulted in while the disk reads)
        buf = staging.take(spans_of.total) if staged else np.empty(spans_of.total, np.uint8)
        # Tasks: the components whose start falls in one BULK_PIECE window of their span.
        window = (
            span_of * (int(spans.max(initial=0)) // BULK_PIECE + 1)
            + (starts - span_starts[span_of]) // BULK_PIECE
        )
        cuts = np.flatnonzero(np.diff(window)) + 1
        firsts = np.concatenate(([0], cuts)).tolist()
        lasts = np.concatenate((cuts, [starts.size])).tolist()
        places, lengths = at_sorted.tolist(), sizes.tolist()
        file_starts, file_ends = starts.tolist(), ends.tolist()
        found = [0] * starts.size
        whole = memoryview(buf)  # type: ignore[arg-type]
        crc, read = _crc32c.crc32c, self._read_fully

        def task(lo: int, hi: int) -> None:
            first, end = file_starts[lo], file_ends[hi - 1]
            place = places[lo]
            if hi - lo == 1 or (file_starts[hi - 1] == first and lengths[hi - 1] == end - first):
                # one component (maybe under several names): checksummed chunk by chunk
                value = read(whole[place : place + end - first], first, crc=True)
                for k in range(lo, hi):
                    found[k] = (
                        value
                        if lengths[k] == end - first
                        else crc(whole[places[k] : places[k] + lengths[k]])
                    )
                return
            read(whole[place : place + end - first], first)
            last, value = (-1, -1), 0
            for k in range(lo, hi):
                p, n = places[k], lengths[k]
                if (p, n) != last:
                    last, value = (p, n), crc(whole[p : p + n])
                found[k] = value

        run_in_order(list(map(functools.partial(functools.partial, task), firsts, lasts)))
        bad = order[np.flatnonzero(np.array(found, np.int64) != table.crcs[slots][order])]
        at = np.empty_like(at_sorted)
        at[order] = at_sorted
        return buf, at, sorted(bad.tolist())

    def prefetch(self, paths: Iterable[str]) -> None:
        """Read the components of the variables at ``paths`` now, in bulk
        (:meth:`bulk_components`: the index's places read in a few large reads, each checked
        against its checksum, every name reached by hard links only), for the reads of those
        variables that follow (:meth:`StoredVariable.read_component_into`,
        :meth:`StoredVariable.component`): a converter streaming a file's tensors in batches
        pays a few system calls per batch, not one per component. Each call replaces what the
        previous one read (the caller bounds a batch's bytes); ``prefetch(())`` drops it. A
        variable the bulk path does not take is read the general way when asked for."""
        self._prefetched = {}
        got: dict[str, list[np.ndarray]] = {}
        for path, comps in self.bulk_components(paths):
            if comps is not None:
                got[path] = comps
        self._prefetched = got

    def unstage(self, recycle: bool = True) -> None:
        """Drop what :meth:`stage` read, and what the verification kept: its staging memory is
        kept for the next restore, unless ``recycle`` is false (the restore failed or was
        interrupted: the memory is then freed, never handed to another restore while something
        may still write into it)."""
        self._staged = None
        with self._lock:
            arena = self._arena
            self._kept, self._slots, self._arena = {}, {}, None
            if recycle:
                staging.give(arena)  # (every copy out of it is done: see RestorePlan.apply)
            self._kept_values, self._held, self._restoring = {}, 0, False
            self._crcs_seen, self._reading_locks = {}, {}

    def _staged_bytes(self, offset: int, nbytes: int) -> np.ndarray | None:
        """The staged bytes ``[offset, offset + nbytes)`` of the file, when staged (or kept
        by a restore's verification)."""
        kept = self._kept.get(offset)
        if kept is not None and kept[0].size == nbytes:
            return kept[0]
        staged = self._staged
        if staged is None:
            return None
        starts, ends, bufs = staged
        k = bisect.bisect_right(starts, offset) - 1
        if k < 0 or offset + nbytes > ends[k]:
            return None
        return bufs[k][offset - starts[k] : offset - starts[k] + nbytes]

    def __getitem__(self, key: str) -> StoredVariable:
        var = self._variables.get(key)
        if var is not None:
            return var
        if key not in self._metas:
            from parallelvars.errors import MissingVariableError

            raise MissingVariableError(
                "no such variable in the checkpoint", file=self.path, variable=key
            )
        # A row of the table, validated at open: made now, once (whichever thread is first),
        # or, for a reader that does not keep them (keep_entries False), each time.
        var = self._from_table(key)
        if var is None:
            var = StoredVariable(self, key, self._metas[key])
        if not self.keep_entries:
            return var
        return self._variables.setdefault(key, var)

    def _from_table(self, key: str) -> StoredVariable | None:
        """The variable at ``key`` made from its row of :attr:`table` (None: not a row the
        table holds whole: sharded, byte strings, or no table)."""
        table = self.table
        row = table.rows.get(key) if table is not None else None
        if table is None or row is None:
            return None
        kind, dtype = table.kinds[row], table.dtypes[row]
        if kind == "sharded" or dtype.kind == "O":
            return None
        metas = self._metas
        attrs = (
            metas.attrs_of(row)
            if isinstance(metas, ColumnEntries)
            else _copied(metas[key]["attrs"])
        )
        first, end = table.first[row : row + 2].tolist()
        offsets: list[int | None] = table.offsets[first:end].tolist()
        if -1 in offsets:  # (a component the index does not place)
            offsets = [None if o is None or o < 0 else o for o in offsets]
        return StoredVariable.from_row(
            self,
            key,
            kind,
            dtype,
            table.shapes[row],
            attrs,
            offsets,
            table.crcs[first:end].tolist(),
        )

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def __contains__(self, key: object) -> bool:
        return key in self._variables or key in self._metas

    def close(self) -> None:
        # Drop the dataset ids first: those reached through external links keep their own
        # (linked) file open until they are released.
        for var in getattr(self, "_variables", {}).values():
            var._datasets.clear()
        if self._metas:  # made again from the index when asked for after closing
            # (each StoredVariable refers back to this reader: dropping them breaks the cycles,
            # so a closed reader and its index are freed at once, not by the cyclic collector)
            self._variables = {}
        if self._raw_fd is not None:
            os.close(self._raw_fd)
            self._raw_fd = None
        for part in getattr(self, "_parts", {}).values():
            try:
                part.close()
            except _H5_ERRORS:
                pass
        self._parts = {}
        if self._file is not None:
            try:
                self._file.close()
            except _H5_ERRORS:
                pass
            self._file = None

    def __enter__(self) -> H5Reader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        return f"<H5Reader {self.path!r} variables={len(self._names)}>"
