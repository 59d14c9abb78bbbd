"""What an HDF5 file may make a reader touch: the one indirection policy of every HDF5 reader.

HDF5 can make a dataset's bytes come from somewhere else than the file being read: *external
storage* (raw bytes in any named file), *virtual datasets* (selections of datasets in other
files), and *external* or *user-defined links* (objects of another file). A hostile file would use
them to copy a local file into a conversion's output, to leak it through checksums, to make a
reader block on a FIFO or read gigabytes of ``/dev/zero``. Every HDF5 reader of the project (the
native reader, the Keras readers, the CLI) goes through this module, which refuses:

* external storage, on any dataset;
* virtual datasets, except our own sharded ``value`` whose sources are all in the same file
  (source file name ``"."``) or, in a multi-process checkpoint's index file, all in its own
  parts (each named as its external links are, see below; each source dataset a plain
  dataset of that part, itself checked by this policy);
* soft, external and user-defined links, checked *before* HDF5 follows them, except the external
  links a multi-process checkpoint writes to its own ``<file>.parts/`` folder: a relative name
  ``<file name>.parts/<part>`` without ``..``, whose target is a regular file (not a symlink,
  FIFO or device) inside that folder; the part is opened by the reader, not by HDF5;
* files that are not regular files (a FIFO would block the open forever), and parts that are
  symbolic links out of their folder (the rule of every file a reader opens,
  :func:`parallelvars._fileio.open_input`);
* group paths deeper than :data:`MAX_DEPTH` levels.

Every refusal is a :class:`~parallelvars.errors.CorruptCheckpointError` naming the file, the
object and what was found.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from typing import Any

import h5py
import numpy as np

from parallelvars._fileio import check_input
from parallelvars.errors import CorruptCheckpointError

__all__ = [
    "H5_ERRORS",
    "HDF5_SIGNATURE",
    "MAX_COMPRESSION",
    "MAX_DEPTH",
    "PARTS_SUFFIX",
    "check_dataset",
    "check_path",
    "check_regular_file",
    "check_stored_type",
    "get",
    "open_dataset",
    "part_file",
    "walk",
]

#: The deepest group path a reader walks (a Keras or native path is a few levels deep).
MAX_DEPTH = 256
#: The folder of a multi-process checkpoint's per-rank files is ``<file><PARTS_SUFFIX>`` (the
#: checkpoint writer takes it from here).
PARTS_SUFFIX = ".parts"

_LINK_KINDS = {h5py.h5l.TYPE_SOFT: "soft link", h5py.h5l.TYPE_EXTERNAL: "external link"}
#: The first eight bytes of every HDF5 file.
HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"
#: What h5py raises on damaged HDF5 structure (HDF5's error stack as h5py maps it, and the
#: decoding errors of attribute values): every HDF5 reader catches this one tuple.
H5_ERRORS = (
    OSError,
    RuntimeError,
    LookupError,
    ValueError,
    TypeError,
    AttributeError,
    ArithmeticError,
)
#: deflate's best case is about 1032:1: no compressed dataset can expand more than this, so a
#: reader bounds a filtered dataset's size by its stored bytes times this.
MAX_COMPRESSION = 1100


_POLICY_HINT = (
    "HDF5 indirection out of the file is refused (docs/FORMAT.md, 'What a reader refuses')"
)


def _parts_hint(folder: str) -> str:
    return (
        f"a checkpoint saved by several processes is the file plus its folder {folder}/ beside it, "
        "under the names it was saved with; copy both without renaming, or make a standalone file "
        "where both are with 'parallelvars convert CHECKPOINT standalone.h5'"
    )


def _refuse(
    what: str, file: str, name: str | None, found: str, *, hint: str = _POLICY_HINT
) -> CorruptCheckpointError:
    return CorruptCheckpointError(what, file=file, variable=name, found=found, hint=hint)


def check_regular_file(path: str) -> os.stat_result:
    """The ``fstat`` of ``path``, a file the user named, refusing anything but a regular file
    (the rule of every file a reader opens, :func:`parallelvars._fileio.open_input`): a FIFO,
    a device or a socket is refused before anything opens it (opening a FIFO blocks)."""
    return check_input(path)


def _link(loc: Any, name: bytes) -> tuple[int, Any]:
    """(link type, value) of the link ``name`` in ``loc``, without following it."""
    info = loc.links.get_info(name)
    value = loc.links.get_val(name) if info.type != h5py.h5l.TYPE_HARD else None
    return info.type, value


def _describe(kind: int, value: Any) -> str:
    what = _LINK_KINDS.get(kind, "user-defined link")
    if isinstance(value, tuple) and len(value) == 2:
        target = f"{os.fsdecode(value[0])}:{os.fsdecode(value[1])}"
        return f"{what} to {target!r}"
    if isinstance(value, bytes):
        return f"{what} to {os.fsdecode(value)!r}"
    return what


def check_path(
    loc: Any, path: str, file: str, *, checked: set[str] | None = None, last_external: bool = False
) -> tuple[bytes, bytes] | None:
    """Refuse any link on ``path`` (inside ``loc``, an h5py id) that is not a hard link.

    Each prefix is checked before HDF5 resolves the next one, so no link is ever followed.
    ``checked`` caches the group prefixes found sound (variables share their parents). With
    ``last_external``, the last link may be an external link: its (file name, object path) is
    returned for :func:`part_file` to validate, and HDF5 is not asked to follow it.
    """
    parts = [p for p in path.split("/") if p]
    if len(parts) > MAX_DEPTH:
        raise _refuse(
            "the object path is too deep", file, path, f"{len(parts)} levels, at most {MAX_DEPTH}"
        )
    prefix = "" if path.startswith("/") else "."
    for n, part in enumerate(parts):
        prefix = f"{prefix}/{part}"
        last = n == len(parts) - 1
        if not last and checked is not None and prefix in checked:
            continue
        try:
            kind, value = _link(loc, prefix.encode())
        except H5_ERRORS:
            return None  # no such link: the caller's open reports it as missing
        if kind != h5py.h5l.TYPE_HARD:
            if last and last_external and kind == h5py.h5l.TYPE_EXTERNAL:
                return (bytes(value[0]), bytes(value[1]))
            raise _refuse(
                "the object is reached through a link out of the file's own objects",
                file,
                prefix.removeprefix(".").lstrip("/"),
                _describe(kind, value),
            )
        if not last and checked is not None:
            checked.add(prefix)
    return None


def check_dataset(
    dsid: Any, file: str, name: str, *, own_virtual: bool = False, dtype: np.dtype | None = None
) -> None:
    """Refuse a dataset whose bytes would come from outside its file.

    ``dsid`` is an h5py ``DatasetID`` (or ``Dataset``). External storage is always refused;
    a virtual dataset only when ``own_virtual`` and all its sources are in the same file. With
    ``dtype``, the stored type is checked too (:func:`check_stored_type`).
    """
    if isinstance(dsid, h5py.Dataset):
        dsid = dsid.id
    try:
        dcpl = dsid.get_create_plist()
        external = dcpl.get_external_count()
        layout = dcpl.get_layout()
        first = dcpl.get_external(0)[0] if external else b""
        sources = (
            [dcpl.get_virtual_filename(i) for i in range(dcpl.get_virtual_count())]
            if layout == h5py.h5d.VIRTUAL
            else []
        )
    except H5_ERRORS as exc:
        raise CorruptCheckpointError(
            "cannot read the dataset's layout", file=file, variable=name, found=str(exc)[:200]
        ) from None
    if external:
        raise _refuse(
            "the dataset keeps its bytes in external storage",
            file,
            name,
            f"{external} external file(s), the first {os.fsdecode(first)!r}",
        )
    if layout == h5py.h5d.VIRTUAL:
        foreign = sorted({s for s in sources if s != "."})
        if not own_virtual:
            raise _refuse(
                "the dataset is a virtual dataset",
                file,
                name,
                f"sources in {foreign[:3]!r}" if foreign else "a virtual layout",
            )
        if foreign:
            _check_part_sources(dcpl, file, name)
    if dtype is not None:
        check_stored_type(dsid, dtype, file, name, dcpl=dcpl)


def get(group: h5py.Group, path: str, file: str) -> h5py.Group | h5py.Dataset | None:
    """``group.get(path)`` with every link on the way checked first (None when absent)."""
    check_path(group.id, path, file)
    try:
        obj = group.get(path)
    except H5_ERRORS:
        return None
    if isinstance(obj, h5py.Dataset):
        check_dataset(obj.id, file, f"{group.name.rstrip('/')}/{path}".lstrip("/"))
    return obj if isinstance(obj, (h5py.Group, h5py.Dataset)) else None


def check_stored_type(
    dsid: Any, dtype: np.dtype, file: str, name: str, *, dcpl: Any = None
) -> None:
    """Refuse a dataset whose HDF5 type or layout is not one our writer makes for ``dtype``.

    Reading converts the stored type to ``dtype``: a stored type of another size (a fixed-length
    string of megabytes per element where the index says ``bytes``) would make HDF5 allocate
    and convert far more than the checks on the declared dtype allow. Variable-length values
    (``bytes``) must be contiguous and unfiltered, as written, so their count is bounded by the
    file's size.
    """
    try:
        stored = dsid.dtype
        dcpl = dcpl or dsid.get_create_plist()
        plain = dcpl.get_layout() == h5py.h5d.CONTIGUOUS and dcpl.get_nfilters() == 0
    except H5_ERRORS as exc:
        raise CorruptCheckpointError(
            "cannot read the dataset's type", file=file, variable=name, found=str(exc)[:200]
        ) from None
    if dtype.kind == "O":
        string = h5py.check_string_dtype(stored)
        vlen = h5py.check_vlen_dtype(stored) is not None or (
            string is not None and string.length is None
        )
        ok = vlen and plain
    else:  # (variable-length and string types map to kinds "O" and "S")
        ok = stored.kind in "biufcV" and stored.itemsize == dtype.itemsize and stored.fields is None
    if not ok:
        expected = (
            "variable-length bytes, contiguous and unfiltered"
            if dtype.kind == "O"
            else f"{dtype.itemsize}-byte elements of {dtype}"
        )
        raise CorruptCheckpointError(
            "the stored type does not match the variable's dtype",
            file=file,
            variable=name,
            expected=expected,
            found=f"{stored} ({'contiguous' if plain else 'chunked or filtered'})",
        )


def open_dataset(
    loc: Any,
    path: str,
    file: str,
    *,
    checked: set[str] | None = None,
    dtype: np.dtype | None = None,
) -> Any:
    """The low-level id of the dataset at ``path`` in ``loc``, its links and layout checked
    (and its stored type, given the ``dtype`` it is read as).

    Returns None when there is no such object (the caller names what is missing).
    """
    check_path(loc, path, file, checked=checked)
    try:
        dsid = h5py.h5d.open(loc, path.encode())
    except H5_ERRORS:
        return None
    check_dataset(dsid, file, path.lstrip("/"), dtype=dtype)
    return dsid


def part_file(file: str, link: tuple[bytes, bytes], name: str) -> str:
    """The validated path of a multi-process checkpoint's part reached by external link ``link``.

    The link's file name must be ``<file name>.parts/<part>`` (relative, no ``..`` or ``.``
    component, nothing else), and the part a regular file in a real folder ``<file>.parts``
    next to ``file`` (a symbolic link only to another file of that folder). Anything else is
    refused.
    """
    target = os.fsdecode(link[0])
    base = os.path.basename(file) + PARTS_SUFFIX
    parts = target.split("/")
    if (
        os.path.isabs(target)
        or "\\" in target
        or "\x00" in target
        or len(parts) != 2
        or parts[0] != base
        or parts[1] in ("", ".", "..")
    ):
        # A well-formed link into another name's parts folder: this file was renamed or copied
        # away from its folder. Still refused (it could reach another checkpoint's parts).
        renamed = (
            len(parts) == 2
            and parts[0].endswith(PARTS_SUFFIX)
            and "/" not in parts[0]
            and parts[0] not in (".", "..")
        )
        raise _refuse(
            "an external link does not point into the checkpoint's own parts folder",
            file,
            name,
            f"external link to {target!r}, expected {base}/<part>",
            hint=_parts_hint(parts[0]) if renamed else _POLICY_HINT,
        )
    folder = os.path.join(os.path.dirname(os.path.abspath(file)), base)
    try:
        st = os.lstat(folder)
    except OSError:
        raise _refuse(
            "the parts folder of an external link is missing",
            file,
            name,
            folder,
            hint=_parts_hint(base),
        ) from None
    if not stat.S_ISDIR(st.st_mode):
        raise _refuse(
            "the parts folder is not a folder", file, name, f"{folder} is not a real folder"
        )
    path = os.path.join(folder, parts[1])
    check_input(path, within=folder, referrer=file, variable=name)
    if os.path.dirname(os.path.realpath(path)) != os.path.realpath(folder):
        raise _refuse("an external link leaves the parts folder", file, name, path)
    return path


def member_names(group: h5py.Group, file: str, path: str) -> list[str]:
    """The names of ``group``'s members (``path``: the group's, for the error), refusing one
    that is not UTF-8 text as the file's error, not as h5py's ``UnicodeDecodeError``: every
    name we read becomes a variable's path, and every format stores those as UTF-8."""
    names = []
    for raw in group.id:  # (bytes: h5py's high-level iteration decodes, and raises)
        try:
            names.append(raw.decode("utf-8"))
        except UnicodeDecodeError as exc:
            raise _refuse(
                "an object's name is not UTF-8 text",
                file,
                f"{path}/{raw.decode('utf-8', 'backslashreplace')}"
                if path
                else raw.decode("utf-8", "backslashreplace"),
                f"{raw[exc.start : exc.end]!r} at byte {exc.start} of {raw!r}",
                hint="names must be valid Unicode text in every format",
            ) from None
    return names


