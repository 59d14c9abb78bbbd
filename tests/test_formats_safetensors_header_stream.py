"""The safetensors header read as columns a piece at a time (no JSON object per tensor) takes
and refuses exactly what the general JSON path does, with the same errors."""

from __future__ import annotations

import json
import os
import struct
import tempfile
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from parallelvars.errors import ParallelVarsError
from parallelvars.formats.safetensors import read_header, write_safetensors

_STREAMED = "parallelvars.formats.safetensors._header._streamed_columns"


def _outcome(path: str, *, general: bool) -> Any:
    """What ``read_header`` gives for the file (or the error it raises), through the
    streamed reading or (``general``) the JSON path only."""
    with pytest.MonkeyPatch.context() as mp:
        if general:
            mp.setattr(_STREAMED, lambda *args: None)
        try:
            with open(path, "rb") as f:
                metadata, tensors, start = read_header(f, path)
        except ParallelVarsError as exc:
            return type(exc).__name__, str(exc)
    return metadata, list(tensors.items()), start


def _streamed(path: str) -> bool:
    """Whether the streamed reading answers for the file by itself (the JSON path refused)."""

    def refused(*args: Any) -> Any:
        raise AssertionError("read the general way")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("parallelvars.formats.safetensors._header._parse_header", refused)
        try:
            with open(path, "rb") as f:
                read_header(f, path)
        except AssertionError:
            return False
    return True


_NAMES = st.lists(
    st.sampled_from(["a", "b", ".", "/", "é", '"', "\\", "]},", "\x01", "_", "\u2028"]),
    max_size=6,
).map("".join)
_DTYPE = st.sampled_from(["F32", "F32", "I64", "U8", "BF16", "F4", "X9", "bool"])
_VALUE = st.text(alphabet=st.sampled_from(["a", '"', "\\", "}", ",", "\n", "é", "\ud800"]))


@st.composite
def _headers(draw: Any) -> tuple[bytes, int]:
    """A header as writers write it (metadata first, compact, padded with spaces), then
    maybe damaged: a field of another type or value, a byte changed, inserted or removed."""
    count = draw(st.integers(0, 5))
    names = [draw(_NAMES) for _ in range(count)]
    if count and draw(st.booleans()):
        names[-1] = draw(st.sampled_from([names[0], "__metadata__"]))
    doc: dict[str, Any] = {}
    pairs: list[str] = []
    if draw(st.booleans()):
        meta = draw(st.dictionaries(_VALUE, _VALUE, max_size=3))
        text = json.dumps(meta, separators=(",", ":"), ensure_ascii=draw(st.booleans()))
        if meta and draw(st.integers(0, 5)) == 0:
            text = text[:-1] + ',"' + next(iter(meta)) + '":"x"}'  # a repeated name
        pairs.append('"__metadata__":' + text)
    at = 0
    for name in names:
        dtype = draw(_DTYPE)
        shape = draw(st.lists(st.integers(0, 3), max_size=3))
        size = 4
        for d in shape:
            size *= d
        size += draw(st.sampled_from([0, 0, 0, 1, -1]))
        info = {"dtype": dtype, "shape": shape, "data_offsets": [at, at + size]}
        doc[name] = info
        pairs.append(
            json.dumps(name, ensure_ascii=draw(st.booleans()))
            + ":"
            + json.dumps(info, separators=(",", ":"))
        )
        at += max(size, 0)
    raw = ("{" + ",".join(pairs) + "}").encode("utf-8", "surrogatepass")
    raw += b" " * draw(st.integers(0, 7))
    change = draw(st.integers(0, 4))
    if change and raw:
        k = draw(st.integers(0, len(raw) - 1))
        byte = bytes([draw(st.sampled_from(b' ",:{}[]0129e-.\\\xff'))])
        if change == 1:
            raw = raw[:k] + byte + raw[k + 1 :]
        elif change == 2:
            raw = raw[:k] + byte + raw[k:]
        elif change == 3:
            raw = raw[:k] + raw[k + 1 :]
    return raw, at + draw(st.sampled_from([0, 0, 0, 1]))


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_headers())
def test_streamed_and_general_reading_agree(header: tuple[bytes, int]) -> None:
    raw, data = header
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "h.safetensors")
        with open(path, "wb") as f:
            f.write(struct.pack("<Q", len(raw)) + raw + b"\0" * data)
        assert _outcome(path, general=False) == _outcome(path, general=True)


@pytest.mark.parametrize("writer", ["ours", "reference"])
def test_files_writers_write_are_read_streamed(tmp_path: Any, writer: str) -> None:
    import numpy as np
    from safetensors.numpy import save_file

    from parallelvars.formats import ArrayEntry, DictView

    tensors = {"a": np.zeros((2, 3), np.float32), "b.c": np.arange(5), "é": np.ones(0, np.int8)}
    path = str(tmp_path / "m.safetensors")
    if writer == "ours":
        write_safetensors(path, DictView([ArrayEntry(k, [v]) for k, v in tensors.items()]))
    else:
        save_file(tensors, path, metadata={"k": 'a "quoted" },"\\ value'})
    assert _streamed(path)
    assert _outcome(path, general=False) == _outcome(path, general=True)


_T = '{"dtype":"F32","shape":[1],"data_offsets":[%d,%d]}'


@pytest.mark.parametrize(
    "raw",
    [
        '{,"a":' + _T % (0, 4) + '"b":' + _T % (4, 8) + "}",  # a comma moved
        '{"a":' + _T % (0, 4) + ',"a":' + _T % (4, 8) + "}",  # a repeated name
        '{"__metadata__":{"k":"v"},"__metadata__":' + _T % (0, 8) + "}",
        '{"__metadata__":{"k":"a\\"},\\"b"},"a":' + _T % (0, 8) + "}",  # '"},' in a value
        '{"__metadata__":{"k":"v","k":"w"},"a":' + _T % (0, 8) + "}",
        '{"__metadata__":{"k":1},"a":' + _T % (0, 8) + "}",
        '{"a":' + _T % (0, 8) + ',"__metadata__":{"k":"v"}}',  # metadata last
        '{"a":' + _T % (0, 4) + "} x",
        '{"a":' + _T % (0, 4) + ',"b":' + _T % (4, 8) + ",}",
        '{"a":' + (_T % (0, 8)).replace("[1]", "[01]") + "}",
        '{"a":' + (_T % (0, 8)).replace("[1]", "[2]") + "}",
        '{"a":' + (_T % (0, 8)).replace("[1]", "[1000000000000000000000]") + "}",
        '{"a":' + (_T % (0, 8)).replace("F32", "F4") + "}",
    ],
)
def test_hostile_headers_are_refused_as_the_general_path_refuses_them(
    tmp_path: Any, raw: str
) -> None:
    data = raw.encode("utf-8")
    path = str(tmp_path / "h.safetensors")
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(data)) + data + b"\0" * 8)
    assert _outcome(path, general=False) == _outcome(path, general=True)
