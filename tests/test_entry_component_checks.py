"""An entry's components must be what it declares: the writers (TensorFlow, safetensors, npz,
HDF5, Keras) refuse a component of another dtype or shape instead of casting or broadcasting
it, through the one check in :meth:`Entry.read_component_into`, naming the file written
(:func:`~parallelvars.checkpoint.entry.naming_file`)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest

from parallelvars.checkpoint.entry import ArrayEntry, Entry, ForwardingEntry, naming_file
from parallelvars.errors import DtypeMismatchError, InvalidEntryError
from parallelvars.formats import DictView, open_checkpoint, write_checkpoint
from parallelvars.formats.testing import StagedEntry


class Lying(Entry):
    """A single entry declaring ``dtype`` and ``shape`` whose component is ``data``."""

    def __init__(self, path: str, data: np.ndarray, dtype: Any, shape: tuple[int, ...]) -> None:
        self.path, self._data = path, data
        self.dtype, self.shape = np.dtype(dtype), shape
        self.kind, self.num_components, self.attrs = "single", 1, {}

    def component(self, i: int) -> np.ndarray:
        self._check_index(i)
        return np.array(self._data)


FORMATS = [("tf", ""), ("safetensors", ".safetensors"), ("npz", ".npz")]
# Every writer: the refusals below name the output file in each.
WRITERS = [*FORMATS, ("hdf5", ".h5"), ("keras", ".weights.h5")]

CASES = {
    # float64 1e40 declared float32 was written as inf
    "float64 as float32": (
        lambda: Lying("v", np.array([1e40, 0.1]), np.float32, (2,)),
        DtypeMismatchError,
        "expected float32, found float64",
    ),
    # float64 declared int32 was truncated
    "float64 as int32": (
        lambda: Lying("v", np.array([1.7, -2.9]), np.int32, (2,)),
        DtypeMismatchError,
        "expected int32, found float64",
    ),
    # shape (1,) declared (4,) was broadcast
    "shape (1,) as (4,)": (
        lambda: Lying("v", np.array([7.0], np.float32), np.float32, (4,)),
        InvalidEntryError,
        r"expected \(4,\), found \(1,\)",
    ),
    # mirrored components of mixed dtypes: cast (same_kind) or a builtin TypeError
    "mirrored float32 + float64": (
        lambda: ArrayEntry("v", [np.array([1.5], np.float32), np.array([2.5], np.float64)]),
        DtypeMismatchError,
        "component 1 has another dtype",
    ),
    "mirrored int32 + float64": (
        lambda: ArrayEntry("v", [np.array([1], np.int32), np.array([1.5])], kind="mirrored"),
        DtypeMismatchError,
        "expected int32, found float64",
    ),
    # a mirrored component of shape (1,) beside (3,) was broadcast
    "mirrored broadcast": (
        lambda: ArrayEntry(
            "v", [np.zeros(3, np.float32), np.array([2.5], np.float32)], kind="mirrored"
        ),
        InvalidEntryError,
        r"component 1 has another shape .*expected \(3,\), found \(1,\)",
    ),
}


@pytest.mark.parametrize(("fmt", "ext"), WRITERS)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("forwarded", [False, True], ids=["entry", "forwarded"])
def test_writers_refuse_a_component_unlike_its_entry(
    tmp_path: Path, fmt: str, ext: str, case: str, forwarded: bool
) -> None:
    make, error, message = CASES[case]
    entry = make()
    if forwarded:  # (a rewriting view's entry: reads through its source)
        entry = ForwardingEntry(entry)
    options = {"update_state": False} if fmt == "tf" else {}
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(error, match=message) as info:
        write_checkpoint(out / ("ckpt" + ext), {"v": entry}, format=fmt, **options)
    text = str(info.value)
    assert text.startswith(str(out / "ckpt")), text  # the file written, then the variable
    assert info.value.file is not None and info.value.file.startswith(str(out / "ckpt"))
    assert "variable 'v'" in text and info.value.variable == "v"
    assert info.value.expected is not None and info.value.found is not None
    assert os.listdir(out) == []  # nothing written, nothing left behind


def test_an_error_naming_its_own_file_keeps_it() -> None:
    with (
        pytest.raises(DtypeMismatchError) as info,
        naming_file("/out/ckpt.npz", prefix="tensor 't': "),
    ):
        raise DtypeMismatchError("x", file="/in/src.h5", variable="v", expected=1, found=2)
    assert info.value.file == "/in/src.h5" and "tensor" not in str(info.value)
    with (
        pytest.raises(InvalidEntryError) as info2,
        naming_file("/out/ckpt.npz", prefix="tensor 't': ", variable="w"),
    ):
        raise InvalidEntryError("bad", variable="v", expected=1, found=2, hint="do y")
    assert str(info2.value) == (
        "/out/ckpt.npz: variable 'w': tensor 't': bad (expected 1, found 2); do y"
    )
    assert isinstance(info2.value.__cause__, InvalidEntryError)


DTYPES = (
    np.float32,
    ml_dtypes.bfloat16,
    np.float16,
    ml_dtypes.float8_e4m3fn,
    np.int8,
    np.int64,
    np.bool_,
)


def test_components_as_declared_are_written_in_every_dtype_and_kind(tmp_path: Path) -> None:
    for dtype in DTYPES:
        data = np.arange(4).astype(dtype)
        entries = [
            ArrayEntry("single", [data]),
            ArrayEntry("mirrored", [data, data.copy()], kind="mirrored"),
            ArrayEntry(
                "sharded",
                [data[:3], data[3:]],
                kind="sharded",
                shape=(4,),
                attrs={"shard_axis": 0, "shard_offsets": [0, 3]},
            ),
        ]
        for fmt, ext in FORMATS:
            path = write_checkpoint(
                tmp_path / f"{fmt}-{np.dtype(dtype).name}{ext}", DictView(entries), format=fmt
            )
            with open_checkpoint(path) as view:
                for name in ("single", "mirrored", "sharded"):
                    got = view[name].value()
                    assert got.dtype == np.dtype(dtype)
                    np.testing.assert_array_equal(got, data)


def test_a_shard_of_another_shape_than_its_offsets_say_is_refused(tmp_path: Path) -> None:
    data = np.arange(4, dtype=np.float32)
    for fmt, ext in FORMATS:
        entry = ArrayEntry(
            "s",
            [data[:2], data[2:]],  # the offsets say 3 + 1
            kind="sharded",
            shape=(4,),
            attrs={"shard_axis": 0, "shard_offsets": [0, 3]},
        )
        with pytest.raises(InvalidEntryError, match=r"'s'.*expected \(3,\), found \(2,\)"):
            write_checkpoint(tmp_path / f"{fmt}{ext}", DictView([entry]), format=fmt)


def test_read_component_into_checks_what_component_gives() -> None:
    out = np.empty(2, np.float32)
    with pytest.raises(DtypeMismatchError, match=r"'v'.*expected float32, found float64"):
        Lying("v", np.array([1e40, 0.1]), np.float32, (2,)).read_component_into(0, out)
    with pytest.raises(InvalidEntryError, match=r"expected \(2,\), found \(3,\)"):
        ArrayEntry("v", [np.zeros(2, np.float32)]).read_component_into(0, np.empty(3, np.float32))

    # A subclass that changes component() is read through it, so both agree.
    class Doubled(ArrayEntry):
        def component(self, i: int) -> np.ndarray:
            return super().component(i) * 2

    Doubled("v", [np.ones(2, np.float32)]).read_component_into(0, out)
    np.testing.assert_array_equal(out, [2, 2])
    # An out of another dtype is refused, a lossless one too: a caller that means to
    # convert reads component() and converts it.
    wide = np.empty(2, np.float64)
    with pytest.raises(DtypeMismatchError, match=r"'v'.*expected float32, found float64"):
        ArrayEntry("v", [np.full(2, 0.5, np.float32)]).read_component_into(0, wide)


# What reading a float64 [1e40, -2.7] into an ``out`` of another dtype gave before it was
# refused: inf, a truncated or overflowed integer, or (entries of a file's bytes) the bits
# of the stored values taken as another type.
OUT_DTYPES = (np.float32, np.int32, np.int64, np.float16, ml_dtypes.bfloat16, np.bool_)


def _entries_from_every_reader(
    tmp_path: Path, data: np.ndarray, stack: contextlib.ExitStack
) -> dict[str, tuple[Entry, Any]]:
    """``name -> (entry, file or None)``: the variable ``v`` holding ``data`` as each reader
    and each rewriting view gives it."""
    from parallelvars.formats import reshard

    source = ArrayEntry("v", [data, data.copy()], kind="mirrored")
    out: dict[str, tuple[Entry, Any]] = {
        "array": (source, None),
        "component()": (Lying("v", data, data.dtype, data.shape), None),
        "reshard": (reshard({"v": source}, 3)["v"], None),
        "reshard sum": (
            reshard(
                {"v": ArrayEntry("v", [data, data], kind="on_read", attrs={"aggregation": "sum"})},
                3,
            )["v"],
            None,
        ),
    }
    for fmt, ext in [*FORMATS, ("keras", ".weights.h5"), ("hdf5", ".h5")]:
        path = write_checkpoint(tmp_path / f"c{ext}", {"v": source}, format=fmt)
        view = stack.enter_context(open_checkpoint(path))
        file = view.path if fmt != "tf" else view.path + ".index"
        out[fmt] = (view["v"], file)
    # A restore's view of another format's entry (it took a ``cast`` flag it ignored, and
    # cast into any out): verified first or read when asked.
    out["staged"] = (StagedEntry(out["npz"][0]), None)
    verified = StagedEntry(out["safetensors"][0])
    for i in range(verified.num_components):
        verified.verify(i)
    out["staged verified"] = (verified, None)
    return out


@pytest.mark.parametrize("out_dtype", OUT_DTYPES, ids=lambda d: np.dtype(d).name)
def test_no_reader_casts_into_an_out_of_another_dtype(tmp_path: Path, out_dtype: Any) -> None:
    data = np.array([1e40, -2.7])
    stack = contextlib.ExitStack()
    with stack:
        _check_every_reader(_entries_from_every_reader(tmp_path, data, stack), out_dtype)


def _check_every_reader(entries: dict[str, tuple[Entry, Any]], out_dtype: Any) -> None:
    for name, (entry, file) in entries.items():
        for i in range(entry.num_components):
            out = np.zeros(entry.component_shape(i), out_dtype)
            with pytest.raises(DtypeMismatchError) as info:
                entry.read_component_into(i, out)
            message = str(info.value)
            assert "'v'" in message, name
            assert f"found {np.dtype(out_dtype).name}" in message or "dtype mismatch" in message
            if file is not None:
                assert str(file) in message, name
            assert not out.any(), name  # nothing landed
        # the entry's own dtype still reads, exactly
        for i in range(entry.num_components):
            out = np.empty(entry.component_shape(i), entry.dtype)
            entry.read_component_into(i, out)
            np.testing.assert_array_equal(out, entry.component(i))


def test_the_tf_writer_names_file_variable_tensor_and_keeps_the_entrys_hint(
    tmp_path: Path,
) -> None:
    """An entry's error raised again by the TF writer names the index file, the variable,
    the tensor it was to be written as and expected versus found, with the entry's hint and
    the entry's error as its cause, on the gathered path and the one-by-one path alike."""

    class Refusing(ArrayEntry):
        def read_component_into(self, i: int, out: np.ndarray) -> None:
            raise InvalidEntryError(
                f"component {i} cannot be read",
                variable=self.path,
                expected="bytes",
                found="none",
                hint="export it again",
            )

    index = str(tmp_path / "ckpt.index")
    cases = [
        (
            Refusing("model/w", [np.ones(2, np.float32)]),
            InvalidEntryError,
            "tensor 'model/w/.ATTRIBUTES/VARIABLE_VALUE': component 0 cannot be read "
            "(expected bytes, found none); export it again",
        ),
        (
            ArrayEntry("model/w", [np.ones(2, np.float32), np.ones(2)], kind="mirrored"),
            DtypeMismatchError,
            "tensor 'model/w/.ATTRIBUTES/parallel_component_1': component 1 has another "
            "dtype than its variable (expected float32, found float64)",
        ),
        (  # an on-read aggregate is checked whole (the one-by-one path)
            type("OddSum", (ArrayEntry,), {"value": lambda self: np.ones(2, np.float64)})(
                "model/w",
                [np.ones(2, np.float32)] * 2,
                kind="on_read",
                attrs={"aggregation": "sum"},
            ),
            DtypeMismatchError,
            "tensor 'model/w/.ATTRIBUTES/VARIABLE_VALUE': the aggregate has another dtype",
        ),
    ]
    for entry, error, what in cases:
        with pytest.raises(error) as info:
            write_checkpoint(tmp_path / "ckpt", {"model/w": entry}, format="tf", update_state=False)
        message = str(info.value)
        assert message.startswith(f"{index}: variable 'model/w': {what}"), message
        assert info.value.file == index and info.value.variable == "model/w"
        if error is InvalidEntryError:
            assert info.value.hint == "export it again"
            assert isinstance(info.value.__cause__, InvalidEntryError)  # the entry's own
        assert os.listdir(tmp_path) == []


