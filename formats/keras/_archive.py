"""Keras 3 ``.keras`` archives: the weights inside, read in place; written from a template.

A ``.keras`` file (Keras 3 ``model.save``) is a zip archive of ``config.json`` (the model's
architecture), ``metadata.json`` (Keras version, date), ``model.weights.h5`` (the weights, in
the layout of :mod:`._weights`) and optionally ``assets/``. Reading opens the weights member
as the ``keras`` format does a ``.weights.h5`` file: a member stored uncompressed (as Keras
writes it) is read in place through a window onto the archive, a compressed one is inflated
into an anonymous temporary file first. The member's CRC-32 from the zip directory is checked
when the archive is opened; every member is checked by the one zip policy
(:mod:`parallelvars.formats._zip`: no duplicate or overlapping entries, bounded expansion,
sizes and offsets inside the file) before anything is read or allocated.

Writing needs the model's own archive as a template (``like=``): its ``config.json``,
``metadata.json`` and assets are copied as they are (under the same zip policy as any input,
each member's CRC-32 checked as it is copied) and its weights replaced, so
``keras.saving.load_model`` loads the result. The weights must fit the template's structure
exactly (the same datasets, shapes and dtypes); anything else is refused before a byte is
written, never turned into an archive Keras cannot load.

The ``keras`` format's entry points (:func:`open_keras`, :func:`write_keras`,
:func:`sniff_keras`) are here: a ``.keras`` archive or a ``.weights.h5`` file, the latter
handed to :mod:`._weights`.
"""

from __future__ import annotations

import io
import os
import shutil
import struct
import tempfile
import zipfile
import zlib
from collections.abc import Mapping
from typing import IO, Any, cast

import h5py

from parallelvars._fileio import atomic_path, load_json, open_input, open_input_file
from parallelvars.errors import (
    CorruptCheckpointError,
    InvalidArgumentError,
    InvalidEntryError,
    NotACheckpointError,
    ParallelVarsError,
    TruncatedFileError,
)
from parallelvars.formats._h5 import H5_ERRORS
from parallelvars.formats._view import CheckpointView, Entry
from parallelvars.formats._zip import (
    ZIP_ERRORS,
    check_members,
    copy_members,
    open_zip,
    zip_errors,
)
from parallelvars.formats.keras._layout import (
    KERAS_LAYOUT,
    LEGACY_LAYOUT,
    RESERVED,
)
from parallelvars.formats.keras._weights import (
    keras3_mapping,
    open_weights,
    sniff_weights,
    write_weights,
)

__all__ = [
    "WEIGHTS_MEMBER",
    "is_keras_archive",
    "is_zip",
    "open_keras",
    "open_keras_archive",
    "sniff_keras",
    "write_keras",
    "write_keras_archive",
]

WEIGHTS_MEMBER = "model.weights.h5"
CONFIG_MEMBER = "config.json"
_LOCAL_HEADER = struct.Struct("<4s22xHH")  # signature, ..., name length, extra length
_BLOCK = 1 << 20


def is_keras_archive(path: str, head: bytes = b"") -> bool:
    """True for a zip archive holding ``config.json`` and ``model.weights.h5``."""
    if os.path.isdir(path) or not (head or _head(path)).startswith(b"PK"):
        return False
    try:
        with open_input_file(path) as f, zipfile.ZipFile(f) as zf:
            names = set(zf.namelist())
    except (*ZIP_ERRORS, ParallelVarsError):
        return False
    return WEIGHTS_MEMBER in names and CONFIG_MEMBER in names


def is_zip(path: str) -> bool:
    """Whether ``path`` is a regular file that starts like a zip archive."""
    return not os.path.isdir(path) and _head(path).startswith(b"PK")


def _head(path: str) -> bytes:
    try:
        fd = open_input(path)  # never a FIFO or a device
    except (OSError, ParallelVarsError):
        return b""
    try:
        return os.pread(fd, 4, 0)
    except OSError:
        return b""
    finally:
        os.close(fd)


