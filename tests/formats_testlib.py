"""Helpers shared by the tests of parallelvars.formats (golden files, bit-exact comparison,
hypothesis strategies for entries)."""

from __future__ import annotations

import pathlib
from typing import Any

import h5py
import ml_dtypes
import numpy as np
from hypothesis import strategies as st

from parallelvars.formats import ArrayEntry, DictView, Entry, split_offsets

DATA = pathlib.Path(__file__).resolve().parent / "data"
TORCH = DATA / "torch"
KERAS = DATA / "keras"

# What torch_expected.npz's "<name>#dtype" entries name.
_TAGS = {"BF16": ml_dtypes.bfloat16, "F8_E4M3": ml_dtypes.float8_e4m3fn}


def torch_expected() -> dict[str, np.ndarray]:
    """torch_expected.npz with the raw-bit entries viewed as their real dtypes."""
    with np.load(TORCH / "torch_expected.npz") as z:
        raw = {k: z[k] for k in z.files}
    out = {}
    for key, value in raw.items():
        if key.endswith("#dtype"):
            continue
        tag = raw.get(f"{key}#dtype")
        out[key] = value.view(_TAGS[str(tag)]) if tag is not None else value
    return out


def keras_expected() -> list[tuple[str, np.ndarray]]:
    """keras_expected.npz's weights in model order: [(variable path, value)]."""
    with np.load(KERAS / "keras_expected.npz") as z:
        weights = [(k, z[k]) for k in z.files if ":" in k]
    weights.sort(key=lambda kv: int(kv[0].split(":", 1)[0]))
    return [(k.split(":", 1)[1], v) for k, v in weights]


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    """Identical dtype, shape and bytes (NaN payloads and signed zeros included)."""
    a, b = np.asarray(a), np.asarray(b)
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype.kind == "O":
        return a.tolist() == b.tolist()
    return np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes()


def assert_same_entry(got: Entry, want: Entry) -> None:
    """Same metadata and bit-identical components."""
    assert got.path == want.path
    assert got.kind == want.kind, (got.path, got.kind, want.kind)
    assert np.dtype(got.dtype) == np.dtype(want.dtype), (got.path, got.dtype, want.dtype)
    assert tuple(got.shape) == tuple(want.shape)
    assert got.num_components == want.num_components
    for i in range(want.num_components):
        assert same_bits(got.component(i), want.component(i)), (got.path, i)
    for key, value in want.attrs.items():
        assert _plain(got.attrs.get(key)) == _plain(value), (got.path, key)


def assert_same_view(got: Any, want: Any) -> None:
    assert sorted(got) == sorted(want)
    for path in want:
        assert_same_entry(got[path], want[path])


def _plain(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    return value


#: Integrity attributes our Keras writers add (a dataset's ``crc32c``, the root's structure
#: checksum); Keras ignores them, and files written by Keras have none.
INTEGRITY_ATTRS = frozenset({"crc32c", "parallelvars_crc32c"})


def h5_structure(path: Any, *, integrity: bool = False) -> dict[str, Any]:
    """Every group and dataset with its attributes, dtype, shape and bytes.

    Args:
        integrity: keep our integrity attributes (:data:`INTEGRITY_ATTRS`); by default they
            are left out, so a file we wrote compares equal to the Keras file it copies.
    """

    def decode(v: Any) -> Any:
        if isinstance(v, np.ndarray):
            return [decode(x) for x in v.tolist()]
        if isinstance(v, list):
            return [decode(x) for x in v]
        return v.decode() if isinstance(v, bytes) else v

    def attrs(obj: Any) -> dict[str, Any]:  # values, whatever string encoding holds them
        return {k: decode(v) for k, v in obj.attrs.items() if integrity or k not in INTEGRITY_ATTRS}

    tree: dict[str, Any] = {}
    with h5py.File(path, "r") as f:
        tree["/"] = attrs(f)

        def visit(name: str, obj: Any) -> None:
            if isinstance(obj, h5py.Dataset):
                tree[name] = ("dataset", attrs(obj), obj.dtype.str, obj.shape, obj[()].tobytes())
            else:
                tree[name] = ("group", attrs(obj))

        f.visititems(visit)
    return tree


# ------------------------------------------------------------------------------------------
# hypothesis strategies

NUMERIC_DTYPES = [
    np.dtype(np.float32),
    np.dtype(np.float64),
    np.dtype(np.float16),
    np.dtype(np.int8),
    np.dtype(np.int16),
    np.dtype(np.int32),
    np.dtype(np.int64),
    np.dtype(np.uint8),
    np.dtype(np.uint16),
    np.dtype(np.uint32),
    np.dtype(np.uint64),
    np.dtype(np.bool_),
    np.dtype(np.complex64),
    np.dtype(ml_dtypes.bfloat16),
    np.dtype(ml_dtypes.float8_e4m3fn),
    np.dtype(ml_dtypes.float8_e5m2),
]
EXTRA_DTYPES = [np.dtype(np.complex128), np.dtype(ml_dtypes.float8_e4m3b11fnuz)]


def random_array(draw: Any, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    """Random bits of ``dtype`` (any bit pattern, so NaNs and infinities too)."""
    n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = draw(st.binary(min_size=n, max_size=n))
    if dtype.kind == "b":
        raw = bytes(b & 1 for b in raw)
    return np.frombuffer(raw, np.uint8).copy().view(dtype).reshape(shape)


@st.composite
def entries(
    draw: Any,
    dtypes: list[np.dtype] = NUMERIC_DTYPES,
    kinds: tuple[str, ...] | None = None,
    max_vars: int = 4,
) -> DictView:
    """A view of up to ``max_vars`` random variables of every kind."""
    kinds = kinds or ("single", "mirrored", "on_read", "independent", "sharded")
    count = draw(st.integers(1, max_vars))
    out = []
    for v in range(count):
        dtype = draw(st.sampled_from(dtypes))
        kind = draw(st.sampled_from(kinds))
        ndim = draw(st.integers(1 if kind == "sharded" else 0, 3))
        shape = tuple(draw(st.lists(st.integers(0, 4), min_size=ndim, max_size=ndim)))
        path = f"v{v}/" + draw(st.sampled_from(["w", "kernel", "bias", "inner/x"]))
        attrs: dict[str, Any] = {}
        if kind == "single":
            comps = [random_array(draw, dtype, shape)]
        else:
            n = draw(st.integers(1, 3))
            attrs["devices"] = [f"cpu:{i}" for i in range(n)]
            if kind == "sharded":
                axis = draw(st.integers(0, ndim - 1))
                offsets = split_offsets(shape[axis], n)
                bounds = [*offsets, shape[axis]]
                comps = []
                for i in range(n):
                    cshape = list(shape)
                    cshape[axis] = bounds[i + 1] - bounds[i]
                    comps.append(random_array(draw, dtype, tuple(cshape)))
                attrs.update(shard_axis=axis, shard_offsets=offsets)
            else:
                comps = [random_array(draw, dtype, shape) for _ in range(n)]
            if kind == "on_read":
                attrs["aggregation"] = draw(st.sampled_from(["sum", "mean", "only_first_replica"]))
                attrs["synchronization"] = "on_read"
        if draw(st.booleans()):
            attrs["trainable"] = draw(st.booleans())
        out.append(ArrayEntry(path, comps, kind=kind, shape=shape, attrs=attrs))
    return DictView(out)
