"""The commands' results written as they are decided: ``diff`` keeps counts, not rows (its
rows go into a :class:`~parallelvars.cli.testing.Spool`, moved to a temporary file past its
memory bound), and prints the same text and JSON as when every row was kept."""

from __future__ import annotations

import json

import numpy as np
import pytest
from test_commands_bulk import _files, _records

from parallelvars.checkpoint.registry import SaveRecord
from parallelvars.cli import main
from parallelvars.cli.testing import Spool, json_document
from parallelvars.cli.testing import cli_output as _output


def _changed() -> list[SaveRecord]:
    """:func:`_records` with a component changed, a variable gone and one added."""
    records = [r for r in _records() if r.path != "m/flag"]
    eq = records[0]
    bumped = eq.components[1].copy()
    bumped[2] += 0.5
    records[0] = SaveRecord("mirrored", [eq.components[0], bumped], eq.shape, eq.attrs, path="m/eq")
    records.append(SaveRecord("single", [np.ones(3, np.float32)], (3,), {}, path="z/new"))
    return records


@pytest.mark.parametrize("flags", [[], ["--json"], ["--logical"], ["--json", "--atol", "0.6"]])
def test_diff_prints_the_same_whether_its_spool_is_held_or_spilled(
    tmp_path, capsys, monkeypatch, flags
):
    glob = flags[:1] if flags[:1] == ["--json"] else []
    rest = flags[len(glob) :]
    lib, gen = _files(tmp_path, _records())
    (tmp_path / "b").mkdir()
    other_lib, other_gen = _files(tmp_path / "b", _changed())
    runs = {}
    for memory in (_output.SPOOL_MEMORY, 1, 150):
        monkeypatch.setattr(_output, "SPOOL_MEMORY", memory)
        for a, b in ((lib, other_gen), (gen, other_lib), (gen, lib)):
            code = main([*glob, "diff", a, b, *rest])
            runs.setdefault((a, b), []).append((code, capsys.readouterr().out))
    for (a, b), seen in runs.items():
        assert seen[1] == seen[0] and seen[2] == seen[0], (a, b)
    code, text = runs[lib, other_gen][0]
    assert code == 1
    if glob:
        doc = json.loads(text)
        assert (doc["missing"], doc["extra"]) == (["m/flag"], ["z/new"])
        assert doc["num_compared"] == len(doc["variables"]) == len(_records()) - 1
        assert doc["num_differing"] == sum(not r["equal"] for r in doc["variables"])
    else:
        assert "missing from B: m/flag" in text and "extra in B: z/new" in text
        assert text.endswith("common variables differ (rtol=0, atol=0" + (
            ", logical values)\n" if "--logical" in flags else ")\n"
        ))  # fmt: skip
    code, text = runs[gen, lib][0]
    assert code == 0


def test_a_spool_holds_at_most_its_bound_and_gives_back_what_was_added(monkeypatch):
    monkeypatch.setattr(_output, "SPOOL_MEMORY", 100)
    rows = [{"path": f"v/{i}", "equal": i % 3 != 0, "x": [i, "\n\u00e9"]} for i in range(500)]
    with Spool() as spool:
        for k, row in enumerate(rows):
            spool.add(row)
            assert spool._held <= 100 + 60  # (the row that passes the bound, then moved)
            if k < 40:  # (read back whether the last rows are held or moved)
                assert [json.loads(line) for line in spool.lines()] == rows[: k + 1]
        assert len(spool) == 500 and spool._file is not None
        assert [json.loads(line) for line in spool.lines()] == rows
        assert json.loads(json_document({"n": 1, "rows": spool})) == {"n": 1, "rows": rows}
    with Spool() as text:
        for i in range(300):
            text.write(f"line {i}\n")
            if i < 40:
                assert "".join(text.pieces()) == "".join(f"line {j}\n" for j in range(i + 1))
        assert "".join(text.pieces()) == "".join(f"line {i}\n" for i in range(300))
    with Spool() as empty:
        assert json_document({"rows": empty}) == '{\n  "rows": []\n}'


@pytest.mark.parametrize("changed", [None, 0, 3, 7, 11])
def test_pairs_compared_in_joined_runs_are_those_compared_one_by_one(monkeypatch, changed):
    """diff's batch of bulk-read variables is compared a run of small components at a time
    (each side's bytes joined): the same answers as pair by pair, whichever variable differs,
    with large, empty and 0-d components among them."""
    from parallelvars.cli import diff

    monkeypatch.setattr(diff, "_JOIN_BYTES", 4096)
    rng = np.random.default_rng(1)
    sizes = [3, 100, 0, 2000, 5, 1, 400, 9, 800, 64, 2, 7]
    pending = []
    for k, size in enumerate(sizes):
        parts = [rng.standard_normal(size).astype(np.float32) for _ in range(2)]
        if size == 1:
            parts = [p.reshape(()) for p in parts]
        other = [p.copy() for p in parts]
        if k == changed and size:
            other[1].reshape(-1)[0] = -other[1].reshape(-1)[0] + 1
        pending.append((f"v{k}", parts, other))
    want = [
        all(x.tobytes() == y.tobytes() for x, y in zip(ca, cb, strict=True))
        for _, ca, cb in pending
    ]
    assert diff._same_pairs(pending) == want
    assert want.count(False) == (changed is not None and sizes[changed] > 0)
