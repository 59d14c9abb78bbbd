"""The byte-level HDF5 layer: lookup3, the bounded header parser, the global heap, and files
generated from the structure, which h5py (the oracle), the HDF5 tools and our reader must see
exactly as the files libhdf5 writes for the same content."""

from __future__ import annotations

import shutil
import struct
import subprocess

import h5py
import ml_dtypes
import numpy as np
import pytest
from generate_reference import build_collections
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from parallelvars.checkpoint.h5io import H5Reader, write_h5
from parallelvars.checkpoint.h5raw import header as hdr
from parallelvars.checkpoint.h5raw.generate import FilePlan, Variable
from parallelvars.checkpoint.h5raw.global_heap import parse_collection
from parallelvars.checkpoint.h5raw.lookup3 import lookup3, lookup3_many, lookup3_rows, prefix_state
from parallelvars.checkpoint.h5raw.messages import Unsupported
from parallelvars.checkpoint.h5raw.native import write_native
from parallelvars.checkpoint.h5raw.source import ImageSource, Refused
from parallelvars.checkpoint.registry import SaveRecord

CREATED = 1_700_000_000.25


# ----------------------------------------------------------------------------- lookup3
def test_lookup3_reference_vectors() -> None:
    # Bob Jenkins' lookup3.c driver: hashlittle("", 0, 0) and the "Four score" vectors.
    assert lookup3(b"") == 0xDEADBEEF
    text = b"Four score and seven years ago"
    assert lookup3(text, 0) == 0x17770551
    assert lookup3(text, 1) == 0xCD628161


def test_vectorised_lookup3_agree_with_the_scalar_one() -> None:
    rng = np.random.default_rng(5)
    image = rng.integers(0, 256, 6000, dtype=np.uint8)
    spans = [(0, 0), (0, 1), (0, 12), (0, 13), (5, 29), (100, 4100), (0, 6000), (5999, 6000)]
    spans += [(int(s), int(s) + k) for k, s in enumerate(rng.integers(0, 900, 60))]
    assert lookup3_many(image, spans).tolist() == [lookup3(image[s:e]) for s, e in spans]
    rows = rng.integers(0, 256, (9, 100), dtype=np.uint8)
    rows[:, :48] = rows[0, :48]
    for length in (1, 12, 13, 49, 100):
        want = [lookup3(r[:length]) for r in rows]
        assert lookup3_rows(rows, length).tolist() == want
        for start in range(0, min(48, length - 1) + 1, 12):
            state = prefix_state(rows[0, :start].tobytes(), length)
            assert lookup3_rows(rows, length, start=start, state=state).tolist() == want


# ----------------------------------------------------------------------------- headers
def _header(messages: list[tuple[int, int, bytes]]) -> bytes:
    return hdr.encode_v2(messages)


def test_the_parser_reads_what_the_encoder_writes_and_what_libhdf5_writes(tmp_path) -> None:
    body = b"\x00\x00" + b"\xff" * 16
    data = _header([(hdr.LINK_INFO, 0, body), (hdr.GROUP_INFO, 1, b"\x00\x00")])
    h = hdr.read_object_header(ImageSource(data), 0, checksums=True)
    assert [(m.type, m.flags, m.body) for m in h.messages] == [
        (hdr.LINK_INFO, 0, body),
        (hdr.GROUP_INFO, 1, b"\x00\x00"),
    ]
    path = str(tmp_path / "lib.h5")
    with h5py.File(path, "w", libver="latest") as f:
        g = f.create_group("g")
        for k in range(40):  # enough attributes for continuation chunks
            g.attrs[f"a{k}"] = np.arange(k + 1)
        address = h5py.h5o.get_info(g.id).addr
    with open(path, "rb") as fh:
        raw = fh.read()
    h = hdr.read_object_header(ImageSource(raw), address, checksums=True)
    assert len([m for m in h.messages if m.type == hdr.ATTRIBUTE]) <= 40


@pytest.mark.parametrize(
    "damage",
    ["truncated", "version", "message past chunk", "checksum", "loop", "outside"],
)
def test_the_parser_refuses_damaged_headers(damage: str) -> None:
    cont = (hdr.CONTINUATION, 0, struct.pack("<QQ", 0, 40))
    data = bytearray(_header([(hdr.GROUP_INFO, 0, b"\x00\x00"), cont]))
    if damage == "truncated":
        data = data[:10]
    elif damage == "version":
        data[4] = 3
    elif damage == "message past chunk":
        data[8] = 0xFF  # the first message's size
    elif damage == "checksum":
        data[-6] ^= 1
    elif damage == "loop":  # a continuation back to chunk 0: listed twice
        pass
    elif damage == "outside":
        at = data.index(struct.pack("<QQ", 0, 40))
        data[at : at + 8] = struct.pack("<Q", 1 << 40)
    with pytest.raises(Refused):
        hdr.read_object_header(ImageSource(bytes(data)), 0, checksums=damage == "checksum")


