"""Reading the checkpoints TensorFlow 2.21 wrote (tests/data/tf), and writing them back."""

from __future__ import annotations

import filecmp
import json
import os
import shutil
import tarfile
from pathlib import Path

import numpy as np
import pytest

from parallelvars.errors import NotACheckpointError
from parallelvars.formats import (
    ArrayEntry,
    DictView,
    Entry,
    detect_format,
    open_checkpoint,
    write_checkpoint,
)
from parallelvars.formats.testing import TableReader
from parallelvars.formats.tf import FORMAT, BundleReader, TfCheckpointView, sniff

DATA = Path(__file__).parent / "data" / "tf"
FOLDERS = {
    "plain": "ckpt-1",
    "parallel": "ckpt-1",
    "mirrored": "ckpt-1",
    "tf1": "model.ckpt-3",
    "many": "ckpt-1",
    "sharded": "ckpt-1",
}
GRAPH = "_CHECKPOINTABLE_OBJECT_GRAPH"


@pytest.fixture(scope="module")
def expected() -> dict[str, dict[str, np.ndarray]]:
    out: dict[str, dict[str, np.ndarray]] = {}
    for file in ("expected.npz", "expected_sharded.npz"):
        with np.load(DATA / file) as npz:
            for name in npz.files:
                folder, key = name.split("|", 1)
                out.setdefault(folder, {})[key] = npz[name]
    return out


def assert_tf_equal(actual: np.ndarray, want: np.ndarray, what: str) -> None:
    """Compare with expected.npz's encoding: bfloat16 as uint16 bits, strings as str."""
    if actual.dtype.kind == "O":
        assert [x.decode() for x in actual.reshape(-1)] == list(want.reshape(-1)), what
        assert actual.shape == want.shape, what
    elif actual.dtype.name == "bfloat16":
        np.testing.assert_array_equal(actual.view(np.uint16), want, err_msg=what)
    else:
        assert actual.dtype == want.dtype, what
        assert actual.shape == want.shape, what
        np.testing.assert_array_equal(actual, want, err_msg=what)


def values_by_key(view: TfCheckpointView) -> dict[str, np.ndarray]:
    """Every value of the view by TensorFlow checkpoint key."""
    out = {}
    for entry in view.values():
        keys = entry.tf_keys
        if entry.kind == "sharded":
            (key,) = keys
            out[key] = entry.value()
        else:
            assert len(keys) == entry.num_components
            for i, key in enumerate(keys):
                out[key] = entry.component(i)
    return out


@pytest.mark.parametrize("folder", sorted(FOLDERS))
def test_every_value_equals_tensorflows(folder: str, expected) -> None:
    with open_checkpoint(DATA / folder) as view:
        assert view.format == "tf"
        got = values_by_key(view)
        want = {k: v for k, v in expected[folder].items() if k != GRAPH}
        assert set(got) == set(want)
        for key, value in want.items():
            assert_tf_equal(got[key], value, f"{folder}|{key}")
        if GRAPH in expected[folder]:
            assert view.object_graph is not None
            assert view.metadata["tf_naming"] == "object"
        else:
            assert view.object_graph is None
            assert view.metadata["tf_naming"] == "name"


@pytest.mark.parametrize("folder", sorted(set(FOLDERS) - {"sharded"}))
def test_shapes_match_keys_json(folder: str) -> None:
    shapes = json.loads((DATA / "keys.json").read_text())[folder]
    with BundleReader(str(DATA / folder / FOLDERS[folder])) as r:
        listed = {k.decode(): list(e.shape) for k, e in r.entries.items() if k not in r.slice_keys}
    assert listed == shapes


def test_object_graph_bytes_are_tensorflows(expected) -> None:
    with BundleReader(str(DATA / "plain" / "ckpt-1")) as r:
        graph = r.read(GRAPH.encode())[()]
    assert graph == expected["plain"][GRAPH].tobytes()


def test_parallel_checkpoint_becomes_parallel_variables(expected) -> None:
    want = expected["parallel"]
    with open_checkpoint(DATA / "parallel") as view:
        assert sorted(view) == ["model/c", "model/w", "save_counter"]
        w = view["model/w"]
        assert (w.kind, w.num_components, w.shape, w.dtype) == ("mirrored", 3, (3, 2), np.float32)
        np.testing.assert_array_equal(w.value(), want["model/w/.ATTRIBUTES/VARIABLE_VALUE"])
        for i, attr in enumerate(
            ["VARIABLE_VALUE", "parallel_component_1", "parallel_component_2"]
        ):
            np.testing.assert_array_equal(w.component(i), want[f"model/w/.ATTRIBUTES/{attr}"])
            out = np.empty((3, 2), np.float32)
            w.read_component_into(i, out)
            np.testing.assert_array_equal(out, want[f"model/w/.ATTRIBUTES/{attr}"])
        c = view["model/c"]
        assert (c.num_components, c.shape) == (3, ())
        assert [int(c.component(i)) for i in range(3)] == [0, 10, 20]
    with TfCheckpointView(DATA / "parallel", parallel_kind="independent") as view:
        assert view["model/w"].kind == "independent"


