"""The TensorFlow checkpoint as a lazy neutral view (:class:`TfCheckpointView`).

Opening resolves the prefix (a directory goes through its ``checkpoint`` state file), parses
and validates the index, the object graph and our optional metadata key, and groups bundle keys
into variables (see :mod:`._keys`). Tensor bytes are read only by ``Entry.component(i)`` /
``Entry.read_component_into(i, out)``.

Grouping rules:

- ``VARIABLE_VALUE`` and ``parallel_component_N`` of one object become one entry with N+1
  components, of kind ``mirrored`` (TensorFlow's keys do not say more; the ``parallel_kind``
  option picks another kind) unless our metadata key records the kind. With a
  ``parallel_component_0`` key (our layout for on-read SUM / MEAN variables), ``VARIABLE_VALUE``
  holds the aggregate and the entry's N components are ``parallel_component_0..N-1``.
- A partitioned (sliced) tensor tiled along exactly one axis becomes a ``sharded`` entry whose
  components are the slices (``value()`` assembles them); any other slicing, or the
  ``assemble_slices`` option, gives a ``single`` entry whose component is the assembled tensor.
- Keys that are not object-based (name-based checkpoints of ``tf.compat.v1.train.Saver``) keep
  their key as path.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from parallelvars._fileio import load_json
from parallelvars._geometry import offsets_problem, shard_bounds
from parallelvars._ints import is_int
from parallelvars.checkpoint.entry import ArrayEntry
from parallelvars.errors import (
    CorruptCheckpointError,
    ForeignReferenceError,
    FormatVersionError,
    InvalidArgumentError,
    NotACheckpointError,
    UnsupportedDtypeError,
)

from .._view import KINDS, DictView, Entry
from ._bundle import BundleReader, key_str, spec_text
from ._dtypes import DT_NAMES, DT_STRING
from ._graph import TrackableObject, decode_graph
from ._keys import ATTRIBUTES, GRAPH_KEY, METADATA_KEY, PART_ZERO, parse_key
from ._ordered_code import encode_slice_key
from ._proto import DecodeError, SliceSpec
from ._state import STATE_FILENAME, read_state

__all__ = ["TfCheckpointView", "TfEntry", "resolve_prefix", "infer_sharding", "METADATA_FORMAT"]

METADATA_FORMAT = "parallelvars.tf-metadata"
METADATA_VERSION = 1
_QUANTIZED = {11, 12, 13, 15, 16}
_DATA_RE = re.compile(r"^(.*)\.data-\d{5,}-of-\d{5,}$")
_TRAILING_NUMBER = re.compile(r"^(.*?)(\d+)$")


def _inside(directory: str, candidate: str) -> bool:
    """Whether ``candidate`` (symbolic links resolved) lies inside ``directory``."""
    base = os.path.realpath(directory)
    return os.path.commonpath([base, os.path.realpath(candidate)]) == base


def _is_text(text: str) -> bool:
    """Whether ``text`` is valid Unicode (no lone surrogate, no undecodable byte escaped)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _present(index: str) -> bool:
    """Whether an index is there: anything but a folder (a FIFO or a link out is refused when
    it is opened, with the reason, rather than taken for no index)."""
    return os.path.lexists(index) and not os.path.isdir(index)