def test_global_heap_collections_round_trip() -> None:
    objects = [(b"x" * (i % 23)) for i in range(9000)]
    lengths = np.array([len(o) for o in objects])
    image, addrs, index = build_collections(b"".join(objects), lengths, 64)
    src = ImageSource(bytes(64) + image.tobytes())
    parsed: dict[int, dict[int, bytes]] = {}
    for i, o in enumerate(objects):
        a = int(addrs[i])
        if a not in parsed:
            parsed[a] = parse_collection(src, a, 8)
        assert parsed[a][int(index[i])] == o
    assert len(parsed) == 3


@settings(max_examples=15, deadline=None)
@given(
    count=st.integers(1, 9000),
    step=st.integers(0, 40),
    base=st.integers(0, 1 << 20),
    data=st.data(),
)
def test_global_heap_collections_made_a_range_at_a_time(count, step, base, data) -> None:
    """Any range of collections made alone is those collections' bytes of the heap made whole,
    and each object's reference names its collection's address and its index there."""
    from parallelvars.checkpoint.h5raw.global_heap import Collections

    lengths = [(i * step + i // 7) % 41 for i in range(count)]
    objects = [bytes([i % 251]) * n for i, n in enumerate(lengths)]
    joined = b"".join(objects)
    whole, addrs, index = build_collections(joined, np.array(lengths), base)
    heap = Collections(np.array(lengths), base)
    lo = data.draw(st.integers(0, heap.count - 1))
    hi = data.draw(st.integers(lo + 1, heap.count))
    start = int(heap.starts[lo]) - base
    part = heap.image(joined, lo, hi)
    assert part.tobytes() == whole[start : start + part.size].tobytes()
    rows = np.arange(len(lengths))
    refs = heap.refs(rows)
    assert refs[:, 0:4].copy().view("<u4").ravel().tolist() == lengths
    assert refs[:, 4:12].copy().view("<u8").ravel().tolist() == addrs.tolist()
    assert refs[:, 12:16].copy().view("<u4").ravel().tolist() == index.tolist()


@settings(max_examples=30, deadline=None)
@given(
    batches=st.lists(st.lists(st.binary(max_size=9), max_size=12), max_size=6),
    batch=st.integers(1, 5),
)
def test_heap_objects_joined_a_batch_at_a_time_are_the_objects_joined(batches, batch) -> None:
    """Objects added in any runs and spilled every ``JOIN_BATCH`` (as the generator adds a
    variable's strings, then spills) give each object's length and their bytes joined, in
    order, and count the objects gathered so far."""
    from parallelvars.checkpoint.h5raw.global_heap import ObjectBytes

    objects = ObjectBytes()
    objects.JOIN_BATCH = batch
    pending, gathered = objects.pending, []
    for run in batches:
        assert len(objects) == len(gathered)
        pending += run
        gathered += run
        if len(pending) >= objects.JOIN_BATCH:
            objects.spill()
    lengths, data = objects.joined()
    assert lengths.dtype == np.int64
    assert lengths.tolist() == [len(b) for b in gathered]
    assert data == b"".join(gathered)
    assert len(objects) == 0 and objects.joined()[1] == b""


@given(
    runs=st.lists(st.tuples(st.booleans(), st.lists(st.binary(max_size=9), max_size=8)), max_size=6)
)
def test_heap_objects_joined_already_come_after_those_gathered(runs) -> None:
    """Objects added joined already (``add_joined``: their lengths and bytes, as the generator
    adds a batch of leaves' strings) between objects gathered one by one keep their order."""
    from parallelvars.checkpoint.h5raw.global_heap import ObjectBytes

    objects = ObjectBytes()
    gathered: list[bytes] = []
    for joined, run in runs:
        if joined:
            objects.add_joined(np.array([len(b) for b in run], np.int64), b"".join(run))
        else:
            objects.pending += run
        gathered += run
        assert len(objects) == len(gathered)
    lengths, data = objects.joined()
    assert lengths.tolist() == [len(b) for b in gathered]
    assert data == b"".join(gathered)


# ----------------------------------------------------------------------------- the oracle
DTYPES = [
    np.dtype(np.float32),
    np.dtype(np.float64),
    np.dtype(np.float16),
    np.dtype(np.int8),
    np.dtype(np.int64),
    np.dtype(np.uint16),
    np.dtype(bool),
    np.dtype(np.complex64),
    np.dtype(ml_dtypes.bfloat16),
    np.dtype(ml_dtypes.float8_e4m3fn),
]
NAMES = ["w", "kernel", "a..b", "x.Sy", "é", "layers", "0", "m" * 40]


def _values(dt: np.dtype, shape: tuple[int, ...], seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, int(np.prod(shape)) * dt.itemsize, dtype=np.uint8)
    if dt.kind == "b":
        return (raw % 2).astype(bool).reshape(shape)
    if dt.kind in "fc" and not dt.name.startswith(("bfloat", "float8")):
        return rng.standard_normal(shape).astype(dt)
    return raw.view(dt).reshape(shape)


@st.composite
def structures(draw: st.DrawFn) -> list[SaveRecord]:
    count = draw(st.integers(1, 6))
    records: list[SaveRecord] = []
    paths: set[str] = set()
    for k in range(count):
        depth = draw(st.integers(1, 3))
        parts = [draw(st.sampled_from(NAMES)) for _ in range(depth)]
        # (some variables are groups on the way to others: a variable's group that is also a
        # parent, made before its children or after them)
        path = "/".join(parts) + ("" if draw(st.integers(0, 3)) == 0 else f"/v{k}")
        if path in paths:
            continue
        paths.add(path)
        dt = draw(st.sampled_from(DTYPES))
        ndim = draw(st.integers(0, 3))
        shape = tuple(draw(st.integers(0, 4)) for _ in range(ndim))
        n = draw(st.integers(1, 6))
        kind = draw(st.sampled_from(["single", "mirrored", "on_read", "independent", "sharded"]))
        if kind == "single":
            n = 1
        if kind == "sharded" and not shape:
            kind = "mirrored"
        devices = [f"cpu:{i}" for i in range(n)]
        attrs: dict[str, object] = {"name": parts[-1], "devices": devices, "trainable": True}
        attrs["aggregation"] = "sum" if kind == "on_read" else "none"
        if kind == "sharded":
            axis = draw(st.integers(0, len(shape) - 1))
            cuts = sorted(
                draw(st.lists(st.integers(0, shape[axis]), min_size=n - 1, max_size=n - 1))
            )
            attrs["shard_axis"] = axis
            attrs["shard_offsets"] = [0, *cuts]
            bounds = [0, *cuts, shape[axis]]
            comps = []
            for i in range(n):
                s = list(shape)
                s[axis] = bounds[i + 1] - bounds[i]
                comps.append(_values(dt, tuple(s), k * 10 + i))
        else:
            first = _values(dt, shape, k * 10)
            equal = kind == "mirrored" and draw(st.booleans())
            comps = [first.copy() if equal else _values(dt, shape, k * 10 + i) for i in range(n)]
            comps[0] = first
        if draw(st.booleans()):
            attrs["slot_of"] = parts[0]
            attrs["slot_name"] = "m"
        if draw(st.booleans()):
            attrs["note"] = {"a": [1, 2]}  # stored as a "json:" string
        records.append(SaveRecord(kind, comps, shape, attrs, path=path))
    return records


def walk(path: str) -> dict[str, object]:
    """Everything h5py sees of a file, the data offsets and the documents aside."""
    seen: dict[str, object] = {}
    with h5py.File(path, "r") as f:

        def attrs(obj: h5py.HLObject) -> dict[str, object]:
            out: dict[str, object] = {}
            for key in obj.attrs:
                a = obj.attrs.get_id(key)
                value = obj.attrs[key]
                if key in ("created", "crc32c"):
                    value = None
                out[key] = (_type(a.get_type()), a.shape, repr(value))
            return out

        def visit(name: str, obj: h5py.HLObject) -> None:
            if name.startswith("_parallelvars/"):
                seen[name] = (type(obj).__name__, attrs(obj))
                return
            if isinstance(obj, h5py.Dataset):
                plist = obj.id.get_create_plist()
                seen[name] = (
                    attrs(obj),
                    _type(obj.id.get_type()),
                    obj.shape,
                    obj.maxshape,
                    obj.chunks,
                    plist.get_layout(),
                    plist.get_nfilters(),
                    obj.is_virtual,
                    np.asarray(obj[()]).tobytes(),
                )
            else:
                seen[name] = attrs(obj)

        seen["/"] = attrs(f)
        # by link, not by object: a dataset with two hard links is seen under both names
        f.visititems_links(lambda name, _link: visit(name, f[name]))
    return seen


def _type(tid: h5py.h5t.TypeID) -> tuple[object, ...]:
    """An HDF5 type as every reader can tell it apart."""
    out: list[object] = [tid.get_class(), tid.get_size()]
    cls = tid.get_class()
    if cls in (h5py.h5t.INTEGER, h5py.h5t.FLOAT):
        out += [tid.get_order(), tid.get_precision()]
    if cls == h5py.h5t.INTEGER:
        out.append(tid.get_sign())
    if cls == h5py.h5t.STRING:
        out += [tid.get_cset(), tid.is_variable_str(), tid.get_strpad()]
    if cls == h5py.h5t.OPAQUE:
        out.append(tid.get_tag())
    if cls in (h5py.h5t.ENUM, h5py.h5t.COMPOUND):
        out += [tid.get_member_name(i) for i in range(tid.get_nmembers())]
    return tuple(out)


def both(tmp_path, records: list[SaveRecord], **kw: object) -> tuple[str, str]:
    import time

    graph = {"version": 1, "nodes": [{"children": []}]}
    meta = {"save_counter": 2, "step": 9}
    real = time.time
    try:
        time.time = lambda: CREATED  # type: ignore[assignment]
        a = write_h5(str(tmp_path / "lib.h5"), records, object_graph=graph, metadata=meta)
    finally:
        time.time = real  # type: ignore[assignment]
    b = write_native(
        str(tmp_path / "gen.h5"),
        records,
        object_graph=graph,
        metadata=meta,
        created=CREATED,
        **kw,  # type: ignore[arg-type]
    )
    return a, b


_SETTINGS = {
    "deadline": None,
    "suppress_health_check": [HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
}


@settings(max_examples=8, **_SETTINGS)  # type: ignore[arg-type]
@given(records=structures(), share=st.booleans())
def test_generated_files_are_what_h5py_reads_in_libhdf5_files(tmp_path, records, share) -> None:
    check_same(tmp_path, records, share)


@pytest.mark.slow
@settings(max_examples=150, **_SETTINGS)  # type: ignore[arg-type]
@given(records=structures(), share=st.booleans())
def test_generated_files_are_what_h5py_reads_soak(tmp_path, records, share) -> None:
    check_same(tmp_path, records, share)


def check_same(tmp_path, records: list[SaveRecord], share: bool) -> None:
    a, b = both(tmp_path, records, share_equal=share)
    wa, wb = walk(a), walk(b)
    assert wa.keys() == wb.keys()
    for key in wa:
        assert wa[key] == wb[key], key
    with H5Reader(a) as ra, H5Reader(b) as rb:
        assert rb.verify_all() == []
        assert list(ra) == list(rb)
        for name in ra:
            va, vb = ra[name], rb[name]
            assert (va.kind, va.dtype, va.shape, va.attrs) == (
                vb.kind,
                vb.dtype,
                vb.shape,
                vb.attrs,
            )
            assert va.stored_checksums == vb.stored_checksums
            for i in range(va.num_components):
                assert va.component(i).tobytes() == vb.component(i).tobytes()
        assert ra.metadata == rb.metadata
        assert ra.object_graph == rb.object_graph


@st.composite
def classed_structures(draw: st.DrawFn) -> list[SaveRecord]:
    """Structures whose records come in classes (records alike but for their paths, shapes,
    names and slots' variables, as a model's variables and their slots are), with names and
    paths holding the characters a format or JSON text treats apart."""
    base = draw(structures())
    out: list[SaveRecord] = []
    for k, r in enumerate(base):
        out.append(r)
        for j in range(draw(st.integers(0, 3))):
            attrs = dict(r.attrs)
            attrs["name"] = draw(st.sampled_from(["w", "50%", 'q"t', "é", f"n{j}", "json:x"]))
            if "slot_of" in attrs or draw(st.booleans()):
                attrs["slot_of"] = draw(st.sampled_from(["a/b", "%s", f"v{j}", "json:[1]"]))
                attrs.setdefault("slot_name", "v")
            key = draw(st.sampled_from([None, 1, True, 1.0, "1"]))
            if key is not None:  # (keys equal in Python, written apart: their own classes)
                attrs["cfg"] = {key: "a"}
            shape = r.shape
            comps = list(r.components)
            if r.kind != "sharded" and shape and draw(st.booleans()):
                shape = tuple(draw(st.integers(0, 3)) for _ in shape)  # (same rank)
                comps = [_values(r.dtype, shape, 100 * k + j)] * len(comps)
            out.append(SaveRecord(r.kind, comps, shape, attrs, path=f"{r.path}_c{j}/x%{j}"))
    return out


@settings(max_examples=25, **_SETTINGS)  # type: ignore[arg-type]
@given(records=classed_structures(), share=st.booleans())
def test_a_first_save_by_record_class_is_the_object_wise_file(
    tmp_path_factory, monkeypatch, records, share
) -> None:
    """A first save plans and writes its documents by record class (``record_classes``:
    a class's layout and texts made once); the file is byte for byte the one written from
    one object per variable (``write_native``: ``Variable`` records and the index's
    objects)."""
    import time

    from parallelvars.checkpoint.h5raw.native import save_native

    tmp = tmp_path_factory.mktemp("classes")
    graph = {"version": 1, "nodes": [{"children": []}]}
    meta = {"save_counter": 2, "step": 9}
    monkeypatch.setattr(time, "time", lambda: CREATED)
    a = write_native(
        str(tmp / "objects.h5"),
        records,
        object_graph=graph,
        metadata=meta,
        share_equal=share,
        created=CREATED,
    )
    b = save_native(
        str(tmp / "classes.h5"), records, object_graph=graph, metadata=meta, share_equal=share
    )
    with open(a, "rb") as fa, open(b, "rb") as fb:
        assert fa.read() == fb.read()


def test_dict_attributes_whose_keys_are_equal_in_python_are_classes_apart(
    tmp_path, monkeypatch
) -> None:
    """``{1: x}``, ``{True: x}`` and ``{1.0: x}`` compare equal but are written apart: records
    holding them are of classes apart (each record's own index text and header attribute),
    and the first save is byte for byte the object-wise file."""
    import time

    from parallelvars.checkpoint.h5io.records import record_classes
    from parallelvars.checkpoint.h5raw.native import save_native

    keys: list[object] = [1, True, 1.0, "1"]
    records = [
        SaveRecord("plain", [np.zeros(2, np.float32)], (2,), {"cfg": {k: "a"}}, path=f"v{n}")
        for n, k in enumerate(keys)
    ]
    assert record_classes(records).ids == [0, 1, 2, 3]
    monkeypatch.setattr(time, "time", lambda: CREATED)
    a = write_native(str(tmp_path / "objects.h5"), records, created=CREATED)
    b = save_native(str(tmp_path / "classes.h5"), records)
    with open(a, "rb") as fa, open(b, "rb") as fb:
        assert fa.read() == fb.read()
    with h5py.File(b, "r") as f:
        assert [f[f"v{n}"].attrs["cfg"] for n in range(4)] == [
            'json:{"1": "a"}',
            'json:{"true": "a"}',
            'json:{"1.0": "a"}',
            'json:{"1": "a"}',
        ]


def test_list_attributes_holding_lists_or_dicts_are_saved(tmp_path, monkeypatch) -> None:
    """A list attribute whose items are lists or dicts (which do not hash) is keyed frozen:
    equal lists share a class, ``[[1]]`` and ``[[True]]`` do not, and the first save is byte
    for byte the object-wise file."""
    import time

    from parallelvars.checkpoint.h5io.records import record_classes
    from parallelvars.checkpoint.h5raw.native import save_native

    values: list[object] = [[[1, 2], [3, 4]], [[1, 2], [3, 4]], [[True, 2], [3, 4]], [{"a": 1}]]
    records = [
        SaveRecord("single", [np.zeros(2, np.float32)], (2,), {"pairs": v}, path=f"v{n}")
        for n, v in enumerate(values)
    ]
    assert record_classes(records).ids == [0, 0, 1, 2]
    monkeypatch.setattr(time, "time", lambda: CREATED)
    a = write_native(str(tmp_path / "objects.h5"), records, created=CREATED)
    b = save_native(str(tmp_path / "classes.h5"), records)
    with open(a, "rb") as fa, open(b, "rb") as fb:
        assert fa.read() == fb.read()
    with H5Reader(b) as r:
        assert [r[f"v{n}"].attrs["pairs"] for n in range(4)] == values


def test_metadata_made_in_batches_is_the_same(tmp_path, monkeypatch) -> None:
    """The global heap's objects and the headers made from templates are made a batch at a
    time (memory bounded by the batch); batches of a few objects give the same bytes as one
    batch of all of them."""
    from parallelvars.checkpoint.h5raw import global_heap, templates

    records = [
        SaveRecord(
            "mirrored",
            [np.full(3, k, np.float32)] * 2,
            (3,),
            {"name": f"w{k}", "devices": ["a", "b"], "slot_of": f"m/{k}", "slot_name": "v"},
            path=f"g{k % 3}/w{k}",
        )
        for k in range(40)
    ]
    whole = write_native(tmp_path / "whole.h5", records, created=CREATED)
    monkeypatch.setattr(global_heap, "_BATCH_OBJECTS", 7)
    monkeypatch.setattr(templates, "_BATCH_ROWS", 3)
    batched = write_native(tmp_path / "batched.h5", records, created=CREATED)
    with open(whole, "rb") as fa, open(batched, "rb") as fb:
        assert fa.read() == fb.read()


@settings(max_examples=60, deadline=None)
@given(
    size=st.integers(1, 9),
    gaps=st.lists(st.integers(-12, 12), min_size=0, max_size=40),
    data=st.data(),
)
def test_template_rows_are_placed_at_their_addresses(size, gaps, data) -> None:
    """Rows laid one after another, at a fixed stride with other bytes between them, or out
    of order are each copied to their own address (a run of equal steps in one strided copy)."""
    from parallelvars.checkpoint.h5raw.templates import place

    at = [0]
    for gap in gaps:  # (a gap repeated makes a run of equal steps)
        at.append(at[-1] + size + gap if gap >= 0 else at[-1] + gap * size)
    addresses = np.array(at, np.int64)
    addresses -= addresses.min()
    rows = data.draw(
        st.lists(st.binary(min_size=size, max_size=size), min_size=len(at), max_size=len(at))
    )
    rows_array = np.frombuffer(b"".join(rows), np.uint8).reshape(len(at), size)
    image = np.zeros(int(addresses.max()) + size + 3, np.uint8)
    want = image.copy()
    for a, row in zip(addresses.tolist(), rows_array, strict=True):
        want[a : a + size] = row
    place(image, addresses, rows_array)
    assert image.tobytes() == want.tobytes()


@pytest.mark.parametrize(
    "addresses",
    [[0, 50, 100], [0, 46, 92], [80, 90, 100], [-5, 5, 15], [-50, 0, 50], [95], [-1], [30, 10, 95]],
)
def test_rows_outside_the_image_are_refused_before_a_byte_is_copied(addresses) -> None:
    """A row past the image's end or before its start raises ``ValueError`` and nothing is
    written, in the image or past it: strided runs included (their view has no bounds)."""
    from parallelvars.checkpoint.h5raw.templates import place

    base = np.zeros(300, np.uint8)
    image = base[100:200]
    rows = np.full((len(addresses), 10), 7, np.uint8)
    with pytest.raises(ValueError, match="do not fit an image of 100 bytes"):
        place(image, np.array(addresses, np.int64), rows)
    assert not base.any()


def test_a_released_plan_is_freed_without_the_cyclic_collector() -> None:
    """A plan's layouts and their groups refer to each other; released, the plan leaves no
    cycle behind (a first save of 50,000 variables with slots left 150,000 objects to the next
    full collection, seconds of a training loop's time)."""
    import collections
    import gc

    variables = [
        Variable(
            f"g/w{k}",
            "mirrored",
            np.dtype(np.float32),
            (3,),
            2,
            {"devices": ["a", "b"], "slot_of": f"m/{k}"},
            [0, 0],
        )
        for k in range(50)
    ]

    def plan_once() -> None:
        plan = FilePlan(variables, root_attrs={"created": np.float64(CREATED)}, documents=["i"])
        plan.metadata({"i": 10})
        plan.release()

    def plans_objects() -> collections.Counter[str]:
        """The live objects of the plan's classes (the classes of ``h5raw``'s modules)."""
        return collections.Counter(
            type(o).__qualname__
            for o in gc.get_objects()
            if str(type(o).__dict__.get("__module__", "")).startswith(
                "parallelvars.checkpoint.h5raw"
            )
        )

    plan_once()  # (imports and caches made on first use)
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()  # (no collection in between: what the plan leaves is seen, not collected)
    try:
        before = plans_objects()
        plan_once()
        left = plans_objects() - before
    finally:
        if enabled:
            gc.enable()
    assert not left, left  # (other objects' cycles, the process's own, are not counted)


def test_mirrored_components_stored_once_are_hard_links(tmp_path) -> None:
    w = np.arange(1000, dtype=np.float32)
    rec = SaveRecord(
        "mirrored", [w, w.copy(), w.copy(), w + 1], (1000,), {"devices": list("abcd")}, path="m/w"
    )
    a, b = both(tmp_path, [rec], share_equal=True)
    with h5py.File(b, "r") as f:
        g = f["m/w"]
        addr = [h5py.h5o.get_info(g[n].id).addr for n in g]
        assert len(set(addr)) == 2  # parallel_component_1 and _2 are primary, _3 differs
        assert h5py.h5o.get_info(g["primary"].id).rc == 3
    import os

    assert os.path.getsize(b) < os.path.getsize(a) - 2 * w.nbytes
    assert walk(a) == walk(b)


# Both files are walked through h5py (2 CPU-seconds per 700 links): the default run takes a
# group whose links fill two chunks, CI's slow step (-m slow) one that fills four.
@pytest.mark.parametrize(
    "links, chunks", [(300, 2), pytest.param(700, 4, marks=pytest.mark.slow)], ids=["2", "4"]
)
def test_wide_groups_continue_in_chunks_and_read_the_same(tmp_path, links, chunks) -> None:
    records = [
        SaveRecord(
            "single", [np.full(3, k, np.int32)], (3,), {"devices": ["cpu:0"]}, path=f"m/v{k}"
        )
        for k in range(links)
    ]
    a, b = both(tmp_path, records)
    assert walk(a) == walk(b)
    with h5py.File(b, "r") as f:
        address = h5py.h5o.get_info(f["m"].id).addr
    with open(b, "rb") as fh:
        raw = fh.read()
    h = hdr.read_object_header(ImageSource(raw), address, checksums=True)
    assert len(h.chunks) >= chunks and sum(m.type == hdr.LINK for m in h.messages) == links


def test_variable_groups_with_long_headers_continue_in_chunks(tmp_path) -> None:
    devices = [f"cpu:{i}" for i in range(300)]  # 4.8 KiB of string references
    records = [
        SaveRecord(
            "mirrored",
            [np.full(3, k, np.float32)] * 2,
            (3,),
            {"devices": devices, "note": "x" * 5000},
            path=f"m/w{k}",
        )
        for k in range(3)
    ]
    a, b = both(tmp_path, records)
    assert walk(a) == walk(b)
    with h5py.File(b, "r") as f:
        address = h5py.h5o.get_info(f["m/w1"].id).addr
    with open(b, "rb") as fh:
        raw = fh.read()
    h = hdr.read_object_header(ImageSource(raw), address, checksums=True)
    assert len(h.chunks) > 1


def test_what_the_generator_cannot_express_is_said(tmp_path) -> None:
    # an attribute message over 64 KiB (5,000 strings: a 16-byte heap reference each)
    wide = {"devices": [f"d{i}" for i in range(5000)]}
    text = SaveRecord("single", [np.zeros(1, np.float32)], (1,), wide, path="t")
    with pytest.raises(Unsupported, match="64 KiB"):
        write_native(str(tmp_path / "t.h5"), [text])
    # a group of more than MAX_COMPACT_LINKS links is a symbol table: hard links only
    many = [
        Variable(f"g/v{k}", "single", np.dtype(np.float32), (1,), 1, {}, None, [("p.h5", "/x")])
        for k in range(1)
    ]
    many[0].num_components = 1025
    many[0].external = [("p.h5", f"/x{k}") for k in range(1025)]
    with pytest.raises(Unsupported, match="external links"):
        FilePlan(many, root_attrs={}).metadata()
    with pytest.raises(Unsupported, match="dtype"):
        FilePlan([Variable("x", "single", np.dtype("M8[s]"), (1,), 1, {})], root_attrs={})


@pytest.mark.skipif(shutil.which("h5dump") is None, reason="the HDF5 tools are not installed")
def test_the_hdf5_tools_read_generated_files(tmp_path) -> None:
    rec = [
        SaveRecord(
            "sharded",
            [np.arange(4, dtype=np.float32).reshape(2, 2), np.ones((1, 2), np.float32)],
            (3, 2),
            {"devices": ["a", "b"], "shard_axis": 0, "shard_offsets": [0, 2]},
            path="model/e",
        ),
        SaveRecord("mirrored", [np.ones(2, ml_dtypes.bfloat16)] * 2, (2,), {}, path="model/h"),
    ]
    _lib, gen = both(tmp_path, rec, share_equal=True)
    # (Debian 12's tools, HDF5 1.10, cannot read the virtual dataset libhdf5 2.0 writes:
    # h5dump fails on that file; generated files are readable by every HDF5 since 1.10.)
    dump = subprocess.run(["h5dump", gen], capture_output=True, text=True, check=True).stdout
    assert 'VIRTUAL DATASET "value"' in dump or 'DATASET "value"' in dump
    assert "(2,0): 1, 1" in dump and 'ATTRIBUTE "shard_offsets"' in dump
    assert "DATATYPE  H5T_OPAQUE" in dump
    listing = subprocess.run(["h5ls", "-r", gen], capture_output=True, text=True, check=True).stdout
    assert "/model/e/value           Dataset {3, 2}" in listing
    assert "/model/h/primary         Dataset, same as /model/h/parallel_component_1" in listing or (
        "/model/h/parallel_component_1 Dataset, same as /model/h/primary" in listing
    )


def test_header_values_change_without_a_new_plan() -> None:
    """A repeated save re-uses its plan: the root values of the same types are put in, and
    anything that would move bytes is refused."""
    v = [Variable("x", "single", np.dtype(np.float32), (2,), 1, {})]
    plan = FilePlan(v, root_attrs={"created": np.float64(1.0), "note": "a"}, documents=["d"])
    first = plan.metadata({"d": 8}, values={"created": np.float64(2.0)})
    again = plan.metadata({"d": 8}, values={"created": np.float64(2.0)})
    assert first == again
    other = plan.metadata({"d": 8}, values={"created": np.float64(3.0)})
    assert other.file_size == first.file_size and other.pieces != first.pieces
    from parallelvars.errors import InvalidEntryError

    with pytest.raises(InvalidEntryError, match="another HDF5 type"):
        plan.metadata({"d": 8}, values={"created": np.int64(3)})
    with pytest.raises(InvalidEntryError, match="string differs"):
        plan.metadata({"d": 8}, values={"note": "b"})
    with pytest.raises(InvalidEntryError, match="written twice"):
        FilePlan(v + v, root_attrs={})


def test_index_files_with_external_links_read_as_libhdf5_writes_them(tmp_path) -> None:
    from parallelvars.checkpoint.h5io import ComponentLink, LinkedVariable, write_h5_index
    from parallelvars.checkpoint.h5raw.index_file import write_native_index

    parts = [f"ckpt.h5.parts/rank-{r:05d}-of-00002.h5" for r in range(2)]
    variables = [
        LinkedVariable(
            path,
            "mirrored",
            np.float32,
            (3,),
            {"devices": ["cpu:0", "cpu:1"], "aggregation": "none"},
            [ComponentLink(parts[r], f"/{path}/primary", 7 + r) for r in range(2)],
        )
        for path in ("m/w", "m/b", "opt/slots/m/w/m")
    ]
    import time

    real = time.time
    try:
        time.time = lambda: CREATED  # type: ignore[assignment]
        a = write_h5_index(str(tmp_path / "lib.h5"), variables, metadata={"processes": 2})
    finally:
        time.time = real  # type: ignore[assignment]
    b = write_native_index(
        str(tmp_path / "gen.h5"), variables, metadata={"processes": 2}, created=CREATED
    )

    def links(path: str) -> dict[str, tuple[str, str]]:
        out = {}
        with h5py.File(path, "r") as f:

            def visit(name: str, link: object) -> None:
                if isinstance(link, h5py.ExternalLink):
                    out[name] = (link.filename, link.path)

            f.visititems_links(visit)
        return out

    assert links(a) == links(b) and len(links(b)) == 6
    with h5py.File(a, "r") as fa, h5py.File(b, "r") as fb:
        for name in ("/", "m/w", "m/b", "opt/slots/m/w/m"):
            assert {k: repr(v) for k, v in fa[name].attrs.items() if k != "crc32c"} == {
                k: repr(v) for k, v in fb[name].attrs.items() if k != "crc32c"
            }
        assert bytes(fa["_parallelvars/index"][()]) == bytes(fb["_parallelvars/index"][()])


_PATH_PARTS = st.sampled_from(["a", "b.c", ".", "..", "", "_parallelvars", "x\ny", "%d", "/"])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(_PATH_PARTS, max_size=4).map("/".join), max_size=6))
@example(["ok", "a/./b"])
@example(["ok", "a/.", "b"])
@example(["./a"])
@example(["."])
@example(["a//b"])
@example(["a/", "/a"])
@example(["ok", "a/"])
@example(["_parallelvars/x"])
@example(["x", "_parallelvars"])
@example(["_parallelvarsx/y", "a\n/b"])
@example(["ok", ""])
def test_paths_validated_together_refuse_what_each_one_refuses(paths: list[str]) -> None:
    """``validate_paths`` (every path of a save at once) refuses exactly the lists holding a
    path the layout refuses (empty, a part empty or ``.``, or under the reserved group),
    naming the first such path."""
    from parallelvars.checkpoint.h5io.layout import META_GROUP, validate_paths
    from parallelvars.errors import InvalidEntryError

    def refused(path: str) -> bool:
        parts = path.split("/")
        return not path or any(p in ("", ".") for p in parts) or parts[0] == META_GROUP

    first_bad = next((p for p in paths if refused(p)), None)
    if first_bad is None:
        validate_paths(paths)
    else:
        with pytest.raises(InvalidEntryError) as err:
            validate_paths(paths)
        assert err.value.variable == first_bad


@pytest.mark.parametrize("writer", ["write_native", "save_native"])
@pytest.mark.parametrize("bad", [None, 7, b"a/b"])
def test_a_path_that_is_no_string_is_an_invalid_entry(tmp_path, writer, bad) -> None:
    """A record whose path is no string is refused as the per-path check refuses it (an
    :class:`InvalidEntryError` naming it), not with the ``TypeError`` of joining the paths."""
    from parallelvars.checkpoint.h5io.layout import validate_paths
    from parallelvars.checkpoint.h5raw import native
    from parallelvars.errors import InvalidEntryError

    with pytest.raises(InvalidEntryError) as err:
        validate_paths(["ok", bad])  # type: ignore[list-item]
    assert err.value.variable == bad
    v = np.zeros(2, np.float32)
    record = SaveRecord("single", [v], v.shape, {"name": "x"}, path=bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidEntryError):
        getattr(native, writer)(str(tmp_path / "a.h5"), [record])
