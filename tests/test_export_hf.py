"""A Hugging Face folder's small files (config.json, tokenizer, processor) travel with its
weights into a Hugging Face folder (formats/safetensors/_hf.py), under the rule for files found
next to a checkpoint: regular files, no link out of the folder, a size bound. transformers'
own from_pretrained of such a folder is tests/test_export_interop.py's."""

from __future__ import annotations

import json
import os
import pathlib

import numpy as np
import pytest
from safetensors.numpy import save_file

from parallelvars import errors, formats
from parallelvars.cli import main
from parallelvars.formats.testing import hf_folder as _hf

CONFIG = b'{"model_type": "gpt2", "n_embd": 8}\n'


def hf_folder(path: pathlib.Path) -> pathlib.Path:
    """A folder laid out as save_pretrained lays it out, with files that must not travel."""
    path.mkdir(parents=True)
    weights = {"wte.weight": np.ones((3, 2), np.float32), "wpe.weight": np.zeros(4, np.float32)}
    save_file(weights, str(path / "model.safetensors"))
    (path / "config.json").write_bytes(CONFIG)
    (path / "tokenizer.json").write_bytes(b'{"model": {}}')
    (path / "merges.txt").write_bytes(b"#version: 0.2\n")
    (path / "README.md").write_text("not carried")
    (path / "pytorch_model.bin").write_bytes(b"PK not carried")
    (path / "sub").mkdir()
    (path / "sub" / "config.json").write_bytes(b"{}")
    return path


CARRIED = ["config.json", "merges.txt", "model.safetensors", "tokenizer.json"]


@pytest.mark.parametrize("dst", ["out/", "out/model.safetensors"])
def test_a_hugging_face_folder_converted_carries_its_files(
    tmp_path: pathlib.Path, dst: str, capsys: pytest.CaptureFixture[str]
) -> None:
    src = hf_folder(tmp_path / "hf")
    out = tmp_path / "out"
    assert main(["convert", str(src), f"{tmp_path}/{dst}", "--to", "safetensors"]) == 0
    assert sorted(p.name for p in out.iterdir()) == CARRIED  # was: model.safetensors alone
    assert (out / "config.json").read_bytes() == CONFIG
    err = capsys.readouterr().err
    assert (
        f"carried the Hugging Face model's config.json, tokenizer.json, merges.txt into {out}"
        in err
    )
    assert main(["convert", str(src), f"{out}/", "--to", "safetensors", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["carried"] == []  # there already: kept


def test_a_trained_checkpoint_takes_them_from_like(tmp_path: pathlib.Path) -> None:
    src = hf_folder(tmp_path / "hf")
    run_h5 = formats.convert(src, tmp_path / "run.h5")  # no Hugging Face folder: nothing beside
    shards = tmp_path / "shards"
    formats.convert(run_h5, shards / "model.safetensors", like=src, max_shard_size="10B")
    assert sorted(p.name for p in shards.glob("*.json")) == [
        "config.json", "model.safetensors.index.json", "tokenizer.json"]  # fmt: skip
    formats.convert(run_h5, tmp_path / "plain" / "model.safetensors")
    assert sorted(p.name for p in (tmp_path / "plain").iterdir()) == ["model.safetensors"]
    with pytest.raises(errors.InvalidArgumentError, match="into a Hugging Face folder"):
        formats.convert(run_h5, tmp_path / "x.safetensors", like=src)
    with pytest.raises(errors.InvalidArgumentError, match=r"holds config\.json"):
        formats.convert(run_h5, tmp_path / "y" / "model.safetensors", like=tmp_path / "plain")
    with formats.open_checkpoint(src) as view:  # the Python API carries as convert does
        formats.write_checkpoint(tmp_path / "api" / "model.safetensors", view)
    assert (tmp_path / "api" / "config.json").read_bytes() == CONFIG


def test_the_destinations_own_file_is_kept(tmp_path: pathlib.Path) -> None:
    src = hf_folder(tmp_path / "hf")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "config.json").write_bytes(b'{"mine": true}')
    formats.convert(src, tmp_path / "out" / "model.safetensors")
    assert (tmp_path / "out" / "config.json").read_bytes() == b'{"mine": true}'
    assert (tmp_path / "out" / "tokenizer.json").is_file()


def _hostile(kind: str, src: pathlib.Path, tmp_path: pathlib.Path) -> None:
    target = src / "tokenizer.json"
    target.unlink()
    if kind == "link-out":
        (tmp_path / "secret").write_bytes(b"{}")
        target.symlink_to(tmp_path / "secret")
    elif kind == "fifo":
        os.mkfifo(target)
    elif kind == "folder":
        target.mkdir()


@pytest.mark.parametrize(
    ("kind", "error"),
    [
        ("link-out", errors.ForeignReferenceError),
        ("fifo", errors.CorruptCheckpointError),
        ("folder", errors.CorruptCheckpointError),
        ("too-large", errors.LimitExceededError),
    ],
)
def test_files_found_beside_are_hostile_and_a_refusal_writes_nothing(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, kind: str, error: type[Exception]
) -> None:
    src = hf_folder(tmp_path / "hf")
    if kind == "too-large":
        monkeypatch.setattr(_hf, "MAX_HF_FILE_BYTES", len(CONFIG) - 1)
    else:
        _hostile(kind, src, tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(error) as info:
        formats.convert(src, out / "model.safetensors")
    assert str(src) in str(info.value)  # names the file found
    assert list(out.iterdir()) == []  # checked before any weight was written


def test_a_link_inside_the_folder_is_followed(tmp_path: pathlib.Path) -> None:
    """As in a Hugging Face cache snapshot, whose files link into the repository's blobs/."""
    src = hf_folder(tmp_path / "hf")
    (src / "blob").write_bytes(CONFIG)
    (src / "config.json").unlink()
    (src / "config.json").symlink_to(src / "blob")
    formats.convert(src, tmp_path / "out" / "model.safetensors")
    assert (tmp_path / "out" / "config.json").read_bytes() == CONFIG
    assert not (tmp_path / "out" / "config.json").is_symlink()
