"""Shared pieces of the command-line tests: registering the test format, sample checkpoints."""

from __future__ import annotations

import json
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from parallelvars.formats import ArrayEntry, Entry, _registry, write_checkpoint


def register_pvtest(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the test-only ``pvtest`` format (tests/_cli_format.py) known to the registry."""
    monkeypatch.setitem(_registry._ADAPTER_MODULES, "pvtest", "_cli_format")
    monkeypatch.setattr(_registry, "FORMAT_NAMES", ("pvtest", *_registry.FORMAT_NAMES))


def sample_entries() -> dict[str, Entry]:
    """One variable of every kind, plus a slot, a bfloat16 and a string variable."""
    kernel = np.arange(6, dtype=np.float32).reshape(3, 2) / 4
    table = np.arange(10, dtype=np.float32).reshape(5, 2)
    entries = [
        ArrayEntry("model/dense/kernel", [kernel, kernel.copy()], kind="mirrored",
                   attrs={"devices": ["cpu:0", "cpu:1"], "trainable": True}),
        ArrayEntry("model/dense/bias", [np.zeros(2, np.float32)] * 2, kind="mirrored"),
        ArrayEntry("model/embedding", [table[:3], table[3:]], kind="sharded", shape=(5, 2),
                   attrs={"shard_axis": 0, "shard_offsets": [0, 3]}),
        ArrayEntry("metrics/count", [np.array(3, np.int64), np.array(4, np.int64)],
                   kind="on_read", attrs={"aggregation": "sum", "synchronization": "on_read"}),
        ArrayEntry("rng/state", [np.array([1, 2], np.uint32), np.array([3, 4], np.uint32)],
                   kind="independent"),
        ArrayEntry("step", [np.array(7, np.int64)]),
        ArrayEntry("model/scale", [np.array([1.5, -2.0, 0.25], dtype=ml_dtypes.bfloat16)]),
        ArrayEntry("vocab", [np.array([b"ab", b"xyz"], dtype=object)]),
        ArrayEntry("optimizer/slots/model/dense/kernel/m", [kernel * 0, kernel * 0],
                   kind="mirrored", attrs={"slot_of": "model/dense/kernel", "slot_name": "m"}),
    ]  # fmt: skip
    return {e.path: e for e in entries}


def write_sample(path: Any, entries: dict[str, Entry] | None = None, **meta: Any) -> str:
    """Write ``entries`` (the sample by default) as a pvtest checkpoint at ``path``."""
    return write_checkpoint(
        str(path),
        entries if entries is not None else sample_entries(),
        format="pvtest",
        metadata=meta,
    )


def replaced(entries: dict[str, Entry], entry: Entry) -> dict[str, Entry]:
    """``entries`` with ``entry`` put in under its path."""
    return {**entries, entry.path: entry}


def read_json(text: str) -> Any:
    """Parse stdout that must be exactly one JSON document."""
    return json.loads(text)