def test_plain_checkpoint_entries_and_attrs() -> None:
    with open_checkpoint(DATA / "plain") as view:
        assert list(view)[:3] == ["net/kernel", "net/bias", "net/half"]
        kernel = view["net/kernel"]
        assert (kernel.kind, kernel.attrs["name"]) == ("single", "kernel")
        assert view["net/bf"].dtype.name == "bfloat16"
        assert view["net/layers/1"].component(0).tolist() == [1.0, 1.0]
        assert view["save_counter"].attrs["name"] == "save_counter"


def test_many_has_four_shards_and_partitioned_tensors(expected) -> None:
    with open_checkpoint(DATA / "many") as view:
        assert view.metadata["tf_num_shards"] == 4
        sharded = {p: e for p, e in view.items() if e.kind == "sharded"}
        assert set(sharded) == {"big/vs/80", "big/vs/161", "big/vs/241"}
        e = sharded["big/vs/80"]
        assert (e.attrs["shard_axis"], e.attrs["shard_offsets"]) == (0, [0, 9, 11])
        assert [e.component_shape(i) for i in range(3)] == [(9, 1), (2, 1), (6, 1)]
        want = expected["many"]["big/vs/80/.ATTRIBUTES/VARIABLE_VALUE"]
        np.testing.assert_array_equal(e.value(), want)
        np.testing.assert_array_equal(e.component(1), want[9:11])
        text = view["big/text"]
        assert text.dtype == object and text.component(0).tolist() == [b"alpha", b"beta-0", b""]
    with TfCheckpointView(DATA / "many", assemble_slices=True) as view:
        e = view["big/vs/241"]
        assert (e.kind, e.num_components) == ("single", 1)
        np.testing.assert_array_equal(
            e.component(0), expected["many"]["big/vs/241/.ATTRIBUTES/VARIABLE_VALUE"]
        )


@pytest.mark.parametrize("folder", ["plain", "parallel", "mirrored", "tf1", "sharded"])
def test_rewriting_a_checkpoint_reproduces_tensorflows_bytes(folder: str, tmp_path: Path) -> None:
    prefix = FOLDERS[folder]
    with open_checkpoint(DATA / folder) as view:
        written = write_checkpoint(tmp_path / prefix, view, format="tf")
    assert written == str(tmp_path / prefix)
    for suffix in (".index", ".data-00000-of-00001"):
        assert filecmp.cmp(
            DATA / folder / (prefix + suffix), tmp_path / (prefix + suffix), shallow=False
        ), suffix
    assert (tmp_path / "checkpoint").read_text() == (DATA / folder / "checkpoint").read_text()


def test_tensorflow_sharded_variable_and_legacy_slots(expected) -> None:
    want = expected["sharded"]
    with open_checkpoint(DATA / "sharded") as view:
        emb = view["model/emb"]
        assert (emb.kind, emb.num_components, emb.shape) == ("sharded", 2, (5, 2))
        assert (emb.attrs["shard_axis"], emb.attrs["shard_offsets"]) == (0, [0, 3])
        np.testing.assert_array_equal(
            emb.component(1), np.arange(6, 10, dtype=np.float32).reshape(2, 2)
        )
        np.testing.assert_array_equal(emb.value(), want["model/emb/.ATTRIBUTES/VARIABLE_VALUE"])
        for slot in ("m", "v"):
            e = view[f"optimizer/slots/model/v/{slot}"]
            assert (e.attrs["slot_of"], e.attrs["slot_name"]) == ("model/v", slot)
            key = f"model/v/.OPTIMIZER_SLOT/optimizer/{slot}/.ATTRIBUTES/VARIABLE_VALUE"
            np.testing.assert_array_equal(e.component(0), want[key])
        assert list(view)[-2:] == ["optimizer/slots/model/v/m", "optimizer/slots/model/v/v"]


def test_multi_block_index_written_by_tensorflow(tmp_path: Path) -> None:
    with tarfile.open(DATA / "multiblock.tar.xz") as tar:
        if hasattr(tarfile, "data_filter"):
            tar.extractall(tmp_path, filter="data")
        else:  # pragma: no cover - Python before 3.10.12
            tar.extractall(tmp_path)
    source = tmp_path / "multiblock"
    with open(source / "ckpt-1.index", "rb") as f:
        assert len(TableReader(f.read(), file="ckpt-1.index").index) == 2
    with open_checkpoint(source) as view:
        assert len(view) == 5601
        name = "model/weights_of_a_layer_with_a_rather_long_descriptive_name"
        for i in (0, 721, 722, 5599):
            assert view[f"{name}/{i}"].component(0) == np.float32(i)
        written = write_checkpoint(tmp_path / "copy" / "ckpt-1", view, format="tf")
    for suffix in (".index", ".data-00000-of-00001"):
        assert filecmp.cmp(source / ("ckpt-1" + suffix), written + suffix, shallow=False), suffix