def _check_part_sources(dcpl: Any, file: str, name: str) -> None:
    """A virtual dataset's sources: each a plain dataset (no virtual layout, no external
    storage, reached through no link) of a part of ``file``'s own parts folder."""
    try:
        pairs = sorted(
            {
                (dcpl.get_virtual_filename(i), dcpl.get_virtual_dsetname(i))
                for i in range(dcpl.get_virtual_count())
            }
        )
    except H5_ERRORS as exc:
        raise CorruptCheckpointError(
            "cannot read the virtual dataset's sources", file=file, variable=name, found=str(exc)
        ) from None
    for source, dataset in pairs:
        if source == ".":
            raise _refuse(
                "the virtual dataset mixes sources in its own file and in parts",
                file,
                name,
                f"sources in '.' and in parts (dataset {dataset!r})",
            )
        try:
            part = part_file(file, (source.encode(), dataset.encode()), name)
        except CorruptCheckpointError:
            raise _refuse(
                "the dataset is a virtual dataset with a source out of the checkpoint's own "
                "parts folder",
                file,
                name,
                f"sources in {source!r}, expected {os.path.basename(file)}{PARTS_SUFFIX}/<part>",
            ) from None
        try:
            with h5py.File(part, "r") as f:
                check_path(f.id, dataset.lstrip("/"), part)
                check_dataset(f[dataset].id, part, dataset)
        except CorruptCheckpointError:
            raise
        except (*H5_ERRORS, KeyError) as exc:
            raise CorruptCheckpointError(
                "a source of the virtual dataset cannot be opened",
                file=file,
                variable=name,
                found=f"{source}:{dataset}: {exc}",
            ) from None


