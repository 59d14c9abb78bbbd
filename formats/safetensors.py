"""safetensors: single files and Hugging Face shard sets, read lazily and written streaming.

A file is ``u64 LE N``, an N-byte JSON header (``name -> {dtype, shape, data_offsets}`` plus an
optional ``__metadata__`` of string -> string), then the tensors' raw little-endian bytes. The
reader checks the header as strictly as the reference implementation does (see FORMATS.md
2.3) before it reads or allocates any tensor: a header length beyond 100,000,000 bytes, a file
shorter than its header or data, invalid UTF-8 or JSON, duplicate names, unknown dtype strings,
offsets that overlap or leave holes, a byte size that does not match dtype and shape, and
trailing bytes each raise an error of :mod:`parallelvars.errors` naming the file and tensor.

Writing streams: the header is computed from the entries' metadata, then each tensor is read
from its source and written, one at a time. Tensors are ordered by alignment, then name, so
every tensor starts aligned to its item size (like the reference writer).

What our files hold (key style ``names``, default ``"dotted"``, see :mod:`._names`):

* every variable's primary (component 0) under the variable's own key, so
  ``safetensors.safe_open`` / ``load_file`` and ``transformers`` find ordinary tensors;
* extra components of parallel variables under ``<key>/parallel_component_<i>``;
* a sharded variable once, as its full stitched value under its key;
* ``__metadata__``: ``"format": "pt"`` (what ``transformers`` expects), the source's file
  metadata as strings, and ``"parallelvars"``: the parallel info (kinds, components, attrs,
  exact paths; see :mod:`._info`), so our reader gets back exactly what was written;
* ``__metadata__["parallelvars_crc32c"]``: integrity data that plain readers ignore, one string
  of 8-digit hex CRC-32Cs: first of a canonical description of the header (every name, dtype,
  shape, offsets and tensor CRC, and every other metadata item), then of each tensor's bytes in
  name order. The CRCs are known only once the tensors are streamed, so the header is written
  with placeholders of the same width and rewritten in place. Our reader verifies the header on
  opening and each tensor's bytes when it is read (the first partial read of a tensor checks
  the whole tensor once); a file whose parallel info says ``"checksums"`` must have the record.
  Files from other writers have none and are read as before. A shard set's index carries the
  same key in its ``metadata``: a CRC-32C of its canonical weight map and metadata.

Shard sets (``max_shard_size=``) follow the Hugging Face convention: ``model-00001-of-00002.
safetensors``, ... and ``model.safetensors.index.json`` with ``metadata.total_size`` (the sum of
the tensors' byte sizes) and ``weight_map``; the parallel info goes into the index's
``metadata.parallelvars``. A set whose tensors all fit in one shard is written as one file.

dtypes: BOOL, U8/I8..U64/I64, F16, BF16, F32, F64, C64 and the float8 types F8_E4M3
(``float8_e4m3fn``), F8_E5M2, F8_E4M3FNUZ, F8_E5M2FNUZ, F8_E8M0 (``float8_e8m0fnu``) map to
numpy / ml_dtypes dtypes bit for bit. Other fixed-size dtypes (complex128, other ml_dtypes) are
stored as their raw bytes in a ``U8`` tensor with a trailing axis of the item size and their
dtype recorded in the parallel info. The sub-byte types F4 and F6_* and string tensors are
refused with :class:`~parallelvars.errors.UnsupportedDtypeError`.
"""

from __future__ import annotations

import json
import math
import os
import struct
import threading
from collections.abc import Callable, Mapping
from typing import IO, Any

import crc32c as _crc32c
import ml_dtypes
import numpy as np

from parallelvars._fileio import DataWriter, Scratch, atomic_path, load_json
from parallelvars.errors import (
    CheckpointNotFoundError,
    ChecksumMismatchError,
    ClosedCheckpointError,
    CorruptCheckpointError,
    InvalidEntryError,
    NotACheckpointError,
    TruncatedFileError,
    UnsupportedDtypeError,
)

