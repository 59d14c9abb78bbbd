"""The generator's bytes against its earlier form (``generate_reference.py``), over generated
structures: every kind, dtype (bfloat16, float8, byte strings), 0-d and empty components, 1-6
components, layered and flat (a symbol table's) groups; the file written by ``write_native``
and by ``save_native``'s first and repeated saves, with the image kept for the repeated save
or made again a chunk at a time, in chunks of a few bytes (a window per object) or of many
objects. And the chunks themselves: contiguous, bounded, the image laid one after another."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import generate_reference as ref
import h5py
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_h5raw import CREATED, structures

from parallelvars.checkpoint.h5io import H5Reader
from parallelvars.checkpoint.h5io.records import PlanCache
from parallelvars.checkpoint.h5raw import generate, native
from parallelvars.checkpoint.h5raw.generate import FilePlan, Variable
from parallelvars.checkpoint.h5raw.global_heap import ObjectBytes
from parallelvars.checkpoint.registry import SaveRecord


class _RefChunks:
    def __init__(self, meta: Any) -> None:
        (self._at, self._image), *self.data = meta.pieces
        self.file_size, self.documents = meta.file_size, meta.documents

    def __iter__(self) -> Iterator[tuple[int, Any]]:
        yield self._at, self._image


class _RefPlan(ref.FilePlan):  # type: ignore[misc]
    """The earlier generator, with the chunked interface the writer calls (one chunk)."""

    made = 0  # (plans made: the files were generated, not written through libhdf5)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        type(self).made += 1
        super().__init__(*args, **kwargs)

    def chunks(self, *args: Any, **kwargs: Any) -> _RefChunks:
        return _RefChunks(self.metadata(*args, **kwargs))


def _read(path: str) -> bytes:
    with open(path, "rb") as fh:
        return fh.read()


def _files(tmp_path: Any, tag: str, records: list[SaveRecord], share: bool) -> list[bytes]:
    """The bytes of ``write_native``'s file and of a first and a repeated ``save_native``."""
    real = time.time
    graph = {"version": 1, "nodes": [{"children": []}]}
    out = []
    try:
        time.time = lambda: CREATED  # type: ignore[assignment]
        a = native.write_native(
            str(tmp_path / f"{tag}w.h5"), records, object_graph=graph, created=CREATED
        )
        out.append(_read(a))
        cache = PlanCache()
        for k, step in enumerate((3, 4)):
            p = native.save_native(
                str(tmp_path / f"{tag}s{k}.h5"),
                records,
                object_graph=graph,
                metadata={"step": step},
                cache=cache,
                share_equal=share,
            )
            out.append(_read(p))
    finally:
        time.time = real  # type: ignore[assignment]
    return out


def _same_as_before(tmp_path: Any, records: list[SaveRecord], share: bool, mp: Any) -> None:
    made = _RefPlan.made
    with mp.context() as m:
        m.setattr(native, "FilePlan", _RefPlan)
        m.setattr(generate, "KEPT_IMAGE_BYTES", 1 << 62)
        before = _files(tmp_path, "ref", records, share)
    assert _RefPlan.made >= made + 2  # (write_native's and the first save's)
    now = _files(tmp_path, "new", records, share)
    assert [len(b) for b in now] == [len(b) for b in before]
    for k, (x, y) in enumerate(zip(now, before, strict=True)):
        assert x == y, k


