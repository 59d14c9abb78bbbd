"""The strict validation of a safetensors header (FORMATS.md 2.3) before any tensor is read
or allocated.
"""

from __future__ import annotations

import math
import os
import re
import struct
from collections.abc import Callable, Mapping, Sequence
from itertools import chain
from operator import attrgetter, itemgetter, mul
from typing import IO, Any, NamedTuple

import numpy as np

from parallelvars._fileio import load_json
from parallelvars._ints import is_index
from parallelvars.errors import (
    CorruptCheckpointError,
    ParallelVarsError,
    TruncatedFileError,
    UnsupportedDtypeError,
)
from parallelvars.formats.safetensors._dtypes import _DTYPES, _SUB_BYTE
from parallelvars.formats.safetensors._integrity import _record_crcs
from parallelvars.formats.safetensors._layout import MAX_HEADER_SIZE


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


_PAIR_CHUNK = 1 << 20


def _json_pairs(raw: bytes) -> int:
    """How many name/value pairs the objects of the JSON text ``raw`` hold, duplicates
    included, without parsing it: the colons outside strings. A quote ends or starts a string
    unless the run of backslashes just before it is odd (an escaped quote). Found in bulk
    (numpy), a chunk at a time (what is carried across: the quotes' parity and the backslash
    run at the chunk's end). Only meaningful for valid JSON."""
    data = np.frombuffer(raw, np.uint8)
    pairs = 0
    inside = 0  # the real quotes so far, mod 2
    carried = 0  # the backslashes that end the previous chunk
    for start in range(0, data.size, _PAIR_CHUNK):
        arr = data[start : start + _PAIR_CHUNK]
        quotes = np.flatnonzero(arr == 34)
        colons = np.flatnonzero(arr == 58)
        slashes = np.flatnonzero(arr == 92)
        if slashes.size:
            # each backslash's run: where it begins (an index into ``slashes``)
            begins = np.ones(slashes.size, bool)
            begins[1:] = np.diff(slashes) != 1
            first = np.maximum.accumulate(np.where(begins, np.arange(slashes.size), 0))
            runs = np.arange(slashes.size) - first + 1
            runs += np.where(slashes[first] == 0, carried, 0)  # (a run the chunk continues)
            last = np.searchsorted(slashes, quotes) - 1  # the backslash before each quote
            safe = np.maximum(last, 0)
            before = (last >= 0) & (slashes[safe] == quotes - 1)
            run_before = np.where(before, runs[safe], 0)
            carry_next = int(runs[-1]) if slashes[-1] == arr.size - 1 else 0
        else:
            run_before = np.zeros(quotes.size, np.int64)
            carry_next = 0
        run_before = np.where(quotes == 0, carried, run_before)
        real = quotes[(run_before & 1) == 0]
        outside = ((np.searchsorted(real, colons) + inside) & 1) == 0
        pairs += int(np.count_nonzero(outside))
        inside = (inside + real.size) & 1
        carried = carry_next
    return pairs


def _parse_header(raw: bytes, file: str) -> Any:
    """The header's JSON, every name unique in every object. json's C parser builds the
    objects; when the pairs they hold do not add up to the pairs of the text (a repeated
    name, or a shape no well-formed header has), the text is parsed again with a hook that
    names the repeated name."""
    pairs = _json_pairs(raw)  # (first: its temporaries gone before the objects are made)
    header = load_json(raw, file=file, what="safetensors header", max_bytes=MAX_HEADER_SIZE)
    if type(header) is dict:
        infos = list(header.values())
        if set(map(type, infos)) <= {dict}:
            metadata = header.get("__metadata__")
            held = len(header) + sum(map(len, infos))
            if (metadata is None or type(metadata) is dict) and held == pairs:
                return header  # (every object counted: none lost a repeated name)
    return load_json(
        raw,
        file=file,
        what="safetensors header",
        max_bytes=MAX_HEADER_SIZE,
        object_pairs_hook=_no_duplicates(file),
    )


#: The most dimensions numpy's arrays take (64 since numpy 2.0, 32 before).
_MAX_NDIM = 64 if np.lib.NumpyVersion(np.__version__) >= "2.0.0" else 32
_MAX_BYTES = 2**63 - 1


def _unholdable(shape: Sequence[int], itemsize: int) -> bool:
    """Whether no numpy array can have ``shape``: too many dimensions, or dimensions whose
    product (the zero ones left out, as numpy counts) times ``itemsize`` passes ``2**63 - 1``
    bytes. A shape with a zero holds no bytes, so the byte-size check alone lets
    ``[0, 10**30]`` through; the reference library takes such a shape while every dimension
    fits in 64 bits, but no reader could make the array."""
    return len(shape) > _MAX_NDIM or math.prod(d for d in shape if d) * itemsize > _MAX_BYTES