from ._dtypes import is_string_dtype
from ._info import StoreView, build_entries
from ._json import carried_metadata, dumps, jsonable
from ._names import check_names
from ._plan import PlannedTensor, plan_tensors
from ._registry import FormatSpec
from ._sizes import parse_size
from ._store import ByteStore, little_endian, read_exact_into
from ._view import CheckpointView, Entry

__all__ = [
    "FORMAT",
    "INDEX_NAME",
    "MAX_HEADER_SIZE",
    "open_safetensors",
    "read_header",
    "write_safetensors",
]

MAX_HEADER_SIZE = 100_000_000
INDEX_NAME = "model.safetensors.index.json"
META_KEY = "parallelvars"
#: ``__metadata__`` key of our checksums: one string of 8-digit hex CRC-32Cs, the header's
#: (of its canonical description, see _header_crc) then each tensor's bytes', in name order.
CRC_KEY = "parallelvars_crc32c"
DEFAULT_NAMES = "dotted"

# safetensors dtype string -> (numpy dtype, bits)
_DTYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "U8": np.dtype(np.uint8),
    "I8": np.dtype(np.int8),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E4M3FNUZ": np.dtype(ml_dtypes.float8_e4m3fnuz),
    "F8_E5M2FNUZ": np.dtype(ml_dtypes.float8_e5m2fnuz),
    "I16": np.dtype(np.int16),
    "U16": np.dtype(np.uint16),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I32": np.dtype(np.int32),
    "U32": np.dtype(np.uint32),
    "F32": np.dtype(np.float32),
    "C64": np.dtype(np.complex64),
    "F64": np.dtype(np.float64),
    "I64": np.dtype(np.int64),
    "U64": np.dtype(np.uint64),
}
if hasattr(ml_dtypes, "float8_e8m0fnu"):
    _DTYPES["F8_E8M0"] = np.dtype(ml_dtypes.float8_e8m0fnu)
# Known to the reference implementation but packed below a byte: refused, with a clear error.
_SUB_BYTE = {"F4": 4, "F6_E2M3": 6, "F6_E3M2": 6}
_NAME_OF = {dtype: name for name, dtype in _DTYPES.items()}


def _st_name(dtype: np.dtype) -> str | None:
    dtype = np.dtype(dtype)
    for candidate, name in _NAME_OF.items():
        if candidate == dtype and candidate.type is dtype.type:
            return name
    return None


# --------------------------------------------------------------------------------------------
# header validation


def _no_duplicates(file: str) -> Callable[[list[tuple[str, Any]]], dict[str, Any]]:
    def hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out = dict(pairs)  # one C call per object; the loop below only when a name repeats
        if len(out) != len(pairs):
            seen: set[str] = set()
            for k, _ in pairs:
                if k in seen:
                    raise CorruptCheckpointError(
                        "duplicate name in the JSON header", file=file, variable=k
                    )
                seen.add(k)
        return out

    return hook


def _tiles_exactly(
    entries: list[tuple[str, np.dtype, tuple[int, ...], int, int, int]], data_size: int
) -> bool:
    """Whether the tensors' offsets tile ``[0, data_size)`` in order with the right byte sizes,
    checked in bulk (numpy); False sends the caller to the tensor-by-tensor loop that says
    which tensor is wrong."""
    if not entries:
        return data_size == 0
    begins = [e[3] for e in entries]
    ends = [e[4] for e in entries]
    sizes = [e[5] for e in entries]
    if max(ends) > data_size or max(sizes) > data_size:
        return False  # also keeps every value below 2**63 for the arrays below
    b = np.array(begins, np.int64)
    e = np.array(ends, np.int64)
    order = np.argsort(b, kind="stable")
    b, e = b[order], e[order]
    n = np.array(sizes, np.int64)[order]
    return bool(b[0] == 0 and e[-1] == data_size and (e - b == n).all() and (b[1:] == e[:-1]).all())


