"""A native checkpoint file written through the generator (:mod:`.generate`) instead of
libhdf5: the same content as ``h5io.write.write_h5`` (groups, attributes, datasets, the index,
the columns and the object graph, checksums), for callers and tests that write a whole file
from entries whose components are arrays in memory.

The metadata is generated in one piece and written with one ``pwrite``; the component bytes go
out in gathered writes (``pwritev``) in file order; then the documents. With
``share_equal``, a component whose bytes equal an earlier component of the same variable (same
shape) is not written again: its name is a hard link to that component's dataset, and the
index records the same offset for both.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import crc32c as _crc32c
import numpy as np

from parallelvars._dtypes import dtype_name
from parallelvars._fileio import IOV_MAX, atomic_path, byte_view, checksum, pwrite_all, pwritev_all
from parallelvars.checkpoint._skeleton import index_capacity
from parallelvars.checkpoint.h5io.attributes import _attr_value, _decode, _root_attr_value
from parallelvars.checkpoint.h5io.layout import (
    COLUMNS_DATASET,
    DOCUMENTS_ATTR,
    FORMAT_VERSION,
    GRAPH_DATASET,
    INDEX_DATASET,
    _library_version,
    _validate_path,
)
from parallelvars.checkpoint.h5io.write import _columns_parts
from parallelvars.checkpoint.h5raw.generate import FilePlan, Variable

__all__ = ["index_documents", "write_native", "write_native_index"]


def _shared(components: Sequence[np.ndarray], crcs: list[int]) -> list[int]:
    """For each component, the first earlier one with the same shape and bytes (or itself)."""
    out: list[int] = []
    for i, c in enumerate(components):
        j = next(
            (
                k
                for k in out[:i]
                if out[k] == k
                and crcs[k] == crcs[i]
                and components[k].shape == c.shape
                and np.array_equal(byte_view(components[k]), byte_view(c))
            ),
            i,
        )
        out.append(j)
    return out


def write_native(
    path: str | os.PathLike[str],
    entries: Iterable[Any],
    *,
    object_graph: Mapping[str, Any] | None = None,
    metadata: Mapping[str, Any] | None = None,
    share_equal: bool = False,
    created: float | None = None,
) -> str:
    """Write ``entries`` (with ``components``: arrays in memory) to ``path`` in the native
    layout, through the generator; returns ``path``. Raises ``Unsupported`` (from
    :mod:`.messages`) for what the generator cannot express.

    The cyclic garbage collector runs as the program set it (no save pauses it: a pause reaches
    every thread); its walks of the plan's objects are part of the cost measured by
    ``bench/bench_h5raw.py``."""
    return _write_native(
        path,
        entries,
        object_graph=object_graph,
        metadata=metadata,
        share_equal=share_equal,
        created=created,
    )


def _write_native(
    path: str | os.PathLike[str],
    entries: Iterable[Any],
    *,
    object_graph: Mapping[str, Any] | None,
    metadata: Mapping[str, Any] | None,
    share_equal: bool,
    created: float | None,
) -> str:
    p = os.fspath(path)
    items = list(entries.values()) if isinstance(entries, Mapping) else list(entries)
    comps = [[np.ascontiguousarray(c) for c in e.components] for e in items]
    crcs = [[checksum(c) for c in cs] for cs in comps]
    variables = []
    for e, cs, cc in zip(items, comps, crcs, strict=True):
        _validate_path(e.path)
        shared = _shared(cs, cc) if share_equal and e.kind != "sharded" else None
        dt = cs[0].dtype if cs else np.dtype(e.dtype)
        variables.append(
            Variable(e.path, e.kind, dt, tuple(e.shape), len(cs), dict(e.attrs), shared)
        )
    documents = [INDEX_DATASET, COLUMNS_DATASET]
    if object_graph is not None:
        documents.append(GRAPH_DATASET)
    root: dict[str, Any] = {
        "parallelvars_format": np.int64(FORMAT_VERSION),
        "parallelvars_version": _root_attr_value(_library_version()),
        "created": np.float64(time.time() if created is None else created),
    }
    for key, value in dict(metadata or {}).items():
        if value is not None:
            root[key] = _root_attr_value(value)
    root[DOCUMENTS_ATTR] = np.array([d.encode() for d in documents])
    plan = FilePlan(variables, root_attrs=root, documents=documents)
    index: dict[str, Any] = {}
    names: dict[np.dtype, str] = {}
    decoded: dict[Any, Any] = {}  # attribute values recur across variables: converted once
    for e, v, cc in zip(items, variables, crcs, strict=True):
        name = names.get(v.dtype)
        if name is None:
            name = names[v.dtype] = dtype_name(v.dtype)
        meta: dict[str, Any] = {
            "kind": e.kind,
            "dtype": name,
            "shape": [int(d) for d in e.shape],
            "num_components": v.num_components,
        }
        meta["attrs"] = {
            k: _index_value(val, decoded)
            for k, val in dict(e.attrs).items()
            if val is not None and k not in meta
        }
        meta["offsets"] = plan.offsets[e.path]
        meta["crc32c"] = cc
        index[e.path] = meta
    docs = index_documents(index)
    if object_graph is not None:
        docs[GRAPH_DATASET] = json.dumps(object_graph).encode()
    meta_out = plan.metadata(
        {k: len(v) for k, v in docs.items()},
        document_checksums={k: _crc32c.crc32c(v) for k, v in docs.items()},
    )
    with atomic_path(p) as tmp:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
        try:
            os.ftruncate(fd, meta_out.file_size)
            for offset, data in meta_out.pieces:
                pwrite_all(fd, memoryview(data), offset)
            _write_components(fd, plan, items, comps)
            for name, data in docs.items():
                pwrite_all(fd, memoryview(data), meta_out.documents[name])
        finally:
            os.close(fd)
    return p


def index_documents(index: Mapping[str, Any]) -> dict[str, bytes]:
    """The index and columns documents of a file with ``index``, as ``write_native`` writes
    them (each padded to its capacity); what ``verify`` regenerates and compares."""
    flat = [c for m in index.values() for c in m["crc32c"]]
    text = json.dumps(index)
    digits = ", ".join(map(str, flat))
    separators = 2 * max(len(flat) - 1, 0)
    docs = {
        INDEX_DATASET: text.encode().ljust(
            index_capacity(len(text) - (len(digits) - separators), len(flat)), b" "
        )
    }
    head, tail = _columns_parts(index)
    docs[COLUMNS_DATASET] = (
        (head + digits + tail)
        .encode()
        .ljust(index_capacity(len(head) + len(tail) + separators, len(flat)), b" ")
    )
    return docs


def _index_value(value: Any, seen: dict[Any, Any]) -> Any:
    """An attribute's value as the index records it (``_decode(_attr_value(value))``), looked
    up in ``seen`` for strings, integers, booleans and lists of strings (a list: a fresh
    copy). Floats are converted each time (``-0.0 == 0.0`` would share one key)."""
    t = type(value)
    if t in (str, int, bool):
        key: Any = (t, value)
    elif t is list and all(type(x) is str for x in value):
        key = ("strs", *value)
    else:
        return _decode(_attr_value(value))
    out = seen.get(key, seen)
    if out is seen:
        out = seen[key] = _decode(_attr_value(value))
    return list(out) if isinstance(out, list) else out


def _write_components(
    fd: int, plan: FilePlan, items: list[Any], comps: list[list[np.ndarray]]
) -> None:
    """Every component with data at its offset, in gathered writes of neighbours (the gaps
    between them are the file's zeros, left by ``ftruncate``)."""
    placed = sorted(
        {
            off: (off, c)
            for e, cs in zip(items, comps, strict=True)
            for off, c in zip(plan.offsets[e.path], cs, strict=True)
            if off is not None and c.nbytes
        }.values(),
        key=lambda t: t[0],
    )
    k = 0
    while k < len(placed):
        start = placed[k][0]
        buffers: list[np.ndarray] = []
        end = start
        while k < len(placed) and len(buffers) < IOV_MAX - 1:
            off, c = placed[k]
            if off != end:
                if off - end > 64:
                    break
                buffers.append(np.zeros(off - end, np.uint8))
            buffers.append(byte_view(c))
            end = off + c.nbytes
            k += 1
        pwritev_all(fd, buffers, start, end - start)


def write_native_index(
    path: str | os.PathLike[str],
    variables: Iterable[Any],
    *,
    object_graph: Mapping[str, Any] | None = None,
    metadata: Mapping[str, Any] | None = None,
    created: float | None = None,
) -> str:
    """The index file of a multi-process checkpoint (``h5io.write.write_h5_index``'s
    content: each component an external link, no columns), through the generator; the
    ``variables`` are ``LinkedVariable`` records."""
    p = os.fspath(path)
    items = list(variables)
    documents = [INDEX_DATASET] + ([GRAPH_DATASET] if object_graph is not None else [])
    root: dict[str, Any] = {
        "parallelvars_format": np.int64(FORMAT_VERSION),
        "parallelvars_version": _root_attr_value(_library_version()),
        "created": np.float64(time.time() if created is None else created),
    }
    for key, value in dict(metadata or {}).items():
        if value is not None:
            root[key] = _root_attr_value(value)
    root[DOCUMENTS_ATTR] = np.array([d.encode() for d in documents])
    plan_vars = []
    index: dict[str, Any] = {}
    for v in items:
        _validate_path(v.path)
        n = len(v.components)
        links = [(c.file, c.dataset) for c in v.components]
        dt = np.dtype(v.dtype)
        plan_vars.append(
            Variable(v.path, v.kind, dt, tuple(v.shape), n, dict(v.attrs), None, links)
        )
        meta: dict[str, Any] = {
            "kind": v.kind,
            "dtype": dtype_name(dt),
            "shape": [int(d) for d in v.shape],
            "num_components": n,
        }
        meta["attrs"] = {
            k: _decode(_attr_value(val))
            for k, val in dict(v.attrs).items()
            if val is not None and k not in meta
        }
        meta["offsets"] = [None] * n
        meta["crc32c"] = [int(c.crc32c) for c in v.components]
        index[v.path] = meta
    plan = FilePlan(plan_vars, root_attrs=root, documents=documents)
    flat = [c for m in index.values() for c in m["crc32c"]]
    text = json.dumps(index)
    digits = ", ".join(map(str, flat))
    separators = 2 * max(len(flat) - 1, 0)
    docs = {
        INDEX_DATASET: text.encode().ljust(
            index_capacity(len(text) - (len(digits) - separators), len(flat)), b" "
        )
    }
    if object_graph is not None:
        docs[GRAPH_DATASET] = json.dumps(object_graph).encode()
    out = plan.metadata(
        {k: len(d) for k, d in docs.items()},
        document_checksums={k: _crc32c.crc32c(d) for k, d in docs.items()},
    )
    with atomic_path(p) as tmp:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
        try:
            os.ftruncate(fd, out.file_size)
            for offset, data in out.pieces:
                pwrite_all(fd, memoryview(data), offset)
            for name, data in docs.items():
                pwrite_all(fd, memoryview(data), out.documents[name])
        finally:
            os.close(fd)
    return p
