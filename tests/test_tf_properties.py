"""Property tests: random entries survive a write/read round trip, and damaged bytes only ever
raise our documented errors."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import ml_dtypes
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from parallelvars.errors import ParallelVarsError
from parallelvars.formats import ArrayEntry, DictView, open_checkpoint, write_checkpoint
from parallelvars.formats.testing import TableBuilder, TableReader, crc32c, mask
from parallelvars.formats.tf import TfCheckpointView

DATA = Path(__file__).parent / "data" / "tf"
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

DTYPES = [np.float32, np.float64, np.int8, np.uint16, np.int64, np.bool_, np.complex64,
          np.float16, ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn, object]  # fmt: skip

# Local names: anything without "/" (our separator); "." and ".S" exercise TensorFlow's escaping.
# A name ".ATTRIBUTES" is left out: our paths use it to carry TensorFlow's other attributes.
NAMES = st.text(
    alphabet=st.sampled_from(list("ab.S_-09é"))
    | st.characters(codec="utf-8", exclude_characters="/"),
    min_size=1,
    max_size=8,
).filter(lambda n: n != ".ATTRIBUTES")


def _value(data: st.DataObject, dtype, shape: tuple[int, ...]) -> np.ndarray:
    n = int(np.prod(shape))
    if dtype is object:
        items = data.draw(st.lists(st.binary(max_size=6), min_size=n, max_size=n))
        out = np.empty(n, dtype=object)
        out[:] = items
        return out.reshape(shape)
    raw = data.draw(
        st.binary(min_size=n * np.dtype(dtype).itemsize, max_size=n * np.dtype(dtype).itemsize)
    )
    value = np.frombuffer(raw, np.uint8).view(dtype).reshape(shape).copy()
    if np.dtype(dtype) == np.bool_:
        value = value.view(np.uint8) % 2 == 1
    return value


@st.composite
def entries(draw: st.DrawFn) -> list[ArrayEntry]:
    paths = draw(
        st.lists(
            st.lists(NAMES, min_size=1, max_size=3).map("/".join),
            min_size=1,
            max_size=5,
            unique=True,
        )
    )
    out = []
    data = draw(st.data())
    for path in paths:
        dtype = draw(st.sampled_from(DTYPES))
        shape = tuple(draw(st.lists(st.integers(0, 3), max_size=3)))
        kind = draw(st.sampled_from(["single", "mirrored", "on_read", "independent", "sharded"]))
        if kind == "sharded":
            shape = (draw(st.integers(0, 5)), *shape)
            cuts = sorted(draw(st.lists(st.integers(0, shape[0]), max_size=3)))
            offsets = [0, *cuts]
            ends = [*cuts, shape[0]]
            comps = [
                _value(data, dtype, (e - s, *shape[1:])) for s, e in zip(offsets, ends, strict=True)
            ]
            attrs = {"shard_axis": 0, "shard_offsets": offsets}
        else:
            n = 1 if kind == "single" else draw(st.integers(1, 3))
            comps = [_value(data, dtype, shape) for _ in range(n)]
            attrs = {}
        if draw(st.booleans()):
            attrs["devices"] = [f"cpu:{i}" for i in range(len(comps))]
        if draw(st.booleans()):
            attrs["name"] = draw(NAMES)
        out.append(ArrayEntry(path, comps, kind=kind, shape=shape, attrs=attrs))
    return out


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    if a.dtype.kind == "O":
        return a.shape == b.shape and a.tolist() == b.tolist()
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


@SETTINGS
@given(entries())
def test_write_read_round_trip(items: list[ArrayEntry]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        prefix = write_checkpoint(Path(tmp) / "ckpt-1", DictView(items), format="tf")
        with open_checkpoint(tmp) as view:
            assert sorted(view) == sorted(e.path for e in items)
            for e in items:
                back = view[e.path]
                assert (back.kind, back.num_components, back.shape) == (
                    e.kind,
                    e.num_components,
                    e.shape,
                )
                assert dict(back.attrs) == e.attrs
                for i in range(e.num_components):
                    assert _same(back.component(i), e.component(i)), (e.path, i)
        with open_checkpoint(prefix + ".index") as view:
            assert len(view) == len(items)


# --- damaged input ------------------------------------------------------------------------


def _read_everything(prefix: str, verify: bool = True) -> None:
    with TfCheckpointView(prefix, verify=verify, skip_unsupported=True) as view:
        for entry in view.values():
            for i in range(entry.num_components):
                entry.component(i)


def _copy_plain(tmp: str) -> Path:
    for f in (DATA / "plain").iterdir():
        shutil.copy(f, Path(tmp) / f.name)
    return Path(tmp) / "ckpt-1"


def _expect_only_our_errors(prefix: Path, verify: bool = True) -> None:
    try:
        _read_everything(str(prefix), verify)
    except ParallelVarsError as err:
        assert isinstance(err, (ValueError, TypeError))
        assert str(prefix.parent) in str(err)


PLAIN_INDEX = (DATA / "plain" / "ckpt-1.index").read_bytes()
PLAIN_ITEMS = list(TableReader(PLAIN_INDEX, file="plain"))

mutation = st.tuples(
    st.sampled_from(["flip", "cut", "insert", "set"]), st.integers(0, 10**6), st.integers(0, 255)
)


def _mutate(data: bytes, ops: list[tuple[str, int, int]]) -> bytes:
    buf = bytearray(data)
    for op, where, byte in ops:
        at = where % (len(buf) + 1)
        if op == "flip" and buf:
            buf[at % len(buf)] ^= 1 << (byte % 8)
        elif op == "set" and buf:
            buf[at % len(buf)] = byte
        elif op == "cut":
            del buf[at : at + 1 + byte % 16]
        elif op == "insert":
            buf[at:at] = bytes([byte])
    return bytes(buf)


@SETTINGS
@given(st.lists(mutation, min_size=1, max_size=4))
def test_mutated_index_bytes_raise_only_our_errors(ops: list[tuple[str, int, int]]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        prefix = _copy_plain(tmp)
        prefix.with_suffix(".index").write_bytes(_mutate(PLAIN_INDEX, ops))
        _expect_only_our_errors(prefix)


@SETTINGS
@given(
    st.lists(
        st.tuples(st.integers(0, 100), st.lists(mutation, min_size=1, max_size=3)),
        min_size=1,
        max_size=3,
    )
)
def test_mutated_index_entries_with_valid_checksums_raise_only_our_errors(changes) -> None:
    """Damage inside the entries (keys and protos), in a table whose block checksums are right,
    so the damage reaches the parsers behind the checksum."""
    items = dict(PLAIN_ITEMS)
    keys = list(items)
    for which, ops in changes:
        key = keys[which % len(keys)]
        if which % 3 == 0 and key:
            items[_mutate(key, ops)] = items.pop(key)
            keys = list(items)
        else:
            items[key] = _mutate(items[key], ops)
    table = TableBuilder()
    for key in sorted(items):
        table.add(key, items[key])
    with tempfile.TemporaryDirectory() as tmp:
        prefix = _copy_plain(tmp)
        prefix.with_suffix(".index").write_bytes(table.finish())
        _expect_only_our_errors(prefix)


@SETTINGS
@given(st.integers(0, 2**32), st.lists(mutation, min_size=1, max_size=4))
def test_mutated_blocks_with_fixed_checksums_raise_only_our_errors(seed: int, ops) -> None:
    """Damage the block structure (restarts, varints) and recompute the block checksum."""
    reader = TableReader(PLAIN_INDEX, file="plain")
    handles = [h for _, h in reader.index] + [reader.metaindex]
    off, size = handles[seed % len(handles)]
    block = _mutate(PLAIN_INDEX[off : off + size], ops)[:size].ljust(size, b"\x00")
    trailer = b"\x00" + mask(crc32c(b"\x00", crc32c(block))).to_bytes(4, "little")
    data = PLAIN_INDEX[:off] + block + trailer + PLAIN_INDEX[off + size + 5 :]
    with tempfile.TemporaryDirectory() as tmp:
        prefix = _copy_plain(tmp)
        prefix.with_suffix(".index").write_bytes(data)
        _expect_only_our_errors(prefix)


@SETTINGS
@given(st.lists(mutation, min_size=1, max_size=4), st.booleans())
def test_mutated_data_bytes_raise_only_our_errors(ops, verify: bool) -> None:
    """With verification off, damaged strings and object graphs reach their decoders."""
    with tempfile.TemporaryDirectory() as tmp:
        prefix = _copy_plain(tmp)
        shard = prefix.with_name("ckpt-1.data-00000-of-00001")
        shard.write_bytes(_mutate(shard.read_bytes(), ops))
        _expect_only_our_errors(prefix, verify)