class _Window(io.RawIOBase):
    """Bytes ``start:start + size`` of an open file, read with ``pread`` (thread-safe)."""

    def __init__(self, f: IO[bytes], start: int, size: int) -> None:
        self._f = f
        self._fd = f.fileno()
        self._start = start
        self._size = size
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        n = max(0, min(len(view), self._size - self._pos))
        done = 0
        while done < n:
            chunk = os.pread(self._fd, n - done, self._start + self._pos + done)
            if not chunk:
                break
            view[done : done + len(chunk)] = chunk
            done += len(chunk)
        self._pos += done
        return done

    def close(self) -> None:
        if not self.closed:
            self._f.close()
        super().close()


def _archive(path: str) -> tuple[IO[bytes], zipfile.ZipFile, list[zipfile.ZipInfo]]:
    """The archive ``path`` (a file the user named) opened, and its members checked by the
    one zip policy (:func:`parallelvars.formats._zip.check_members`)."""
    f = open_input_file(path)
    try:
        size = os.fstat(f.fileno()).st_size
        zf = open_zip(f, path, expected="a Keras .keras archive")
        try:
            with zip_errors("damaged zip archive", path):
                infos = check_members(zf, path, size)
        except BaseException:
            zf.close()
            raise
    except BaseException:
        f.close()
        raise
    return f, zf, infos


def _weights_file(path: str) -> tuple[IO[bytes], int]:
    """The weights member of the archive ``path`` as a seekable binary file, and its size."""
    where = f"{path}/{WEIGHTS_MEMBER}"
    f, zf, infos = _archive(path)
    keep = False
    try:
        size = os.fstat(f.fileno()).st_size
        info = next((i for i in infos if i.filename == WEIGHTS_MEMBER), None)
        if info is None:
            raise NotACheckpointError(
                "a zip archive without model weights",
                file=path,
                expected=f"a member {WEIGHTS_MEMBER!r} (a Keras 3 .keras archive)",
                found=", ".join(i.filename for i in infos[:5]) or "no members",
            )
        if info.compress_type == zipfile.ZIP_STORED:
            start = _stored_data_start(f, info, size, where)
            window = _Window(f, start, info.file_size)  # owns f from here: closed with the view
            keep = True
            try:
                _check_crc(window, info, where)
            except BaseException:
                window.close()
                raise
            window.seek(0)
            return cast(IO[bytes], window), info.file_size  # h5py reads it as a binary file
        out = tempfile.TemporaryFile()  # noqa: SIM115 - closed with the view
        try:
            with zip_errors("the weights member cannot be inflated", where), zf.open(info) as m:
                shutil.copyfileobj(m, out, _BLOCK)  # stops at file_size; checks the CRC at the end
            out.seek(0)
        except BaseException:
            out.close()
            raise
        return out, info.file_size
    finally:
        zf.close()
        if not keep:
            f.close()


def _stored_data_start(f: IO[bytes], info: zipfile.ZipInfo, size: int, where: str) -> int:
    """Where an uncompressed member's bytes start, checked against the archive's size."""
    raw = os.pread(f.fileno(), _LOCAL_HEADER.size, info.header_offset)
    if len(raw) < _LOCAL_HEADER.size:
        raise TruncatedFileError("the archive ends inside a member's header", file=where)
    signature, name_len, extra_len = _LOCAL_HEADER.unpack(raw)
    if signature != b"PK\x03\x04":
        raise CorruptCheckpointError(
            "the member's local header is damaged",
            file=where,
            expected="signature PK\\x03\\x04",
            found=repr(signature),
        )
    start = info.header_offset + _LOCAL_HEADER.size + name_len + extra_len
    if info.compress_size != info.file_size or start + info.file_size > size:
        raise TruncatedFileError(
            "the weights member extends past the end of the archive",
            file=where,
            expected=f"{start + info.file_size} bytes",
            found=f"{size} bytes",
        )
    return start


def _check_crc(window: _Window, info: zipfile.ZipInfo, where: str) -> None:
    crc = 0
    buf = bytearray(_BLOCK)
    while n := window.readinto(buf):
        crc = zlib.crc32(memoryview(buf)[:n], crc)
    if crc != info.CRC:
        raise CorruptCheckpointError(
            "the weights member does not match its CRC-32 in the zip directory",
            file=where,
            expected=f"crc32 {info.CRC:#010x}",
            found=f"crc32 {crc:#010x}",
        )


