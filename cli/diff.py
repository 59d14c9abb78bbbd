"""``parallelvars diff``: compare two checkpoints variable by variable, component by component."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from parallelvars._aggregate import has_logical_value, no_value_what
from parallelvars._dtypes import dtype_name
from parallelvars._fileio import same_bytes
from parallelvars._spans import BULK_BYTES
from parallelvars.checkpoint._gcfreeze import freeze_made_so_far, older_objects_frozen
from parallelvars.formats import CheckpointView, Entry

from ._common import natural_key, non_negative_float, open_view, shape_str
from ._output import Output, Progress, Spool

__all__ = ["add_parser", "run", "compare_arrays", "compare_entries"]

_EPILOG = """\
Two values x (from A) and y (from B) agree when |x - y| <= atol + rtol * |y| (numpy's
isclose, with B as the reference); NaN agrees with NaN, and an infinity only with the same
infinity. With the default tolerances of zero, values must be equal (-0.0 equals 0.0; the
bits of a NaN are not compared). Every component is
compared, not only the primary; when the two sides hold a variable in different kinds or
numbers of components, their logical values (what a single-device restore gives) are compared.
With --logical only the logical values are compared, and how they are spread over devices
(kind, number of components, shard layout) is ignored.

"missing" variables are in A but not in B; "extra" ones are in B but not in A. The exit code is
1 when anything differs (a missing or extra variable, a dtype, shape, kind or component count,
an aggregation or shard layout, or a value beyond the tolerances), else 0.

examples:
  parallelvars diff before.h5 after.h5
  parallelvars diff run.h5 model.safetensors --rtol 1e-5 --atol 1e-8
  parallelvars diff run.h5 run-8dev.h5 --logical
  parallelvars diff a.h5 b.h5 --json | jq '.variables[] | select(.equal | not)'"""

# Elements compared at a time, so that the float64 temporaries stay small for big tensors.
_CHUNK = 1 << 20
# Attributes whose difference changes what a restore gives.
_SEMANTIC_ATTRS = ("aggregation", "shard_axis", "shard_offsets")


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "diff",
        help="compare two checkpoints",
        description="Compare two checkpoints: keys, dtypes, shapes, kinds and every component's "
        "values (max absolute and relative difference).",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("a", metavar="A", help="first checkpoint")
    parser.add_argument("b", metavar="B", help="second checkpoint (the reference for --rtol)")
    parser.add_argument(
        "--logical",
        action="store_true",
        help="compare each variable's logical value only, ignoring how it is spread over "
        "devices (kind, components, shard layout): to check a --components logical copy "
        "or a resharded checkpoint",
    )
    parser.add_argument(
        "--rtol", metavar="R", type=non_negative_float, default=0.0,
        help="relative tolerance (default: 0)",
    )  # fmt: skip
    parser.add_argument(
        "--atol", metavar="A", type=non_negative_float, default=0.0,
        help="absolute tolerance (default: 0)",
    )  # fmt: skip
    return parser


def _numeric(x: np.ndarray) -> np.ndarray | None:
    """``x`` as float64 (complex128 for complex), or None when it holds no numbers."""
    if x.dtype.kind == "c":
        return x.astype(np.complex128)
    if x.dtype.kind in "OSUM":
        return None
    try:  # bool, ints, floats, and ml_dtypes' bfloat16 / float8 (kind "V")
        return x.astype(np.float64)
    except (TypeError, ValueError):
        return None


_COMPARABLE: dict[np.dtype, bool] = {}


def _comparable(dtype: np.dtype) -> bool:
    """Whether values of ``dtype`` are compared as numbers (:func:`_numeric` takes them)."""
    known = _COMPARABLE.get(dtype)
    if known is None:
        known = dtype.kind not in "OSU" and _numeric(np.empty(0, dtype)) is not None
        if len(_COMPARABLE) < 64:
            _COMPARABLE[dtype] = known
    return known


def _same_bytes(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two arrays of one dtype and shape hold the same bytes."""
    return a.shape == b.shape and same_bytes(a, b)