def test_every_reader_reads_into_an_out_of_the_other_byte_order(tmp_path: Path) -> None:
    """An ``out`` of the entry's dtype in the other byte order takes the values, converted:
    not the stored bytes as they are (1.0 read as 4.6e-41), and not refused by one reader
    while the others convert."""
    data = np.array([1.0, -2.5, 3.0e38, 7.0], np.float32)
    stack = contextlib.ExitStack()
    with stack:
        entries = _entries_from_every_reader(tmp_path, data, stack)
        assert {"array", "tf", "safetensors", "npz", "keras", "hdf5"} <= set(entries)
        for name, (entry, _) in entries.items():
            for i in range(entry.num_components):
                want = entry.component(i)
                for order in ("<", ">"):
                    out = np.zeros(
                        entry.component_shape(i), np.dtype(entry.dtype).newbyteorder(order)
                    )
                    entry.read_component_into(i, out)
                    assert out.dtype.byteorder in (order, "="), name
                    np.testing.assert_array_equal(out, want, err_msg=f"{name} into {order}")


def test_tf_float32_counters_read_their_source_through_its_checks(tmp_path: Path) -> None:
    """Adam's float64 ``beta1_power`` is written as float32: a component of another shape
    than the scalar it declares is refused (not broadcast into it), and a value that is not
    a scalar is refused with our error naming the variable (not a bare TypeError)."""

    class WrongComponent(ArrayEntry):
        def component(self, i: int) -> np.ndarray:
            return np.array([0.5])  # (1,), declared ()

        def value(self) -> np.ndarray:
            return np.array(0.5)

    class WrongValue(ArrayEntry):
        def value(self) -> np.ndarray:
            return np.array([0.9, 0.8])

    cases = [
        (WrongComponent, r"component 0 has another shape .*expected \(\), found \(1,\)"),
        (WrongValue, r"not a float64 scalar .*expected \(\) float64, found \(2,\) float64"),
    ]
    for make, message in cases:
        entry = make("opt/beta1_power", [np.array(0.9)])
        with pytest.raises(InvalidEntryError, match=message) as info:
            write_checkpoint(tmp_path / "ckpt", {"opt/beta1_power": entry}, format="tf")
        assert "'opt/beta1_power'" in str(info.value)
        assert info.value.file == str(tmp_path / "ckpt.index")
        assert os.listdir(tmp_path) == []
    # as declared, it is written as float32 and read back exactly
    good = ArrayEntry("opt/beta1_power", [np.array(0.9)])
    path = write_checkpoint(tmp_path / "ok", {"opt/beta1_power": good}, format="tf")
    with open_checkpoint(path) as view:
        assert view["opt/beta1_power"].value() == np.float64(0.9)