def _tiles_exactly(
    begins: list[int] | np.ndarray, ends: list[int] | np.ndarray, sizes: list[int], data_size: int
) -> bool:
    """Whether the tensors' offsets tile ``[0, data_size)`` in order with the right byte sizes
    (the offsets: Python ints, or int64 arrays), checked in bulk (numpy); False sends the
    caller to the tensor-by-tensor loop that says which tensor is wrong."""
    if not len(begins):
        return data_size == 0
    if max(sizes) > data_size:
        return False
    if isinstance(begins, list) and (max(ends) > data_size or max(begins) > data_size):
        return False  # also keeps every value below 2**63 for the arrays below
    b = np.asarray(begins, np.int64)
    e = np.asarray(ends, np.int64)
    if e.max() > data_size or b.max() > data_size:
        return False
    order = np.argsort(b, kind="stable")
    b, e = b[order], e[order]
    n = np.array(sizes, np.int64)[order]
    return bool(b[0] == 0 and e[-1] == data_size and (e - b == n).all() and (b[1:] == e[:-1]).all())


class HeaderColumns(NamedTuple):
    """The tensors of a checked safetensors header, one column per field, in file order:
    names, numpy dtypes, shapes, ``[begin, end)`` offsets relative to the data's start
    (int64 arrays) and each tensor's CRC-32C from our checksum record (an int64 array; None
    for a file without one)."""

    names: list[str]
    dtypes: list[np.dtype]
    shapes: list[tuple[int, ...]]
    begins: np.ndarray
    ends: np.ndarray
    crcs: np.ndarray | None


def read_header(
    f: IO[bytes], file: str
) -> tuple[dict[str, str], dict[str, tuple[np.dtype, tuple[int, ...], int, int, int | None]], int]:
    """Parse and validate the header of the open safetensors file ``f``.

    When the header carries our checksum record (``__metadata__["parallelvars_crc32c"]``), the
    header is verified against it here.

    Returns:
        ``(metadata, tensors, data_start)``: ``tensors`` maps each name to (numpy dtype, shape,
        begin, end, CRC-32C of its bytes or None) with offsets relative to ``data_start``, in
        file order (:func:`read_header_columns` gives the same as columns).

    Raises:
        TruncatedFileError, CorruptCheckpointError, ChecksumMismatchError, UnsupportedDtypeError:
        see the module doc.
    """
    metadata, cols, start = read_header_columns(f, file)
    crcs = [None] * len(cols.names) if cols.crcs is None else cols.crcs.tolist()
    tensors = dict(
        zip(
            cols.names,
            zip(
                cols.dtypes,
                cols.shapes,
                cols.begins.tolist(),
                cols.ends.tolist(),
                crcs,
                strict=True,
            ),
            strict=True,
        )
    )
    return metadata, tensors, start


def read_header_columns(f: IO[bytes], file: str) -> tuple[dict[str, str], HeaderColumns, int]:
    """:func:`read_header`'s checks and answer, the tensors as :class:`HeaderColumns` (no
    object per tensor beyond its name and shape)."""
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
    streamed = _streamed_columns(raw, file, size - 8 - n)
    if streamed is not None:
        return streamed[0], streamed[1], 8 + n
    header = _parse_header(raw, file)
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
    fast = _fast_columns(header, size - 8 - n)
    if fast is not None:
        cols, describe = fast
        crcs = _record_crcs(file, metadata, cols.names, raw, describe)
        return metadata, cols._replace(crcs=crcs), 8 + n
    described: dict[str, tuple[str, list[int], list[int]]] = {}
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
        if not isinstance(shape, list) or not all(is_index(d) for d in shape):
            raise CorruptCheckpointError(
                "shape must be a list of non-negative integers",
                file=file,
                variable=name,
                expected="[d0, d1, ...] with d >= 0",
                found=shape,
            )
        if not (
            isinstance(offsets, list) and len(offsets) == 2 and all(is_index(o) for o in offsets)
        ):
            raise CorruptCheckpointError(
                "data_offsets must be [begin, end]",
                file=file,
                variable=name,
                expected="two integers >= 0",
                found=offsets,
            )
        dtype = _DTYPES[dtype_str]
        if _unholdable(shape, dtype.itemsize):
            raise CorruptCheckpointError(
                "shape is too large for any array",
                file=file,
                variable=name,
                expected=f"at most {_MAX_NDIM} dimensions whose product (zeros left out) "
                f"is at most {_MAX_BYTES} bytes",
                found=shape,
            )
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
    names = [e[0] for e in entries]
    cols = HeaderColumns(
        names,
        [e[1] for e in entries],
        [e[2] for e in entries],
        np.array([e[3] for e in entries], np.int64),
        np.array([e[4] for e in entries], np.int64),
        _record_crcs(file, metadata, names, raw, lambda: described),
    )
    return metadata, cols, 8 + n