def compare_arrays(a: np.ndarray, b: np.ndarray, *, rtol: float, atol: float) -> dict[str, Any]:
    """How far ``a`` is from ``b`` (same shape): counts and the largest differences.

    Returns a dict with ``size``, ``mismatched`` (elements beyond the tolerances), ``max_abs``
    and ``max_rel`` (None for non-numeric data; ``inf`` where one side is NaN or infinite and
    the other is not). ``max_rel`` is relative to ``|b|``.
    """
    size = int(a.size)
    if a.dtype == b.dtype and _comparable(a.dtype) and _same_bytes(a, b):
        # Bit for bit the same numbers: every value agrees and the differences are all 0
        # (what the loop below finds for them, at the cost of one comparison of the bytes).
        return {"size": size, "mismatched": 0, "max_abs": 0.0, "max_rel": 0.0}
    a_flat = np.ravel(a)
    b_flat = np.ravel(b)
    text_a, text_b = a.dtype.kind in "OSU", b.dtype.kind in "OSU"
    if text_a != text_b:  # strings against numbers: nothing agrees
        return {"size": size, "mismatched": size, "max_abs": None, "max_rel": None}
    if text_a:
        mismatched = 0
        for start in range(0, size, _CHUNK):
            sl = slice(start, start + _CHUNK)
            mismatched += int(np.count_nonzero(a_flat[sl] != b_flat[sl]))
        return {"size": size, "mismatched": mismatched, "max_abs": None, "max_rel": None}
    max_abs = 0.0
    max_rel = 0.0
    mismatched = 0
    with np.errstate(all="ignore"):
        for start in range(0, size, _CHUNK):
            sl = slice(start, start + _CHUNK)
            fa = _numeric(a_flat[sl])
            fb = _numeric(b_flat[sl])
            if fa is None or fb is None:
                return {"size": size, "mismatched": size, "max_abs": None, "max_rel": None}
            same = (fa == fb) | (np.isnan(fa) & np.isnan(fb))
            absd = np.abs(fa - fb)
            absd[same] = 0.0
            absd[np.isnan(absd)] = np.inf
            mag = np.abs(fb)
            rel = np.where(
                mag > 0, absd / np.where(mag > 0, mag, 1.0), np.where(absd > 0, np.inf, 0.0)
            )
            rel[np.isnan(rel)] = np.inf
            close = same | (np.isfinite(fa) & np.isfinite(fb) & (absd <= atol + rtol * mag))
            mismatched += int(close.size - np.count_nonzero(close))
            if absd.size:
                max_abs = max(max_abs, float(absd.max()))
                max_rel = max(max_rel, float(rel.max()))
    return {"size": size, "mismatched": mismatched, "max_abs": max_abs, "max_rel": max_rel}


def compare_entries(
    ea: Entry,
    eb: Entry,
    *,
    rtol: float,
    atol: float,
    logical: bool = False,
    progress: Progress | None = None,
    components_a: list[np.ndarray] | None = None,
    components_b: list[np.ndarray] | None = None,
) -> dict[str, Any]:
    """Structural differences and per-component value differences of two entries.

    With ``logical``, only the logical values (and their dtype and shape) are compared, not
    how they are spread over devices. ``components_a``/``components_b``: ``ea``'s/``eb``'s
    components, read already (in bulk, checksums verified).
    """
    differences: list[str] = []
    if ea.dtype != eb.dtype:
        differences.append(f"dtype {dtype_name(ea.dtype)} vs {dtype_name(eb.dtype)}")
    if tuple(ea.shape) != tuple(eb.shape):
        differences.append(f"shape {shape_str(ea.shape)} vs {shape_str(eb.shape)}")
    if not logical:
        if ea.kind != eb.kind:
            differences.append(f"kind {ea.kind} vs {eb.kind}")
        if ea.num_components != eb.num_components:
            differences.append(f"components {ea.num_components} vs {eb.num_components}")
        for key in _SEMANTIC_ATTRS:
            va, vb = _semantic(ea.attrs, key), _semantic(eb.attrs, key)
            if va != vb and ea.kind == eb.kind:
                differences.append(f"{key} {va} vs {vb}")

    def advance(entry: Entry, i: int | None) -> None:
        if progress is not None:
            progress.advance(entry.nbytes if i is None else entry.component_nbytes(i))

    components: list[dict[str, Any]] = []
    compared: str | None = None
    same_layout = (
        ea.kind == eb.kind
        and ea.num_components == eb.num_components
        and (
            tuple(ea.shape) == tuple(eb.shape)  # (every component has the variable's shape)
            if ea.kind != "sharded"
            else all(
                tuple(ea.component_shape(i)) == tuple(eb.component_shape(i))
                for i in range(ea.num_components)
            )
        )
    )
    # (Whether both have one logical value matters only when the layouts differ or with
    # --logical: not asked otherwise.)
    has_logical = (not same_layout or logical) and has_logical_value(ea) and has_logical_value(eb)
    if same_layout and not (logical and has_logical):
        compared = "components"
        for i in range(ea.num_components):
            ca = ea.component(i) if components_a is None else components_a[i]
            cb = eb.component(i) if components_b is None else components_b[i]
            advance(ea, i)
            advance(eb, i)
            components.append({"component": i, **compare_arrays(ca, cb, rtol=rtol, atol=atol)})
    elif tuple(ea.shape) == tuple(eb.shape) and has_logical:
        compared = "logical"
        value_a, value_b = ea.value(), eb.value()
        advance(ea, None)
        advance(eb, None)
        compared_values = compare_arrays(value_a, value_b, rtol=rtol, atol=atol)
        components.append({"component": None, **compared_values})
    elif tuple(ea.shape) == tuple(eb.shape):
        which = next(e for e in (ea, eb) if not has_logical_value(e))
        differences.append(
            f"values not compared: {which.path!r} holds {no_value_what(which)} and no single value"
            if which.kind != "independent"
            else "values not compared: independent components have no single value"
        )
    equal = not differences and all(c["mismatched"] == 0 for c in components)
    return {
        "path": ea.path,
        "equal": equal,
        "differences": differences,
        "compared": compared,
        "components": components,
    }


