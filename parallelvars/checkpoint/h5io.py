"""Reading and writing the native HDF5 layout (version 1).

The layout (documented with an ``h5dump``-style example in ``docs/FORMAT.md``):

* root attributes ``parallelvars_format`` (= 1), ``parallelvars_version``, ``created`` and
  whatever the writer knows (``save_counter``, ``step``);
* one group per variable at its object path, with attributes ``kind``, ``dtype``, ``shape``,
  ``num_components``, ``devices``, ``aggregation``, ``synchronization``, ``trainable``,
  ``name`` and, for sharded variables, ``shard_axis`` and ``shard_offsets``;
* in it one dataset per component, ``primary`` and ``parallel_component_1`` ..., each with a
  ``crc32c`` attribute (CRC-32C of its C-order bytes) and its ``device``;
* for sharded variables a virtual dataset ``value`` stitching the shards together;
* the object graph as JSON in the dataset ``/_parallelvars/object_graph``.

bfloat16 and the float8 family are stored as HDF5 opaque types of their size, with the
``dtype`` group attribute naming them (the convention Keras uses); strings as variable-length
bytes.

Reading is lazy and fast: contiguous datasets are read through a read-only memory map of the
file, so a checksum is computed over the mapped bytes without a copy and the value is copied
once, straight into the destination buffer.
"""

from __future__ import annotations

import json
import mmap
import os
import secrets
import time
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import crc32c as _crc32c
import h5py
import numpy as np

from parallelvars._dtypes import as_dtype, dtype_name, is_extension_dtype
from parallelvars.checkpoint.registry import component_name
from parallelvars.errors import (
    ChecksumMismatchError,
    CorruptCheckpointError,
    DtypeMismatchError,
    FormatVersionError,
    NotACheckpointError,
    ShapeMismatchError,
    TruncatedFileError,
    UnsupportedDtypeError,
)

__all__ = [
    "FORMAT_VERSION",
    "META_GROUP",
    "H5Reader",
    "StoredVariable",
    "write_h5",
    "checksum",
    "is_native_checkpoint",
]

FORMAT_VERSION = 1
META_GROUP = "_parallelvars"
GRAPH_DATASET = f"{META_GROUP}/object_graph"
HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"
# deflate's best case is about 1032:1; no compressed dataset can expand more than this.
_MAX_COMPRESSION = 1100
_H5_ERRORS = (OSError, RuntimeError, KeyError, ValueError, TypeError, AttributeError)


def _library_version() -> str:
    from parallelvars import __version__

    return __version__


# ----------------------------------------------------------------------------- dtypes
def _storage_dtype(dt: np.dtype) -> np.dtype:
    if dt.kind == "O":
        return h5py.vlen_dtype(bytes)
    if is_extension_dtype(dt):
        return h5py.opaque_dtype(np.dtype(f"V{dt.itemsize}"))
    return dt.newbyteorder("<") if dt.byteorder == ">" else dt


def _byte_view(arr: np.ndarray) -> np.ndarray:
    """A flat uint8 view of a C-contiguous array (any dtype, 0-d included)."""
    return arr.reshape(-1).view(np.uint8)


def checksum(arr: np.ndarray) -> int:
    """CRC-32C of an array's C-order bytes; for byte strings, of each length (u64 LE) and bytes."""
    if arr.dtype.kind == "O":
        crc = 0
        for item in arr.reshape(-1):
            b = bytes(item)
            crc = _crc32c.crc32c(len(b).to_bytes(8, "little"), crc)
            crc = _crc32c.crc32c(b, crc)
        return crc
    a = np.ascontiguousarray(arr)
    return int(_crc32c.crc32c(_byte_view(a)))


# ----------------------------------------------------------------------------- writing
def _fsync_path(path: str, directory: bool = False) -> None:
    flags = os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if directory else 0)
    try:
        fd = os.open(path, flags)
    except OSError:
        if directory:
            return  # some platforms cannot open directories; the rename is still atomic
        raise
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temp_path_for(path: str) -> str:
    """A temporary name in the same directory, recognisable as ours (``.NAME.tmp-...``)."""
    directory, base = os.path.split(os.path.abspath(path))
    return os.path.join(directory, f".{base}.tmp-{os.getpid()}-{secrets.token_hex(4)}")


