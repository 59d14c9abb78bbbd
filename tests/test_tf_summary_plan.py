"""The TensorFlow writer plans a view's variables from its summaries (no entry held per
variable): the bytes are those of writing the entries themselves, entries are made only while
their run is written (or not at all where the view reads components in bulk), and a view whose
entry differs from its summary is refused."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from parallelvars.errors import InvalidEntryError
from parallelvars.formats import ArrayEntry, DictView, Entry
from parallelvars.formats.tf import write_bundle


def _entries() -> list[ArrayEntry]:
    rng = np.random.default_rng(0)
    out = []
    for i in range(5):
        w = rng.standard_normal((3, 2)).astype(np.float32)
        out.append(
            ArrayEntry(f"model/v{i}", [w, w.copy()], kind="mirrored", attrs={"name": f"v{i}"})
        )
        out.append(
            ArrayEntry(
                f"optimizer/slots/model/v{i}/m",
                [w * 2, w * 2],
                kind="mirrored",
                attrs={"slot_of": f"model/v{i}", "slot_name": "m"},
            )
        )
    out.append(ArrayEntry("optimizer/iter", [np.array(7, np.int64)], attrs={"trainable": False}))
    out.append(ArrayEntry("strings/s", [np.array([b"a", b"bc"], dtype=object)], shape=(2,)))
    return out


class _Summarized(DictView):
    """A view that describes its variables (``summary``) and counts the entries made; with
    ``bulk``, it reads components in bulk too (and, with ``matched``, says its summaries and
    entries come from one row); ``lie`` gives one variable's summary another shape."""

    makes_entries = True

    def __init__(
        self, entries: list[ArrayEntry], bulk: bool = False, lie: str = "", matched: bool = True
    ) -> None:
        super().__init__(entries)
        self.made: list[str] = []
        self._lie = lie
        if bulk:
            self.bulk_components = self._bulk
            self.summaries_match_entries = matched

    def __getitem__(self, key: str) -> Entry:
        self.made.append(key)
        return super().__getitem__(key)

    def summary(self, key: str) -> tuple[Any, ...]:
        e = super().__getitem__(key)
        shape = (1, *e.shape) if key == self._lie else tuple(e.shape)
        return (e.kind, e.dtype, shape, e.num_components, int(e.nbytes), dict(e.attrs))

    def _bulk(self, paths: list[str]) -> Iterator[tuple[str, list[np.ndarray] | None]]:
        for path in paths:
            e = super().__getitem__(path)
            yield path, [e.component(i) for i in range(e.num_components)]


def _files(prefix: str) -> list[bytes]:
    with open(prefix + ".index", "rb") as f, open(prefix + ".data-00000-of-00001", "rb") as g:
        return [f.read(), g.read()]


@pytest.mark.parametrize("names", ["tf", "slash"])
@pytest.mark.parametrize("bulk", [False, True])
def test_summarized_view_writes_the_same_bytes(tmp_path: Any, bulk: bool, names: str) -> None:
    entries = _entries()
    if names == "slash":
        entries = [e for e in entries if e.num_components == 1]
    plain = write_bundle(str(tmp_path / "a" / "ckpt"), DictView(entries), names=names)
    view = _Summarized(entries, bulk=bulk)
    summarized = write_bundle(str(tmp_path / "b" / "ckpt"), view, names=names)
    assert _files(plain) == _files(summarized)
    # Only a variable a summary cannot describe for the writer (the string tensor) is made
    # to plan (and held); the others once, for their run, or never when read in bulk.
    if bulk:
        assert view.made == ["strings/s"]
    else:
        assert sorted(view.made) == sorted(view)


@pytest.mark.parametrize("bulk", [False, True])
def test_entry_that_differs_from_its_summary_is_refused(tmp_path: Any, bulk: bool) -> None:
    # (a view that reads in bulk but does not say its summaries match its entries has its
    # entries made and compared all the same)
    view = _Summarized(_entries(), bulk=bulk, lie="model/v3", matched=False)
    with pytest.raises(InvalidEntryError, match="differs from its summary in its shape") as e:
        write_bundle(str(tmp_path / "ckpt"), view)
    assert "model/v3" in str(e.value)
    assert not list(tmp_path.glob("ckpt.index"))  # the failed write leaves nothing
