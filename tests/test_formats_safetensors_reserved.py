"""The safetensors writer refuses a tensor key the header reserves for itself; the flat-key
writers refuse a dtype that is no tensor dtype naming the file and the variable."""

from __future__ import annotations

import numpy as np
import pytest

from parallelvars.cli import main
from parallelvars.errors import InvalidEntryError, UnsupportedDtypeError
from parallelvars.formats import ArrayEntry, DictView, convert, write_checkpoint
from parallelvars.formats.safetensors import write_safetensors


def _meta(kind: str = "mirrored") -> DictView:
    return DictView(
        {"__metadata__": ArrayEntry("__metadata__", [np.ones(2, np.float32)] * 2, kind=kind)}
    )


def _good(path) -> bytes:
    write_safetensors(path, DictView({"w": ArrayEntry("w", [np.ones(2, np.float32)])}))
    return path.read_bytes()


@pytest.mark.parametrize("names", ["slash", "dotted", None])
@pytest.mark.parametrize("max_shard_size", [None, 4])
def test_metadata_key_is_refused_and_the_last_good_file_is_kept(
    tmp_path, names, max_shard_size
) -> None:
    p = tmp_path / "out.safetensors"
    before = _good(p)
    listing = sorted(x.name for x in tmp_path.iterdir())
    kwargs = {} if names is None else {"names": names}
    with pytest.raises(InvalidEntryError, match="__metadata__") as err:
        write_safetensors(p, _meta(), max_shard_size=max_shard_size, **kwargs)
    e = err.value
    assert e.file is not None and e.file.endswith("out.safetensors")
    assert e.variable == "__metadata__"
    assert e.found == "__metadata__"
    assert "reserved by safetensors" in str(e.expected)
    assert p.read_bytes() == before
    assert sorted(x.name for x in tmp_path.iterdir()) == listing


def test_metadata_key_is_refused_through_convert_and_the_cli(tmp_path) -> None:
    src = write_checkpoint(tmp_path / "src.npz", _meta(), format="npz")
    dst = tmp_path / "out.safetensors"
    before = _good(dst)
    with pytest.raises(InvalidEntryError, match="reserved by safetensors"):
        convert(src, dst, names="slash")
    assert dst.read_bytes() == before
    assert main(["convert", str(src), str(dst), "--names", "slash"]) != 0
    assert dst.read_bytes() == before


@pytest.mark.parametrize(
    ("fmt", "name"), [("safetensors", "s.safetensors"), ("keras", "k.weights.h5")]
)
def test_fixed_width_bytes_are_refused_naming_file_and_variable(tmp_path, fmt, name) -> None:
    views = DictView({"v": ArrayEntry("v", [np.array([b"abcd"], "S4")])})
    with pytest.raises(UnsupportedDtypeError) as err:
        write_checkpoint(tmp_path / name, views, format=fmt)
    e = err.value
    assert e.file is not None and e.file.endswith(name)
    assert e.variable == "v"
    assert e.found == "|S4"
    assert e.expected is not None
    assert not (tmp_path / name).exists()
