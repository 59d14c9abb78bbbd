"""A multi-process checkpoint's index file written through the generator (:mod:`.generate`):
:func:`write_native_index`.

The index file holds no component data: each component of a variable is an HDF5 external link
into the rank file that holds it, a sharded variable's ``value`` a virtual dataset over the
shards in the rank files, and the index document records every component's checksum (no
columns document). Rank 0 keeps the generated metadata of the structure it wrote last (a
:class:`~.native.Prepared`); the links' folder (``ckpt-7.h5.parts/``, which names the
checkpoint) is not part of that structure, only its length: a save to another path puts its
folder into the cached image (:func:`_relinked`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, cast

import crc32c as _crc32c
import numpy as np

from parallelvars._dtypes import dtype_name
from parallelvars._fileio import atomic_path, pwrite_all
from parallelvars._ints import unique_ints
from parallelvars.checkpoint.h5io.attributes import _attr_value, _decode
from parallelvars.checkpoint.h5io.columns import index_pieces, template_runs
from parallelvars.checkpoint.h5io.layout import (
    DOCUMENTS_ATTR,
    GRAPH_DATASET,
    INDEX_DATASET,
    _library_version,
    _validate_path,
)
from parallelvars.checkpoint.h5io.records import (
    _index_template,
    crc_mark,
    index_capacity,
    marked_template,
    metadata_key,
)
from parallelvars.checkpoint.h5raw.generate import FilePlan, Variable
from parallelvars.checkpoint.h5raw.lookup3 import lookup3_many
from parallelvars.checkpoint.h5raw.messages import Unsupported
from parallelvars.checkpoint.h5raw.native import (
    Prepared,
    Unexpressed,
    _changing,
    _fitted,
    _root_values,
)

__all__ = ["write_native_index"]


def write_native_index(
    path: str | os.PathLike[str],
    variables: Iterable[Any],
    *,
    object_graph: Mapping[str, Any] | None = None,
    metadata: Mapping[str, Any] | None = None,
    created: float | None = None,
    cache: Any = None,
) -> str:
    """The index file of a multi-process checkpoint (each component an external link into a
    rank file, no columns; the ``variables`` are ``h5io.write.LinkedVariable`` records),
    through the generator; returns ``path``.

    With ``cache`` (a :class:`~parallelvars.checkpoint.h5io.records.PlanCache`), a later save
    of the same structure (the same variables, links, object graph and metadata names) reuses
    the generated metadata and the index template: only the checksums, the root header values
    and the document's checksum change. The folder every link's file is in (``ckpt-7.h5.parts/``:
    it names the checkpoint) is not part of the structure: a save to another path of the same
    length puts its folder into the cached image (each link's bytes, and the checksums of the
    header chunks holding them), so a ``CheckpointManager``'s numbered saves reuse one plan.
    A structure the generator cannot express (a variable
    with more than :data:`~.generate.MAX_COMPACT_LINKS` components: a group keeps that many
    external links only in HDF5's dense storage) is written by ``h5io.write.write_h5_index``
    through libhdf5."""
    from parallelvars.checkpoint.h5io.write import write_h5_index

    p = os.fspath(path)
    items = list(variables)
    folder = _link_folder(items)
    key = None if cache is None else _index_key(items, object_graph, metadata, folder)
    prep = None if key is None else cache.get(key)
    if isinstance(prep, Unexpressed):
        return write_h5_index(p, items, object_graph=object_graph, metadata=metadata)
    root = _root_values(metadata, created)
    if not isinstance(prep, Prepared):
        try:
            prep = _prepare_index(key, items, object_graph, root, folder)
        except Unsupported:
            if cache is not None:
                cache.put(Unexpressed(key))
            return write_h5_index(p, items, object_graph=object_graph, metadata=metadata)
        if cache is not None:
            cache.put(prep)
    name = None if folder is None else folder.encode()
    with atomic_path(p) as tmp:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
        try:
            if not _write_image(fd, prep, name, items, root):
                # (no folder to put in the cached image: this save's own plan)
                prep = _prepare_index(key, items, object_graph, root, None)
                if cache is not None:
                    cache.put(prep)
                _write_image(fd, prep, None, items, root)
        finally:
            os.close(fd)
    return p


def _write_image(
    fd: int, prep: Prepared, folder: bytes | None, items: Sequence[Any], root: Mapping[str, Any]
) -> bool:
    """Write the index file of ``prep`` with the links' ``folder`` (None: the image's own) and
    the checksums of ``items`` to ``fd``; False (nothing written) when the cached image
    cannot take ``folder`` (:func:`_relink`). The folder is put in and the image written
    under the plan's lock: another save of the structure may put its own folder in."""
    flat = tuple(int(c.crc32c) for v in items for c in v.components)
    docs = {INDEX_DATASET: "".join(index_pieces(prep.template, flat)).encode()}
    if prep.graph is not None:
        docs[GRAPH_DATASET] = prep.graph
    docs = _fitted(prep, docs)
    with prep.lock:
        if folder is not None and folder != prep.folder and not _relink(prep, folder):
            return False
        os.ftruncate(fd, prep.file_size)
        refresh = prep.plan.refresh(
            _changing(root), {k: _crc32c.crc32c(v) for k, v in docs.items()}
        )
        pwrite_all(fd, memoryview(prep.image), 0)
    for offset, data in refresh:
        pwrite_all(fd, memoryview(data), offset)
    for name, data in docs.items():
        pwrite_all(fd, memoryview(data), prep.documents[name])
    return True


