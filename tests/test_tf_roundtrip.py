"""Writing neutral views as TensorFlow checkpoints and reading them back: kinds, attrs, slots,
names, dtypes."""

from __future__ import annotations

import os
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from parallelvars.errors import DtypeMismatchError, InvalidEntryError, UnsupportedDtypeError
from parallelvars.formats import ArrayEntry, DictView, open_checkpoint, write_checkpoint
from parallelvars.formats.testing import decode_graph
from parallelvars.formats.tf import METADATA_KEY, BundleReader, BundleWriter, TfCheckpointView

GRAPH = b"_CHECKPOINTABLE_OBJECT_GRAPH"


def write(tmp_path: Path, entries: list[ArrayEntry], **options) -> str:
    return write_checkpoint(tmp_path / "ckpt-1", DictView(entries), format="tf", **options)


def keys_of(prefix: str) -> dict[bytes, int]:
    with BundleReader(prefix) as r:
        return {k: e.dtype for k, e in r.entries.items() if k not in r.slice_keys}


def graph_of(prefix: str):
    with BundleReader(prefix) as r:
        return decode_graph(r.read(GRAPH)[()])


def test_kinds_and_attrs_tf_cannot_express_survive_a_round_trip(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    devices = ["cpu:0", "cpu:1"]
    entries = [
        ArrayEntry(
            "m/w",
            [rng.normal(size=(3, 2)).astype(np.float32)] * 2,
            kind="mirrored",
            attrs={"devices": devices, "trainable": True, "name": "w"},
        ),
        ArrayEntry(
            "m/n",
            [np.float32(1), np.float32(2)],
            kind="on_read",
            attrs={"aggregation": "sum", "synchronization": "on_read", "devices": devices},
        ),
        ArrayEntry("m/buf", [np.arange(3), np.arange(3) * 2], kind="independent"),
        ArrayEntry(
            "m/e",
            [np.ones((3, 4)), np.zeros((2, 4))],
            kind="sharded",
            shape=(5, 4),
            attrs={"shard_axis": 0, "shard_offsets": [0, 3], "devices": devices},
        ),
        ArrayEntry(
            "m/col",
            [np.ones((2, 1), np.int32), np.zeros((2, 3), np.int32)],
            kind="sharded",
            shape=(2, 4),
            attrs={"shard_axis": 1, "shard_offsets": np.array([0, 1])},
        ),
        ArrayEntry(
            "m/one",
            [np.ones((4,), np.float16)],
            kind="sharded",
            shape=(4,),
            attrs={"shard_axis": 0, "shard_offsets": [0]},
        ),
        ArrayEntry("m/lonely", [np.float64(3)], kind="mirrored"),
        ArrayEntry("step", [np.int64(7)], attrs={"trainable": False}),
    ]
    prefix = write_checkpoint(
        tmp_path / "ckpt-1", DictView(entries, metadata={"step": 7, "tf_x": 1}), format="tf"
    )
    assert METADATA_KEY.encode() in keys_of(prefix)
    with open_checkpoint(tmp_path) as view:
        assert list(view) == [e.path for e in entries]
        assert view.metadata["step"] == 7 and "tf_x" not in view.metadata
        for e in entries:
            back = view[e.path]
            assert (back.kind, back.num_components, back.shape, back.dtype) == (
                e.kind,
                e.num_components,
                e.shape,
                e.dtype,
            ), e.path
            want_attrs = {
                k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in e.attrs.items()
            }
            assert dict(back.attrs) == want_attrs, e.path
            for i in range(e.num_components):
                np.testing.assert_array_equal(back.component(i), e.component(i))
            if e.kind != "independent":
                np.testing.assert_array_equal(back.value(), e.value())


def test_plain_entries_write_no_metadata_key(tmp_path: Path) -> None:
    prefix = write(
        tmp_path,
        [
            ArrayEntry("a/b", [np.arange(4.0)]),
            ArrayEntry("a/c", [np.arange(2), np.arange(2)]),  # mirrored: what a reader infers
            ArrayEntry(
                "e",
                [np.ones((2, 2)), np.ones((1, 2))],
                kind="sharded",
                shape=(3, 2),
                attrs={"shard_axis": 0, "shard_offsets": [0, 2], "name": "e"},
            ),
        ],
    )
    assert set(keys_of(prefix)) == {
        GRAPH,
        b"a/b/.ATTRIBUTES/VARIABLE_VALUE",
        b"a/c/.ATTRIBUTES/VARIABLE_VALUE",
        b"a/c/.ATTRIBUTES/parallel_component_1",
        b"e/.ATTRIBUTES/VARIABLE_VALUE",
    }
    with open_checkpoint(prefix) as view:
        assert view["e"].kind == "sharded" and view["e"].attrs["shard_offsets"] == [0, 2]


def test_graph_is_consistent_with_the_keys(tmp_path: Path) -> None:
    entries = [
        ArrayEntry("model/dense/kernel", [np.ones((2, 2), np.float32)], attrs={"name": "kernel"}),
        ArrayEntry("model/dense/bias", [np.ones(2, np.float32)] * 3),
        ArrayEntry("optimizer/iter", [np.int64(3)]),
        ArrayEntry(
            "optimizer/slots/model/dense/kernel/m",
            [np.zeros((2, 2), np.float32)],
            attrs={"slot_of": "model/dense/kernel", "slot_name": "m"},
        ),
        ArrayEntry(
            "optimizer/slots/model/dense/kernel/v",
            [np.zeros((2, 2), np.float32)],
            attrs={"slot_of": "model/dense/kernel", "slot_name": "v"},
        ),
        ArrayEntry("a.b/c/d", [np.int8(1)]),
    ]
    prefix = write(tmp_path, entries)
    keys = keys_of(prefix)
    nodes = graph_of(prefix)
    graph_keys = {a.checkpoint_key.encode() for n in nodes for a in n.attributes}
    assert graph_keys | {GRAPH} == set(keys)
    assert b"model/dense/kernel/.OPTIMIZER_SLOT/optimizer/m/.ATTRIBUTES/VARIABLE_VALUE" in keys
    assert b"a..b/c/d/.ATTRIBUTES/VARIABLE_VALUE" in keys
    # the first path from the root to each node spells its key
    paths = {0: []}
    queue = [0]
    while queue:
        nid = queue.pop(0)
        for child in nodes[nid].children:
            if child.node_id not in paths:
                paths[child.node_id] = [*paths[nid], child.local_name]
                queue.append(child.node_id)
    for nid, names in paths.items():
        for att in nodes[nid].attributes:
            escaped = "/".join(n.replace(".", "..").replace("/", ".S") for n in names)
            assert att.checkpoint_key == f"{escaped}/.ATTRIBUTES/{att.name}"
    (opt,) = [n for n in nodes if n.slot_variables]
    assert [s.slot_name for s in opt.slot_variables] == ["m", "v"]
    for s in opt.slot_variables:
        assert paths[s.original_variable_node_id] == ["model", "dense", "kernel"]
        assert s.slot_variable_node_id not in paths  # slots are reached through the optimizer
    assert all(n.has_checkpoint_values for n in nodes)
    with open_checkpoint(prefix) as view:
        m = view["optimizer/slots/model/dense/kernel/m"]
        assert dict(m.attrs) == {"slot_of": "model/dense/kernel", "slot_name": "m"}
        assert view["model/dense/kernel"].attrs["name"] == "kernel"
        assert view["a.b/c/d"].component(0) == 1
        # variables in the order given, then the slots (saved after every object, as TF does)
        slots = [e.path for e in entries if "slot_of" in e.attrs]
        assert list(view) == [e.path for e in entries if e.path not in slots] + slots
    assert METADATA_KEY.encode() not in keys


def test_slot_of_a_variable_that_is_not_saved_keeps_an_empty_node(tmp_path: Path) -> None:
    prefix = write(
        tmp_path,
        [ArrayEntry("opt/slots/w/m", [np.zeros(2)], attrs={"slot_of": "w", "slot_name": "m"})],
    )
    nodes = graph_of(prefix)
    names = {c.local_name: c.node_id for c in nodes[0].children}
    assert set(names) == {"w", "opt"}
    assert not nodes[names["w"]].has_checkpoint_values or nodes[names["w"]].attributes == []
    assert nodes[names["opt"]].has_checkpoint_values


def test_other_attributes_keep_their_key(tmp_path: Path) -> None:
    config = np.array(b'{"units": 3}', dtype=object)
    prefix = write(
        tmp_path,
        [
            ArrayEntry("layer/.ATTRIBUTES/OBJECT_CONFIG_JSON", [config]),
            ArrayEntry("layer/kernel", [np.ones(3)]),
        ],
    )
    assert b"layer/.ATTRIBUTES/OBJECT_CONFIG_JSON" in keys_of(prefix)
    with open_checkpoint(prefix) as view:
        assert view["layer/.ATTRIBUTES/OBJECT_CONFIG_JSON"].component(0)[()] == b'{"units": 3}'


def test_irregular_component_keys_become_separate_entries(tmp_path: Path) -> None:
    prefix = str(tmp_path / "odd")
    with BundleWriter(prefix) as w:
        w.add(b"x/.ATTRIBUTES/VARIABLE_VALUE", np.zeros(2))
        w.add(b"x/.ATTRIBUTES/parallel_component_2", np.ones(2))
        w.add(b"y/.ATTRIBUTES/VARIABLE_VALUE", np.zeros(2))
        w.add(b"y/.ATTRIBUTES/parallel_component_1", np.ones(3))  # another shape
    with open_checkpoint(prefix + ".index") as view:
        assert sorted(view) == [
            "x/.ATTRIBUTES/VARIABLE_VALUE",
            "x/.ATTRIBUTES/parallel_component_2",
            "y/.ATTRIBUTES/VARIABLE_VALUE",
            "y/.ATTRIBUTES/parallel_component_1",
        ]
        copy = DictView({p: ArrayEntry(p, [e.component(0)]) for p, e in view.items()})
    again = write_checkpoint(tmp_path / "again" / "c", copy, format="tf")
    assert set(keys_of(again)) - {GRAPH} == set(keys_of(prefix))


def test_name_based_checkpoints(tmp_path: Path) -> None:
    prefix = write(
        tmp_path,
        [
            ArrayEntry("dense/kernel", [np.ones((2, 3), np.float32)]),
            ArrayEntry(
                "emb",
                [np.ones((2, 2)), np.ones((2, 2))],
                kind="sharded",
                shape=(4, 2),
                attrs={"shard_axis": 0, "shard_offsets": [0, 2]},
            ),
        ],
        naming="name",
    )
    assert set(keys_of(prefix)) == {b"dense/kernel", b"emb"}
    with open_checkpoint(prefix) as view:
        assert view.metadata["tf_naming"] == "name"
        assert view["emb"].kind == "sharded"
        again = write_checkpoint(tmp_path / "again" / "c", view, format="tf")  # stays name-based
    assert set(keys_of(again)) == {b"dense/kernel", b"emb"}
    with pytest.raises(InvalidEntryError, match="one tensor per variable") as info:
        write(tmp_path / "bad", [ArrayEntry("w", [np.ones(2)] * 2)], naming="name")
    assert "'w'" in str(info.value)


DTYPES = [
    np.float32, np.float64, np.float16, np.int8, np.int16, np.int32, np.int64,
    np.uint8, np.uint16, np.uint32, np.uint64, np.bool_, np.complex64, np.complex128,
    ml_dtypes.bfloat16, ml_dtypes.float8_e5m2, ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e4m3fnuz,
    ml_dtypes.float8_e4m3b11fnuz, ml_dtypes.float8_e5m2fnuz, ml_dtypes.int4, ml_dtypes.uint4,
    ml_dtypes.int2, ml_dtypes.uint2, ml_dtypes.float4_e2m1fn,
]  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_every_numeric_dtype_round_trips_bit_exactly(dtype, tmp_path: Path) -> None:
    dtype = np.dtype(dtype)
    rng = np.random.default_rng(0)
    if dtype.kind == "b":
        value = rng.integers(0, 2, (3, 4)).astype(bool)
    elif dtype.kind == "c":
        value = (rng.normal(size=(3, 4)) + 1j * rng.normal(size=(3, 4))).astype(dtype)
    else:
        value = rng.integers(0, 4, (3, 4)).astype(np.float32).astype(dtype)
    prefix = write(tmp_path, [ArrayEntry("v", [value]), ArrayEntry("s", [value[0, 0]])])
    with open_checkpoint(prefix) as view:
        back = view["v"].component(0)
        assert back.dtype == dtype and back.shape == (3, 4)
        assert back.tobytes() == value.tobytes()
        assert view["s"].component(0).shape == ()


def test_strings_bytes_and_unicode_arrays_become_dt_string(tmp_path: Path) -> None:
    prefix = write(
        tmp_path,
        [
            ArrayEntry("o", [np.array([b"a", b"", b"\x00z"], dtype=object)]),
            ArrayEntry("s", [np.array([b"xy", b"z"])]),
            ArrayEntry("u", [np.array([["é", "b"]])]),
        ],
    )
    assert set(keys_of(prefix).values()) == {7}
    with open_checkpoint(prefix) as view:
        assert view["o"].component(0).tolist() == [b"a", b"", b"\x00z"]
        assert view["s"].component(0).tolist() == [b"xy", b"z"]
        assert view["u"].component(0).tolist() == [["é".encode(), b"b"]]


def test_quantized_types_keep_their_tensorflow_type(tmp_path: Path) -> None:
    prefix = write(
        tmp_path, [ArrayEntry("q", [np.arange(4, dtype=np.int8)], attrs={"tf_dtype": "DT_QINT8"})]
    )
    assert keys_of(prefix)[b"q/.ATTRIBUTES/VARIABLE_VALUE"] == 11
    with open_checkpoint(prefix) as view:
        assert view["q"].attrs == {"tf_dtype": "DT_QINT8"}
        assert view["q"].dtype == np.int8


def test_unsupported_numpy_dtype_is_refused(tmp_path: Path) -> None:
    with pytest.raises(UnsupportedDtypeError, match="'when'"):
        write(tmp_path, [ArrayEntry("when", [np.array(["2020-01-01"], dtype="datetime64[D]")])])
    assert not list(tmp_path.glob("ckpt-1.*"))


def test_big_endian_bundles_and_arrays(tmp_path: Path) -> None:
    prefix = str(tmp_path / "be")
    values = {
        b"f": np.arange(6, dtype=np.float32).reshape(2, 3),
        b"c": np.array([1 + 2j, 3 - 4j], np.complex64),
        b"b": np.array([1.5, -2], ml_dtypes.bfloat16),
        b"s": np.array([b"ab", b"c"], dtype=object),
        b"i": np.array([1, 2], dtype=">i8"),
    }
    with BundleWriter(prefix, big_endian=True) as w:
        for k, v in values.items():
            w.add(k, v)
    data = (tmp_path / "be.data-00000-of-00001").read_bytes()
    assert data.startswith(np.arange(6, dtype=">f4").tobytes())
    with BundleReader(prefix) as r:
        assert r.header.endianness == 1
        for k, v in values.items():
            back = r.read(k)
            assert back.tolist() == v.tolist(), k
            assert back.dtype.isnative or back.dtype.kind == "O"


@pytest.mark.parametrize("shape", [(), (0,), (3, 0, 2), (1, 1, 1, 1, 1, 1, 2)])
def test_unusual_shapes(shape: tuple[int, ...], tmp_path: Path) -> None:
    value = np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape)
    prefix = write(tmp_path, [ArrayEntry("v", [value, value])])
    with open_checkpoint(prefix) as view:
        for i in range(2):
            assert view["v"].component(i).shape == shape
            np.testing.assert_array_equal(view["v"].component(i), value)


