"""A component's name hard-linked to another variable's dataset: the index still places the
component's own bytes, but HDF5 (h5py, the HDF5 tools) reads the other dataset. Every reader
must read the same bytes or refuse: the bulk paths (diff, inspect, convert, extract), a
variable's reads, ``verify`` and ``Checkpoint.restore``; the error names the file, the
component and both places."""

from __future__ import annotations

import os
import pathlib

import h5py
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from parallelvars import formats
from parallelvars.checkpoint.h5io import H5Reader
from parallelvars.checkpoint.h5raw.links import data_addresses
from parallelvars.checkpoint.h5raw.source import WindowSource
from parallelvars.cli import main
from parallelvars.errors import CorruptCheckpointError
from parallelvars.formats import ArrayEntry, DictView

h5bulk = pytest.importorskip("parallelvars.checkpoint.h5io.bulk")


def _write(path: pathlib.Path, count: int) -> None:
    """``count`` mirrored variables ``g{i % 7}/v{i}`` of two components, all ``i``."""
    entries = [
        ArrayEntry(
            f"g{i % 7}/v{i}",
            [np.full(3, i, np.float32)] * 2,
            kind="mirrored",
            attrs={"devices": ["cpu:0", "cpu:1"]},
        )
        for i in range(count)
    ]
    formats.write_checkpoint(str(path), DictView(entries, format="npz"), format="hdf5")


def _relink(path: pathlib.Path, name: str, target: str) -> None:
    with h5py.File(path, "r+") as f:
        del f[name]
        f[name] = f[target]


@pytest.fixture(params=["walk", "one_by_one"])
def how(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The names checked by one walk of the groups (past LINK_CHECKS), or one by one."""
    if request.param == "walk":
        monkeypatch.setattr(h5bulk, "LINK_CHECKS", 2)
    return str(request.param)


def test_a_name_linked_to_another_variables_dataset_is_refused_by_every_reader(
    tmp_path: pathlib.Path, how: str, capsys: pytest.CaptureFixture[str]
) -> None:
    good, bad = tmp_path / "a.h5", tmp_path / "twice.h5"
    _write(good, 14)
    _write(bad, 14)
    _relink(bad, "g6/v6/primary", "g0/v7/primary")
    with h5py.File(bad, "r") as f:
        assert f["g6/v6/primary"][()].tolist() == [7, 7, 7]  # what HDF5 reads

    with H5Reader(bad) as r:
        assert "g6/v6" not in r.differing_components(["g6/v6", "g0/v7"])
        assert dict(r.bulk_components(["g6/v6"]))["g6/v6"] is None
        with pytest.raises(CorruptCheckpointError) as err:
            r["g6/v6"].component(0)
        assert r["g0/v7"].component(0).tolist() == [7, 7, 7]
        assert r["g6/v6"].component(1).tolist() == [6, 6, 6]  # (its own name: untouched)
    exc = err.value
    assert (exc.file, exc.variable) == (str(bad), "g6/v6/primary")
    assert "the index places it at offset" in str(exc) and "data lies at offset" in str(exc)

    for argv in (
        ["diff", str(good), str(bad)],
        ["verify", str(bad)],
        ["convert", str(bad), str(tmp_path / "o.safetensors")],
        ["extract", str(bad), "g6/v6", "-o", str(tmp_path / "x.npy")],
    ):
        assert main(argv) != 0, argv
        captured = capsys.readouterr()
        assert "g6/v6/primary" in captured.out + captured.err, argv
    assert not os.path.exists(tmp_path / "o.safetensors")


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    count=st.integers(2, 20),
    moves=st.lists(
        st.tuples(st.integers(0, 19), st.integers(0, 1), st.integers(0, 19), st.integers(0, 1)),
        min_size=1,
        max_size=3,
    ),
    swap=st.booleans(),
)
def test_every_reader_reads_what_hdf5_reads_or_refuses(
    tmp_path_factory: pytest.TempPathFactory,
    how: str,
    count: int,
    moves: list[tuple[int, int, int, int]],
    swap: bool,
) -> None:
    """Names re-pointed (or swapped) between variables' datasets: each component is what
    HDF5 reads there, or a CorruptCheckpointError naming it, the same from the bulk path and
    from the variable's own reads."""
    path = tmp_path_factory.mktemp("relinked") / "c.h5"
    _write(path, count)
    names = ["primary", "parallel_component_1"]
    with h5py.File(path, "r+") as f:
        for a, i, b, j in moves:
            src = f"g{a % count % 7}/v{a % count}/{names[i]}"
            dst = f"g{b % count % 7}/v{b % count}/{names[j]}"
            if src == dst:
                continue
            there, here = f[dst], f[src]
            del f[src]
            f[src] = there
            if swap:
                del f[dst]
                f[dst] = here
        seen = {
            f"g{k % 7}/v{k}": [f[f"g{k % 7}/v{k}/{n}"][()].tobytes() for n in names]
            for k in range(count)
        }
    with H5Reader(path) as r:
        bulk = dict(r.bulk_components(list(seen)))
        for var, hdf5 in seen.items():
            comps = bulk[var]
            if comps is not None:
                assert [c.tobytes() for c in comps] == hdf5
            for i in range(2):
                try:
                    assert r[var].component(i).tobytes() == hdf5[i]
                except CorruptCheckpointError as exc:
                    assert exc.variable == f"{var}/{names[i]}"
                    assert hdf5[i] != np.full(3, int(var.rsplit("v", 1)[1]), np.float32).tobytes()


def test_data_addresses_are_hdf5s(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "a.h5"
    _write(path, 40)
    addresses, offsets = [], []
    with h5py.File(path, "r") as f:

        def visit(name: str, obj: object) -> None:
            if isinstance(obj, h5py.Dataset):
                addresses.append(h5py.h5o.get_info(obj.id).addr)
                offset = obj.id.get_offset()
                offsets.append(-1 if offset is None else offset)

        f.visititems(visit)
    fd = os.open(path, os.O_RDONLY)
    try:
        found = data_addresses(WindowSource(fd, os.fstat(fd).st_size), np.array(addresses))
    finally:
        os.close(fd)
    assert found.tolist() == offsets and len(offsets) > 40