_SETTINGS: Any = {
    "deadline": None,
    "suppress_health_check": [HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
}


def _writes_the_bytes_it_wrote_before(
    tmp_path: Any,
    mp: Any,
    records: list[SaveRecord],
    share: bool,
    chunk: int,
    kept: int,
    order: Any,
) -> None:
    records = list(records)
    order.shuffle(records)  # (records in any order, not the file's)
    mp.setattr(generate, "CHUNK_BYTES", chunk)
    mp.setattr(generate, "KEPT_IMAGE_BYTES", kept)
    _same_as_before(tmp_path, records, share, mp)


_KEPT = st.sampled_from([0, generate.KEPT_IMAGE_BYTES])


@settings(max_examples=6, **_SETTINGS)
@given(
    records=structures(),
    share=st.booleans(),
    chunk=st.sampled_from([1, 300, generate.CHUNK_BYTES]),
    kept=_KEPT,
    order=st.randoms(use_true_random=False),
)
def test_the_generator_writes_the_bytes_it_wrote_before(
    tmp_path, monkeypatch, records, share, chunk, kept, order
) -> None:
    _writes_the_bytes_it_wrote_before(tmp_path, monkeypatch, records, share, chunk, kept, order)


@pytest.mark.slow
@settings(max_examples=150, **_SETTINGS)
@given(
    records=structures(),
    share=st.booleans(),
    chunk=st.sampled_from([1, 300, 5000, generate.CHUNK_BYTES]),
    kept=_KEPT,
    order=st.randoms(use_true_random=False),
)
def test_the_generator_writes_the_bytes_it_wrote_before_soak(
    tmp_path, monkeypatch, records, share, chunk, kept, order
) -> None:
    _writes_the_bytes_it_wrote_before(tmp_path, monkeypatch, records, share, chunk, kept, order)


def _model(count: int, flat: bool) -> list[SaveRecord]:
    """Mirrored variables (the first 20 with two slot variables each): in groups of 10, or
    one flat group (more links than a header keeps: a symbol table)."""
    records = []
    for k in range(count):
        path = f"vars/v{k}" if flat else f"layers/{k // 10}/w{k % 10}"
        value = np.full((k % 3, 2) if k % 4 else (), k, np.float32)
        attrs = {"name": f"w{k}", "devices": ["a", "b"]}
        records.append(SaveRecord("mirrored", [value, value.copy()], value.shape, attrs, path=path))
        for slot in ("m", "v") if k < 20 else ():
            s_attrs = {**attrs, "slot_of": path, "slot_name": slot}
            other = value + 1
            records.append(
                SaveRecord("on_read", [value, other], value.shape, s_attrs, path=f"opt/{slot}/{k}")
            )
    return records


@pytest.mark.parametrize("flat", [False, True])
@pytest.mark.parametrize("chunk", [3000])
@pytest.mark.parametrize("join", [1 << 15, 7], ids=["joined", "spilled"])
def test_large_structures_write_the_bytes_written_before(
    tmp_path, monkeypatch, flat, chunk, join
) -> None:
    """(``join``: the heap objects' bytes joined at once, or a few at a time as a large
    file's are)"""
    monkeypatch.setattr(generate, "CHUNK_BYTES", chunk)
    monkeypatch.setattr(ObjectBytes, "JOIN_BATCH", join)
    monkeypatch.setattr(generate, "KEPT_IMAGE_BYTES", 0)
    _same_as_before(tmp_path, _model(1030 if flat else 100, flat), True, monkeypatch)


def _plan(records: list[SaveRecord]) -> FilePlan:
    variables = [
        Variable(r.path, r.kind, r.dtype, tuple(r.shape), r.num_components, dict(r.attrs))
        for r in records
    ]
    return FilePlan(variables, root_attrs={"step": np.int64(1)}, documents=["doc"])


@pytest.mark.parametrize("chunk", [1, 5000])
def test_chunks_are_the_image_a_few_bytes_at_a_time(monkeypatch, chunk) -> None:
    """The chunks follow one another from 0 to the metadata's end; each is at most
    ``CHUNK_BYTES`` long or one object alone, and they lay the image ``metadata`` gives."""
    records = _model(1030, True) if chunk > 1 else _model(40, False)
    whole = _plan(records).metadata({"doc": 10}, document_checksums={"doc": 7})
    image = bytes(whole.pieces[0][1])
    monkeypatch.setattr(generate, "CHUNK_BYTES", chunk)
    plan = _plan(records)
    chunks = plan.chunks({"doc": 10}, document_checksums={"doc": 7})
    assert (chunks.file_size, chunks.documents) == (whole.file_size, whole.documents)
    at, made = 0, []
    cols = plan._window_columns()
    starts = set(cols.starts.tolist())
    heap_at = plan._heap_at
    for offset, data in chunks:
        assert offset == at
        if len(data) > chunk and offset < heap_at:  # (one object: no other starts inside)
            assert not starts & set(range(offset + 1, offset + len(data)))
        else:
            assert len(data) <= max(chunk, 1)
        made.append(bytes(data))
        at += len(data)
    assert at == plan.metadata_size and b"".join(made) == image


def test_verify_compares_a_chunk_at_a_time(tmp_path, monkeypatch) -> None:
    """``verify``'s regenerated metadata, in small chunks, still finds one damaged byte."""
    from parallelvars.checkpoint.h5io.regenerated import sound_as_generated

    monkeypatch.setattr(generate, "CHUNK_BYTES", 512)
    path = native.save_native(str(tmp_path / "a.h5"), _model(60, False))
    with H5Reader(path) as r:
        assert sound_as_generated(r)
    data = bytearray(_read(path))
    plan_end = 4000  # (inside the object headers: the root's children)
    data[plan_end] ^= 0x01
    bad = tmp_path / "b.h5"
    bad.write_bytes(bytes(data))
    with H5Reader(str(bad)) as r:
        assert not sound_as_generated(r)


@pytest.mark.parametrize("kernel_copy", [True, False])
def test_an_image_kept_in_a_file_writes_the_same_bytes(tmp_path, monkeypatch, kernel_copy) -> None:
    """A structure of more metadata than is kept in memory keeps its image in an unnamed file
    beside the checkpoint: the repeated save copies it (by the kernel, or a chunk at a time
    where ``copy_file_range`` is refused), byte for byte, and leaves no file behind."""
    import os

    def refused(*args: Any) -> int:
        raise OSError(18, "cross-device")

    monkeypatch.setattr(generate, "KEPT_IMAGE_BYTES", 0)
    monkeypatch.setattr(generate, "CHUNK_BYTES", 2000)
    if not kernel_copy:
        monkeypatch.setattr(os, "copy_file_range", refused, raising=False)
    _same_as_before(tmp_path, _model(60, False), True, monkeypatch)
    assert sorted(os.listdir(tmp_path)) == sorted(
        f"{tag}{name}.h5" for tag in ("ref", "new") for name in ("w", "s0", "s1")
    )


@pytest.mark.parametrize("kept", [0, generate.KEPT_IMAGE_BYTES])
def test_byte_strings_write_the_bytes_written_before(tmp_path, monkeypatch, kept) -> None:
    """Byte-string variables (their elements global heap objects, their data the references
    the plan lays itself), 0-d and empty among them, beside numbers of every width."""
    import ml_dtypes

    records = []
    for k, shape in enumerate([(), (0,), (3,), (2, 2)]):
        n = 1 + k % 3
        size = int(np.prod(shape))
        comps = [
            np.array([b"v%d-%d" % (k, j) * (j + 1) for j in range(size)], object).reshape(shape)
            for _ in range(n)
        ]
        attrs = {"name": f"s{k}", "devices": [f"d{i}" for i in range(n)]}
        records.append(SaveRecord("mirrored", comps, shape, attrs, path=f"strings/s{k}"))
    for k, dt in enumerate([ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn, np.int8, np.float64]):
        value = np.arange(k + 2).astype(dt)
        records.append(
            SaveRecord("single", [value], value.shape, {"name": f"n{k}"}, path=f"numbers/n{k}")
        )
    monkeypatch.setattr(generate, "CHUNK_BYTES", 600)
    monkeypatch.setattr(generate, "KEPT_IMAGE_BYTES", kept)
    _same_as_before(tmp_path, records, True, monkeypatch)


def _interleaved(count: int) -> list[SaveRecord]:
    """Variables each followed by its slot (the order a model and its optimizer give them):
    one layout whose records are not in the file's order (``model/...`` before ``opt/...``)."""
    records = []
    for k in range(count):
        value = np.full((2,), k, np.float32)
        for path, v in ((f"model/l{k}/kernel", value), (f"opt/m/l{k}/kernel", value + 1)):
            attrs = {"name": path.replace("/", "_"), "devices": ["a", "b"]}
            records.append(SaveRecord("mirrored", [v, v + 2], v.shape, attrs, path=path))
    return records


def _values_read_by_h5py(path: str, records: list[SaveRecord]) -> None:
    with h5py.File(path, "r") as f:
        for r in records:
            for i, comp in enumerate(r.components):
                name = "primary" if i == 0 else f"parallel_component_{i}"
                got = f[f"{r.path}/{name}"][()]
                assert got.tobytes() == np.asarray(comp).tobytes(), (r.path, i)


@pytest.mark.parametrize("chunk", [1, 300, 2000, generate.CHUNK_BYTES])
@pytest.mark.parametrize("kept", [0, generate.KEPT_IMAGE_BYTES])
def test_records_out_of_file_order_write_the_bytes_written_before(
    tmp_path, monkeypatch, chunk, kept
) -> None:
    """A layout's records in another order than the file's (each variable followed by its
    slot): every window holds the headers that start in it, whatever the records' order."""
    records = _interleaved(40)
    monkeypatch.setattr(generate, "CHUNK_BYTES", chunk)
    monkeypatch.setattr(generate, "KEPT_IMAGE_BYTES", kept)
    _same_as_before(tmp_path, records, True, monkeypatch)
    for name in ("neww", "news0", "news1"):
        _values_read_by_h5py(str(tmp_path / f"{name}.h5"), records)


@settings(max_examples=8, **_SETTINGS)
@given(
    order=st.permutations(range(2 * 12 + 8)),
    chunk=st.sampled_from([1, 300, 2000, generate.CHUNK_BYTES]),
)
def test_records_in_any_order_make_the_image_the_reference_makes(monkeypatch, order, chunk) -> None:
    """Records in any order: the chunks lay the image the earlier generator makes whole."""
    base = _interleaved(12) + [r for r in _model(8, False) if r.path.startswith("layers/")]
    records = [base[k] for k in order]
    variables = [
        Variable(r.path, r.kind, r.dtype, tuple(r.shape), r.num_components, dict(r.attrs))
        for r in records
    ]
    kwargs: Any = {"root_attrs": {"step": np.int64(1)}, "documents": ["doc"]}
    want = ref.FilePlan(variables, **kwargs).metadata({"doc": 10}, document_checksums={"doc": 7})
    monkeypatch.setattr(generate, "CHUNK_BYTES", chunk)
    chunks = FilePlan(variables, **kwargs).chunks({"doc": 10}, document_checksums={"doc": 7})
    image = b"".join(bytes(data) for _, data in chunks)
    assert image == bytes(want.pieces[0][1])
    assert (chunks.file_size, chunks.documents) == (want.file_size, want.documents)


def test_verify_finds_a_file_of_records_out_of_order_sound_and_a_damaged_one_not(
    tmp_path, monkeypatch
) -> None:
    """``verify`` regenerates the metadata of a file whose records are not in the file's order
    window by window: the file is sound, and one changed byte in a slot's header is found."""
    from parallelvars.checkpoint.h5io.regenerated import sound_as_generated

    monkeypatch.setattr(generate, "CHUNK_BYTES", 700)
    records = _interleaved(60)
    path = native.save_native(str(tmp_path / "a.h5"), records)
    with H5Reader(path) as r:
        assert sound_as_generated(r)
    with h5py.File(path, "r") as f:
        at = h5py.h5o.get_info(f["opt/m/l30/kernel"].id).addr
    data = bytearray(_read(path))
    data[at + 40] ^= 0x01
    bad = tmp_path / "b.h5"
    bad.write_bytes(bytes(data))
    with H5Reader(str(bad)) as r:
        assert not sound_as_generated(r)


def test_an_image_kept_in_a_file_lies_in_a_relative_checkpoints_folder(
    tmp_path, monkeypatch
) -> None:
    """A checkpoint named relative to the working folder spills its image into that folder
    (the checkpoint's file system), not into the temporary files' default folder."""
    import os
    import tempfile

    folders = []
    real = tempfile.TemporaryFile

    def spy(*args: Any, **kwargs: Any) -> Any:
        folders.append(kwargs.get("dir"))
        return real(*args, **kwargs)

    monkeypatch.setattr("tempfile.TemporaryFile", spy)
    monkeypatch.setattr(generate, "KEPT_IMAGE_BYTES", 0)
    (tmp_path / "run").mkdir()
    monkeypatch.chdir(tmp_path / "run")
    records = _model(30, False)
    cache = PlanCache()
    for step in (1, 2):
        native.save_native("ckpt.h5", records, metadata={"step": step}, cache=cache)
    assert [os.path.realpath(f) for f in folders] == [os.path.realpath(tmp_path / "run")]
    assert os.listdir(tmp_path / "run") == ["ckpt.h5"]
    _values_read_by_h5py(str(tmp_path / "run" / "ckpt.h5"), records)


def test_an_image_nothing_reuses_is_written_once_and_not_spilled(tmp_path, monkeypatch) -> None:
    """A save without a cache writes a large image straight into its file (no spilled copy
    to copy back): the same bytes as a save whose image is kept in memory."""
    import tempfile

    monkeypatch.setattr("time.time", lambda: CREATED)
    records = _model(60, False)
    kept = native.save_native(str(tmp_path / "kept.h5"), records, metadata={"step": 1})
    spilled: list[str] = []
    real = tempfile.TemporaryFile
    monkeypatch.setattr(
        "tempfile.TemporaryFile", lambda *a, **k: spilled.append("spill") or real(*a, **k)
    )
    copy = generate.SpilledImage.write_to
    monkeypatch.setattr(
        generate.SpilledImage, "write_to", lambda s, fd: spilled.append("copy") or copy(s, fd)
    )
    monkeypatch.setattr(generate, "KEPT_IMAGE_BYTES", 0)
    monkeypatch.setattr(generate, "CHUNK_BYTES", 700)
    path = native.save_native(str(tmp_path / "a.h5"), records, metadata={"step": 1})
    assert spilled == []
    assert _read(path) == _read(kept)
    _values_read_by_h5py(path, records)


@pytest.mark.parametrize("failure", ["full", "refused"])
def test_a_failed_spill_leaves_the_save_whole(tmp_path, monkeypatch, failure) -> None:
    """The spilled image's disk full (or its folder refusing a temporary file): the saves
    write their files all the same, byte for byte, each making its image again."""
    import errno

    def unusable(*args: Any, **kwargs: Any) -> Any:
        if failure == "refused":
            raise OSError(errno.EACCES, "refused")
        return open("/dev/full", "r+b", buffering=0)

    monkeypatch.setattr("tempfile.TemporaryFile", unusable)
    monkeypatch.setattr(generate, "KEPT_IMAGE_BYTES", 0)
    monkeypatch.setattr(generate, "CHUNK_BYTES", 2000)
    records = _model(60, False)
    _same_as_before(tmp_path, records, True, monkeypatch)
    _values_read_by_h5py(str(tmp_path / "news1.h5"), records)


def test_the_kept_image_size_is_read_where_it_is_set(tmp_path, monkeypatch) -> None:
    """``generate.KEPT_IMAGE_BYTES`` set to 0 spills every cached image (read when a save
    uses it, not copied at import); a released plan keeps no checksum spans."""
    import tempfile

    spilled: list[Any] = []
    real = tempfile.TemporaryFile
    monkeypatch.setattr(
        "tempfile.TemporaryFile", lambda *a, **k: spilled.append(k) or real(*a, **k)
    )
    monkeypatch.setattr(generate, "KEPT_IMAGE_BYTES", 0)
    native.save_native(str(tmp_path / "a.h5"), _model(10, False), cache=PlanCache())
    assert len(spilled) == 1
    plan = _plan(_model(10, False))
    plan.metadata({"doc": 10})
    assert plan.checksum_spans
    plan.release()
    assert plan.checksum_spans == []


def _tree_variables() -> list[Variable]:
    """Variables whose groups are not all leaves made from a template: at the root, one linked
    as a leaf that later variables make a parent (``a``), one whose group was made as a parent
    first (``c``), variables whose header needs a second chunk (an attribute of 600 integers:
    encoded on their own), under a leaf made a parent too, and slots (a row string each)."""
    f32 = np.dtype(np.float32)

    def var(path: str, n: int = 2, **attrs: Any) -> Variable:
        return Variable(path, "mirrored", f32, (3,), n, {"devices": ["cpu:0"] * n, **attrs})

    big = {"note": list(range(600))}
    return [
        var("w"),
        var("a"),
        var("c/d"),
        var("c/d/x"),
        var("a/b", 1),
        var("c"),
        var("c/y"),
        var("big/x", **big),
        var("big/y", **big),
        var("a/b/z", **big),
        var("s/w/m", slot_of="w", slot_name="m"),
        var("s/a/m", slot_of="a", slot_name="m"),
        var("s/w/v", slot_of="w", slot_name="v"),
        var("s/a/v", slot_of="a", slot_name="v"),
        var("a/e"),
    ]


@pytest.mark.parametrize("chunk", [1, 300, generate.CHUNK_BYTES])
def test_groups_made_apart_from_the_templates_make_the_image_the_reference_makes(
    monkeypatch, chunk
) -> None:
    """Leaves made parents (before and after their children), headers of two chunks, slots,
    a variable at the root: the image, the offsets, and after a release the refreshed root."""
    variables = _tree_variables()
    kwargs: Any = {"root_attrs": {"step": np.int64(1), "note": "n"}, "documents": ["doc"]}
    want_plan = ref.FilePlan(variables, **kwargs)
    want = want_plan.metadata({"doc": 10}, document_checksums={"doc": 7})
    monkeypatch.setattr(generate, "CHUNK_BYTES", chunk)
    plan = FilePlan(variables, **kwargs)
    chunks = plan.chunks({"doc": 10}, document_checksums={"doc": 7})
    image = b"".join(bytes(data) for _, data in chunks)
    assert image == bytes(want.pieces[0][1])
    assert dict(plan.offsets) == want_plan.offsets
    plan.release()
    got = plan.refresh({"step": np.int64(5)}, {"doc": 9})
    assert got == want_plan.refresh({"step": np.int64(5)}, {"doc": 9})


@pytest.mark.parametrize("kind", ["single", "mirrored", "sharded"])
def test_a_parent_variable_whose_child_leaf_became_a_parent_links_its_components_in_place(
    tmp_path, monkeypatch, kind
) -> None:
    """``c/a``, ``c/a/a``, ``c``, ``c/b``: ``c``'s components are linked after ``c/a`` (where
    they were when ``c`` was added), not after ``c/b``: as Variables, and as a save's records
    (sorted into classes)."""
    paths = ["c/a", "c/a/a", "c", "c/b"]
    attrs: dict[str, Any] = {"devices": ["cpu:0", "cpu:1"]}
    if kind == "sharded":
        attrs.update(shard_axis=0, shard_offsets=[0, 2])
    n = 1 if kind == "single" else 2
    f32 = np.dtype(np.float32)
    variables = [Variable(p, kind, f32, (4,), n, dict(attrs)) for p in paths]
    want = ref.FilePlan(variables, root_attrs={}).metadata({})
    image = b"".join(bytes(d) for _, d in FilePlan(variables, root_attrs={}).chunks({}))
    assert image == bytes(want.pieces[0][1])
    size = 2 if kind == "sharded" else 4
    records = [
        SaveRecord(
            kind,
            [np.full(size, k + i, np.float32) for i in range(n)],
            (4,),
            dict(attrs),
            path=p,
        )
        for k, p in enumerate(paths)
    ]
    _same_as_before(tmp_path, records, False, monkeypatch)


def test_offsets_are_found_in_any_order_and_kept_after_a_release() -> None:
    """:attr:`FilePlan.offsets` asked in the variables' order, backwards, twice, for a path
    it does not hold (KeyError), and after the plan is released: the reference's dict."""
    variables = _tree_variables()
    variables.append(Variable("e", "single", np.dtype(np.float32), (0,), 1, {}))  # (no data)
    variables.append(Variable("m", "mirrored", np.dtype(np.float32), (2,), 3, {}, [0, 0, 0]))
    variables.append(Variable("p", "on_read", np.dtype(np.float32), (2,), 3, {}, [0, 1, 0]))
    kwargs: Any = {"root_attrs": {}, "documents": ["doc"]}
    want = ref.FilePlan(variables, **kwargs).offsets
    plan = FilePlan(variables, **kwargs)
    offsets = plan.offsets
    paths = [v.path for v in variables]
    assert [offsets[p] for p in paths] == [want[p] for p in paths]
    assert [offsets[p] for p in reversed(paths)] == [want[p] for p in reversed(paths)]
    assert offsets["m"] == want["m"] and offsets["e"] == [None]
    assert len(offsets) == len(want) and list(offsets) == list(want)
    with pytest.raises(KeyError):
        offsets["nowhere"]
    plan.metadata({"doc": 4})
    plan.release()
    assert dict(plan.offsets) == want


def test_a_path_written_twice_is_refused_leaf_or_not() -> None:
    from parallelvars.errors import InvalidEntryError

    f32 = np.dtype(np.float32)
    for paths in (["x", "x"], ["x/y", "x", "x"], ["x", "x/y", "x"], ["x", "z", "x"]):
        variables = [Variable(p, "single", f32, (2,), 1, {}) for p in paths]
        with pytest.raises(InvalidEntryError, match="written twice"):
            FilePlan(variables, root_attrs={})


def test_the_offsets_kept_after_a_release_hold_no_layout() -> None:
    """A released plan's :attr:`FilePlan.offsets` keeps per layout only its way of finding
    offsets (a few ints), not the layout (its template, signature, dataset keys)."""
    import gc

    variables = _tree_variables()
    variables.append(Variable("m", "mirrored", np.dtype(np.float32), (2,), 3, {}, [0, 0, 0]))
    plan = FilePlan(variables, root_attrs={})
    plan.metadata({})
    plan.release()
    seen: set[int] = set()
    todo: list[Any] = [plan.offsets]
    while todo:
        obj = todo.pop()
        if id(obj) in seen or isinstance(obj, type):
            continue
        seen.add(id(obj))
        assert type(obj).__name__ not in ("Layout", "Template", "Signature"), type(obj)
        todo.extend(gc.get_referents(obj))
    assert len(seen) > len(variables)  # (the walk reached the paths)