def atomic_write(path: str, write: Any) -> str:
    """Call ``write(tmp_path)``, fsync, and rename onto ``path``; remove the temporary on failure.

    A reader (or a crash) sees either the old file or the complete new one, never a torn one.
    """
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    tmp = temp_path_for(path)
    try:
        write(tmp)
        _fsync_path(tmp)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    _fsync_path(directory, directory=True)
    return path


def _attr_value(value: Any) -> Any:
    if isinstance(value, bool) or isinstance(value, np.bool_):
        return np.bool_(value)
    if isinstance(value, (int, np.integer)):
        return np.int64(value)
    if isinstance(value, (float, np.floating)):
        return np.float64(value)
    if isinstance(value, str):
        # Fixed-length bytes live inside the (checksummed) object header; variable-length
        # strings would go to the global heap, which HDF5 does not checksum and whose damage
        # can make the C library loop or crash.
        return np.bytes_(value.encode("utf-8"))
    if isinstance(value, (list, tuple)):
        if all(isinstance(v, str) for v in value):
            return np.array([v.encode("utf-8") for v in value], dtype=bytes) if value else np.zeros(0, np.int64)
        if all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in value):
            return np.asarray(value, dtype=np.int64)
    if isinstance(value, np.ndarray) and value.dtype.kind in "iuf":
        return value
    return "json:" + json.dumps(value)


def _validate_path(path: str) -> None:
    parts = path.split("/")
    if not path or path.startswith("/") or any(p in ("", ".") for p in parts) or parts[0] == META_GROUP:
        raise ValueError(f"invalid variable path {path!r} for the HDF5 layout")


def _write_entry(f: h5py.File, entry: Any, file: str) -> None:
    path = entry.path
    _validate_path(path)
    if path in f and isinstance(f[path], h5py.Group) and "kind" in f[path].attrs:
        raise ValueError(f"{file}: variable {path!r} is written twice")
    grp = f.require_group(path)
    dt = np.dtype(entry.dtype)
    storage = _storage_dtype(dt)
    shape = tuple(int(s) for s in entry.shape)
    a = grp.attrs
    a["kind"] = _attr_value(str(entry.kind))
    a["dtype"] = _attr_value(dtype_name(dt))
    a["shape"] = np.asarray(shape, dtype=np.int64)
    a["num_components"] = np.int64(entry.num_components)
    for key, value in dict(entry.attrs).items():
        if value is None or key in ("kind", "dtype", "shape", "num_components"):
            continue
        a[key] = _attr_value(value)
    devices = list(entry.attrs.get("devices") or [])
    for i in range(entry.num_components):
        arr = np.asarray(entry.component(i))
        cshape = tuple(entry.component_shape(i))
        if arr.shape != cshape:
            raise ShapeMismatchError(
                "component has the wrong shape", file=file, variable=f"{path}[{i}]", expected=cshape, found=arr.shape
            )
        if arr.dtype != dt:
            raise DtypeMismatchError(
                "component has the wrong dtype", file=file, variable=f"{path}[{i}]", expected=dt, found=arr.dtype
            )
        ds = grp.create_dataset(component_name(i), shape=cshape, dtype=storage)
        if dt.kind == "O":
            if arr.size:
                ds[...] = arr
        elif arr.size:
            src = np.ascontiguousarray(arr)
            ds.write_direct(src.view(storage) if is_extension_dtype(dt) else src)
        ds.attrs["crc32c"] = np.int64(checksum(arr))
        if i < len(devices):
            ds.attrs["device"] = _attr_value(str(devices[i]))
    if entry.kind == "sharded" and entry.num_components:
        axis = int(entry.attrs["shard_axis"])
        layout = h5py.VirtualLayout(shape=shape, dtype=storage)
        for i, start in enumerate(entry.attrs["shard_offsets"]):
            cshape = tuple(entry.component_shape(i))
            index: list[Any] = [slice(None)] * len(shape)
            index[axis] = slice(int(start), int(start) + cshape[axis])
            layout[tuple(index)] = h5py.VirtualSource(".", f"{grp.name}/{component_name(i)}", shape=cshape)
        grp.create_virtual_dataset("value", layout)


