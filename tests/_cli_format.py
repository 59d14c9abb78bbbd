"""A small checkpoint format used only by the command-line tests.

It keeps every kind, attribute and dtype the neutral view can hold, so that the CLI can be
tested end to end on real files before (and independently of) the production adapters. A file
is an uncompressed zip written by ``numpy.savez``: ``__pvtest__.npy`` holds a JSON header
(as uint8), and ``<i>.npy`` the raw bytes of the i-th component. The zip's own CRC-32 catches
damaged bytes; a file cut short loses its zip directory.

Registered under the name ``pvtest`` (suffix ``.pvt``) by the ``pvtest`` fixture of the tests.
"""

from __future__ import annotations

import json
import os
import zipfile
from collections.abc import Iterator, Mapping
from typing import Any

import ml_dtypes  # noqa: F401 - registers bfloat16 and float8 names with numpy
import numpy as np
from parallelvars.formats import CheckpointView, Entry, FormatSpec

from parallelvars.errors import ChecksumMismatchError, NotACheckpointError, TruncatedFileError

_HEADER = "__pvtest__"


def _sniff(path: str, head: bytes) -> bool:
    if not head.startswith(b"PK\x03\x04"):
        return False
    try:
        with zipfile.ZipFile(path) as z:
            return f"{_HEADER}.npy" in z.namelist()
    except (zipfile.BadZipFile, OSError):
        return False


class _PvEntry(Entry):
    def __init__(self, view: _PvView, meta: dict[str, Any]) -> None:
        self._view = view
        self.path = meta["path"]
        self._string = meta["dtype"] == "string"
        self.dtype = np.dtype(object) if self._string else np.dtype(meta["dtype"])
        self.shape = tuple(meta["shape"])
        self.kind = meta["kind"]
        self.attrs = meta["attrs"]
        self._members = meta["members"]
        self._shapes = [tuple(s) for s in meta["component_shapes"]]
        self.num_components = len(self._members)

    def component_shape(self, i: int) -> tuple[int, ...]:
        self._check_index(i)
        return self._shapes[i]

    def component(self, i: int) -> np.ndarray:
        self._check_index(i)
        try:
            raw = self._view._npz[self._members[i]]
        except zipfile.BadZipFile as exc:
            raise ChecksumMismatchError(
                f"component {i} is damaged ({exc})", file=self._view.path, variable=self.path
            ) from exc
        if self._string:
            return np.array(list(raw.tolist()), dtype=object).reshape(self._shapes[i])
        return raw.view(self.dtype).reshape(self._shapes[i]).copy()


class _PvView(CheckpointView):
    def __init__(self, path: str) -> None:
        self.path = path
        self.format = "pvtest"
        self._file = open(path, "rb")  # noqa: SIM115 - closed by close(), or here on error
        try:
            self._npz = np.load(self._file, allow_pickle=False)
            header = json.loads(bytes(self._npz[_HEADER]).decode())
        except zipfile.BadZipFile as exc:
            self._file.close()
            raise TruncatedFileError(
                "the file ends before its zip directory",
                file=path,
                expected="a complete zip archive",
                found=f"{os.path.getsize(path)} bytes",
            ) from exc
        except (KeyError, ValueError) as exc:
            self._file.close()
            raise NotACheckpointError("not a pvtest checkpoint", file=path) from exc
        self.metadata = header["metadata"]
        self._entries = {m["path"]: _PvEntry(self, m) for m in header["entries"]}

    def __getitem__(self, key: str) -> Entry:
        return self._entries[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def close(self) -> None:
        self._npz.close()
        self._file.close()


def _open(path: str, **options: Any) -> CheckpointView:
    return _PvView(path)


def _write(
    path: str, entries: Mapping[str, Entry], metadata: Mapping[str, Any] | None = None
) -> str:
    arrays: dict[str, np.ndarray] = {}
    metas = []
    for key in entries:
        entry = entries[key]
        members = []
        for i in range(entry.num_components):
            value = entry.component(i)
            name = str(len(arrays))
            if entry.dtype.kind == "O":
                arrays[name] = np.array(value.ravel().tolist(), dtype="S")
            else:
                arrays[name] = np.ascontiguousarray(value).view(np.uint8).ravel()
            members.append(name)
        metas.append(
            {
                "path": entry.path,
                "dtype": "string" if entry.dtype.kind == "O" else entry.dtype.name,
                "shape": list(entry.shape),
                "kind": entry.kind,
                "attrs": dict(entry.attrs),
                "members": members,
                "component_shapes": [
                    list(entry.component_shape(i)) for i in range(entry.num_components)
                ],
            }
        )
    header = {"metadata": dict(metadata or {}), "entries": metas}
    arrays[_HEADER] = np.frombuffer(json.dumps(header).encode(), dtype=np.uint8)
    with open(path, "wb") as f:
        np.savez(f, **arrays)
    return path


FORMAT = FormatSpec(
    name="pvtest",
    description="test-only zip of raw components with a JSON header",
    suffixes=(".pvt",),
    sniff=_sniff,
    open=_open,
    write=_write,
)
