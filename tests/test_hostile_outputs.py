"""Outputs: a write never replaces a file of its own source, and every output is all or
nothing (a shard set, a TF checkpoint, an npz, a ``.keras``): a kill at any step leaves the
old content or the new, never a mix that verifies."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from parallelvars import formats
from parallelvars.cli import main
from parallelvars.errors import InvalidArgumentError


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