def open_keras_archive(path: str | os.PathLike[str]) -> CheckpointView:
    """Open the weights of a Keras 3 ``.keras`` archive (entry paths as in ``.weights.h5``)."""
    p = os.fspath(path)
    fobj, size = _weights_file(p)
    try:
        try:
            h5 = h5py.File(fobj, "r")
        except H5_ERRORS as exc:
            raise CorruptCheckpointError(
                f"h5py cannot open the weights ({exc})", file=f"{p}/{WEIGHTS_MEMBER}"
            ) from None
        view = open_weights(f"{p}/{WEIGHTS_MEMBER}", h5=h5, size=size, owned=fobj)
    except BaseException:
        fobj.close()
        raise
    view.path = p
    return view


def keras_layer_order(path: str | os.PathLike[str]) -> tuple[list[str], str | None]:
    """The names of the model's layers in the model's order, from the ``config.json`` of the
    ``.keras`` archive ``path``, and the layout of its weights (``keras_weights_layout``: each
    ``vars`` group's layer name). A legacy Keras file lists layers in this order."""
    p = os.fspath(path)
    f, zf, infos = _archive(p)
    try:
        info = next((i for i in infos if i.filename == CONFIG_MEMBER), None)
        if info is None:
            raise NotACheckpointError(
                "a zip archive without a model config",
                file=p,
                expected=f"a member {CONFIG_MEMBER!r} (a Keras 3 .keras archive)",
                found=f"members {sorted(i.filename for i in infos)[:5]}",
            )
        with zip_errors("damaged zip archive", p, CONFIG_MEMBER):
            raw = zf.read(info)  # its expansion bounded by check_members
    finally:
        zf.close()
        f.close()
    doc = load_json(raw, file=f"{p}/{CONFIG_MEMBER}", what="Keras model config")
    cfg = doc.get("config") if isinstance(doc, dict) else None
    layers = cfg.get("layers") if isinstance(cfg, dict) else None
    if not isinstance(layers, list):
        raise InvalidArgumentError(
            f"{p}: the model config lists no layers (config.json: config.layers); cannot "
            "tell the model's layer order"
        )
    names = []
    for layer in layers:
        lcfg = layer.get("config") if isinstance(layer, dict) else None
        name = lcfg.get("name") if isinstance(lcfg, dict) else None
        if not isinstance(name, str) and isinstance(layer, dict):
            name = layer.get("name")
        if isinstance(name, str):
            names.append(name)
    with open_keras_archive(p) as source:
        layout = source.metadata.get(KERAS_LAYOUT)
    return names, layout if isinstance(layout, str) else None


def _structure(view: Mapping[str, Entry]) -> dict[str, tuple[str, tuple[int, ...]]]:
    return {
        k: (str(e.dtype), tuple(int(s) for s in e.shape))
        for k, e in view.items()
        if not k.startswith(f"{RESERVED}/")
    }