def write_h5(
    path: str | os.PathLike[str],
    entries: Iterable[Any] | Mapping[str, Any],
    *,
    object_graph: Mapping[str, Any] | None = None,
    metadata: Mapping[str, Any] | None = None,
) -> str:
    """Write entries (neutral-view entries or save records) to ``path`` in the native layout.

    Components are streamed one at a time from the entries (for live variables, straight from
    their buffers). The file appears under ``path`` only once complete and flushed to disk.

    Returns:
        ``path``.
    """
    p = os.fspath(path)
    items = list(entries.values()) if isinstance(entries, Mapping) else entries

    def write(tmp: str) -> None:
        # libver "latest": superblock v3 and v2 object headers, B-trees and heaps, which all
        # carry checksums, so a damaged metadata byte is an error rather than a wrong value.
        with h5py.File(tmp, "w", libver="latest") as f:
            f.attrs["parallelvars_format"] = np.int64(FORMAT_VERSION)
            f.attrs["parallelvars_version"] = _attr_value(_library_version())
            f.attrs["created"] = np.float64(time.time())
            for key, value in dict(metadata or {}).items():
                if value is not None:
                    f.attrs[key] = _attr_value(value)
            for entry in items:
                _write_entry(f, entry, p)
            if object_graph is not None:
                raw = json.dumps(object_graph).encode("utf-8")
                ds = f.create_dataset(GRAPH_DATASET, data=np.bytes_(raw))
                ds.attrs["crc32c"] = np.int64(_crc32c.crc32c(raw))

    return atomic_write(p, write)


# ----------------------------------------------------------------------------- reading
def _decode(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if isinstance(value, str) and value.startswith("json:"):
        try:
            return json.loads(value[5:])
        except ValueError:
            return value
    if isinstance(value, np.ndarray):
        if value.dtype.kind in ("O", "S", "U"):
            return [_decode(v) for v in value.tolist()]
        return value.tolist()
    if isinstance(value, np.bool_):
        return bool(value)
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.floating):
        return float(value)
    return value


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