def _semantic(attrs: Any, key: str) -> Any:
    """The value of attribute ``key`` in ``attrs`` as compared (:func:`_semantic_value`)."""
    return _semantic_value(key, attrs.get(key))


def _semantic_value(key: str, value: Any) -> Any:
    """Attribute ``key``'s ``value`` as compared: an aggregation in lower case, a shard axis
    and offsets as integers (a value that is none, from a damaged or foreign file, compared
    as written rather than raising)."""
    if value is None:
        return None
    try:
        if key == "aggregation":
            return str(value).lower()
        if key == "shard_offsets":
            return [int(v) for v in value]
        if key == "shard_axis":
            return int(value)
    except (TypeError, ValueError, OverflowError):
        return repr(value)
    return value


def _alike(
    a: tuple[Any, ...],
    b: tuple[Any, ...],
    components_a: list[np.ndarray],
    components_b: list[np.ndarray],
) -> bool:
    """Whether a variable's two sides are described alike (``a``/``b``: its
    :func:`_descriptions`, their :func:`_signature` equal) and their components, read in
    bulk, are of one comparable dtype and shape, so that equal bytes settle it."""
    kind, dtype, _, n = a[:4]
    if (
        kind == "sharded"
        or not _same_signature(a, b)
        or len(components_a) != n
        or len(components_b) != n
        or not _comparable(dtype)
    ):
        return False
    for ca, cb in zip(components_a, components_b, strict=True):
        if ca.dtype != cb.dtype or ca.shape != cb.shape:
            return False
    return True


#: Attribute value types compared as they are: equal values of one of these types give
#: equal :func:`_semantic_value` (``1`` and ``True`` are equal but of two types).
_PLAIN = frozenset((type(None), str, int))