def test_a_staged_entry_casts_only_when_asked(tmp_path: Path) -> None:
    # The restore's view of another format's entry took a ``cast`` flag and ignored it,
    # casting into any ``out``; it casts now only with ``cast=True`` (the source protocol's
    # flag, as the native reader takes it), and never a component unlike its entry.
    data = np.array([1.5, -2.25, 3e38], np.float32)
    path = write_checkpoint(tmp_path / "c.npz", {"v": ArrayEntry("v", [data])}, format="npz")
    with open_checkpoint(path) as view:
        for verified in (False, True):
            staged = StagedEntry(view["v"])
            if verified:
                staged.verify(0)
            out = np.zeros(3, np.float64)
            with pytest.raises(DtypeMismatchError, match="expected float32, found float64"):
                staged.read_component_into(0, out)
            assert not out.any()
            staged.read_component_into(0, out, cast=True)
            np.testing.assert_array_equal(out, data.astype(np.float64))
            same = np.zeros(3, np.float32)
            staged.read_component_into(0, same, cast=True)
            np.testing.assert_array_equal(same, data)
            with pytest.raises(InvalidEntryError, match=r"expected \(3,\), found \(2,\)"):
                staged.read_component_into(0, np.zeros(2, np.float64), cast=True)
    lying = StagedEntry(Lying("v", np.array([1e40, 0.1]), np.float32, (2,)))
    with pytest.raises(DtypeMismatchError, match="expected float32, found float64"):
        lying.read_component_into(0, np.zeros(2, np.float16), cast=True)