def _is_uint(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def read_header(
    f: IO[bytes], file: str
) -> tuple[dict[str, str], dict[str, tuple[np.dtype, tuple[int, ...], int, int, int | None]], int]:
    """Parse and validate the header of the open safetensors file ``f``.

    When the header carries our checksum record (``__metadata__["parallelvars_crc32c"]``), the
    header is verified against it here.

    Returns:
        ``(metadata, tensors, data_start)``: ``tensors`` maps each name to (numpy dtype, shape,
        begin, end, CRC-32C of its bytes or None) with offsets relative to ``data_start``, in
        file order.

    Raises:
        TruncatedFileError, CorruptCheckpointError, ChecksumMismatchError, UnsupportedDtypeError:
        see the module doc.
    """
    size = os.fstat(f.fileno()).st_size
    if size < 8:
        raise TruncatedFileError(
            "file too short for a safetensors header length",
            file=file,
            expected=">= 8 bytes",
            found=f"{size} bytes",
        )
    f.seek(0)
    (n,) = struct.unpack("<Q", f.read(8))
    if n > MAX_HEADER_SIZE:
        raise CorruptCheckpointError(
            "safetensors header length too large",
            file=file,
            expected=f"<= {MAX_HEADER_SIZE} bytes",
            found=f"{n} bytes",
        )
    if 8 + n > size:
        raise TruncatedFileError(
            "the file ends inside the safetensors JSON header",
            file=file,
            expected=f"{8 + n} bytes",
            found=f"{size} bytes",
        )
    raw = f.read(n)
    header = load_json(
        raw,
        file=file,
        what="safetensors header",
        max_bytes=MAX_HEADER_SIZE,
        object_pairs_hook=_no_duplicates(file),
    )
    if not isinstance(header, dict):
        raise CorruptCheckpointError(
            "the safetensors header is not a JSON object",
            file=file,
            expected="an object",
            found=type(header).__name__,
        )
    metadata = header.pop("__metadata__", None)
    if metadata is None:
        metadata = {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CorruptCheckpointError(
            "__metadata__ must map strings to strings", file=file, variable="__metadata__"
        )
    entries: list[tuple[str, np.dtype, tuple[int, ...], int, int, int]] = []
    described: dict[str, tuple[str, list[int], list[int]]] = {}
    fast = _fast_entries(header, described)
    if fast is not None and _tiles_exactly(fast, size - 8 - n):
        crcs = _verify_header(file, metadata, described)
        tensors = {
            name: (dtype, shape, b, e, None if crcs is None else crcs[name])
            for name, dtype, shape, b, e, _ in fast
        }
        return metadata, tensors, 8 + n
    described.clear()
    for name, info in header.items():
        if not isinstance(info, dict):
            raise CorruptCheckpointError("tensor info is not an object", file=file, variable=name)
        dtype_str, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if not isinstance(dtype_str, str):
            raise CorruptCheckpointError(
                "tensor info has no dtype string", file=file, variable=name
            )
        if dtype_str in _SUB_BYTE:
            raise UnsupportedDtypeError(
                "sub-byte safetensors dtypes are not supported",
                file=file,
                variable=name,
                expected="a dtype of 8 bits or more",
                found=dtype_str,
            )
        if dtype_str not in _DTYPES:
            raise UnsupportedDtypeError(
                "unknown safetensors dtype",
                file=file,
                variable=name,
                expected=f"one of {', '.join(_DTYPES)}",
                found=repr(dtype_str),
            )
        if not isinstance(shape, list) or not all(_is_uint(d) for d in shape):
            raise CorruptCheckpointError(
                "shape must be a list of non-negative integers",
                file=file,
                variable=name,
                expected="[d0, d1, ...] with d >= 0",
                found=shape,
            )
        if not (
            isinstance(offsets, list) and len(offsets) == 2 and all(_is_uint(o) for o in offsets)
        ):
            raise CorruptCheckpointError(
                "data_offsets must be [begin, end]",
                file=file,
                variable=name,
                expected="two integers >= 0",
                found=offsets,
            )
        dtype = _DTYPES[dtype_str]
        nbytes = math.prod(shape) * dtype.itemsize  # Python ints: no overflow
        described[name] = (dtype_str, shape, offsets)
        entries.append((name, dtype, tuple(shape), offsets[0], offsets[1], nbytes))
    # Offsets must tile [0, end) exactly, in order: no overlap, no hole.
    expected = 0
    last = None
    for name, _dtype, _shape, begin, end, nbytes in sorted(entries, key=lambda e: (e[3], e[4])):
        last = name
        if begin < expected:
            raise CorruptCheckpointError(
                "tensor data overlaps the previous tensor",
                file=file,
                variable=name,
                expected=f"begin >= {expected}",
                found=f"begin {begin}",
            )
        if begin > expected:
            raise CorruptCheckpointError(
                "hole before the tensor's data",
                file=file,
                variable=name,
                expected=f"begin {expected}",
                found=f"begin {begin}",
            )
        if end < begin:
            raise CorruptCheckpointError(
                "data_offsets end before they begin",
                file=file,
                variable=name,
                expected="end >= begin",
                found=[begin, end],
            )
        if end - begin != nbytes:
            raise CorruptCheckpointError(
                "byte size does not match dtype and shape",
                file=file,
                variable=name,
                expected=f"{nbytes} bytes",
                found=f"{end - begin} bytes",
            )
        if 8 + n + end > size:
            raise TruncatedFileError(
                "the file ends before the tensor's data",
                file=file,
                variable=name,
                expected=f"{8 + n + end} bytes",
                found=f"{size} bytes",
            )
        expected = end
    if 8 + n + expected != size:
        raise CorruptCheckpointError(
            "trailing bytes after the last tensor",
            file=file,
            variable=last,
            expected=f"{8 + n + expected} bytes",
            found=f"{size} bytes",
        )
    crcs = _verify_header(file, metadata, described)
    tensors = {
        name: (dtype, shape, b, e, None if crcs is None else crcs[name])
        for name, dtype, shape, b, e, _ in entries
    }
    return metadata, tensors, 8 + n


def _fast_entries(
    header: Mapping[str, Any], described: dict[str, tuple[str, list[int], list[int]]]
) -> list[tuple[str, np.dtype, tuple[int, ...], int, int, int]] | None:
    """The tensors of a well-formed header, checked in bulk (one pass, no per-field calls);
    None at the first doubt, for the tensor-by-tensor checks to name the problem."""
    out = []
    dims: list[Any] = []
    offs: list[Any] = []
    dtypes = _DTYPES
    for name, info in header.items():
        if type(info) is not dict:
            return None
        shape, offsets = info.get("shape"), info.get("data_offsets")
        dtype = dtypes.get(info.get("dtype"))  # type: ignore[arg-type]
        if (
            dtype is None
            or type(shape) is not list
            or type(offsets) is not list
            or len(offsets) != 2
        ):
            return None
        dims += shape
        offs += offsets
        described[name] = (info["dtype"], shape, offsets)
        out.append((name, dtype, shape, offsets))
    # Only non-negative ints (bool is not int here, as in _is_uint).
    for values in (dims, offs):
        if values and (not set(map(type, values)) <= {int} or min(values) < 0):
            return None
    return [
        (name, dtype, tuple(shape), offsets[0], offsets[1], math.prod(shape) * dtype.itemsize)
        for name, dtype, shape, offsets in out
    ]


# --------------------------------------------------------------------------------------------
# checksums


def _header_crc(
    metadata: Mapping[str, str],
    tensors: Mapping[str, tuple[str, list[int], list[int]]],
    crcs: Mapping[str, str],
) -> str:
    """CRC-32C of a canonical description of a header: every tensor's name, dtype string,
    shape, offsets and CRC, and every metadata item but our checksum record."""
    doc = {
        "metadata": {k: v for k, v in metadata.items() if k != CRC_KEY},
        "tensors": {
            name: [dtype, list(shape), list(offsets), crcs[name]]
            for name, (dtype, shape, offsets) in tensors.items()
        },
    }
    text = json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return f"{_crc32c.crc32c(text.encode('ascii')):08x}"


def _crc_record(header_crc: str, crcs: Mapping[str, str]) -> str:
    return header_crc + "".join(crcs[name] for name in sorted(crcs))


def _index_crc(metadata: Mapping[str, Any], weight_map: Mapping[str, str]) -> str:
    """CRC-32C of a canonical description of a shard set's index (all but our checksum)."""
    doc = {
        "metadata": {k: v for k, v in metadata.items() if k != CRC_KEY},
        "weight_map": dict(weight_map),
    }
    text = json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return f"{_crc32c.crc32c(text.encode('ascii')):08x}"


def _verify_header(
    file: str,
    metadata: Mapping[str, str],
    described: Mapping[str, tuple[str, list[int], list[int]]],
) -> dict[str, int] | None:
    """Check our checksum record of a header; the tensors' CRCs, or None for a file without one.

    A file whose parallel info says it carries checksums must have the record.
    """
    raw = metadata.get(CRC_KEY)
    if raw is None:
        info = metadata.get(META_KEY)
        if info is not None and '"checksums"' in info:
            try:
                flagged = load_json(
                    info.encode("utf-8", "surrogatepass"), file=file, variable=META_KEY
                ).get("checksums")
            except (CorruptCheckpointError, AttributeError):
                flagged = None  # reported by the info parser
            if flagged:
                raise CorruptCheckpointError(
                    "the checksum record is missing",
                    file=file,
                    variable=CRC_KEY,
                    expected=f"a {CRC_KEY!r} metadata item",
                    found="none",
                )
        return None
    names = sorted(described)
    if len(raw) != 8 * (1 + len(names)) or not all(c in "0123456789abcdef" for c in raw):
        raise CorruptCheckpointError(
            "the checksum record is damaged",
            file=file,
            variable=CRC_KEY,
            expected=f"{8 * (1 + len(names))} hex digits for {len(names)} tensors",
            found=f"{raw[:80]!r}",
        )
    header = raw[:8]
    tensors = {name: raw[8 * (i + 1) : 8 * (i + 2)] for i, name in enumerate(names)}
    found = _header_crc(metadata, described, tensors)
    if found != header:
        raise ChecksumMismatchError(
            "the safetensors header does not match its checksum",
            file=file,
            variable=CRC_KEY,
            expected=f"crc32c {header}",
            found=f"crc32c {found}",
        )
    return {name: int(v, 16) for name, v in tensors.items()}


# --------------------------------------------------------------------------------------------
# reading


class _Store(ByteStore):
    """The tensors of one safetensors file or of a shard set."""

    def __init__(self, file: str, shard_files: list[str]) -> None:
        self.file = file
        self._files = shard_files
        self._handles: dict[int, IO[bytes]] = {}
        self._lock = threading.Lock()
        self._tensors: dict[str, tuple[int, np.dtype, tuple[int, ...], int]] = {}
        self._crcs: dict[str, int] = {}
        self.shard_metadata: list[dict[str, str]] = []
        self.shard_checked: list[bool] = []
        try:
            for idx, shard in enumerate(shard_files):
                f = open(shard, "rb")  # noqa: SIM115 - held open for lazy reads, closed by close()
                self._handles[idx] = f
                meta, tensors, start = read_header(f, shard)
                self.shard_checked.append(meta.pop(CRC_KEY, None) is not None)
                self.shard_metadata.append(meta)
                for name, (dtype, shape, begin, _end, crc) in tensors.items():
                    if name in self._tensors:
                        raise CorruptCheckpointError(
                            "tensor appears in two shards", file=shard, variable=name
                        )
                    self._tensors[name] = (idx, dtype, shape, start + begin)
                    if crc is not None:
                        self._crcs[name] = crc
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


def _find_index(path: str) -> str | None:
    if path.endswith(".index.json"):
        return path
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, INDEX_NAME)):
            return os.path.join(path, INDEX_NAME)
        found = sorted(n for n in os.listdir(path) if n.endswith(".safetensors.index.json"))
        if len(found) == 1:
            return os.path.join(path, found[0])
    return None