class StoredVariable:
    """One variable of a checkpoint file; duck-types the neutral view's ``Entry``."""

    def __init__(self, reader: H5Reader, path: str, group: h5py.Group) -> None:
        self._reader = reader
        self.path = path
        file = reader.path
        attrs = {k: _decode(v) for k, v in group.attrs.items()}
        try:
            self.kind = str(attrs.pop("kind"))
            dname = str(attrs.pop("dtype"))
            self.shape = tuple(int(s) for s in attrs.pop("shape"))
            self.num_components = int(attrs.pop("num_components"))
        except (KeyError, TypeError, ValueError) as exc:
            raise CorruptCheckpointError(
                "variable group lacks its layout attributes", file=file, variable=path, found=str(exc)
            ) from None
        if dname == "bytes":
            self.dtype = np.dtype(object)
        else:
            try:
                self.dtype = as_dtype(dname)
            except UnsupportedDtypeError:
                raise UnsupportedDtypeError("unknown dtype", file=file, variable=path, found=dname) from None
        if self.num_components < 1 or self.num_components > 1 << 16:
            raise CorruptCheckpointError(
                "impossible number of components", file=file, variable=path, found=self.num_components
            )
        self.attrs: dict[str, Any] = attrs
        self._verified: set[int] = set()
        self._storage_ok: set[int] = set()
        self._datasets: list[h5py.Dataset] = []
        for i in range(self.num_components):
            name = component_name(i)
            ds = group.get(name)
            if not isinstance(ds, h5py.Dataset):
                raise CorruptCheckpointError(
                    f"dataset {name!r} is missing", file=file, variable=path,
                    expected=f"{self.num_components} components", found=f"no {name}",
                )
            self._datasets.append(ds)
        for i in range(self.num_components):
            expected = self._expected_component_shape(i)
            if expected is not None and tuple(self._datasets[i].shape) != expected:
                raise CorruptCheckpointError(
                    f"dataset {component_name(i)!r} has the wrong shape", file=file, variable=path,
                    expected=expected, found=tuple(self._datasets[i].shape),
                )

    def _expected_component_shape(self, i: int) -> tuple[int, ...] | None:
        if self.kind != "sharded":
            return self.shape
        try:
            axis = int(self.attrs["shard_axis"])
            offsets = [int(o) for o in self.attrs["shard_offsets"]] + [self.shape[axis]]
        except (KeyError, TypeError, ValueError, IndexError):
            raise CorruptCheckpointError(
                "sharded variable without valid shard_axis / shard_offsets", file=self._reader.path, variable=self.path
            ) from None
        if len(offsets) != self.num_components + 1:
            raise CorruptCheckpointError(
                "shard offsets do not match the components", file=self._reader.path, variable=self.path,
                expected=self.num_components, found=len(offsets) - 1,
            )
        shape = list(self.shape)
        shape[axis] = offsets[i + 1] - offsets[i]
        return tuple(shape)

    def component_shape(self, i: int) -> tuple[int, ...]:
        return tuple(self._datasets[i].shape)

    def component_nbytes(self, i: int) -> int:
        return int(np.prod(self.component_shape(i), dtype=np.int64)) * self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        return sum(self.component_nbytes(i) for i in range(self.num_components))

    @property
    def stored_checksums(self) -> list[int | None]:
        out: list[int | None] = []
        for ds in self._datasets:
            v = ds.attrs.get("crc32c")
            out.append(None if v is None else int(v))
        return out

    def _fail(self, what: str, i: int, **kw: Any) -> CorruptCheckpointError:
        return CorruptCheckpointError(what, file=self._reader.path, variable=f"{self.path}/{component_name(i)}", **kw)

    def _check_storage(self, i: int) -> None:
        """Refuse a component whose shape needs more bytes than the file can hold.

        Called before anything is allocated for it, so a damaged or hostile header cannot
        make a reader allocate more than the file's size (times the best compression ratio
        of deflate, for compressed datasets).
        """
        if i in self._storage_ok:
            return
        ds = self._datasets[i]
        size = int(np.prod(ds.shape, dtype=np.int64)) if ds.shape else 1
        per_item = 16 if self.dtype.kind == "O" else self.dtype.itemsize  # vlen: a heap id each
        needed = size * per_item
        try:
            stored = int(ds.id.get_storage_size())
            filtered = ds.id.get_create_plist().get_nfilters() > 0
            external = bool(ds.external)
        except _H5_ERRORS as exc:
            raise self._fail("cannot read the dataset layout", i, found=str(exc)) from None
        if not external and needed:
            limit = stored * _MAX_COMPRESSION if filtered else stored
            if needed > limit or stored > self._reader.file_size:
                raise TruncatedFileError(
                    "the dataset holds fewer bytes than its shape needs", file=self._reader.path,
                    variable=f"{self.path}/{component_name(i)}",
                    expected=f"{needed} bytes{' (uncompressed)' if filtered else ''}",
                    found=f"{stored} bytes stored, file of {self._reader.file_size} bytes",
                )
        self._storage_ok.add(i)

    def _mapped(self, i: int) -> np.ndarray | None:
        """The component as a read-only array over the memory-mapped file, when contiguous."""
        ds = self._datasets[i]
        if self.dtype.kind == "O":
            return None
        size = int(np.prod(ds.shape, dtype=np.int64))
        nbytes = size * self.dtype.itemsize
        if nbytes == 0:
            return np.empty(ds.shape, self.dtype)
        try:
            if ds.chunks is not None or ds.compression is not None or ds.external:
                return None
            offset = ds.id.get_offset()
            stored = ds.id.get_storage_size()
        except _H5_ERRORS:
            return None
        file_dt = ds.dtype
        if offset is None or (file_dt.kind != "V" and file_dt.byteorder == ">"):
            return None
        if stored != nbytes or file_dt.itemsize != self.dtype.itemsize:
            raise self._fail("stored size does not match the shape", i, expected=f"{nbytes} bytes", found=f"{stored} bytes")
        mm = self._reader._mmap()
        if mm is None or offset + nbytes > len(mm):
            raise TruncatedFileError(
                "file ends inside the data", file=self._reader.path, variable=f"{self.path}/{component_name(i)}",
                expected=f"{offset + nbytes} bytes", found=f"{self._reader.file_size} bytes",
            )
        return np.frombuffer(mm, dtype=self.dtype, count=size, offset=offset).reshape(ds.shape)

    def _read_h5(self, i: int) -> np.ndarray:
        self._check_storage(i)
        ds = self._datasets[i]
        try:
            data = ds[()]
        except _H5_ERRORS as exc:
            raise self._fail("cannot read the dataset", i, found=str(exc)) from None
        if self.dtype.kind == "O":
            return np.asarray(data, dtype=object).reshape(ds.shape)
        data = np.asarray(data)
        if data.dtype != self.dtype:
            data = data.view(self.dtype) if data.dtype.kind == "V" else data.astype(self.dtype.newbyteorder("="))
        return data.reshape(ds.shape)

    def _check(self, i: int, data: np.ndarray) -> None:
        expected = self.stored_checksums[i]
        if expected is None:
            raise self._fail("dataset has no crc32c attribute", i)
        found = checksum(data)
        if found != expected:
            raise ChecksumMismatchError(
                "checksum mismatch: the stored bytes are damaged",
                file=self._reader.path,
                variable=f"{self.path}/{component_name(i)}",
                expected=f"crc32c {expected:#010x}",
                found=f"crc32c {found:#010x}",
            )

    def verify(self, i: int) -> None:
        """Check component ``i``'s bytes against its stored checksum (no copy when mapped)."""
        raw = self._mapped(i)
        self._check(i, raw if raw is not None else self._read_h5(i))
        self._verified.add(i)

    def read_component_into(self, i: int, out: np.ndarray, *, verify: bool = True, cast: bool = False) -> None:
        """Read component ``i`` straight into ``out`` (same shape; same dtype unless ``cast``)."""
        if tuple(out.shape) != self.component_shape(i):
            raise ShapeMismatchError(
                "shape mismatch", file=self._reader.path, variable=self.path,
                expected=tuple(out.shape), found=self.component_shape(i),
            )
        if out.dtype != self.dtype and not cast:
            raise DtypeMismatchError(
                "dtype mismatch", file=self._reader.path, variable=self.path,
                expected=dtype_name(out.dtype), found=dtype_name(self.dtype), hint="pass allow_cast=True to convert",
            )
        raw = self._mapped(i)
        data = raw if raw is not None else self._read_h5(i)
        if verify and i not in self._verified:
            self._check(i, data)
        if out.dtype == data.dtype:
            np.copyto(out, data)
        else:
            out[...] = data.astype(out.dtype)
        del raw, data

    def component(self, i: int) -> np.ndarray:
        self._check_storage(i)
        out = np.empty(self.component_shape(i), self.dtype)
        self.read_component_into(i, out)
        return out

    def value(self) -> np.ndarray:
        from parallelvars.checkpoint._restore import read_logical_into

        for i in range(self.num_components):
            self._check_storage(i)
        out = np.empty(self.shape, self.dtype)
        read_logical_into(self, out, file=self._reader.path, cast=False)
        return out

    def __repr__(self) -> str:
        return (
            f"<StoredVariable {self.path!r} kind={self.kind} dtype={dtype_name(self.dtype)} "
            f"shape={self.shape} components={self.num_components}>"
        )