def walk(
    group: h5py.Group, file: str, *, own_virtual: str | None = None, skip_links: bool = False
) -> Iterator[tuple[str, h5py.Group | h5py.Dataset]]:
    """Every object under ``group`` as (path relative to it, object), groups before their members.

    Iterative and linear in the number of links: only hard links are followed, each object once
    (a hard-link cycle is refused), datasets are checked with :func:`check_dataset`, and paths
    deeper than :data:`MAX_DEPTH` are refused. Sibling order is HDF5's (by name). Datasets named
    ``own_virtual`` may be virtual datasets over the same file. With ``skip_links`` (format
    detection), links are passed over instead of refused.
    """
    seen = {group.id}
    stack: list[tuple[str, h5py.Group, int, Iterator[str]]] = [
        ("", group, 0, iter(member_names(group, file, "")))
    ]
    while stack:
        prefix, grp, depth, names = stack[-1]
        name = next(names, None)
        if name is None:
            stack.pop()
            continue
        path = f"{prefix}{name}"
        link = grp.get(name, getlink=True)
        if not isinstance(link, h5py.HardLink):
            if skip_links:
                continue
            if isinstance(link, h5py.SoftLink):
                kind, value = h5py.h5l.TYPE_SOFT, link.path.encode()
            elif isinstance(link, h5py.ExternalLink):
                kind, value = h5py.h5l.TYPE_EXTERNAL, (link.filename.encode(), link.path.encode())
            else:
                kind, value = -1, None
            raise _refuse(
                "the object is reached through a link out of the file's own objects",
                file,
                path,
                _describe(kind, value),
            )
        obj = grp[name]
        if isinstance(obj, h5py.Dataset):
            check_dataset(obj.id, file, path, own_virtual=name == own_virtual)
            yield path, obj
        elif isinstance(obj, h5py.Group):
            if obj.id in seen:
                raise _refuse(
                    "a group is linked twice",
                    file,
                    path,
                    "a hard link to a group met before (a cycle?)",
                )
            seen.add(obj.id)
            if depth + 1 > MAX_DEPTH:
                raise _refuse(
                    "the group path is too deep", file, path, f"more than {MAX_DEPTH} levels"
                )
            yield path, obj
            stack.append((f"{path}/", obj, depth + 1, iter(member_names(obj, file, path))))
