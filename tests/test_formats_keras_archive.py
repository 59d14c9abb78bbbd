"""Keras 3 ``.keras`` archives: the weights inside read in place (stored) or inflated
(deflated), written from a template whose configuration is kept, refused when they do not fit.
Real Keras loading what we write is in test_keras_interop.py."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import numpy as np
import pytest
from formats_testlib import KERAS, same_bits

import parallelvars as pv
from parallelvars import errors, formats
from parallelvars.cli import main

WEIGHTS = KERAS / "model.weights.h5"
CONFIG = json.dumps({"class_name": "Sequential", "config": {"name": "sequential"}})
META = json.dumps({"keras_version": "3.15.1", "date_saved": "2026-01-01@00:00:00"})


def _archive(path: Path, compression: int = zipfile.ZIP_STORED, weights: Path = WEIGHTS) -> str:
    """An archive laid out as Keras 3's model.save writes one."""
    with zipfile.ZipFile(path, "w", compression=compression) as z:
        z.writestr("metadata.json", META)
        z.writestr("config.json", CONFIG)
        z.write(weights, "model.weights.h5")
    return str(path)


def _values(path: str) -> dict[str, np.ndarray]:
    with formats.open_checkpoint(path) as view:
        return {k: view[k].value() for k in view}


@pytest.mark.parametrize("compression", [zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED])
def test_the_weights_inside_read_as_the_weights_file(tmp_path: Path, compression: int) -> None:
    path = _archive(tmp_path / "model.keras", compression)
    assert formats.detect_format(path) == "keras"
    want = _values(str(WEIGHTS))
    with formats.open_checkpoint(path) as view:
        assert view.format == "keras" and view.path == path
        assert list(view) == list(want)
        for key, value in want.items():
            assert same_bits(view[key].value(), value), key


def test_a_keras_archive_under_another_name_is_detected(tmp_path: Path) -> None:
    path = _archive(tmp_path / "model.zip")
    assert formats.detect_format(path) == "keras"


def test_write_keeps_the_template_and_replaces_the_weights(tmp_path: Path) -> None:
    template = _archive(tmp_path / "model.keras")
    h5 = formats.convert(template, str(tmp_path / "run.h5"))
    with formats.open_checkpoint(h5) as view:
        changed = formats.DictView(
            {
                k: formats.ArrayEntry(k, [view[k].value() * 2], attrs=dict(view[k].attrs))
                for k in view
            },
            metadata=view.metadata,
        )
        formats.write_checkpoint(str(tmp_path / "trained.h5"), changed)
    out = formats.convert(
        str(tmp_path / "trained.h5"), str(tmp_path / "trained.keras"), like=template
    )
    with zipfile.ZipFile(out) as z, zipfile.ZipFile(template) as t:
        assert z.namelist() == t.namelist()
        assert z.read("config.json") == t.read("config.json")
        assert z.read("metadata.json") == t.read("metadata.json")
        assert z.getinfo("model.weights.h5").compress_type == zipfile.ZIP_STORED
    got = _values(out)
    for key, value in _values(str(WEIGHTS)).items():
        assert same_bits(got[key], value * 2), key


def test_weights_that_do_not_fit_the_template_are_refused(tmp_path: Path) -> None:
    template = _archive(tmp_path / "model.keras")
    other = str(KERAS.parent / "torch" / "model.safetensors")
    with pytest.raises(errors.InvalidEntryError, match="do not fit the template") as info:
        formats.convert(other, str(tmp_path / "bad.keras"), like=template)
    assert "missing layers/" in str(info.value)
    assert not (tmp_path / "bad.keras").exists()
    # one weight of another shape
    with formats.open_checkpoint(template) as view:
        entries = {k: formats.ArrayEntry(k, [view[k].value()]) for k in view}
    key = "layers/dense/vars/1"
    entries[key] = formats.ArrayEntry(key, [np.zeros(9, np.float32)])
    with pytest.raises(errors.InvalidEntryError, match=r"layers/dense/vars/1 is float32 \(9,\)"):
        formats.write_checkpoint(
            str(tmp_path / "bad.keras"), formats.DictView(entries), like=template
        )
    assert not (tmp_path / "bad.keras").exists()