def _read_index(index: str) -> tuple[dict[str, Any], dict[str, str]]:
    size = os.path.getsize(index)
    if size > MAX_HEADER_SIZE:
        raise CorruptCheckpointError(
            "index file too large",
            file=index,
            expected=f"<= {MAX_HEADER_SIZE} bytes",
            found=f"{size} bytes",
        )
    with open(index, "rb") as f:
        raw = f.read(MAX_HEADER_SIZE + 1)
    doc = load_json(
        raw,
        file=index,
        what="shard index",
        max_bytes=MAX_HEADER_SIZE,
        object_pairs_hook=_no_duplicates(index),
    )
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise NotACheckpointError(
            "not a safetensors index: no weight_map of names to files",
            file=index,
            expected='{"weight_map": {...}}',
            found=f"keys {sorted(doc) if isinstance(doc, dict) else type(doc).__name__}",
        )
    metadata = doc.get("metadata") or {}
    if not isinstance(metadata, dict):
        raise CorruptCheckpointError("the index metadata is not an object", file=index)
    info = metadata.get(META_KEY)
    if CRC_KEY in metadata or (isinstance(info, dict) and info.get("checksums")):
        stored = metadata.get(CRC_KEY)
        found = _index_crc(metadata, weight_map)
        if stored != found:
            raise ChecksumMismatchError(
                "the index does not match its checksum",
                file=index,
                variable=CRC_KEY,
                expected=f"crc32c {stored}",
                found=f"crc32c {found}",
            )
    for shard in set(weight_map.values()):
        if os.path.basename(shard) != shard or shard in ("", ".", ".."):
            raise CorruptCheckpointError(
                "shard file names must be plain names in the index's folder",
                file=index,
                variable=shard,
            )
    return metadata, weight_map


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
    if index is None:
        single = os.path.join(p, "model.safetensors") if os.path.isdir(p) else p
        if not os.path.isfile(single):
            raise CheckpointNotFoundError("no safetensors file or index found", file=p)
        store = _Store(single, [single])
        meta = dict(store.shard_metadata[0])
        try:
            info = _parse_info(meta.pop(META_KEY, None), single)
        except BaseException:
            store.close()
            raise
        file = single
    else:
        index_meta, weight_map = _read_index(index)
        folder = os.path.dirname(index)
        shards = sorted(set(weight_map.values()))
        missing = [s for s in shards if not os.path.isfile(os.path.join(folder, s))]
        if missing:
            raise TruncatedFileError(
                "a shard listed in the index is missing", file=index, variable=missing[0]
            )
        store = _Store(index, [os.path.join(folder, s) for s in shards])
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
            if k not in ("total_size", META_KEY, CRC_KEY):
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
    except BaseException:
        store.close()
        raise
    return StoreView(store, entries, format="safetensors", path=file, metadata=meta)


