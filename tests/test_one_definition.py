"""Small helpers the library needs in several layers exist once; the other layers import them."""

from __future__ import annotations

import pathlib

import h5py
import numpy as np
import pytest

from parallelvars.checkpoint import _foreign, _h5policy
from parallelvars.checkpoint.h5io import layout


def test_hdf5_constants_are_the_policy_modules() -> None:
    from parallelvars.checkpoint import h5io
    from parallelvars.formats import _h5

    assert h5io.HDF5_SIGNATURE is _h5.HDF5_SIGNATURE is _h5policy.HDF5_SIGNATURE
    assert _foreign.HDF5_SIGNATURE is _h5policy.HDF5_SIGNATURE
    assert layout._H5_ERRORS is _h5.H5_ERRORS is _h5policy.H5_ERRORS
    assert layout._MAX_COMPRESSION == _h5policy.MAX_COMPRESSION == 1100
    with open(h5py.__file__, "rb") as f:  # not HDF5
        assert not f.read(8).startswith(_h5policy.HDF5_SIGNATURE)


# The native reader's copy of the tuple lacked IndexError and ArithmeticError (the formats' had
# them): h5py raising either on a damaged file now becomes our error in the native reader too.
@pytest.mark.parametrize("exc", [IndexError("index"), ZeroDivisionError("div"), OverflowError("o")])
def test_h5_errors_cover_lookup_and_arithmetic(exc: Exception) -> None:
    assert isinstance(exc, _h5policy.H5_ERRORS)


def test_the_hdf5_sniffer_takes_damage_as_not_ours(tmp_path: pathlib.Path) -> None:
    from parallelvars.formats import hdf5

    path = tmp_path / "x.h5"
    with h5py.File(path, "w") as f:
        f["a"] = np.zeros(3)
    raw = path.read_bytes()
    assert hdf5.sniff(str(path), raw[:64]) is False  # HDF5, but not our root attribute
    path.write_bytes(raw[:200])  # truncated
    assert hdf5.sniff(str(path), raw[:64]) is False


@pytest.mark.parametrize(
    ("value", "integer", "index"),
    [(3, True, True), (0, True, True), (-1, True, False), (np.int64(5), True, True),
     (np.uint8(0), True, True), (np.int32(-2), True, False), (True, False, False),
     (np.bool_(True), False, False), (2.0, False, False), ("1", False, False), (None, False, False)],
)  # fmt: skip
def test_integer_checks_on_decoded_values(value: object, integer: bool, index: bool) -> None:
    from parallelvars._ints import is_index, is_int

    assert (is_int(value), is_index(value)) == (integer, index)


class _OneProcess:
    """mpi4py's Comm for a one-process world, the calls the collective writer makes."""

    def Get_rank(self) -> int:
        return 0

    def Get_size(self) -> int:
        return 1

    def gather(self, value: object, root: int = 0) -> list[object]:
        return [value]

    def bcast(self, value: object, root: int = 0) -> object:
        return value


def test_the_collective_writer_lives_with_the_layout(tmp_path: pathlib.Path) -> None:
    """One layout writer in checkpoint/: the multi-process save is h5io.collective, built on
    write_h5 and write_h5_index, and needs neither MPI nor the MPI strategy."""
    import subprocess
    import sys

    from parallelvars.checkpoint.h5io import H5Reader
    from parallelvars.checkpoint.h5io.collective import parts_dir_for, write_collective
    from parallelvars.checkpoint.registry import SaveRecord

    devices = ["cpu:0", "cpu:1"]
    comps = [np.arange(6, dtype=np.float32).reshape(2, 3), np.ones((2, 3), np.float32)]
    records = [
        SaveRecord("mirrored", comps, (2, 3), {"devices": devices}, path="m/w"),
        SaveRecord("single", [np.array(4, np.int64)], (), {"devices": ["cpu:0"]}, path="step"),
    ]
    path = str(tmp_path / "ckpt.h5")
    stale = pathlib.Path(parts_dir_for(path)) / "rank-00000-of-00003.h5"
    stale.parent.mkdir()
    stale.write_bytes(b"an earlier save with three processes")
    assert write_collective(_OneProcess(), path, records, devices, devices) == path
    assert sorted(p.name for p in stale.parent.iterdir()) == ["rank-00000-of-00001.h5"]
    with H5Reader(path) as reader:
        assert reader.metadata["processes"] == 1
        w = reader["m/w"]
        assert w.num_components == 2
        assert np.array_equal(w.component(0), comps[0]) and np.array_equal(w.component(1), comps[1])
        assert int(reader["step"].component(0)) == 4
    code = (
        "import sys, parallelvars.checkpoint.h5io.collective\n"
        "print(sorted(m for m in sys.modules if m.startswith(('mpi4py', 'parallelvars.strategy._mpi', 'parallelvars.strategy._coll'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
