"""Writing safetensors: one file or a shard set, streamed one tensor at a time."""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import struct
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import crc32c as _crc32c_module
import numpy as np

from parallelvars._fileio import DataWriter, Scratch, atomic_path
from parallelvars.checkpoint.entry import naming_file
from parallelvars.errors import (
    CorruptCheckpointError,
    InvalidArgumentError,
    InvalidEntryError,
    UnsupportedDtypeError,
)
from parallelvars.formats._dtypes import is_string_dtype
from parallelvars.formats._info_columns import to_columns
from parallelvars.formats._json import carried_metadata, dumps, jsonable
from parallelvars.formats._plan import PlannedTensor, plan_tensors, read_batches, read_run
from parallelvars.formats._sizes import parse_size
from parallelvars.formats._store import little_endian
from parallelvars.formats._view import Entry
from parallelvars.formats.safetensors._dtypes import _DTYPES, _st_name
from parallelvars.formats.safetensors._hf import hf_files_for, is_hf_output
from parallelvars.formats.safetensors._integrity import (
    RAW_PREFIX,
    _crc_record,
    _index_crc,
)
from parallelvars.formats.safetensors._layout import (
    CRC_KEY,
    DEFAULT_NAMES,
    MAX_HEADER_SIZE,
    META_KEY,
    SHARDS_KEY,
)


def _crc32c(data: Any) -> int:
    return int(_crc32c_module.crc32c(data))


def _storage(t: PlannedTensor, file: str) -> tuple[str, tuple[int, ...]]:
    """The safetensors dtype string and stored shape of a planned tensor."""
    if is_string_dtype(t.dtype):
        raise UnsupportedDtypeError(
            "safetensors cannot store string tensors",
            file=file,
            variable=t.path,
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
            variable=t.path,
            expected="a numeric dtype",
            found=str(t.dtype),
        )
    return "U8", (*t.shape, t.dtype.itemsize)  # raw bytes; the dtype goes into the parallel info


def _storages(tensors: list[PlannedTensor], file: str) -> list[tuple[str, tuple[int, ...]]]:
    """:func:`_storage` of every tensor, in order, worked out once per distinct dtype (a file
    names a few): the same answers, and the same refusal at the first tensor refused."""
    known: dict[tuple[np.dtype, type], str | None] = {}  # its name; None: stored as raw bytes
    out: list[tuple[str, tuple[int, ...]]] = []
    for t in tensors:
        dtype = t.dtype
        key = (dtype, dtype.type)
        if key not in known:
            _storage(t, file)  # (refuses what cannot be stored)
            known[key] = _st_name(dtype)
        name = known[key]
        out.append((name, t.shape) if name is not None else ("U8", (*t.shape, dtype.itemsize)))
    return out


# What JSON escapes in a string (json's own table, ensure_ascii=False): a key without any of
# these is written between quotes as it is.
_NEEDS_ESCAPE = re.compile(r'[\x00-\x1f\\"]')


def _json_string(text: str) -> str:
    """``text`` as :func:`dumps` writes a string."""
    return f'"{text}"' if _NEEDS_ESCAPE.search(text) is None else dumps(text)


def _header_parts(
    metadata: dict[str, str],
    described: Iterable[str],
    record: str,
    path: str,
) -> list[bytes]:
    """The header of a file of the ``described`` tensors (each its member's text,
    ``"key":{...}``, as :func:`dumps` writes it: :func:`_described`) with our checksum
    ``record``: the bytes :func:`dumps` makes of the whole header as one object, in pieces
    written one after the other (the metadata object second, then the members in blocks of
    :data:`_MEMBERS_PER_PART`): no object per tensor, no single buffer grown (and copied)
    to the header's size, which at 300,000 tensors passes 60 MB."""
    meta = dict(metadata)
    meta[CRC_KEY] = record
    parts = [b'{"__metadata__":', dumps(meta).encode("utf-8")]
    block: list[str] = []
    for member in described:
        block.append(member)
        if len(block) == _MEMBERS_PER_PART:
            parts.append(("," + ",".join(block)).encode("utf-8"))
            block = []
    if block:
        parts.append(("," + ",".join(block)).encode("utf-8"))
    size = sum(map(len, parts)) + 1
    # (the buffer starts 8-byte aligned, as the reference writes it)
    parts.append(b"}" + b" " * (-size % 8))
    size += -size % 8
    if size > MAX_HEADER_SIZE:
        raise InvalidEntryError(
            f"{path}: the safetensors header would be {size} bytes, over the "
            f"{MAX_HEADER_SIZE} bytes readers accept; write a shard set or fewer tensors"
        )
    return parts


#: Tensors' members joined into one piece of the header (a few hundred kB of text).
_MEMBERS_PER_PART = 4096


def _described(key: str, dtype: str, shape: tuple[int, ...], start: int, stop: int) -> str:
    """A tensor's member of the header, as :func:`dumps` writes ``{key: {"dtype": dtype,
    "shape": shape, "data_offsets": [start, stop]}}`` inside the header object."""
    dims = ",".join([str(int(d)) for d in shape])
    return (
        f'{_json_string(key)}:{{"dtype":{_json_string(dtype)},"shape":[{dims}],'
        f'"data_offsets":[{start},{stop}]}}'
    )