def test_the_cli_writes_with_like_and_refuses_without(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    template = _archive(tmp_path / "model.keras")
    assert main(["convert", template, str(tmp_path / "run.h5")]) == 0
    out = str(tmp_path / "out.keras")
    assert main(["convert", str(tmp_path / "run.h5"), out, "--like", template]) == 0
    assert main(["diff", out, template]) == 0
    capsys.readouterr()
    assert main(["convert", str(tmp_path / "run.h5"), str(tmp_path / "x.keras")]) == 2
    assert "--like" in capsys.readouterr().err
    assert main(["convert", str(WEIGHTS), str(tmp_path / "x.npz"), "--like", template]) == 2
    assert (
        main(
            ["convert", str(KERAS.parent / "torch" / "model.safetensors"), out, "--like", template]
        )
        == 2
    )
    assert "do not fit the template" in capsys.readouterr().err


def test_restore_reads_a_keras_archive(tmp_path: Path) -> None:
    path = _archive(tmp_path / "model.keras")
    with pv.MirroredStrategy(2).scope():
        dense = [pv.Variable(np.zeros((6, 8), np.float32)), pv.Variable(np.zeros(8, np.float32))]
    status = pv.Checkpoint(layers={"dense": {"vars": dense}}).restore(path)
    assert status.restored_paths == ["layers/dense/vars/0", "layers/dense/vars/1"]
    want = _values(str(WEIGHTS))
    for i, var in enumerate(dense):
        for c in var.components:
            assert same_bits(c, want[f"layers/dense/vars/{i}"])


# ------------------------------------------------------------------------------ hostile archives


def test_an_archive_without_weights_says_so(tmp_path: Path) -> None:
    path = tmp_path / "model.keras"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("config.json", CONFIG)
    with pytest.raises(errors.NotACheckpointError, match=r"model\.weights\.h5"):
        formats.open_checkpoint(str(path))


def test_a_damaged_stored_member_fails_its_crc(tmp_path: Path) -> None:
    path = tmp_path / "model.keras"
    _archive(path)
    with zipfile.ZipFile(path) as z:
        info = z.getinfo("model.weights.h5")
    raw = bytearray(path.read_bytes())
    start = info.header_offset + 30 + len(info.filename.encode()) + len(info.extra)
    raw[start + info.file_size - 100] ^= 0xFF
    path.write_bytes(bytes(raw))
    with pytest.raises(errors.CorruptCheckpointError, match="CRC-32"):
        formats.open_checkpoint(str(path))


def test_a_truncated_archive_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "model.keras"
    _archive(path)
    path.write_bytes(path.read_bytes()[:-200])
    with pytest.raises(errors.ParallelVarsError):
        formats.open_checkpoint(str(path), format="keras")


def test_a_member_that_claims_to_expand_too_much_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "model.keras"
    _archive(path, zipfile.ZIP_DEFLATED)
    raw = bytearray(path.read_bytes())
    with zipfile.ZipFile(path) as z:
        info = z.getinfo("model.weights.h5")
    name = b"model.weights.h5"
    # the weights member's central directory record: uncompressed size at +24, name at +46
    record = next(
        i
        for i in range(len(raw))
        if raw[i : i + 4] == b"PK\x01\x02" and raw[i + 46 : i + 46 + len(name)] == name
    )
    raw[record + 24 : record + 28] = (info.compress_size * 5000).to_bytes(4, "little")
    path.write_bytes(bytes(raw))
    with pytest.raises(errors.CorruptCheckpointError, match="expand"):
        formats.open_checkpoint(str(path))


# ------------------------------------------------------------------------------ fuzzed archives


@pytest.fixture(scope="module")
def fuzz_sample(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, bytes]:
    """The fuzzers' sample model (every kind) as the weights of a .keras archive."""
    import fuzz_readers

    d = tmp_path_factory.mktemp("keras_archive")
    weights = fuzz_readers.write_sample("keras", str(d))
    clean = _archive(d / "clean.keras", weights=Path(weights))
    return clean, Path(clean).read_bytes()


@pytest.fixture(scope="module")
def reader_worker():  # type: ignore[no-untyped-def]
    import fuzz_readers

    with fuzz_readers.ReaderWorker(timeout=30) as worker:
        yield worker


def test_mutated_archives_raise_only_documented_errors(
    fuzz_sample: tuple[str, bytes], reader_worker: object, tmp_path: Path
) -> None:
    """Bytes flipped in the first and last KiB (local header, the weights' HDF5 superblock, the
    central directory), or the archive cut short: only our documented errors, no crash, no
    hang, no allocation beyond the file (the readers' isolated worker of tools/fuzz_readers)."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    clean, original = fuzz_sample
    target = tmp_path / "fuzzed.keras"
    head = 1024

    @settings(
        max_examples=40,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    )
    @given(
        edits=st.lists(
            st.tuples(st.integers(0, 2 * head - 1), st.integers(1, 255)), min_size=1, max_size=6
        ),
        cut=st.one_of(st.none(), st.integers(0, len(original))),
    )
    def prop(edits: list[tuple[int, int]], cut: int | None) -> None:
        data = bytearray(original)
        for pos, mask in edits:
            offset = pos if pos < head else len(data) - (pos - head) - 1
            data[offset] ^= mask
        if cut is not None:
            del data[cut:]
        target.write_bytes(bytes(data))
        res = reader_worker.check(str(target), clean, "keras")  # type: ignore[attr-defined]
        assert res["outcome"] not in ("undocumented", "crash", "hang", "alloc"), res

    prop()


@pytest.mark.parametrize(
    ("config", "error"),
    [
        (b"[" * 100_000 + b"]" * 100_000, errors.LimitExceededError),  # nesting past the cap
        (b'{"config": ', errors.CorruptCheckpointError),  # not JSON
        (b"\xff\xfe{}", errors.CorruptCheckpointError),  # not UTF-8
    ],
)
def test_a_template_config_is_read_within_the_json_caps(
    tmp_path: Path, config: bytes, error: type[Exception]
) -> None:
    """The layer order read from a ``--like`` template's config.json goes through the same
    size, depth and encoding checks as every JSON document we read."""
    from parallelvars.formats.testing import keras_layer_order

    template = tmp_path / "t.keras"
    with zipfile.ZipFile(template, "w") as zf:
        zf.writestr("config.json", config)
        zf.writestr("metadata.json", b"{}")
        zf.write(KERAS / "model.weights.h5", "model.weights.h5")
    with pytest.raises(error) as e:
        keras_layer_order(template)
    assert "config.json" in str(e.value)