def _same_signature(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    """Whether two descriptions (:func:`_descriptions`) have equal :func:`_signature`:
    equal descriptions whose attribute values are of one plain type each settle it without
    making the signatures."""
    if (
        a == b
        and _PLAIN.issuperset(map(type, a[4:]))
        and list(map(type, a[4:])) == list(map(type, b[4:]))
    ):
        return True
    return _signature(a[0], a[1], a[2], a[3], a[4:]) == _signature(b[0], b[1], b[2], b[3], b[4:])


def _signature(kind: Any, dtype: Any, shape: Any, n: Any, values: Any) -> tuple[Any, ...]:
    """A variable's kind, dtype, shape, number of components and the values of its
    attributes that change what a restore gives (:data:`_SEMANTIC_ATTRS`, as compared): two
    variables described alike have equal signatures."""
    return (
        kind,
        dtype,
        tuple(shape),
        n,
        *[
            None if v is None else _semantic_value(name, v)
            for name, v in zip(_SEMANTIC_ATTRS, values, strict=True)
        ],
    )


def _descriptions(view: CheckpointView, keys: list[str]) -> list[tuple[Any, ...] | None]:
    """Each of ``keys``' kind, dtype, shape, number of components and the values of
    :data:`_SEMANTIC_ATTRS` as stored, from the view's columns (``described``: no entry
    made); None for one it does not describe so (:func:`_description_of` then)."""
    described = getattr(view, "described", None)
    if described is None:
        return [None] * len(keys)
    return described(keys, _SEMANTIC_ATTRS)


def _description_of(view: CheckpointView, listed: Any, key: str) -> tuple[Any, ...]:
    """:func:`_descriptions` of ``key`` from the view's listing or entry
    (:func:`_described`)."""
    kind, dtype, shape, n, attrs = _described(view, listed, key)
    return (kind, dtype, shape, n, *[attrs.get(name) for name in _SEMANTIC_ATTRS])


# Variables described at a time (:func:`_descriptions`).
_DESCRIBE = 4096


def _equal_result(path: str, n: int, size: int) -> dict[str, Any]:
    """:func:`compare_entries`' result for ``n`` components of ``size`` values, bit for bit
    equal."""
    rows = [
        {"component": i, "size": size, "mismatched": 0, "max_abs": 0.0, "max_rel": 0.0}
        for i in range(n)
    ]
    return {
        "path": path,
        "equal": True,
        "differences": [],
        "compared": "components",
        "components": rows,
    }


#: What a variable found equal in bulk gives where nothing but the count is kept (the human
#: output lists only the variables that differ).
_EQUAL: dict[str, Any] = {"equal": True}


def _counted_equal(path: str, n: int, size: int) -> dict[str, Any]:
    return _EQUAL


def _settle(
    pending: list[tuple[str, list[np.ndarray], list[np.ndarray]]],
    general: Callable[[str, Any, Any], dict[str, Any]],
    equal: Callable[[str, int, int], dict[str, Any]] = _equal_result,
) -> list[dict[str, Any]]:
    """:func:`compare_entries`' results for a batch of variables read in bulk on both sides
    and described alike, in order: equal where every component holds the same bytes as its
    counterpart (:func:`_same_pairs`), else compared the general way (``general``), with the
    components read."""
    out = []
    for (key, ca, cb), same in zip(pending, _same_pairs(pending), strict=True):
        if same:
            out.append(equal(key, len(ca), int(ca[0].size) if ca else 0))
        else:
            out.append(general(key, ca, cb))
    return out


# Bytes of small components joined on each side and compared at once (see _same_pairs).
_JOIN_BYTES = 4 << 20


def _same_pairs(pending: list[tuple[str, list[np.ndarray], list[np.ndarray]]]) -> list[bool]:
    """For each variable of ``pending`` (its components on both sides, pair by pair of one
    dtype and shape: :func:`_alike`), whether every pair holds the same bytes.

    Runs of variables whose components are small are compared together: each side's bytes
    joined (a run takes variables of at most an eighth of :data:`_JOIN_BYTES` a side until it
    holds that much: at most 1.125 times it a side) and the two joins compared, which
    settles them all when equal (every pair is of one size, so equal joins are equal pairs);
    otherwise, and for larger components, pair by pair (no copy)."""
    out: list[bool] = []
    k, n = 0, len(pending)
    while k < n:
        j, held = k, 0
        while j < n and held < _JOIN_BYTES:
            components = pending[j][1]  # (of one dtype and shape: _alike)
            size = len(components) * components[0].nbytes if components else 0
            if size > _JOIN_BYTES // 8:
                break
            held += size
            j += 1
        if j > k + 1:
            run = pending[k:j]
            left = b"".join([c.tobytes() for _, ca, _ in run for c in ca])
            right = b"".join([c.tobytes() for _, _, cb in run for c in cb])
            if left == right:
                out.extend([True] * len(run))
                k = j
                continue
        else:
            j = k + 1
        for _, ca, cb in pending[k:j]:
            out.append(all(_same_bytes(x, y) for x, y in zip(ca, cb, strict=True)))
        k = j
    return out


# A batch of variables settled together: at most this many, and their components on both
# sides at most ``_BATCH_BYTES`` (the bulk reader's own step; one variable past it alone).
_BATCH = 512
_BATCH_BYTES = BULK_BYTES


def _described(view: CheckpointView, listed: Any, key: str) -> tuple[Any, ...]:
    """A variable's kind, dtype, shape, number of components and attributes: from the
    view's listing (``listed``: a function giving one variable's summary, or None) or its
    entry."""
    known = None if listed is None else listed(key)
    if known is not None:
        kind, dtype, shape, n, _, attrs = known
        return kind, dtype, shape, n, attrs
    entry = view[key]
    return entry.kind, entry.dtype, entry.shape, entry.num_components, entry.attrs


def _listing(view: CheckpointView) -> Callable[[str], Any] | None:
    """A function giving one variable's summary from ``view``'s index (None for a variable
    it does not list), or None for a view without one."""
    summary = getattr(view, "summary", None)
    if summary is not None:
        return summary
    summaries = getattr(view, "summaries", None)
    listed = summaries() if summaries is not None else None
    return None if listed is None else listed.get


class _Listed(Entry):
    """A variable as its view's index lists it (kind, dtype, shape, components, attributes),
    made without an entry of its own; a read asks the view for the entry then."""

    def __init__(self, view: CheckpointView, path: str, summary: tuple[Any, ...]) -> None:
        self._view = view
        self.path = path
        self.kind, self.dtype, self.shape, self.num_components, _, self.attrs = summary

    def component(self, i: int) -> np.ndarray:
        return self._view[self.path].component(i)

    def value(self) -> np.ndarray:
        return self._view[self.path].value()


def _fmt_num(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.6g}"


def _side(path: str, view: CheckpointView) -> dict[str, Any]:
    return {"path": path, "format": view.format, "num_variables": len(view)}


def _result_lines(r: dict[str, Any]) -> list[str]:
    """The human lines of one variable that differs (:func:`compare_entries`' result)."""
    lines = [f"{r['path']}: {d}" for d in r["differences"]]
    if r["components"] and all(c["mismatched"] == 0 for c in r["components"]):
        lines.append(f"{r['path']}: {'logical ' if r['compared'] == 'logical' else ''}values agree")
    for c in r["components"]:
        if c["mismatched"] == 0:
            continue
        where = "logical value" if c["component"] is None else f"component {c['component']}"
        lines.append(
            f"{r['path']} [{where}]: {c['mismatched']} of {c['size']} values differ; "
            f"max abs {_fmt_num(c['max_abs'])}, max rel {_fmt_num(c['max_rel'])}"
        )
    return lines


def run(args: argparse.Namespace) -> int:
    out: Output = args.out
    # Each variable's result is written as it is decided (a JSON row, or a differing
    # variable's human lines) into a spool that prints once the comparison is done; only the
    # counts are kept, so memory is bounded by a batch, not by the number of variables.
    # (What the command keeps until it ends, each side's index, is frozen out of the
    # collector's walks as it is made: see _gcfreeze.)
    with Spool() as spool, older_objects_frozen():
        return _run(args, out, spool)


def _run(args: argparse.Namespace, out: Output, spool: Spool) -> int:
    compared = differing = 0
    # (a variable found equal in bulk is a row of the JSON output, only a count otherwise)
    equal_row = _equal_result if out.json_mode else _counted_equal

    def decided(result: dict[str, Any]) -> None:
        nonlocal compared, differing
        compared += 1
        if not result["equal"]:
            differing += 1
            if not out.json_mode:
                spool.write("".join(line + "\n" for line in _result_lines(result)))
        if out.json_mode:
            spool.add(result)

    with open_view(args.a, None, args.read_options) as va:
        freeze_made_so_far()
        with open_view(args.b, None, args.read_options) as vb:
            freeze_made_so_far()
            keys_a, keys_b = set(va), set(vb)
            missing = sorted(keys_a - keys_b, key=natural_key)
            extra = sorted(keys_b - keys_a, key=natural_key)
            common = sorted(keys_a & keys_b, key=natural_key)
            del keys_a, keys_b
            total = (
                sum(int(va[k].nbytes) + int(vb[k].nbytes) for k in common)
                if out.show_progress
                else None
            )
            # A's components read in bulk where its view can (a native file: by offset, in file
            # order, checksums verified), else entry by entry; B's entry by entry.
            bulk_a = getattr(va, "bulk_components", None)
            bulk_b = getattr(vb, "bulk_components", None)
            read_a = bulk_a(common) if bulk_a is not None else ((k, None) for k in common)
            read_b = bulk_b(common) if bulk_b is not None else ((k, None) for k in common)
            # Each side's variables as its index lists them, where it can (no entry made for
            # those whose components were read in bulk), one when asked for.
            listed, listed_b = _listing(va), _listing(vb)
            with out.progress(total, "compare") as bar:

                def general(key: str, components_a: Any, components_b: Any) -> dict[str, Any]:
                    summary = None if listed is None or components_a is None else listed(key)
                    return compare_entries(
                        va[key] if summary is None else _Listed(va, key, summary),
                        vb[key],
                        rtol=args.rtol,
                        atol=args.atol,
                        logical=args.logical,
                        progress=bar if total is not None else None,
                        components_a=components_a,
                        components_b=components_b,
                    )

                # Variables read in bulk on both sides and described alike wait here, in order,
                # and are settled a batch at a time (bounded in count and in bytes).
                pending: list[tuple[str, list[np.ndarray], list[np.ndarray]]] = []
                held = 0

                def flush() -> None:
                    nonlocal held
                    for result in _settle(pending, general, equal_row):
                        decided(result)
                    if total is not None:
                        bar.advance(held)
                    pending.clear()
                    held = 0

                # Each side's descriptions from its columns, the next keys' at a time (None:
                # from its listing or entry, when its components were read in bulk).
                sigs_a: list[tuple[Any, ...] | None] = []
                sigs_b: list[tuple[Any, ...] | None] = []
                described_from = -1
                for k, ((key, components_a), (_, components_b)) in enumerate(
                    zip(read_a, read_b, strict=True)
                ):
                    if components_a is None or components_b is None or args.logical:
                        flush()
                        decided(general(key, components_a, components_b))
                        continue
                    if k - k % _DESCRIBE != described_from:
                        described_from = k - k % _DESCRIBE
                        ahead = common[described_from : described_from + _DESCRIBE]
                        sigs_a, sigs_b = _descriptions(va, ahead), _descriptions(vb, ahead)
                    sig_a, sig_b = sigs_a[k - described_from], sigs_b[k - described_from]
                    if _alike(
                        _description_of(va, listed, key) if sig_a is None else sig_a,
                        _description_of(vb, listed_b, key) if sig_b is None else sig_b,
                        components_a,
                        components_b,
                    ):
                        # (every component of one dtype and shape on both sides: _alike)
                        size = 2 * len(components_a) * components_a[0].nbytes if components_a else 0
                        if pending and held + size > _BATCH_BYTES:
                            flush()
                        pending.append((key, components_a, components_b))
                        held += size
                        if len(pending) >= _BATCH:
                            flush()
                        continue
                    flush()
                    decided(general(key, components_a, components_b))
                flush()
            side_a, side_b = _side(args.a, va), _side(args.b, vb)
    equal = not missing and not extra and not differing
    data = {
        "a": side_a,
        "b": side_b,
        "rtol": args.rtol,
        "atol": args.atol,
        "logical": args.logical,
        "equal": equal,
        "missing": missing,
        "extra": extra,
        "num_compared": compared,
        "num_differing": differing,
        "variables": spool,
    }

    def human() -> Iterator[str]:
        head = [
            f"A: {args.a} ({side_a['format']}, {side_a['num_variables']} variables)",
            f"B: {args.b} ({side_b['format']}, {side_b['num_variables']} variables)",
        ]
        head += [f"missing from B: {k}" for k in missing]
        head += [f"extra in B: {k}" for k in extra]
        yield "".join(line + "\n" for line in head)
        yield from spool.pieces()  # (each differing variable's lines)
        tol = f"rtol={args.rtol:g}, atol={args.atol:g}" + (
            ", logical values" if args.logical else ""
        )
        if equal:
            yield f"no differences ({compared} variables compared, {tol})\n"
        else:
            yield (
                f"different: {len(missing)} missing, {len(extra)} extra, "
                f"{differing} of {compared} common variables differ ({tol})\n"
            )

    out.emit(data, human)
    return 0 if equal else 1