def _fast_columns(
    header: Mapping[str, Any], data_size: int
) -> tuple[HeaderColumns, Callable[[], dict[str, tuple[str, list[int], list[int]]]]] | None:
    """The tensors of a well-formed header, checked in bulk (C-level maps over the tensors,
    no Python frame per tensor), and a function giving each tensor's description as written
    (for an older checksum record, :func:`_record_crcs`); None at the first doubt, for the
    tensor-by-tensor checks to name the problem."""
    names = list(header)
    infos = list(header.values())
    if not infos:
        if data_size != 0:
            return None
        empty = np.empty(0, np.int64)
        return HeaderColumns([], [], [], empty, empty.copy(), None), dict
    if set(map(type, infos)) != {dict}:
        return None
    try:
        dtype_strs = list(map(itemgetter("dtype"), infos))
        shapes = list(map(itemgetter("shape"), infos))
        offsets = list(map(itemgetter("data_offsets"), infos))
    except (KeyError, TypeError):
        return None
    if set(map(type, dtype_strs)) != {str}:
        return None
    if set(map(type, shapes)) != {list} or set(map(type, offsets)) != {list}:
        return None
    if set(map(len, offsets)) != {2}:
        return None
    # Only non-negative ints (bool is not int here, as in is_index).
    for values in (list(chain.from_iterable(shapes)), list(chain.from_iterable(offsets))):
        if values and (not set(map(type, values)) <= {int} or min(values) < 0):
            return None
    begins = list(map(itemgetter(0), offsets))
    ends = list(map(itemgetter(1), offsets))
    cols = _checked_columns(names, dtype_strs, list(map(tuple, shapes)), begins, ends, data_size)
    if cols is None:
        return None
    return cols, lambda: dict(
        zip(names, zip(dtype_strs, shapes, offsets, strict=True), strict=True)
    )


def _checked_columns(
    names: list[str],
    dtype_strs: list[str],
    shapes: list[tuple[int, ...]],
    begins: list[int] | np.ndarray,
    ends: list[int] | np.ndarray,
    data_size: int,
) -> HeaderColumns | None:
    """The columns of tensors whose fields are of the right types (``shapes`` and offsets
    non-negative ints), checked in bulk: known dtypes, shapes an array can have, offsets
    that tile ``[0, data_size)`` with each tensor's byte count; None at the first doubt."""
    try:
        dtypes = list(map(_DTYPES.__getitem__, dtype_strs))
    except KeyError:
        return None
    # (each distinct shape's element count once: a model's tensors share a few shapes)
    counts = {s: math.prod(s) for s in set(shapes)}
    sizes = list(map(mul, map(counts.__getitem__, shapes), map(attrgetter("itemsize"), dtypes)))
    if 0 in sizes and any(  # (a nonzero size is bounded by the file's size in _tiles_exactly)
        _unholdable(s, d.itemsize) for s, d, z in zip(shapes, dtypes, sizes, strict=True) if not z
    ):
        return None
    if max(map(len, counts), default=0) > _MAX_NDIM:
        return None
    if not _tiles_exactly(begins, ends, sizes, data_size):
        return None
    return HeaderColumns(
        names, dtypes, shapes, np.asarray(begins, np.int64), np.asarray(ends, np.int64), None
    )


# The header as our writer and the reference implementation write it, read without a JSON
# object per tensor (:func:`_streamed_columns`): ``{"__metadata__":{...},`` (optional, first),
# then each tensor as ``"name":{"dtype":"F32","shape":[2,3],"data_offsets":[0,24]}``
# separated by commas, ``}`` and the spaces that pad the header. Names without escapes or
# control characters, integers of at most 18 digits (every one below 2**63); anything else
# is read the general way.
_INT = rb"(?:0|[1-9][0-9]{0,17})"
_TENSOR = re.compile(
    rb'(,?)"([^"\\\x00-\x1f]*)":\{"dtype":"([0-9A-Z_a-z]{1,32})","shape":\[((?:%s(?:,%s)*)?)\],'
    rb'"data_offsets":\[(%s),(%s)\]\}' % (_INT, _INT, _INT, _INT)
)
#: The characters of a tensor's text that are not in its groups.
_TENSOR_FIXED = len('"":{"dtype":"","shape":[],"data_offsets":[,]}')
# Header bytes matched at a time (each piece's rows made into columns before the next).
_PIECE = 1 << 20