def _link_folder(items: Sequence[Any]) -> str | None:
    """The folder (up to the last ``/``) every link's file is in, when it can be put into a
    cached image: None without one, or with a sharded variable (its value's mapping names
    the files too)."""
    if any(v.kind == "sharded" for v in items):
        return None
    first = next((c.file for v in items for c in v.components), None)
    if first is None:
        return None
    folder = first[: first.rfind("/") + 1]
    for v in items:
        for c in v.components:
            if not c.file.startswith(folder) or "/" in c.file[len(folder) :]:
                return None
    return folder


def _index_key(
    items: Sequence[Any],
    object_graph: Mapping[str, Any] | None,
    metadata: Mapping[str, Any] | None,
    folder: str | None,
) -> Any:
    """What an index file's bytes depend on besides the checksums, the header values and the
    links' ``folder`` (only its length)."""
    cut = 0 if folder is None else len(folder)
    records = tuple(
        (
            v.path,
            v.kind,
            np.dtype(v.dtype),
            tuple(map(int, v.shape)),
            dict(v.attrs),
            tuple((c.file[cut:], c.dataset) for c in v.components),
        )
        for v in items
    )
    size = None if folder is None else len(folder.encode())
    return ("index", _library_version(), metadata_key(metadata), object_graph, size, records)


def _relink(prep: Prepared, folder: bytes) -> bool:
    """Put the links' folder ``folder`` (of the cached one's length) into the cached index
    image, in place: its bytes at each link, and the lookup3 checksums of the header chunks
    holding them (nothing else of the image is copied or read). The image then names
    ``folder`` (``prep.folder``), and a later save to it writes the image as it is. False when
    the cached plan cannot tell where the folder lies. The caller holds ``prep.lock``."""
    if prep.relinker is None:
        prep.relinker = _relinker(prep) or False
        prep.plan.release()
    if prep.relinker is False:
        return False
    runs, spans = prep.relinker
    if not isinstance(prep.image, np.ndarray):  # (writable from now on)
        prep.image = np.frombuffer(bytearray(prep.image), np.uint8)
    image: np.ndarray = prep.image
    width = len(folder)
    image[(runs[:, None] + np.arange(width)).reshape(-1)] = np.tile(
        np.frombuffer(folder, np.uint8), runs.size
    )
    sums = lookup3_many(image, cast(Any, spans))  # (an (n, 2) array: taken as it is)
    image[(spans[:, 1:2] + np.arange(4)).reshape(-1)] = sums.astype("<u4").view(np.uint8)
    prep.folder = folder
    return True


