"""Outputs: a write never replaces a file of its own source, and every output is all or
nothing (a shard set, a TF checkpoint, an npz, a ``.keras``): a kill at any step leaves the
old content or the new, never a mix that verifies."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from parallelvars import formats
from parallelvars.cli import main
from parallelvars.errors import CorruptCheckpointError, InvalidArgumentError


def entries(value: float, n: int = 6) -> dict[str, formats.ArrayEntry]:
    return {
        f"w{i}": formats.ArrayEntry(f"w{i}", [np.full(16, value + i, np.float32)]) for i in range(n)
    }


def snapshot(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


# ------------------------------------------------------------------ the destination guard


def test_convert_over_a_shard_or_the_index_of_its_own_source_is_refused(tmp_path: Path) -> None:
    d = tmp_path / "set"
    index = formats.write_checkpoint(
        str(d) + "/", entries(1.0), format="safetensors", max_shard_size=100
    )
    before = snapshot(d)
    shards = sorted(n for n in before if n.endswith(".safetensors"))
    assert len(shards) > 1
    for dst in (d / shards[0], Path(index)):
        with pytest.raises(InvalidArgumentError, match="a file of the source checkpoint"):
            formats.convert(str(d), str(dst))
        assert main(["convert", str(d), str(dst)]) == 2
        assert main(["reshard", str(d), str(dst), "--devices", "2"]) == 2
    assert snapshot(d) == before


def test_convert_over_its_own_tf_data_shard_is_refused(tmp_path: Path) -> None:
    prefix = str(tmp_path / "ckpt-1")
    formats.write_checkpoint(prefix, entries(1.0), format="tf")
    before = snapshot(tmp_path)
    with pytest.raises(InvalidArgumentError, match="a file of the source checkpoint"):
        formats.convert(prefix + ".index", prefix, to_format="tf")
    assert snapshot(tmp_path) == before


# ------------------------------------------------------------------------------ names

LONE = "a\ud800"


def _safetensors_file(path: Path, name_json: str) -> Path:
    import struct

    entry = '{"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}'
    header = f'{{"{name_json}": {entry}}}'.encode()
    header += b" " * (-len(header) % 8)
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\0\0\x80\x3f")
    return path


def test_a_lone_surrogate_name_is_refused_at_open_as_the_reference_does(tmp_path: Path) -> None:
    from safetensors.numpy import load_file

    bad = _safetensors_file(tmp_path / "bad.safetensors", "a\\ud800")
    from safetensors import SafetensorError

    with pytest.raises(SafetensorError, match="hex escape"):  # the reference's verdict
        load_file(str(bad))
    with pytest.raises(CorruptCheckpointError, match="not valid Unicode") as info:
        formats.open_checkpoint(str(bad))
    assert info.value.file == str(bad)
    assert main(["convert", str(bad), str(tmp_path / "out.npz")]) == 2
    # a surrogate pair is one character: both read it
    good = _safetensors_file(tmp_path / "good.safetensors", "a\\ud83d\\ude00")
    assert list(load_file(str(good))) == ["a\U0001f600"]
    with formats.open_checkpoint(str(good)) as view:
        assert list(view) == ["a\U0001f600"]


def test_a_lone_surrogate_in_the_native_index_is_refused_at_open(tmp_path: Path) -> None:
    import json

    import h5py
    from _columns_support import write_columns

    import parallelvars as pv
    from parallelvars.checkpoint.h5io import INDEX_DATASET, H5Reader
    from parallelvars.checkpoint.h5io.attributes import _write_json

    path = tmp_path / "n.h5"
    pv.Checkpoint(w=pv.Variable(np.arange(4, dtype=np.float32), name="w")).write(str(path))
    with h5py.File(path, "r+") as f:
        doc = json.loads(f[INDEX_DATASET][()])
        doc[LONE] = doc.pop("w")
        del f[INDEX_DATASET]
        _write_json(f, INDEX_DATASET, doc)
    write_columns(str(path))
    with pytest.raises(CorruptCheckpointError, match="not valid Unicode"):
        H5Reader(str(path)).close()


def test_a_tf_key_that_is_not_utf8_is_refused_at_open(tmp_path: Path) -> None:
    from parallelvars.formats.tf._bundle import BundleWriter

    with BundleWriter(str(tmp_path / "ckpt")) as w:
        w.add(b"a\xff/.ATTRIBUTES/VARIABLE_VALUE", np.ones(2, np.float32))
    with pytest.raises(CorruptCheckpointError, match="not UTF-8 text"):
        formats.open_checkpoint(str(tmp_path / "ckpt"))


@pytest.mark.parametrize("fmt", ["safetensors", "npz", "tf", "hdf5", "keras"])
def test_writers_refuse_a_lone_surrogate_name_as_our_error(tmp_path: Path, fmt: str) -> None:
    from parallelvars.errors import InvalidEntryError

    suffix = {"safetensors": ".safetensors", "npz": ".npz", "tf": "", "hdf5": ".h5"}
    path = str(tmp_path / f"out{suffix.get(fmt, '.weights.h5')}")
    bad = {LONE: formats.ArrayEntry(LONE, [np.ones(2, np.float32)])}
    with pytest.raises(InvalidEntryError, match="not valid Unicode") as info:
        formats.write_checkpoint(path, bad, format=fmt)
    str(info.value).encode("utf-8")  # the message itself prints
    assert not [p for p in tmp_path.iterdir()]
