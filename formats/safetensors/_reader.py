"""Opening a safetensors file or shard set as a lazy :class:`~parallelvars.formats.CheckpointView`."""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from typing import IO, Any

import numpy as np

from parallelvars._fileio import load_json, open_input_file
from parallelvars.errors import (
    CheckpointNotFoundError,
    ChecksumMismatchError,
    ClosedCheckpointError,
    CorruptCheckpointError,
    TruncatedFileError,
)
from parallelvars.formats._info import StoreView, build_entries
from parallelvars.formats._json import dumps, jsonable
from parallelvars.formats._names import check_names
from parallelvars.formats._store import ByteStore, read_exact_into
from parallelvars.formats._view import CheckpointView
from parallelvars.formats.safetensors._header import read_header
from parallelvars.formats.safetensors._index import _find_index, _read_index
from parallelvars.formats.safetensors._integrity import record_header_crc
from parallelvars.formats.safetensors._layout import CRC_KEY, DEFAULT_NAMES, META_KEY, SHARDS_KEY


class _Store(ByteStore):
    """The tensors of one safetensors file or of a shard set."""

    def __init__(self, file: str, shard_files: list[str], *, within: str | None = None) -> None:
        """Open ``shard_files`` (of the index ``file``, or the one file ``file``); ``within``:
        the folder they were found in (None: the user named the file)."""
        self.file = file
        self._files = shard_files
        self.paths = list(shard_files)
        self._handles: dict[int, IO[bytes]] = {}
        self._lock = threading.Lock()
        self._tensors: dict[str, tuple[int, np.dtype, tuple[int, ...], int]] = {}
        self._crcs: dict[str, int] = {}
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
                meta, tensors, start = read_header(f, shard)
                record = meta.pop(CRC_KEY, None)
                self.shard_checked.append(record is not None)
                self.shard_crcs.append(
                    record_header_crc(record) if isinstance(record, str) else None
                )
                self.shard_metadata.append(meta)
                if self._tensors and not self._tensors.keys().isdisjoint(tensors):
                    name = next(name for name in tensors if name in self._tensors)
                    raise CorruptCheckpointError(
                        "tensor appears in two shards", file=shard, variable=name
                    )
                self._tensors.update(
                    {name: (idx, t[0], t[1], start + t[2]) for name, t in tensors.items()}
                )
                self._crcs.update({name: t[4] for name, t in tensors.items() if t[4] is not None})
        except BaseException:
            self.close()
            raise

    def keys(self) -> list[str]:
        return list(self._tensors)

    def stored(self, key: str) -> tuple[np.dtype, tuple[int, ...]]:
        _, dtype, shape, _ = self._tensors[key]
        return dtype, shape

    def _expected_crc(self, key: str) -> int | None:
        return self._crcs.get(key)

    def _place(self, key: str) -> tuple[int, int] | None:
        idx, _, _, start = self._tensors[key]
        f = self._handles.get(idx)
        return None if f is None else (f.fileno(), start)

    def _places(self, keys: Sequence[str]) -> list[tuple[int, int] | None]:
        fds = {idx: f.fileno() for idx, f in self._handles.items()}
        tensors = self._tensors
        out: list[tuple[int, int] | None] = []
        for key in keys:
            idx, _, _, start = tensors[key]
            fd = fds.get(idx)
            out.append(None if fd is None else (fd, start))
        return out

    def _expected_crcs(self, keys: Sequence[str]) -> list[int | None]:
        return list(map(self._crcs.get, keys))

    def shard_of(self, key: str) -> str:
        return self._files[self._tensors[key][0]]

    def _read_bytes(self, key: str, offset: int, buf: memoryview) -> None:
        idx, _, _, start = self._tensors[key]
        f = self._handles.get(idx)
        if f is None:
            raise ClosedCheckpointError("the checkpoint view is closed", file=self.file)
        read_exact_into(f, self._lock, start + offset, buf, file=self._files[idx], key=key)

    def close(self) -> None:
        for f in self._handles.values():
            f.close()
        self._handles.clear()


def _parse_info(raw: Any, file: str) -> dict[str, Any] | None:
    if raw is None:
        return None
    if isinstance(raw, str):
        raw = load_json(
            raw.encode("utf-8", "surrogatepass"),
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
        meta = dict(store.shard_metadata[0])
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
        entries = build_entries(store, info, names=style)
        view = StoreView(store, entries, format="safetensors", path=file, metadata=meta, info=info)
        view.files = list(dict.fromkeys([file, *store.paths]))  # the index first, then shards
        return view
    except BaseException:
        store.close()
        raise