# --------------------------------------------------------------------------------------------
# writing


def _storage(t: PlannedTensor, file: str) -> tuple[str, tuple[int, ...]]:
    """The safetensors dtype string and stored shape of a planned tensor."""
    if is_string_dtype(t.dtype):
        raise UnsupportedDtypeError(
            "safetensors cannot store string tensors",
            file=file,
            variable=t.entry.path,
            expected="a numeric dtype",
            found="bytes",
        )
    name = _st_name(t.dtype)
    if name is not None:
        return name, t.shape
    if t.dtype.kind not in "biufcV" or t.dtype.itemsize == 0:
        raise UnsupportedDtypeError(
            "safetensors cannot store this dtype",
            file=file,
            variable=t.entry.path,
            expected="a numeric dtype",
            found=str(t.dtype),
        )
    return "U8", (*t.shape, t.dtype.itemsize)  # raw bytes; the dtype goes into the parallel info


def _header_bytes(
    metadata: dict[str, str],
    described: dict[str, tuple[str, list[int], list[int]]],
    crcs: dict[str, str],
    path: str,
) -> bytes:
    meta = dict(metadata)
    meta[CRC_KEY] = _crc_record(_header_crc(metadata, described, crcs), crcs)
    header: dict[str, Any] = {"__metadata__": meta}
    for name, (dtype, shape, offsets) in described.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": offsets}
    raw = dumps(header).encode("utf-8")
    raw += b" " * (-len(raw) % 8)  # the buffer starts 8-byte aligned, as the reference writes it
    if len(raw) > MAX_HEADER_SIZE:
        raise InvalidEntryError(
            f"{path}: the safetensors header would be {len(raw)} bytes, over the "
            f"{MAX_HEADER_SIZE} bytes readers accept; write a shard set or fewer tensors"
        )
    return raw