def _write_one(
    path: str,
    tensors: list[PlannedTensor],
    storages: list[tuple[str, tuple[int, ...]]],
    metadata: dict[str, str],
) -> str:
    """Write one file of ``tensors`` (stored as ``storages``: :func:`_storages`); return its
    header's CRC-32C (8 hex digits). The header carries the tensors' CRC-32Cs, known only once
    they are streamed: it is written with fixed-width placeholders first and rewritten in
    place. The parallel info's text (``metadata[META_KEY]``) is taken out of ``metadata``
    once the header is made (it is held no longer than that)."""
    itemsize = {name: _DTYPES[name].itemsize for name in {st for st, _shape in storages}}
    order = sorted(range(len(tensors)), key=lambda k: (-itemsize[storages[k][0]], tensors[k].key))
    ordered = [tensors[k] for k in order]
    crcs = {t.key: "00000000" for t in ordered}

    def described() -> Iterator[str]:  # each tensor's member of the header, in file order
        offset = 0
        for k in order:
            t = tensors[k]
            st, shape = storages[k]
            yield _described(t.key, st, shape, offset, offset + t.nbytes)
            offset += t.nbytes

    # The header with a placeholder record of the final one's length (every CRC is 8 hex
    # digits): the final record, known once the tensors are written, takes its place.
    placeholder = RAW_PREFIX + "0" * (8 * (len(crcs) + 1))
    parts = _header_parts(metadata, described(), placeholder, path)
    # (The parallel info's text, the largest of the metadata, is in the parts now: the file's
    # one copy of it is let go, the caller's too, before the tensors are read.)
    metadata.pop(META_KEY, None)
    size = sum(map(len, parts))
    # (Its one place, in the metadata object, the header's second piece: a string's quotes
    # are escaped, so `"key":"` is the key's own.)
    at = parts[1].index(f"{json.dumps(CRC_KEY)}:{json.dumps(placeholder)}".encode())
    at += len(parts[0]) + len(json.dumps(CRC_KEY)) + 2
    # The header's CRC covers its bytes as written, the record's digits as the zeros they
    # are now (_integrity.RAW_PREFIX: raw_header_crc's, taken piece by piece).
    crc = 0
    for part in parts:
        crc = _crc32c_module.crc32c(part, crc)
    header_crc = f"{crc:08x}"
    # Whether a dtype's values are stored byte-swapped (asked once per dtype, not per tensor).
    swapped_dtypes: dict[np.dtype, bool] = {}
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", size))
            for part in parts:
                f.write(part)
        del parts
        data_start = 8 + size
        # The tensors' bytes in runs (read_batches: the source's files read in bulk), each
        # run read into one buffer, every tensor checksummed there while it is in the cache,
        # and the run written at once (DataWriter: the disk asked to start every 8 MiB).
        writer, scratch, ok = DataWriter(tmp, path), Scratch(), False
        try:
            written = 0  # the data's bytes written so far: where the next run begins
            for run in read_batches(ordered):
                with naming_file(path):
                    buf, arrays = read_run(run, scratch)
                data = memoryview(buf)  # type: ignore[arg-type]
                pos = 0
                for t, array in zip(run, arrays, strict=True):
                    n = array.nbytes
                    if n != t.nbytes:  # the source lied about its shape
                        raise CorruptCheckpointError(
                            "component has another size than declared",
                            file=path,
                            variable=t.path,
                            expected=f"{t.nbytes} bytes",
                            found=f"{n} bytes",
                        )
                    dtype = array.dtype
                    swap = swapped_dtypes.get(dtype)
                    if swap is None:
                        swap = swapped_dtypes[dtype] = (
                            little_endian(np.empty((), dtype)).dtype != dtype
                        )
                    if swap:  # (in place: the buffer is the file's)
                        array[...] = little_endian(array).view(dtype)
                    # (read_run lays the tensors back to back in the buffer, in run order)
                    crcs[t.key] = f"{_crc32c(data[pos : pos + n]):08x}"
                    pos += n
                if buf.size:
                    writer.write(buf, data_start + written)
                    written += buf.size
            ok = True
        finally:
            writer.close(raise_errors=ok)
        record = _crc_record(header_crc, crcs, RAW_PREFIX).encode("ascii")
        if len(record) != len(placeholder):  # cannot happen: every CRC is 8 hex digits
            raise AssertionError(f"{path}: the safetensors header changed length")
        with open(tmp, "r+b") as patched:
            patched.seek(8 + at)
            patched.write(record)
    return header_crc


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
    like: str | os.PathLike[str] | None = None,
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
        like: a Hugging Face model folder whose ``config.json``, tokenizer and processor
            files go into the output's folder (:mod:`._hf`); by default the folder of
            ``entries`` when they are a view of one. Only an output under Hugging Face's names
            (a folder, ``model.safetensors``, or its shard set) gets them; ``like=`` with
            another is an InvalidArgumentError.

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
    if like is not None and not is_hf_output(p):
        raise InvalidArgumentError(
            f"{p}: like= carries a Hugging Face folder's files into a Hugging Face folder; "
            "write to a folder (model.safetensors inside) or to model.safetensors"
        )
    # Read (and checked) before any weight is written: a refusal leaves the folder as it was.
    carried = hf_files_for(entries, like) if is_hf_output(p) else None
    if metadata is None:
        metadata = getattr(entries, "metadata", None) or {}
    planned, info = plan_tensors(
        entries,
        names=names,
        needs_record=lambda e: _st_name(e.dtype) is None,
        file=p,
        hold_entries=False,  # (read through read_batches only)
    )
    info["checksums"] = "crc32c"  # every file written carries CRC_KEY; its loss is damage
    # The info in columns (version 2, formats/_info_columns.py): a fraction of the per-variable
    # form's bytes, read without a record per variable.
    info = to_columns(info, (t.key for t in planned)) or info
    storages = _storages(planned, p)  # refuses what cannot be stored before writing anything
    for t in planned:
        if t.key == "__metadata__":  # (the header's own member: a file no reader can open)
            raise InvalidEntryError(
                "a tensor cannot be stored under the header's metadata key",
                file=p,
                variable=t.path,
                expected="a tensor key other than '__metadata__' (reserved by safetensors)",
                found=t.key,
            )
    meta = {"format": "pt", **_str_metadata(metadata)}
    limit = parse_size(max_shard_size) if max_shard_size is not None else None
    shards: list[list[PlannedTensor]] = [[]]
    shard_storages: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for t, storage in zip(planned, storages, strict=True):
        if limit is not None and shards[-1] and size + t.nbytes > limit:
            shards.append([])
            shard_storages.append([])
            size = 0
        shards[-1].append(t)
        shard_storages[-1].append(storage)
        size += t.nbytes
    folder = os.path.dirname(os.path.abspath(p))
    stem = os.path.basename(p)
    stem = stem[: -len(".safetensors")] if stem.endswith(".safetensors") else stem
    index_path = f"{os.path.join(folder, os.path.basename(p))}.index.json"
    if len(shards) == 1 and not force_index:
        meta[META_KEY] = dumps(info)
        del info  # (its objects, the object graph's among them: the header holds its text)
        _write_one(p, planned, storages, meta)
        # The file is the output at p now: a set of that name is the previous one (a folder's
        # readers take the index first, so it goes first; then its shards).
        _remove_previous(folder, stem, index_path, keep=set())
        if carried is not None:
            carried.write(folder)
        return p
    # All or nothing (docs/formats.md, "Outputs"): the shards are written under names no file
    # of the folder has, each whole under its final name before the index; the index, written
    # last with each shard's checksum, is the commit; then the previous set's files go. A
    # kill at any step leaves the previous set (index and shards untouched) or the new one.
    shard_names = _fresh_names(folder, stem, len(shards))
    weight_map: dict[str, str] = {}
    checks: dict[str, str] = {}
    for name, tensors, kept in zip(shard_names, shards, shard_storages, strict=True):
        checks[name] = _write_one(os.path.join(folder, name), tensors, kept, meta)
        weight_map.update((t.key, name) for t in tensors)
    index_meta: dict[str, Any] = {"total_size": sum(t.nbytes for t in planned), META_KEY: info}
    index_meta[SHARDS_KEY] = checks
    weight_map = dict(sorted(weight_map.items()))
    index_meta[CRC_KEY] = _index_crc(index_meta, weight_map)
    index = {"metadata": index_meta, "weight_map": weight_map}
    with atomic_path(index_path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        json.dump(index, f, indent=2, ensure_ascii=False)
        f.write("\n")
    _remove_previous(folder, stem, None, keep=set(shard_names), single=p)
    if carried is not None:
        carried.write(folder)
    return index_path


def _shard_name(stem: str, i: int, n: int, tag: str = "") -> str:
    return f"{stem}-{i:05d}-of-{n:05d}{tag}.safetensors"


def _fresh_names(folder: str, stem: str, n: int) -> list[str]:
    """Hugging Face's shard names when none of them is in the folder (a new set), else the
    same names with a tag no file of the folder has: a new set never replaces a file the
    previous one's index names."""
    names = [_shard_name(stem, i, n) for i in range(1, n + 1)]
    while any(os.path.lexists(os.path.join(folder, name)) for name in names):
        tag = f"-{secrets.token_hex(4)}"
        names = [_shard_name(stem, i, n, tag) for i in range(1, n + 1)]
    return names


def _remove_previous(
    folder: str, stem: str, index: str | None, *, keep: set[str], single: str | None = None
) -> None:
    """After a commit: the previous output of this name goes (the index ``index`` of a set,
    the single file ``single``, and every shard of a set of this stem not in ``keep``)."""
    shard = re.compile(re.escape(stem) + r"-\d{5}-of-\d{5}(-[0-9a-f]{8})?\.safetensors")
    doomed = [path for path in (index, single) if path is not None and os.path.lexists(path)]
    doomed += [
        os.path.join(folder, name)
        for name in sorted(os.listdir(folder))
        if shard.fullmatch(name) and name not in keep
    ]
    for path in doomed:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