def resolve_prefix(path: str, *, follow_state_outside: bool = False) -> str:
    """The checkpoint prefix that ``path`` names.

    ``path`` may be a prefix (``dir/ckpt-1``), its ``.index`` or a data file, or a directory:
    then the latest checkpoint of its ``checkpoint`` state file, else its only ``*.index``,
    else (several, no state file) the one with the highest trailing number.

    A state file naming a checkpoint outside the directory (an absolute path elsewhere, a path
    through ``..`` or a symbolic link out) is refused with
    :class:`~parallelvars.errors.ForeignReferenceError` unless ``follow_state_outside``; an
    absolute path whose checkpoint is gone but whose name is in the directory (the directory
    was moved) resolves to the one in the directory.
    """
    if os.path.isdir(path):
        state = read_state(path)
        if state is not None and state.model_checkpoint_path:
            p = state.model_checkpoint_path
            cand = p if os.path.isabs(p) else os.path.join(path, p)
            if not _present(cand + ".index") and os.path.isabs(p):
                moved = os.path.join(path, os.path.basename(p))  # the directory was moved
                if _present(moved + ".index"):
                    cand = moved
            if not follow_state_outside and not _inside(path, cand + ".index"):
                raise ForeignReferenceError(
                    "the checkpoint state file names a checkpoint outside its directory",
                    file=os.path.join(path, STATE_FILENAME),
                    expected="a checkpoint inside the directory",
                    found=repr(p),
                    hint="pass follow_state_outside=True (CLI: --follow-state-outside) to follow it",
                )
            if not _present(cand + ".index"):
                raise NotACheckpointError(
                    "the checkpoint state file names a checkpoint that does not exist",
                    file=os.path.join(path, STATE_FILENAME),
                    expected=f"{cand}.index",
                    found="no such file",
                )
            return cand
        names = sorted(
            f[: -len(".index")]
            for f in os.listdir(path)
            if f.endswith(".index") and _present(os.path.join(path, f))
        )
        if len(names) == 1:
            return os.path.join(path, names[0])
        if not names:
            raise NotACheckpointError(
                "no TensorFlow checkpoint in this directory",
                file=path,
                expected=f"a '{STATE_FILENAME}' state file or a <prefix>.index",
                found="neither",
            )
        matches = [_TRAILING_NUMBER.match(n) for n in names]
        if all(matches) and len({m.group(1) for m in matches if m}) == 1:
            best = max(names, key=lambda n: int(_TRAILING_NUMBER.match(n).group(2)))  # type: ignore[union-attr]
            return os.path.join(path, best)
        raise NotACheckpointError(
            f"several checkpoints and no '{STATE_FILENAME}' state file to say which is the latest",
            file=path,
            found=", ".join(names[:5]) + (", ..." if len(names) > 5 else ""),
            hint="pass the prefix of the one to read",
        )
    if path.endswith(".index") and os.path.isfile(path):
        return path[: -len(".index")]
    m = _DATA_RE.match(path)
    if m and os.path.isfile(path):
        return m.group(1)
    return path


def infer_sharding(
    specs: Sequence[SliceSpec], shape: Sequence[int], axis: int | None = None
) -> tuple[int, list[int]] | None:
    """``(axis, order)`` when the slices tile the tensor along one axis, else None.

    ``order`` lists the slices by position along the axis (their stored order when that already
    tiles). Without ``axis``, it is the only axis along which some slice is partial, and at
    least two slices are needed.
    """
    rank = len(shape)
    if axis is None:
        if len(specs) < 2:
            return None
        partial = {
            d
            for spec in specs
            for d, (start, length) in enumerate(spec)
            if not (start == 0 and (length is None or length == shape[d]))
        }
        if len(partial) != 1:
            return None
        axis = partial.pop()
    if not 0 <= axis < rank or not specs:
        return None
    for spec in specs:
        for d, (start, length) in enumerate(spec):
            if d != axis and not (start == 0 and (length is None or length == shape[d])):
                return None

    def extent(i: int) -> tuple[int, int]:
        start, length = specs[i][axis]
        return start, shape[axis] if length is None else length

    def tiles(order: list[int]) -> bool:
        pos = 0
        for i in order:
            start, length = extent(i)
            if start != pos:
                return False
            pos += length
        return pos == shape[axis]

    listed = list(range(len(specs)))
    if tiles(listed):
        return axis, listed
    ordered = sorted(listed, key=extent)
    return (axis, ordered) if tiles(ordered) else None


class TfEntry(Entry):
    """One variable of a TensorFlow checkpoint; components are read from the bundle on demand.

    Attributes:
        tf_keys: the bundle keys this entry was built from (one per component, or the one key
            of a partitioned tensor).
    """

    def __init__(
        self,
        bundle: BundleReader,
        path: str,
        dtype: np.dtype,
        shape: tuple[int, ...],
        kind: str,
        attrs: dict[str, Any],
        sources: Sequence[bytes | None],
        tf_keys: tuple[str, ...],
    ) -> None:
        self._bundle = bundle
        self.path = path
        self.dtype = dtype
        self.shape = shape
        self.kind = kind
        self.attrs = attrs
        self.num_components = len(sources)
        # None: an empty shard, which has no slice of its own in the bundle
        self._sources = list(sources)
        self.tf_keys = tf_keys

    def component_shape(self, i: int) -> tuple[int, ...]:
        self._check_index(i)
        source = self._sources[i]
        if source is None:
            return super().component_shape(i)
        return self._bundle.entries[source].shape

    def component(self, i: int) -> np.ndarray:
        self._check_index(i)
        source = self._sources[i]
        if source is None:
            return np.empty(self.component_shape(i), self.dtype)
        return self._bundle.read(source)

    def read_component_into(self, i: int, out: np.ndarray) -> None:
        self._check_index(i)
        self.check_out(i, out, file=self._bundle.index_path)  # no cast: Entry.read_component_into
        source = self._sources[i]
        if source is not None:
            self._bundle.read_into(source, out)