def _write_one(path: str, tensors: list[PlannedTensor], metadata: dict[str, str]) -> None:
    """Write one file. The header carries the tensors' CRC-32Cs, known only once they are
    streamed: it is written with fixed-width placeholders first and rewritten in place."""
    stored = [(t, *_storage(t, path)) for t in tensors]
    stored.sort(key=lambda s: (-_DTYPES[s[1]].itemsize, s[0].key))
    described: dict[str, tuple[str, list[int], list[int]]] = {}
    offset = 0
    for t, st, shape in stored:
        described[t.key] = (st, list(shape), [offset, offset + t.nbytes])
        offset += t.nbytes
    crcs = {t.key: "00000000" for t, _st, _shape in stored}
    raw = _header_bytes(metadata, described, crcs, path)
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(raw)))
            f.write(raw)
        data_start = 8 + len(raw)
        # The tensors' bytes, each checksummed as it is written (see DataWriter).
        writer, scratch, ok = DataWriter(tmp, path), Scratch(), False
        try:
            for t, _st, _shape in stored:
                array = little_endian(t.read_with(scratch))
                if array.nbytes != t.nbytes:  # the source lied about its shape
                    raise CorruptCheckpointError(
                        "component has another size than declared",
                        file=path,
                        variable=t.entry.path,
                        expected=f"{t.nbytes} bytes",
                        found=f"{array.nbytes} bytes",
                    )
                crcs[t.key] = f"{writer.write(array, data_start + described[t.key][2][0]):08x}"
            ok = True
        finally:
            writer.close(raise_errors=ok)
        final = _header_bytes(metadata, described, crcs, path)
        if len(final) != len(raw):  # cannot happen: every CRC is 8 hex digits
            raise AssertionError(f"{path}: the safetensors header changed length")
        with open(tmp, "r+b") as f:
            f.seek(8)
            f.write(final)