@pytest.mark.parametrize(
    "components, found",
    [
        (np.ones((2, 3), np.float32), r"found one array of shape \(2, 3\)"),
        (np.ones((0, 3), np.float32), r"found one array of shape \(0, 3\)"),
        (np.array(1.5, np.float32), r"found one array of shape \(\)"),
        (np.float32(1.5), r"found one array of shape \(\)"),
        ("abc", "found a str"),
        (b"abc", "found a bytes"),
    ],
)
def test_array_entry_refuses_an_array_for_its_list_of_components(
    components: Any, found: str
) -> None:
    # An array given where the list of components goes raised numpy's "truth value of an
    # array is ambiguous" ValueError (or, for a str, made one component per character).
    with pytest.raises(InvalidEntryError, match=rf"variable 'v'.*{found}"):
        ArrayEntry("v", components)


def test_array_entry_takes_any_sequence_and_refuses_an_empty_one() -> None:
    a = np.arange(3, dtype=np.float32)
    for given in ([a, a], (a, a), iter([a, a])):
        entry = ArrayEntry("v", given)  # type: ignore[arg-type]
        assert entry.num_components == 2 and entry.kind == "mirrored"
    with pytest.raises(InvalidEntryError, match="at least one component"):
        ArrayEntry("v", [])
    with pytest.raises(InvalidEntryError, match="at least one component"):
        ArrayEntry("v", iter([]))  # type: ignore[arg-type]