@pytest.mark.parametrize(
    ("entry", "match"),
    [
        (ArrayEntry("a//b", [np.ones(1)]), "non-empty names"),
        (ArrayEntry("/a", [np.ones(1)]), "non-empty names"),
        (
            ArrayEntry(
                "e",
                [np.ones((2, 2)), np.ones((2, 2))],
                kind="sharded",
                shape=(4, 2),
                attrs={"shard_axis": 0, "shard_offsets": [1, 2]},
            ),
            "shard_offsets",
        ),
        (ArrayEntry("e", [np.ones((2, 2))], kind="sharded", shape=(2, 2), attrs={}), "shard_axis"),
        (
            ArrayEntry(
                "e",
                [np.ones((2, 2)), np.ones((3, 2))],
                kind="sharded",
                shape=(4, 2),
                attrs={"shard_axis": 0, "shard_offsets": [0, 2]},
            ),
            "another shape",
        ),
    ],
)
def test_entries_a_writer_cannot_store(entry: ArrayEntry, match: str, tmp_path: Path) -> None:
    with pytest.raises(InvalidEntryError, match=match) as info:
        write(tmp_path, [entry])
    assert repr(entry.path) in str(info.value)
    assert sorted(os.listdir(tmp_path)) == []  # nothing left behind


def test_failed_write_leaves_the_previous_checkpoint_intact(tmp_path: Path) -> None:
    good = write(tmp_path, [ArrayEntry("w", [np.ones(3)])])
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}

    class Broken(ArrayEntry):
        def component(self, i: int) -> np.ndarray:
            raise OSError("device lost")

        def read_component_into(self, i: int, out: np.ndarray) -> None:
            raise OSError("device lost")

    with pytest.raises(OSError, match="device lost"):
        write(tmp_path, [ArrayEntry("w", [np.zeros(3)]), Broken("x", [np.ones(2)])])
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
    with TfCheckpointView(good) as view:
        np.testing.assert_array_equal(view["w"].component(0), np.ones(3))