class H5Reader(Mapping[str, StoredVariable]):
    """A checkpoint file in the native layout, opened read-only: a Mapping path -> variable.

    Raises:
        FileNotFoundError: no such file.
        NotACheckpointError: not HDF5, or HDF5 without our layout.
        FormatVersionError: written by a newer, incompatible layout version.
        TruncatedFileError / CorruptCheckpointError: damaged file.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self._file: h5py.File | None = None
        self._fh: Any = None
        self._mm: mmap.mmap | None = None
        if not os.path.exists(self.path):
            raise FileNotFoundError(f"{self.path}: no such checkpoint file")
        if os.path.isdir(self.path):
            raise NotACheckpointError("is a directory, not a checkpoint file", file=self.path)
        self.file_size = os.path.getsize(self.path)
        with open(self.path, "rb") as fh:
            head = fh.read(8)
        if not h5py.is_hdf5(self.path):
            raise NotACheckpointError(
                "not an HDF5 file", file=self.path, expected=f"HDF5 signature {HDF5_SIGNATURE!r}", found=f"{head!r}"
            )
        try:
            self._file = h5py.File(self.path, "r")
        except _H5_ERRORS as exc:
            msg = str(exc)
            if "truncated" in msg.lower():
                raise TruncatedFileError("file is truncated", file=self.path, found=msg) from None
            raise CorruptCheckpointError("HDF5 file cannot be opened", file=self.path, found=msg) from None
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
            raise CorruptCheckpointError("root attributes unreadable", file=self.path, found=str(exc)) from None
        if version is None:
            raise NotACheckpointError(
                "an HDF5 file, but not a parallelvars checkpoint", file=self.path,
                expected="root attribute 'parallelvars_format'", found="none",
            )
        try:
            version = int(version)
        except (TypeError, ValueError):
            raise CorruptCheckpointError("bad format version attribute", file=self.path, found=repr(version)) from None
        if version > FORMAT_VERSION:
            raise FormatVersionError(
                "checkpoint written by a newer layout version", file=self.path,
                expected=f"version <= {FORMAT_VERSION}", found=f"version {version}",
                hint="upgrade parallelvars to read it",
            )
        self.format_version = version
        try:
            self.metadata: dict[str, Any] = {k: _decode(v) for k, v in f.attrs.items()}
            groups: list[str] = []

            def visit(name: str, obj: Any) -> None:
                if isinstance(obj, h5py.Group) and "kind" in obj.attrs and not name.startswith(META_GROUP):
                    groups.append(name)

            f.visititems(visit)
            self._variables = {name: StoredVariable(self, name, f[name]) for name in sorted(groups)}
            graph = f.get(GRAPH_DATASET)
            self.object_graph: dict[str, Any] | None = None
            if graph is not None:
                raw = graph[()]
                raw = raw if isinstance(raw, bytes) else str(raw).encode("utf-8")
                stored_crc = graph.attrs.get("crc32c")
                if stored_crc is not None and int(stored_crc) != _crc32c.crc32c(raw):
                    raise ChecksumMismatchError(
                        "checksum mismatch: the object graph is damaged", file=self.path, variable=GRAPH_DATASET,
                        expected=f"crc32c {int(stored_crc):#010x}", found=f"crc32c {_crc32c.crc32c(raw):#010x}",
                    )
                self.object_graph = json.loads(raw.decode("utf-8"))
        except (CorruptCheckpointError, UnsupportedDtypeError):
            raise
        except (*_H5_ERRORS, json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise CorruptCheckpointError("damaged file structure", file=self.path, found=str(exc)) from None

    def _mmap(self) -> mmap.mmap | None:
        if self._mm is None and self.file_size > 0:
            self._fh = open(self.path, "rb")
            self._mm = mmap.mmap(self._fh.fileno(), 0, access=mmap.ACCESS_READ)
        return self._mm

    def __getitem__(self, key: str) -> StoredVariable:
        try:
            return self._variables[key]
        except KeyError:
            from parallelvars.errors import MissingVariableError

            raise MissingVariableError("no such variable in the checkpoint", file=self.path, variable=key) from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._variables)

    def __len__(self) -> int:
        return len(self._variables)

    def verify_all(self) -> list[str]:
        """Check every component of every variable; the problems found (empty when sound)."""
        problems = []
        for var in self._variables.values():
            for i in range(var.num_components):
                try:
                    var.verify(i)
                except CorruptCheckpointError as exc:
                    problems.append(str(exc))
        return problems

    def close(self) -> None:
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:  # an array still views the map; it closes with that array
                pass
            self._mm = None
        if self._fh is not None:
            self._fh.close()
            self._fh = None
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
        return f"<H5Reader {self.path!r} variables={len(self._variables)}>"