def _streamed_columns(
    raw: bytes, file: str, data_size: int
) -> tuple[dict[str, str], HeaderColumns] | None:
    """:func:`read_header_columns`' answer for a header as writers write it, read as columns
    a piece at a time (no object per tensor but its name and, once per distinct shape, its
    shape), every check of the general path made: each tensor's text matched whole, names
    unique, the metadata parsed by :func:`~parallelvars._fileio.load_json` with every name
    checked, then :func:`_checked_columns` and the checksum record. None at the first
    doubt: the general path reads it then, and names any problem, so both paths take and
    refuse the same headers with the same errors."""
    end = len(raw.rstrip(b" \t\n\r"))
    if end < 2 or raw[end - 1] != 0x7D:  # "}"
        return None
    metadata: Any = {}
    at = 1
    if raw.startswith(b'{"__metadata__":{}'):
        at = 18
    elif raw.startswith(b'{"__metadata__":{"'):
        # Its end: the first '"},"' (a quote after a comma ends any string: only there
        # can the object end before a tensor's name); the object's text up to it parses
        # whole or the general path reads the header.
        at = raw.find(b'"},"', 18) + 2
        if at < 2:
            return None
        try:
            metadata = load_json(
                raw[16:at],
                file=file,
                what="safetensors header",
                max_bytes=MAX_HEADER_SIZE,
                object_pairs_hook=_no_duplicates(file),
            )
        except ParallelVarsError:  # (refused the general way, with its own error)
            return None
        if type(metadata) is not dict or not all(type(v) is str for v in metadata.values()):
            return None
    if at > 1:
        if raw[at : at + 1] != b",":
            return None
        at += 1
    if raw[0] != 0x7B or end - 1 - at < 1:  # "{", and at least one tensor
        return None
    names: list[str] = []
    dtype_strs: list[str] = []  # (one text per distinct dtype, shared)
    shapes: list[tuple[int, ...]] = []  # (one tuple per distinct shape, shared)
    begins: list[np.ndarray] = []
    ends: list[np.ndarray] = []
    dtype_of: dict[bytes, str] = {}
    shape_of: dict[bytes, tuple[int, ...]] = {}
    first = True
    while at < end - 1:
        cut = raw.find(b"]},", at + _PIECE, end - 1)
        cut = end - 1 if cut < 0 else cut + 2  # (the next piece begins with its comma)
        piece = raw[at:cut]
        rows = _TENSOR.findall(piece)
        if not rows:
            return None
        seps, piece_names, piece_dtypes, piece_shapes, piece_begins, piece_ends = zip(
            *rows, strict=True
        )
        del rows
        fixed = _TENSOR_FIXED * len(seps)
        if (
            fixed
            + sum(map(len, chain(seps, piece_names, piece_dtypes, piece_shapes)))
            + sum(map(len, chain(piece_begins, piece_ends)))
            != len(piece)
            or seps.count(b",") != len(seps) - first
            or (first and seps[0])
        ):
            return None  # (not every byte in a tensor's text, or not comma-separated)
        try:
            names.extend(map(bytes.decode, piece_names))
        except UnicodeDecodeError:
            return None
        for t in set(piece_dtypes).difference(dtype_of):
            dtype_of[t] = t.decode()
        for t in set(piece_shapes).difference(shape_of):
            shape_of[t] = tuple(map(int, t.split(b","))) if t else ()
        dtype_strs.extend(map(dtype_of.__getitem__, piece_dtypes))
        shapes.extend(map(shape_of.__getitem__, piece_shapes))
        # (at most 18 digits each: below 2**63)
        begins.append(np.array(piece_begins).astype(np.int64))
        ends.append(np.array(piece_ends).astype(np.int64))
        first = False
        at = cut
    if len(set(names)) != len(names) or "__metadata__" in names:
        return None
    starts, stops = np.concatenate(begins), np.concatenate(ends)
    del begins, ends
    cols = _checked_columns(names, dtype_strs, shapes, starts, stops, data_size)
    if cols is None:
        return None
    crcs = _record_crcs(
        file,
        metadata,
        names,
        raw,
        lambda: {
            name: (d, list(s), [b, e])
            for name, d, s, b, e in zip(
                names, dtype_strs, shapes, starts.tolist(), stops.tolist(), strict=True
            )
        },
    )
    return metadata, cols._replace(crcs=crcs)