def _relinker(prep: Prepared) -> tuple[np.ndarray, np.ndarray] | None:
    """Where the links' folder lies in the cached image (each link's first byte) and the
    header chunks holding them (start, checksum offset): found by encoding the metadata again
    with every byte of the folder changed and comparing, then checked (each place holds the
    whole folder, inside a checksummed chunk)."""
    old, plan = prep.folder, prep.plan
    if not old:
        return None
    stand_in = bytes(b ^ 1 for b in old)
    plan.refresh(prep.first, {})  # (the root values of the cached image, not the last save's)
    count = plan.relink(old, stand_in)
    try:
        again = plan.metadata(prep.capacities)
    finally:
        plan.relink(stand_in, old)
    a = np.frombuffer(prep.image, np.uint8)
    b = np.frombuffer(again.pieces[0][1], np.uint8)
    spans = np.asarray(plan.checksum_spans, np.int64).reshape(-1, 2)
    if a.size != b.size or not spans.size:
        return None
    diff = np.flatnonzero(a != b)
    sums = np.zeros(a.size + 4, bool)
    sums[(spans[:, 1:2] + np.arange(4)).reshape(-1)] = True
    places = diff[~sums[diff]]
    width = len(old)
    if places.size != count * width:
        return None
    runs = places.reshape(count, width)
    if not (
        np.array_equal(runs - runs[:, :1], np.broadcast_to(np.arange(width), runs.shape))
        and np.array_equal(a[runs], np.broadcast_to(np.frombuffer(old, np.uint8), runs.shape))
    ):
        return None
    order = np.argsort(spans[:, 0])
    starts, ends = spans[order, 0], spans[order, 1]
    which = np.searchsorted(starts, runs[:, 0], "right") - 1
    if (which < 0).any() or (runs[:, -1] >= ends[np.maximum(which, 0)]).any():
        return None  # (a link outside a checksummed chunk: not what the generator writes)
    return runs[:, 0].copy(), spans[order][unique_ints(which)[0]]


def _prepare_index(
    key: Any,
    items: Sequence[Any],
    object_graph: Mapping[str, Any] | None,
    root: Mapping[str, Any],
    folder: str | None,
) -> Prepared:
    """An index file's plan, metadata image and index template (with the links' ``folder``,
    the plan is kept whole until a save to another folder asks where the folder lies)."""
    documents = [INDEX_DATASET] + ([GRAPH_DATASET] if object_graph is not None else [])
    root = dict(root)
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
        meta["crc32c"] = crc_mark(n)
        index[v.path] = meta
    plan = FilePlan(plan_vars, root_attrs=root, documents=documents)
    template = marked_template(index)
    if template is None:  # (a value with a mark's text: made record by record)
        for v in items:
            index[v.path]["crc32c"] = [int(c.crc32c) for c in v.components]
        template = _index_template(index)
    checksums = sum(len(v.components) for v in items)
    bare = len(template) - template.count("%%") - 2 * checksums
    capacities = {INDEX_DATASET: index_capacity(bare, checksums)}
    graph = None
    if object_graph is not None:
        graph = json.dumps(object_graph).encode()
        capacities[GRAPH_DATASET] = len(graph)
    meta_out = plan.metadata(capacities)
    if folder is None:
        plan.release()
    (at, image), *rest = meta_out.pieces
    assert at == 0 and not rest
    prep = Prepared(
        key,
        plan,
        image,
        meta_out.file_size,
        meta_out.documents,
        template_runs(template, checksums),
        capacities,
        ((), ""),
        graph,
    )
    prep.folder = None if folder is None else folder.encode()
    prep.first = _changing(root)  # (the root values its image holds)
    return prep