class TfCheckpointView(DictView):  # the Mapping over ._entries comes from DictView
    """A TensorFlow checkpoint opened as a lazy :class:`CheckpointView`.

    Args:
        path: a prefix, an ``.index`` or data file, or a checkpoint directory.
        verify: check each tensor's CRC-32C when it is read (block checksums of the index are
            always checked).
        parallel_kind: the kind given to variables with ``parallel_component_N`` keys when our
            metadata key does not record one (``"mirrored"`` or ``"independent"``).
        assemble_slices: read every partitioned tensor as one ``single`` entry.
        skip_unsupported: leave out tensors numpy cannot hold (``DT_VARIANT``,
            ``DT_RESOURCE``), listing them in :attr:`skipped`, instead of raising.
        follow_state_outside: for a directory, follow its ``checkpoint`` state file even when
            it names a checkpoint outside the directory (refused by default).

    Attributes:
        object_graph: the decoded ``TrackableObjectGraph`` nodes, or None (name-based).
        skipped: bundle key -> why it was left out.

    Example:
        >>> with TfCheckpointView("ckpts") as view:  # doctest: +SKIP
        ...     view["model/dense/kernel"].value()
    """

    format = "tf"

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        verify: bool = True,
        parallel_kind: str = "mirrored",
        assemble_slices: bool = False,
        skip_unsupported: bool = False,
        follow_state_outside: bool = False,
    ) -> None:
        if parallel_kind not in ("mirrored", "independent", "on_read"):
            raise InvalidArgumentError(
                f"parallel_kind must be 'mirrored', 'independent' or 'on_read', not {parallel_kind!r}"
            )
        self.source = os.fspath(path)
        self.path = resolve_prefix(self.source, follow_state_outside=follow_state_outside)
        # The checkpoint's folder, which its files found by name may not leave (symbolic
        # links out are refused): the directory named, else the prefix's own.
        folder = (
            self.source
            if os.path.isdir(self.source) and _inside(self.source, self.path + ".index")
            else os.path.dirname(self.path) or os.curdir
        )
        self._bundle = BundleReader(
            self.path,
            verify=verify,
            folder=folder,
            index_named=self.source == self.path + ".index",
        )
        state = os.path.join(self.source, STATE_FILENAME)
        self.files = [
            *([state] if os.path.isdir(self.source) and os.path.lexists(state) else []),
            self._bundle.index_path,
            *(
                self._bundle.shard_path(i)
                for i in range(self._bundle.header.num_shards)
                if os.path.lexists(self._bundle.shard_path(i))
            ),
        ]
        self._parallel_kind = parallel_kind
        self._assemble = assemble_slices
        self._skip = skip_unsupported
        self.skipped: dict[str, str] = {}
        self.object_graph: list[TrackableObject] | None = None
        self._entries: dict[str, Entry] = {}  # TfEntry values
        try:
            self._build()
        except BaseException:
            self._bundle.close()
            raise

    # --- Mapping ----------------------------------------------------------------------------

    def close(self) -> None:
        self._bundle.close()

    # --- building ---------------------------------------------------------------------------

    def _corrupt(self, what: str, variable: str | None = None, **kw: Any) -> CorruptCheckpointError:
        return CorruptCheckpointError(what, file=self._bundle.index_path, variable=variable, **kw)

    def _read_string_scalar(self, key: str) -> bytes:
        b = self._bundle
        raw = key.encode("utf-8")
        e = b.entries[raw]
        if e.dtype != DT_STRING or e.shape != () or e.slices:
            raise self._corrupt(
                "not a scalar string tensor",
                variable=key,
                expected="DT_STRING []",
                found=f"{DT_NAMES.get(e.dtype, e.dtype)} {list(e.shape)}",
            )
        return bytes(b.read(raw)[()])

    def _build(self) -> None:
        b = self._bundle
        keys = {key_str(k): k for k in b.entries if k not in b.slice_keys}
        for text, k in keys.items():
            if text.encode("utf-8", "surrogateescape") != k or not _is_text(text):
                # TensorFlow's Python reader refuses such a key too (it decodes keys as UTF-8)
                raise self._corrupt(
                    "a tensor key is not UTF-8 text",
                    variable=k.decode("utf-8", "backslashreplace"),
                    expected="UTF-8 text",
                    found=ascii(k[:80]),
                )
        full_names: dict[str, str] = {}
        if GRAPH_KEY in keys:
            try:
                self.object_graph = decode_graph(self._read_string_scalar(GRAPH_KEY))
            except DecodeError as exc:
                raise self._corrupt(f"bad object graph: {exc}", variable=GRAPH_KEY) from None
            for node in self.object_graph:
                for att in node.attributes:
                    full_names[att.checkpoint_key] = att.full_name
        meta_vars, file_meta = self._read_metadata(keys)
        self.metadata = {
            **file_meta,
            "tf_naming": "object" if self.object_graph is not None else "name",
            "tf_num_shards": b.header.num_shards,
            "tf_producer": b.header.producer,
        }

        # path -> {component: key}, slot relation per path
        groups: dict[str, dict[int, str]] = {}
        slots: dict[str, tuple[str, str]] = {}
        attribute_of: dict[str, str] = {}
        for key in keys:
            if key in (GRAPH_KEY, METADATA_KEY):
                continue
            parsed = parse_key(key)
            if parsed is None:
                path, comp = key, 0
            else:
                path, comp = parsed.path, parsed.component
                if parsed.slot_of is not None and parsed.slot_name is not None:
                    slots[path] = (parsed.slot_of, parsed.slot_name)
                attribute_of[key] = key[key.find("/" + ATTRIBUTES + "/") + len(ATTRIBUTES) + 2 :]
            comps = groups.setdefault(path, {})
            if comp in comps:
                raise self._corrupt(
                    f"keys {comps[comp]!r} and {key!r} name the same variable", variable=path
                )
            comps[comp] = key

        # groups that are not one regular variable become one entry per key
        regular: dict[str, dict[int, str]] = {}
        for path, comps in groups.items():
            if self._is_regular(comps, keys):
                regular[path] = comps
                continue
            for key in comps.values():
                alone = f"{path}/{ATTRIBUTES}/{attribute_of[key]}" if key in attribute_of else key
                if alone in groups or alone in regular:
                    raise self._corrupt(
                        f"key {key!r} and another key both map to {alone!r}", variable=alone
                    )
                regular[alone] = {0: key}

        key_to_path = {key: path for path, comps in regular.items() for key in comps.values()}
        for path in self._order(regular, key_to_path, keys):
            comps = regular[path]
            entry = self._make_entry(
                path, comps, keys, full_names, slots.get(path), meta_vars.get(path)
            )
            if entry is not None:
                self._entries[path] = _exact_counter(entry)

    def _is_regular(self, comps: dict[int, str], keys: dict[str, bytes]) -> bool:
        if len(comps) == 1:
            return 0 in comps
        if PART_ZERO in comps:  # VARIABLE_VALUE: the aggregate; parts 0..N-1 beside it
            if sorted(comps) != [PART_ZERO, *range(len(comps) - 1)]:
                return False
        elif sorted(comps) != list(range(len(comps))):
            return False
        es = [self._bundle.entries[keys[k]] for k in comps.values()]
        return all(e.dtype == es[0].dtype and e.shape == es[0].shape for e in es)

    def _order(
        self, groups: dict[str, dict[int, str]], key_to_path: dict[str, str], keys: dict[str, bytes]
    ) -> list[str]:
        """Depth-first order of the object graph (so a writer rebuilds the same graph), then the
        rest in data-file order."""
        order: dict[str, None] = {}
        nodes = self.object_graph
        if nodes:
            seen: set[int] = set()
            stack = [0]
            while stack:
                nid = stack.pop()
                if nid in seen:
                    continue
                seen.add(nid)
                for att in nodes[nid].attributes:
                    path = key_to_path.get(att.checkpoint_key)
                    if path is not None:
                        order.setdefault(path)
                stack.extend(c.node_id for c in reversed(nodes[nid].children))

        def position(path: str) -> tuple[int, int]:
            e = self._bundle.entries[keys[groups[path][0]]]
            return (e.shard_id, e.offset)

        rest = sorted((p for p in groups if p not in order), key=position)
        return [*order, *rest]

    def _read_metadata(
        self, keys: dict[str, bytes]
    ) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
        if METADATA_KEY not in keys:
            return {}, {}
        raw = self._read_string_scalar(METADATA_KEY)
        doc = load_json(raw, file=self._bundle.index_path, variable=METADATA_KEY, what="metadata")
        if not isinstance(doc, dict) or doc.get("format") != METADATA_FORMAT:
            raise self._corrupt(
                "unrecognised metadata", variable=METADATA_KEY, expected=METADATA_FORMAT
            )
        version = doc.get("version")
        if not isinstance(version, int) or version > METADATA_VERSION:
            raise FormatVersionError(
                "metadata written by a newer version",
                file=self._bundle.index_path,
                variable=METADATA_KEY,
                expected=f"version <= {METADATA_VERSION}",
                found=version,
            )
        variables = doc.get("variables", {})
        file_meta = doc.get("metadata", {})
        if not isinstance(variables, dict) or not isinstance(file_meta, dict):
            raise self._corrupt("malformed metadata", variable=METADATA_KEY)
        for path, rec in variables.items():
            if (
                not isinstance(rec, dict)
                or not isinstance(rec.get("attrs", {}), dict)
                or rec.get("kind", "single") not in KINDS
            ):
                raise self._corrupt(
                    "malformed metadata record", variable=path, found=repr(rec)[:120]
                )
        return variables, file_meta

    def _make_entry(
        self,
        path: str,
        comps: dict[int, str],
        keys: dict[str, bytes],
        full_names: dict[str, str],
        slot: tuple[str, str] | None,
        meta: dict[str, Any] | None,
    ) -> TfEntry | None:
        b = self._bundle
        if PART_ZERO in comps:  # an on-read aggregate under VARIABLE_VALUE: read the parts
            ordered = [comps[PART_ZERO], *(comps[i] for i in range(1, len(comps) - 1))]
            full_names = {**full_names, ordered[0]: full_names.get(comps[0], "")}
        else:
            ordered = [comps[i] for i in range(len(comps))]
        sources = [keys[k] for k in ordered]
        first = b.entries[sources[0]]
        try:
            dtype = b.dtype(sources[0])
        except UnsupportedDtypeError as exc:
            if not self._skip:
                raise UnsupportedDtypeError(
                    f"{exc.what} (key {ordered[0]!r})",
                    file=b.index_path,
                    variable=path,
                    hint="open with skip_unsupported=True to leave such tensors out",
                ) from None
            for k in ordered:
                self.skipped[k] = exc.what
            return None
        attrs: dict[str, Any] = {}
        name = full_names.get(ordered[0])
        if name:
            attrs["name"] = name
        if slot is not None:
            attrs["slot_of"], attrs["slot_name"] = slot
        if first.dtype in _QUANTIZED:
            attrs["tf_dtype"] = DT_NAMES[first.dtype]
        meta = meta or {}
        meta_kind = meta.get("kind")
        meta_attrs = dict(meta.get("attrs", {}))
        kind = "single" if len(sources) == 1 else self._parallel_kind
        if PART_ZERO in comps:
            kind = "on_read"
        shape = first.shape
        shards: tuple[int, list[int], list[bytes | None]] | None = None
        if meta_kind == "sharded":
            if len(sources) != 1:
                raise self._corrupt(
                    "the metadata says sharded, but the variable has several tensors",
                    variable=path,
                    expected="one partitioned tensor",
                    found=f"{len(sources)} tensors",
                )
            if not self._assemble:
                shards = self._shards_from_metadata(path, sources[0], meta_attrs)
        elif meta_kind is None and first.slices and not self._assemble:
            inferred = infer_sharding(first.slices, shape)
            if inferred is not None:
                axis, order = inferred
                shards = (
                    axis,
                    [first.slices[i][axis][0] for i in order],
                    [encode_slice_key(sources[0], first.slices[i]) for i in order],
                )
        if meta_kind is not None and meta_kind != "sharded":
            if meta_kind == "single" and len(sources) > 1:
                raise self._corrupt(
                    "the metadata's kind does not fit the saved tensors",
                    variable=path,
                    expected="one component",
                    found=f"{len(sources)} components",
                )
            kind = meta_kind
        attrs.update(meta_attrs)
        attrs.pop("shard_axis", None)
        attrs.pop("shard_offsets", None)
        parts: list[bytes | None] = list(sources)
        if shards is not None:
            axis, offsets, parts = shards
            kind = "sharded"
            attrs["shard_axis"] = axis
            attrs["shard_offsets"] = offsets
        return TfEntry(b, path, dtype, shape, kind, attrs, parts, tuple(ordered))

    def _shards_from_metadata(
        self, path: str, key: bytes, meta_attrs: dict[str, Any]
    ) -> tuple[int, list[int], list[bytes | None]]:
        """The shards our writer recorded: slices for the non-empty ones, nothing for empty ones."""
        e = self._bundle.entries[key]
        raw_axis, raw_offsets = meta_attrs.get("shard_axis"), meta_attrs.get("shard_offsets")
        rank = len(e.shape)

        axis = int(raw_axis) if is_int(raw_axis) else -1  # type: ignore[arg-type]
        offsets: list[int] = []
        if isinstance(raw_offsets, list) and all(map(is_int, raw_offsets)):
            offsets = list(raw_offsets)
        if not (
            0 <= axis < rank
            and offsets
            and offsets_problem(offsets, e.shape[axis], len(offsets)) is None
        ):
            raise self._corrupt(
                "bad shard axis or offsets in the metadata",
                variable=path,
                expected=f"an axis < {rank} and non-decreasing offsets from 0",
                found=f"axis {raw_axis!r}, offsets {str(raw_offsets)[:80]}",
            )
        ends = shard_bounds(offsets, e.shape[axis])[1:]
        wanted = [(o, end - o) for o, end in zip(offsets, ends, strict=True) if end > o]
        by_extent: dict[tuple[int, int], SliceSpec] = {}
        for spec in e.slices:
            if any(
                d != axis and not (s == 0 and (n is None or n == e.shape[d]))
                for d, (s, n) in enumerate(spec)
            ):
                break
            start, length = spec[axis]
            by_extent[(start, e.shape[axis] if length is None else length)] = spec
        if sorted(by_extent) != sorted(wanted) or len(e.slices) != len(wanted):
            raise self._corrupt(
                "the metadata's shards do not match the saved slices",
                variable=path,
                expected=[f"{s},{n}" for s, n in wanted],
                found=[spec_text(s) for s in e.slices] or "an unpartitioned tensor",
            )
        parts = [
            encode_slice_key(key, by_extent[(o, end - o)]) if end > o else None
            for o, end in zip(offsets, ends, strict=True)
        ]
        return axis, offsets, parts


#: The metadata attribute holding the exact float64 value of a counter our writer stored in
#: float32 (Adam's beta powers, as TensorFlow keeps them).
FLOAT64_VALUE = "float64_value"


def _exact_counter(entry: Entry) -> Entry:
    """A float64 counter our writer stored as the float32 TensorFlow keeps (Adam's beta powers)
    back as the exact float64 it recorded, when the float32 still is that value rounded (a file
    TensorFlow saved again keeps its own float32); any other entry as it is."""
    exact = entry.attrs.get(FLOAT64_VALUE) if entry.attrs else None
    if exact is None:
        return entry
    attrs = {k: v for k, v in entry.attrs.items() if k != FLOAT64_VALUE}
    if (
        isinstance(exact, float)
        and entry.dtype == np.float32
        and tuple(entry.shape) == ()
        and entry.kind in ("single", "mirrored")
    ):
        n = entry.num_components
        if all(np.float32(exact) == np.asarray(entry.component(i)) for i in range(n)):
            exact64 = [np.array(exact, np.float64) for _ in range(n)]
            return ArrayEntry(entry.path, exact64, kind=entry.kind, attrs=attrs)
    entry.attrs = attrs
    return entry
