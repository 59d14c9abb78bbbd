"""Opening a safetensors file or shard set as a lazy :class:`~parallelvars.formats.CheckpointView`."""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from typing import IO, Any

import numpy as np

from parallelvars._fileio import load_json, open_input_file
from parallelvars.checkpoint._gcfreeze import freeze_made_so_far
from parallelvars.errors import (
    CheckpointNotFoundError,
    ChecksumMismatchError,
    ClosedCheckpointError,
    CorruptCheckpointError,
    TruncatedFileError,
)
from parallelvars.formats._info import StoreView, entry_table, take_graph
from parallelvars.formats._json import dumps, jsonable
from parallelvars.formats._names import check_names
from parallelvars.formats._store import ByteStore, read_exact_into, read_spans
from parallelvars.formats._view import CheckpointView
from parallelvars.formats.safetensors._header import read_header_columns
from parallelvars.formats.safetensors._index import _find_index, _read_index
from parallelvars.formats.safetensors._integrity import record_header_crc
from parallelvars.formats.safetensors._layout import CRC_KEY, DEFAULT_NAMES, META_KEY, SHARDS_KEY


class _Store(ByteStore):
    """The tensors of one safetensors file or of a shard set, held as columns (every shard's
    tensors in turn, each in file order): names, numpy dtypes, shapes, and in int64 arrays
    each tensor's shard, absolute byte offset, byte count and CRC-32C (-1: none)."""

    def __init__(self, file: str, shard_files: list[str], *, within: str | None = None) -> None:
        """Open ``shard_files`` (of the index ``file``, or the one file ``file``); ``within``:
        the folder they were found in (None: the user named the file)."""
        self.file = file
        self._files = shard_files
        self.paths = list(shard_files)
        self._handles: dict[int, IO[bytes]] = {}
        self._lock = threading.Lock()
        self._names: list[str] = []
        self._dtypes: list[np.dtype] = []
        self._shapes: list[tuple[int, ...]] = []
        self._pos: dict[str, int] = {}
        shard_cols: list[np.ndarray] = []
        start_cols: list[np.ndarray] = []
        size_cols: list[np.ndarray] = []
        crc_cols: list[np.ndarray] = []
        self.shard_metadata: list[dict[str, str]] = []
        self.shard_checked: list[bool] = []
        self.shard_crcs: list[str | None] = []  # each header's CRC-32C, from its record
        try:
            for idx, shard in enumerate(shard_files):
                try:  # held open for lazy reads, closed by close()
                    f = open_input_file(
                        shard, within=within, referrer=None if shard == file else file
                    )
                except CheckpointNotFoundError:
                    if shard == file:
                        raise
                    raise TruncatedFileError(
                        "a shard listed in the index is missing",
                        file=file,
                        variable=os.path.basename(shard),
                    ) from None
                self._handles[idx] = f
                meta, cols, start = read_header_columns(f, shard)
                record = meta.pop(CRC_KEY, None)
                self.shard_checked.append(record is not None)
                self.shard_crcs.append(
                    record_header_crc(record) if isinstance(record, str) else None
                )
                self.shard_metadata.append(meta)
                base = len(self._names)
                self._pos.update(zip(cols.names, range(base, base + len(cols.names)), strict=True))
                if len(self._pos) != base + len(cols.names):
                    seen = set(self._names)
                    name = next(name for name in cols.names if name in seen)
                    raise CorruptCheckpointError(
                        "tensor appears in two shards", file=shard, variable=name
                    )
                self._names.extend(cols.names)
                self._dtypes.extend(cols.dtypes)
                self._shapes.extend(cols.shapes)
                shard_cols.append(np.full(len(cols.names), idx, np.int64))
                start_cols.append(cols.begins + start)
                size_cols.append(cols.ends - cols.begins)
                crc_cols.append(
                    np.full(len(cols.names), -1, np.int64) if cols.crcs is None else cols.crcs
                )
        except BaseException:
            self.close()
            raise
        empty = np.empty(0, np.int64)
        self._shard = np.concatenate(shard_cols) if shard_cols else empty
        self._start = np.concatenate(start_cols) if start_cols else empty
        self._size = np.concatenate(size_cols) if size_cols else empty
        self._crc = np.concatenate(crc_cols) if crc_cols else empty

    def keys(self) -> list[str]:
        return list(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def position(self, key: str) -> int:
        """Where tensor ``key`` is in the columns (KeyError: the store has no such tensor)."""
        return self._pos[key]

    def positions(self, keys: Sequence[str]) -> np.ndarray:
        """:meth:`position` of each of ``keys`` (int64)."""
        return np.fromiter(map(self._pos.__getitem__, keys), np.int64, len(keys))

    def stored(self, key: str) -> tuple[np.dtype, tuple[int, ...]]:
        i = self._pos[key]
        return self._dtypes[i], self._shapes[i]

    def stored_columns(self) -> tuple[list[np.dtype], list[tuple[int, ...]]]:
        """Every tensor's dtype and shape, in column order (the store's own lists: read
        them, do not change them)."""
        return self._dtypes, self._shapes

    def _expected_crc(self, key: str) -> int | None:
        crc = int(self._crc[self._pos[key]])
        return None if crc < 0 else crc

    def _place(self, key: str) -> tuple[int, int] | None:
        i = self._pos[key]
        f = self._handles.get(int(self._shard[i]))
        return None if f is None else (f.fileno(), int(self._start[i]))

    def _places(self, keys: Sequence[str]) -> list[tuple[int, int] | None]:
        fds = {idx: f.fileno() for idx, f in self._handles.items()}
        pos = self.positions(keys)
        return [
            None if fd is None else (fd, start)
            for fd, start in zip(
                map(fds.get, self._shard[pos].tolist()), self._start[pos].tolist(), strict=True
            )
        ]

    def _expected_crcs(self, keys: Sequence[str]) -> list[int | None]:
        return [None if c < 0 else c for c in self._crc[self.positions(keys)].tolist()]

    def read_positions(self, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The bytes of the tensors at column positions ``pos``, read together
        (:func:`read_spans`: each file's ranges in offset order, near neighbours in one
        ``pread``) and each checked against its CRC-32C where the file carries one.

        Returns ``(buf, at, ok)``: tensor ``k``'s bytes are ``buf[at[k] : at[k] + size]``
        where ``ok[k]``; False for one the file does not hold whole, whose bytes do not
        match their checksum, or of a closed view: the caller reads that one through
        :meth:`read_into`, which names the damage."""
        fds = np.full(len(self._files), -1, np.int64)
        for idx, f in self._handles.items():
            fds[idx] = f.fileno()
        return read_spans(fds[self._shard[pos]], self._start[pos], self._size[pos], self._crc[pos])

    def read_many(self, keys: Sequence[str], sizes: Sequence[int]) -> list[np.ndarray | None]:
        pos = self.positions(keys)
        if not np.array_equal(self._size[pos], np.asarray(sizes, np.int64).reshape(-1)):
            return super().read_many(keys, sizes)  # (sizes other than the file's: as asked)
        buf, at, ok = self.read_positions(pos)
        out: list[np.ndarray | None] = [None] * len(keys)
        for k, a, n in zip(
            np.flatnonzero(ok).tolist(), at[ok].tolist(), self._size[pos][ok].tolist(), strict=True
        ):
            out[k] = buf[a : a + n]
        return out

    def shard_of(self, key: str) -> str:
        return self._files[int(self._shard[self._pos[key]])]

    def _read_bytes(self, key: str, offset: int, buf: memoryview) -> None:
        i = self._pos[key]
        idx = int(self._shard[i])
        f = self._handles.get(idx)
        if f is None:
            raise ClosedCheckpointError("the checkpoint view is closed", file=self.file)
        start = int(self._start[i])
        read_exact_into(f, self._lock, start + offset, buf, file=self._files[idx], key=key)

    def close(self) -> None:
        for f in self._handles.values():
            f.close()
        self._handles.clear()


def _parse_info(raw: Any, file: str) -> dict[str, Any] | None:
    if raw is None:
        return None
    if isinstance(raw, str):
        # (the text is held once while it is parsed, as these bytes: not also as the str)
        data, raw = raw.encode("utf-8", "surrogatepass"), None
        raw = load_json(
            data,
            file=file,
            variable=META_KEY,
            what="parallelvars metadata",
        )
    if not isinstance(raw, dict):
        raise CorruptCheckpointError(
            "the parallelvars metadata is not an object", file=file, variable=META_KEY
        )
    return raw


def open_safetensors(path: str | os.PathLike[str], *, names: str | None = None) -> CheckpointView:
    """Open a safetensors file, a shard set's index, or a folder holding either.

    Args:
        path: a ``.safetensors`` file, a ``*.safetensors.index.json`` file, or a folder with
            ``model.safetensors.index.json`` or ``model.safetensors``.
        names: how to map keys that the file's parallel info does not list to our paths
            (default: the style recorded in the file, else ``"dotted"``).
    """
    p = os.fspath(path)
    index = _find_index(p)
    # Files found in a folder (the index of a folder, every shard) are held to the rule of
    # every file a reader opens: regular files, no symbolic link out of the folder.
    found_in = p if os.path.isdir(p) else None
    if index is None:
        single = os.path.join(p, "model.safetensors") if found_in is not None else p
        if not os.path.lexists(single):
            raise CheckpointNotFoundError("no safetensors file or index found", file=p)
        store = _Store(single, [single], within=found_in)
        # (the columns, kept for the view's life, out of the collector's walks while the info
        # is parsed, inside a command that freezes what it keeps: see _gcfreeze)
        freeze_made_so_far()
        # (the info's text taken out of the store's metadata: held once parsed, not twice)
        meta = store.shard_metadata[0]
        try:
            info = _parse_info(meta.pop(META_KEY, None), single)
        except BaseException:
            store.close()
            raise
        file = single
    else:
        index_meta, weight_map = _read_index(index, within=found_in)
        folder = os.path.dirname(index) or os.curdir
        shards = sorted(set(weight_map.values()))
        store = _Store(index, [os.path.join(folder, s) for s in shards], within=folder)
        try:
            raw_info = index_meta.get(META_KEY)
            if isinstance(raw_info, dict) and raw_info.get("checksums"):
                for shard, checked in zip(shards, store.shard_checked, strict=True):
                    if not checked:
                        raise CorruptCheckpointError(
                            "the shard has no checksum record",
                            file=os.path.join(folder, shard),
                            variable=CRC_KEY,
                            expected=f"a {CRC_KEY!r} metadata item",
                            found="none",
                        )
            written = index_meta.get(SHARDS_KEY)
            if written is not None:  # each shard must be the one the index was written with
                for shard, crc in zip(shards, store.shard_crcs, strict=True):
                    want = written.get(shard) if isinstance(written, dict) else None
                    if want != crc:
                        raise ChecksumMismatchError(
                            "the shard is not the one its index was written with",
                            file=os.path.join(folder, shard),
                            variable=SHARDS_KEY,
                            expected=f"header crc32c {want}",
                            found=f"header crc32c {crc}",
                            hint=f"listed by {index}",
                        )
            listed = set(weight_map)
            stored_keys = store.keys()
            for key in stored_keys:
                if key not in listed:
                    raise CorruptCheckpointError(
                        "tensor is in a shard but not in the index",
                        file=store.shard_of(key),
                        variable=key,
                    )
                if os.path.basename(store.shard_of(key)) != weight_map[key]:
                    raise CorruptCheckpointError(
                        "tensor is in another shard than the index says",
                        file=store.shard_of(key),
                        variable=key,
                        expected=weight_map[key],
                        found=os.path.basename(store.shard_of(key)),
                    )
            absent = listed - set(stored_keys)
            if absent:
                name = sorted(absent)[0]
                raise CorruptCheckpointError(
                    "tensor listed in the index is missing from its shard",
                    file=os.path.join(folder, weight_map[name]),
                    variable=name,
                )
        except BaseException:
            store.close()
            raise
        meta = {}
        for m in store.shard_metadata:
            meta.update(m)
        meta.pop(META_KEY, None)
        for k, v in index_meta.items():
            if k not in ("total_size", META_KEY, CRC_KEY, SHARDS_KEY):
                meta.setdefault(k, v if isinstance(v, str) else dumps(jsonable(v)))
        try:
            info = _parse_info(index_meta.get(META_KEY), index)
        except BaseException:
            store.close()
            raise
        file = index
    try:
        style = check_names(names or (info or {}).get("names") or DEFAULT_NAMES)
        graph = take_graph(info, file)  # (its objects let go before the entries are built)
        freeze_made_so_far()
        entries = entry_table(store, info, names=style)
        view = StoreView(
            store, entries, format="safetensors", path=file, metadata=meta, info=info, graph=graph
        )
        view.files = list(dict.fromkeys([file, *store.paths]))  # the index first, then shards
        return view
    except BaseException:
        store.close()
        raise