def _str_metadata(metadata: Mapping[str, Any]) -> dict[str, str]:
    out = {}
    for k, v in carried_metadata(metadata, META_KEY, CRC_KEY, "total_size").items():
        out[k] = v if isinstance(v, str) else dumps(jsonable(v))
    return out


def write_safetensors(
    path: str | os.PathLike[str],
    entries: Mapping[str, Entry],
    *,
    names: str = DEFAULT_NAMES,
    max_shard_size: int | str | None = None,
    metadata: Mapping[str, Any] | None = None,
) -> str:
    """Write ``entries`` as safetensors, streaming one tensor at a time.

    Args:
        path: the output ``.safetensors`` file (or a folder: ``model.safetensors`` in it). With
            ``max_shard_size``, shards are named after it (``model-00001-of-00003.safetensors``)
            and the index is ``<path>.index.json``.
        entries: the entries (a view from another format, or :class:`ArrayEntry` objects).
        names: key style, ``"dotted"`` (default), ``"slash"`` or ``"tf"``.
        max_shard_size: largest shard in bytes (or ``"500MB"``, ``"2GiB"``); a tensor larger
            than this gets a shard of its own.
        metadata: file metadata (default: the source view's), stored as strings.

    Returns:
        The file written, or the index file of a shard set.
    """
    p = os.fspath(path)
    if os.path.isdir(p) or p.endswith(("/", os.sep)):  # a folder: Hugging Face's names inside
        p = os.path.join(p, "model.safetensors")
    if p.endswith(".index.json"):
        p = p[: -len(".index.json")]
        force_index = True
    else:
        force_index = False
    if metadata is None:
        metadata = getattr(entries, "metadata", None) or {}
    planned, info = plan_tensors(
        entries, names=names, needs_record=lambda e: _st_name(e.dtype) is None, file=p
    )
    info["checksums"] = "crc32c"  # every file written carries CRC_KEY; its loss is damage
    for t in planned:
        _storage(t, p)  # refuse what cannot be stored before writing anything
    meta = {"format": "pt", **_str_metadata(metadata)}
    limit = parse_size(max_shard_size) if max_shard_size is not None else None
    shards: list[list[PlannedTensor]] = [[]]
    size = 0
    for t in planned:
        if limit is not None and shards[-1] and size + t.nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    if len(shards) == 1 and not force_index:
        meta[META_KEY] = dumps(info)
        _write_one(p, planned, meta)
        return p
    folder = os.path.dirname(os.path.abspath(p))
    stem = os.path.basename(p)
    stem = stem[: -len(".safetensors")] if stem.endswith(".safetensors") else stem
    weight_map: dict[str, str] = {}
    for i, tensors in enumerate(shards, 1):
        name = f"{stem}-{i:05d}-of-{len(shards):05d}.safetensors"
        _write_one(os.path.join(folder, name), tensors, meta)
        weight_map.update((t.key, name) for t in tensors)
    index_meta: dict[str, Any] = {"total_size": sum(t.nbytes for t in planned), META_KEY: info}
    weight_map = dict(sorted(weight_map.items()))
    index_meta[CRC_KEY] = _index_crc(index_meta, weight_map)
    index = {"metadata": index_meta, "weight_map": weight_map}
    index_path = f"{os.path.join(folder, os.path.basename(p))}.index.json"
    with atomic_path(index_path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        json.dump(index, f, indent=2, ensure_ascii=False)
        f.write("\n")
    return index_path


# --------------------------------------------------------------------------------------------
# detection


def sniff(path: str, head: bytes) -> bool:
    """True for a safetensors file, a safetensors index, or a folder holding one."""
    if os.path.isdir(path):
        return _find_index(path) is not None or os.path.isfile(
            os.path.join(path, "model.safetensors")
        )
    if path.endswith(".index.json"):
        return b'"weight_map"' in head and (
            path.endswith(".safetensors.index.json") or b".safetensors" in head
        )
    if len(head) < 10:
        return False
    (n,) = struct.unpack("<Q", head[:8])
    try:
        size = os.path.getsize(path)
    except OSError:
        return False
    if n < 2 or n > MAX_HEADER_SIZE or 8 + n > size:
        return False
    return head[8:].lstrip(b" \t\r\n").startswith(b"{")


FORMAT = FormatSpec(
    name="safetensors",
    description="safetensors file or Hugging Face shard set (model.safetensors.index.json)",
    suffixes=(".safetensors", ".safetensors.index.json"),
    sniff=sniff,
    open=open_safetensors,
    write=write_safetensors,
    options={
        "names": "key style: dotted (default), slash or tf",
        "max_shard_size": "split into Hugging Face shards of at most this size (e.g. 5GB)",
    },
)