def test_components_must_have_their_variables_dtype_and_a_known_kind(tmp_path: Path) -> None:
    class Odd(ArrayEntry):
        def component(self, i: int) -> np.ndarray:
            return super().component(i).astype(np.float64) if i == 1 else super().component(i)

    # A component in another dtype is refused, whether it is read whole or into the
    # writer's buffer (the entry checks it: Entry.read_component_into).
    with pytest.raises(DtypeMismatchError, match="another dtype") as info:
        write(tmp_path, [Odd("w", [np.ones(2, np.float32)] * 2)])
    assert "'w'" in str(info.value) and ".index" in str(info.value)
    assert os.listdir(tmp_path) == []

    # A component handed over whole (an on-read variable's aggregate) likewise.
    class OddSum(ArrayEntry):
        def value(self) -> np.ndarray:
            return np.ones(2, np.float64)

    odd_sum = OddSum(
        "s", [np.ones(2, np.float32)] * 2, kind="on_read", attrs={"aggregation": "sum"}
    )
    with pytest.raises(DtypeMismatchError, match="another dtype") as info:
        write(tmp_path, [odd_sum])
    assert "'s'" in str(info.value)
    assert os.listdir(tmp_path) == []
    weird = ArrayEntry("k", [np.ones(2)])
    weird.kind = "scattered"
    with pytest.raises(InvalidEntryError, match="unknown variable kind"):
        write(tmp_path, [weird])
    assert os.listdir(tmp_path) == []