def _in_memory(view) -> DictView:
    """A deep copy of a view: every component read into memory."""
    entries = {
        path: ArrayEntry(
            path,
            [e.component(i) for i in range(e.num_components)],
            kind=e.kind,
            shape=e.shape,
            attrs=dict(e.attrs),
        )
        for path, e in view.items()
    }
    return DictView(entries, metadata=view.metadata)


def _checkpoint_keys(prefix: str) -> set[bytes]:
    with BundleReader(prefix) as r:
        return {k for k in r.entries if k not in r.slice_keys}


@pytest.mark.parametrize("folder", sorted(FOLDERS))
def test_tf_to_memory_to_tf_keeps_keys_and_values(folder: str, tmp_path: Path, expected) -> None:
    with open_checkpoint(DATA / folder) as view:
        memory = _in_memory(view)
    prefix = write_checkpoint(tmp_path / "out" / "ckpt-1", memory, format="tf")
    assert _checkpoint_keys(prefix) == _checkpoint_keys(str(DATA / folder / FOLDERS[folder]))
    with open_checkpoint(tmp_path / "out") as back:
        got = values_by_key(back)
        for key, value in expected[folder].items():
            if key != GRAPH:
                assert_tf_equal(got[key], value, key)
        for path, entry in memory.items():
            assert (back[path].kind, back[path].num_components) == (
                entry.kind,
                entry.num_components,
            )
            assert dict(back[path].attrs) == dict(entry.attrs)


def test_directory_prefix_index_and_data_paths_all_open(tmp_path: Path) -> None:
    base = DATA / "plain"
    for p in [base, base / "ckpt-1", base / "ckpt-1.index", base / "ckpt-1.data-00000-of-00001"]:
        assert detect_format(p) == "tf"
        assert sniff(str(p))
        with open_checkpoint(p) as view:
            assert view.path == str(base / "ckpt-1")
    assert FORMAT.name == "tf" and FORMAT.open is not None
    (tmp_path / "notes.txt").write_text("hello")
    assert not sniff(str(tmp_path))
    assert not sniff(str(tmp_path / "notes.txt"))
    assert not sniff(str(tmp_path / "missing"))


def test_directory_without_state_file_picks_the_highest_step(tmp_path: Path) -> None:
    for step in (2, 10):
        for f in (DATA / "plain").glob("ckpt-1.*"):
            shutil.copy(f, tmp_path / f.name.replace("ckpt-1", f"ckpt-{step}"))
    with open_checkpoint(tmp_path) as view:
        assert view.path == str(tmp_path / "ckpt-10")
    shutil.copy(DATA / "tf1" / "model.ckpt-3.index", tmp_path / "other.index")
    with pytest.raises(NotACheckpointError, match="several checkpoints"):
        open_checkpoint(tmp_path, format="tf")
    (tmp_path / "checkpoint").write_text('model_checkpoint_path: "ckpt-2"\n')
    with open_checkpoint(tmp_path) as view:
        assert view.path == str(tmp_path / "ckpt-2")
    (tmp_path / "checkpoint").write_text('model_checkpoint_path: "ckpt-7"\n')
    with pytest.raises(NotACheckpointError, match="does not exist") as info:
        open_checkpoint(tmp_path, format="tf")
    assert "ckpt-7.index" in str(info.value)


def test_state_file_with_an_absolute_path_of_a_moved_directory(tmp_path: Path) -> None:
    for f in (DATA / "plain").glob("ckpt-1.*"):
        shutil.copy(f, tmp_path / f.name)
    (tmp_path / "checkpoint").write_text('model_checkpoint_path: "/elsewhere/run/ckpt-1"\n')
    with open_checkpoint(tmp_path) as view:
        assert view.path == str(tmp_path / "ckpt-1")


def test_opening_reads_no_tensor_until_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    reads: list[bytes] = []
    original = BundleReader._pread

    def counting(self, shard_id, offset, flat, key):  # type: ignore[no-untyped-def]
        reads.append(key)
        return original(self, shard_id, offset, flat, key)

    monkeypatch.setattr(BundleReader, "_pread", counting)
    with open_checkpoint(DATA / "plain") as view:
        assert reads == [GRAPH.encode()]  # the object graph only
        entry: Entry = view["net/kernel"]
        assert reads == [GRAPH.encode()]
        entry.component(0)
        assert reads[1:] == [b"net/kernel/.ATTRIBUTES/VARIABLE_VALUE"]


def test_directory_output_gets_the_next_checkpoint_number(tmp_path: Path) -> None:
    with open_checkpoint(DATA / "mirrored") as view:
        first = FORMAT.write(str(tmp_path), view)
        second = FORMAT.write(str(tmp_path), view)
    assert (os.path.basename(first), os.path.basename(second)) == ("ckpt-1", "ckpt-2")
    with open_checkpoint(tmp_path) as view:
        assert view.path == second