def write_keras_archive(
    path: str | os.PathLike[str],
    entries: Mapping[str, Entry],
    *,
    like: str | os.PathLike[str] | None,
    metadata: Mapping[str, Any] | None = None,
) -> str:
    """Write ``entries`` as the weights of a copy of the archive ``like``.

    Raises:
        InvalidArgumentError: no template.
        InvalidEntryError: the weights do not fit the template's structure.
    """
    p = os.fspath(path)
    if like is None:
        raise InvalidArgumentError(
            f"{p}: a .keras archive holds the model's architecture besides its weights; "
            "pass the model's own archive as a template (like=TEMPLATE.keras, --like)"
        )
    template = os.fspath(like)
    with open_keras_archive(template) as source:
        want = _structure(source)
        layout = source.metadata.get(KERAS_LAYOUT)
    meta = dict(metadata if metadata is not None else getattr(entries, "metadata", None) or {})
    keys, _ = keras3_mapping(entries, meta, p)  # a legacy file's layers under Keras 3's names
    got = {keys[k]: (str(e.dtype), tuple(int(s) for s in e.shape)) for k, e in entries.items()}
    missing = sorted(set(want) - set(got))
    extra = sorted(set(got) - set(want))
    differ = sorted(k for k in set(want) & set(got) if want[k] != got[k])
    if missing or extra or differ:
        problems = []
        if missing:
            problems.append(f"missing {', '.join(missing[:5])}")
        if extra:
            problems.append(f"not in the template {', '.join(extra[:5])}")
        for k in differ[:5]:
            problems.append(
                f"{k} is {got[k][0]} {got[k][1]}, the template's {want[k][0]} {want[k][1]}"
            )
        raise InvalidEntryError(
            "the weights do not fit the template's structure",
            file=p,
            variable=(missing or extra or differ)[0],
            expected=f"the {len(want)} weights of {template}",
            found="; ".join(problems),
        )
    meta.pop(LEGACY_LAYOUT, None)
    if layout is not None:
        meta[KERAS_LAYOUT] = layout  # the template's groups and their attributes
    with tempfile.TemporaryDirectory(dir=os.path.dirname(os.path.abspath(p)) or None) as tmpdir:
        weights = write_weights(
            os.path.join(tmpdir, WEIGHTS_MEMBER), entries, metadata=meta, keys=keys
        )
        # The template is as hostile as any input: its members are checked by the zip policy
        # (no duplicate or overlapping entries, the expansion bounded) and each is read to its
        # end (its CRC-32 checked) as it is copied.
        f, zin, infos = _archive(template)
        try:
            with atomic_path(p) as tmp, zipfile.ZipFile(tmp, "w") as zout:
                copy_members(  # the template's members in its order, the weights replaced
                    zin,
                    infos,
                    zout,
                    template,
                    replace=lambda info: info.filename == WEIGHTS_MEMBER,
                    replaced=lambda z, info: z.write(
                        weights, WEIGHTS_MEMBER, compress_type=zipfile.ZIP_STORED
                    ),
                )
        finally:
            zin.close()
            f.close()
    return p


def open_keras(
    path: str | os.PathLike[str],
    *,
    h5: h5py.File | None = None,
    size: int | None = None,
    owned: IO[bytes] | None = None,
) -> CheckpointView:
    """Open a Keras 3 ``.weights.h5`` file or ``.keras`` archive lazily (entry paths:
    ``layers/<name>/vars/<i>``).

    Files we wrote carry CRC-32Cs (per dataset and of the structure), checked on read; a file
    from Keras has none and is read as it is. ``h5``, ``size`` and ``owned``: the weights of a
    ``.keras`` archive already open.
    """
    p = os.fspath(path)
    if h5 is None and is_zip(p):  # a .keras archive: the weights inside
        return open_keras_archive(p)
    return open_weights(p, h5=h5, size=size, owned=owned)


def write_keras(
    path: str | os.PathLike[str],
    entries: Mapping[str, Entry],
    *,
    metadata: Mapping[str, Any] | None = None,
    like: str | os.PathLike[str] | None = None,
) -> str:
    """Write ``entries`` as a Keras 3 ``.weights.h5`` file (or ``.keras`` archive), one tensor
    at a time.

    Args:
        path: the output file; a name ending in ``.keras`` writes an archive (needs ``like``).
        entries: the entries (a view of a Keras file keeps its exact layout).
        metadata: file metadata (default: the source view's); ``keras_weights_layout`` gives
            the groups' attributes. The weights of a legacy Keras file (``keras_legacy_layout``)
            go where Keras 3 looks for them (``layers/<class>/vars/<i>``), which needs the
            model config of a full-model file; a mapping that cannot be made is a ValueError.
        like: for a ``.keras`` archive, the model's own archive: its configuration is kept and
            its weights replaced.

    Returns:
        The file written.
    """
    p = os.fspath(path)
    if p.lower().endswith(".keras"):
        return write_keras_archive(p, entries, like=like, metadata=metadata)
    if like is not None:
        raise InvalidArgumentError(
            f"{p}: like= applies to .keras archives (a template's config kept, its weights "
            "replaced); a .weights.h5 file holds the weights only"
        )
    return write_weights(p, entries, metadata=metadata)


def sniff_keras(path: str, head: bytes) -> bool:
    """True for an HDF5 file with Keras 3 ``vars`` groups and no legacy attributes, or a
    ``.keras`` archive."""
    if head.startswith(b"PK"):
        return is_keras_archive(path, head)
    return sniff_weights(path, head)
