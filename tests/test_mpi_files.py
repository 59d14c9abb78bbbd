"""Multi-process saves through the generator: the rank files (``save_native``) and the index
file (``write_native_index``) read, through h5py, as their plain-libhdf5 twins do
(``write_h5`` / ``write_h5_index`` of the same content); a repeated save reuses the generated
metadata and is byte for byte a save without any cache; a failed save leaves the last good
checkpoint.

The ranks here are threads sharing an in-process communicator (the duck-typed ``gather`` /
``bcast`` of ``write_collective``), so these run in the default suite; the real ``mpiexec``
runs of the same checks are in ``test_mpi_repeated.py`` (slow).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_save_native import every_name

from parallelvars.checkpoint import H5Reader
from parallelvars.checkpoint.h5io import collective
from parallelvars.checkpoint.h5io.collective import index_cache, write_collective
from parallelvars.checkpoint.h5io.records import RecordList
from parallelvars.checkpoint.h5io.write import (
    ComponentLink,
    LinkedVariable,
    write_h5,
    write_h5_index,
)
from parallelvars.checkpoint.h5raw import native
from parallelvars.checkpoint.h5raw.index_file import write_native_index
from parallelvars.checkpoint.registry import SaveRecord
from parallelvars.errors import CheckpointError
from parallelvars.testing import PlanCache, as_dtype

CREATED = 1_700_000_000.5


@pytest.fixture
def fixed_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every save records the same ``created`` time, so two ways of writing can be compared."""
    monkeypatch.setattr(time, "time", lambda: CREATED)


class ThreadComm:
    """Rank ``rank`` of ``size`` threads: ``gather`` and ``bcast`` as mpi4py's ``Comm``."""

    def __init__(self, rank: int, shared: dict[str, Any]) -> None:
        self.rank, self.shared = rank, shared

    def Get_rank(self) -> int:
        return self.rank

    def Get_size(self) -> int:
        return int(self.shared["size"])

    def gather(self, value: object, root: int = 0) -> list[object] | None:
        self.shared["slots"][self.rank] = value
        self.shared["barrier"].wait()
        out = list(self.shared["slots"]) if self.rank == root else None
        self.shared["barrier"].wait()
        return out

    def bcast(self, value: object, root: int = 0) -> object:
        if self.rank == root:
            self.shared["value"] = value
        self.shared["barrier"].wait()
        out = self.shared["value"]
        self.shared["barrier"].wait()
        return out


def run_ranks(size: int, fn: Callable[[ThreadComm], object]) -> list[object]:
    """``fn(comm)`` on ``size`` threads at once; each one's result or exception."""
    shared: dict[str, Any] = {
        "size": size,
        "slots": [None] * size,
        "barrier": threading.Barrier(size, timeout=60),
    }
    out: list[object] = [None] * size

    def one(r: int) -> None:
        try:
            out[r] = fn(ThreadComm(r, shared))
        except BaseException as exc:  # handed to the test
            out[r] = exc

    threads = [threading.Thread(target=one, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return out


def records(rank: int, size: int, k: int, extra: bool = False, bump: float = 0) -> list[SaveRecord]:
    """What rank ``rank`` saves at save ``k``: per-replica variables of its device (mirrored
    ones equal on every rank, as training keeps them; on-read parts of its own) and, like a
    checkpoint's counter, one value (saved by rank 0 only)."""
    dev = [f"cpu:{rank}"]
    w = np.arange(12, dtype=np.float32).reshape(3, 4) * (k + 1) + np.float32(bump)
    recs = [
        SaveRecord("mirrored", [w], (3, 4), {"devices": dev, "aggregation": "mean"}, path="m/w"),
        SaveRecord(
            "mirrored", [np.full(70_000, k, np.float32)], (70_000,), {"devices": dev}, path="m/big"
        ),
        SaveRecord("on_read", [np.array(k * 10 + rank)], (), {"devices": dev}, path="m/seen"),
        SaveRecord("single", [np.array(k, np.int64)], (), {"devices": ["cpu:0"]}, path="count"),
    ]
    if extra:
        recs.append(SaveRecord("mirrored", [w[:1] + 1], (1, 4), {"devices": dev}, path="m/new"))
    return recs


def save_all(
    directory: Path,
    size: int,
    k: int,
    caches: list[PlanCache | None],
    extra: bool = False,
    name: str = "ckpt",
    bump: float = 0,
) -> list[object]:
    devices = [f"cpu:{r}" for r in range(size)]
    path = str(directory / f"{name}-{k}.h5")

    def save(comm: ThreadComm) -> str:
        r = comm.Get_rank()
        return write_collective(
            comm,
            path,
            records(r, size, k, extra, bump),
            [f"cpu:{r}"],
            devices,
            object_graph={"nodes": [k if extra else 0]},
            metadata={"save_counter": k, "step": 100 * k},
            cache=caches[r],
        )

    return run_ranks(size, save)


def files_of(path: str) -> dict[str, bytes]:
    """The index file and every rank file of the checkpoint at ``path``, by relative name."""
    out = {"index": Path(path).read_bytes()}
    parts = Path(path + ".parts")
    for f in sorted(parts.iterdir()):
        if f.is_file():
            out[f.name] = f.read_bytes()
    return out


def assert_readable(path: str, size: int, k: int, extra: bool = False) -> None:
    """Plain h5py sees every component through the links; our reader verifies them all."""
    rank_files = [
        f"{os.path.basename(path)}.parts/rank-{r:05d}-of-{size:05d}.h5" for r in range(size)
    ]
    with h5py.File(path, "r") as f:
        grp = f["m/w"]
        assert int(grp.attrs["num_components"]) == size
        # A mirrored variable is written once in the job: every component links to that copy
        # (the larger m/big went to rank 0, so the small m/w to rank 1).
        holder = rank_files[1 if size > 1 else 0]
        for r in range(size):
            name = "primary" if r == 0 else f"parallel_component_{r}"
            link = grp.get(name, getlink=True)
            assert isinstance(link, h5py.ExternalLink)
            assert link.filename == holder
            expected = np.arange(12, dtype=np.float32).reshape(3, 4) * (k + 1)
            np.testing.assert_array_equal(grp[name][()], expected)
        assert int(f.attrs["save_counter"]) == k and int(f.attrs["step"]) == 100 * k
        assert ("m/new" in f) == extra
    for r, name in enumerate(rank_files):
        with h5py.File(os.path.join(os.path.dirname(path), name), "r") as part:
            assert ("m/w" in part) == (name == holder)
            assert ("m/big" in part) == (r == 0)
    with H5Reader(path) as reader:
        assert reader.verify_all() == []
        assert int(reader["count"].component(0)) == k
        assert [int(reader["m/seen"].component(r)) for r in range(size)] == [
            k * 10 + r for r in range(size)
        ]


def libhdf5_twin(directory: Path, size: int, k: int, **kw: Any) -> str:
    """The same collective save with every file written the plain libhdf5 way."""
    real = (collective.save_native, collective.write_native_index)

    def rank_file(path: str, records: Any, **options: Any) -> str:
        options.pop("cache", None)
        return write_h5(path, records, **options)

    def index_file(path: str, variables: Any, **options: Any) -> str:
        options.pop("cache", None)
        return write_h5_index(path, variables, **options)

    collective.save_native, collective.write_native_index = rank_file, index_file  # type: ignore[assignment]
    try:
        (plain,) = set(save_all(directory, size, k, [None] * size, **kw))
    finally:
        collective.save_native, collective.write_native_index = real  # type: ignore[assignment]
    return str(plain)


def index_of(f: h5py.File) -> dict[str, Any]:
    """The index document without the components' offsets (where each writer put them)."""
    index = json.loads(bytes(f["_parallelvars/index"][()]))
    for meta in index.values():
        meta.pop("offsets")
    return index


def assert_reads_as_twin(ours: str, theirs: str) -> None:
    """Every file of two checkpoints (the index file, through its links, and each rank file):
    every group, dataset, attribute and value h5py reads, and the index documents."""
    names = sorted(files_of(ours))
    assert names == sorted(files_of(theirs))
    for name in names:
        a, b = (p if name == "index" else f"{p}.parts/{name}" for p in (ours, theirs))
        with h5py.File(a, "r") as fa, h5py.File(b, "r") as fb:
            wa, wb = every_name(fa), every_name(fb)
            assert wa.keys() == wb.keys(), name
            for key in wa:
                assert wa[key] == wb[key], (name, key)
            assert index_of(fa) == index_of(fb), name


@pytest.mark.parametrize("size", [1, 2, 4, 12])
def test_collective_saves_read_as_their_libhdf5_twins(
    tmp_path: Path, fixed_clock: None, size: int
) -> None:
    caches: list[PlanCache | None] = [PlanCache() for _ in range(size)]
    for d in ("a", "b", "c"):
        (tmp_path / d).mkdir()
    for k in (1, 2, 3):  # ckpt-1, -2, -3: every index file links to a new folder
        (path,) = set(save_all(tmp_path / "a", size, k, caches))
        assert isinstance(path, str)
        assert_reads_as_twin(path, libhdf5_twin(tmp_path / "b", size, k))
        # a repeated save is the file a save without any cache generates, byte for byte
        (fresh,) = set(save_all(tmp_path / "c", size, k, [None] * size))
        assert files_of(path) == files_of(str(fresh))
        assert_readable(path, size, k)
        plans = [c.held for c in caches if c is not None]
        assert all(isinstance(p, native.Prepared) for p in plans)
        assert caches[0] is not None
        assert isinstance(index_cache(caches[0]).held, native.Prepared)
        if k == 1:
            first = plans
        else:  # the rank files' plans of the first save, not made again
            assert all(a is b for a, b in zip(plans, first, strict=True))
    assert_readable(str(tmp_path / "a" / "ckpt-1.h5"), size, 1)  # earlier saves are untouched


def test_a_checkpoints_records_find_their_rank_plans_by_token(
    tmp_path: Path, fixed_clock: None
) -> None:
    # A checkpoint hands the same records to every save of an unchanged structure: each rank
    # file's plan is found by their token, and the files are those of a save without cache.
    size = 3
    kept = [RecordList(records(r, size, 1)) for r in range(size)]
    caches: list[PlanCache | None] = [PlanCache() for _ in range(size)]
    devices = [f"cpu:{r}" for r in range(size)]
    (tmp_path / "fresh").mkdir()
    plans = []
    for k in (1, 2, 3):
        for r in range(size):  # new values in the same records
            kept[r][0].components[0][...] = k
        for d, cache in ((tmp_path, caches), (tmp_path / "fresh", [None] * size)):

            def save(
                comm: ThreadComm, d: Path = d, cache: list[PlanCache | None] = cache, k: int = k
            ) -> str:
                r = comm.Get_rank()
                return write_collective(
                    comm, str(d / f"ckpt-{k}.h5"), kept[r], [f"cpu:{r}"], devices, cache=cache[r]
                )

            assert len(set(run_ranks(size, save))) == 1
        assert files_of(str(tmp_path / f"ckpt-{k}.h5")) == files_of(
            str(tmp_path / "fresh" / f"ckpt-{k}.h5")
        )
        plans.append([c.held for c in caches if c is not None])
        with H5Reader(str(tmp_path / f"ckpt-{k}.h5")) as reader:
            assert reader.verify_all() == []
            assert float(reader["m/w"].component(2)[0, 0]) == k
    assert all(a is b for a, b in zip(plans[0], plans[2], strict=True))


def test_saves_to_one_path_reuse_the_index_plan(tmp_path: Path, fixed_clock: None) -> None:
    caches: list[PlanCache | None] = [PlanCache(), PlanCache()]
    (tmp_path / "b").mkdir()
    held = []
    for bump in (0, 1, 2):
        (path,) = set(save_all(tmp_path, 2, 1, caches, name="latest", bump=bump))
        assert caches[0] is not None
        held.append(index_cache(caches[0]).held)
        with H5Reader(str(path)) as reader:
            assert reader.verify_all() == []
            assert float(reader["m/w"].component(1)[0, 0]) == bump
    assert held[0] is held[1] is held[2]
    assert_reads_as_twin(str(path), libhdf5_twin(tmp_path / "b", 2, 1, name="latest", bump=2))


def test_a_changed_structure_makes_new_plans(tmp_path: Path, fixed_clock: None) -> None:
    caches: list[PlanCache | None] = [PlanCache(), PlanCache()]
    for d in ("a", "b"):
        (tmp_path / d).mkdir()
    save_all(tmp_path / "a", 2, 1, caches)
    assert caches[0] is not None and caches[1] is not None
    before = (caches[1].held, index_cache(caches[0]).held)
    for k, extra, name in (
        (2, True, "ckpt"),
        (3, True, "ckpt"),
        (10, True, "ckpt"),
        (4, False, "x"),
    ):
        (path,) = set(save_all(tmp_path / "a", 2, k, caches, extra, name))
        assert_reads_as_twin(str(path), libhdf5_twin(tmp_path / "b", 2, k, extra=extra, name=name))
        assert_readable(str(path), 2, k, extra)
    after = (caches[1].held, index_cache(caches[0]).held)
    assert after[0] is not before[0] and after[1] is not before[1]


def test_a_rank_failing_mid_save_leaves_the_last_good_checkpoint(
    tmp_path: Path, fixed_clock: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    caches: list[PlanCache | None] = [PlanCache() for _ in range(4)]
    for k in (1, 2):
        save_all(tmp_path, 4, k, caches)
    good = files_of(str(tmp_path / "ckpt-2.h5"))
    real = collective.save_native

    def failing(path: str, *args: Any, **kwargs: Any) -> str:
        if "rank-00002" in path:  # rank 2 writes half its file, then the disk fails
            with open(path, "wb") as f:
                f.write(b"half")
            raise OSError(28, "No space left on device")
        return real(path, *args, **kwargs)

    monkeypatch.setattr(collective, "save_native", failing)
    outcomes = save_all(tmp_path, 4, 3, caches)
    assert all(isinstance(o, CheckpointError) for o in outcomes), outcomes
    assert "rank 2" in str(outcomes[0]) and "No space left" in str(outcomes[0])
    assert not (tmp_path / "ckpt-3.h5").exists()  # never committed
    assert not (tmp_path / "ckpt-3.h5.parts").exists()  # and nothing of it left behind
    assert files_of(str(tmp_path / "ckpt-2.h5")) == good  # the last good checkpoint
    assert_readable(str(tmp_path / "ckpt-2.h5"), 4, 2)

    # The index write failing (after every rank file is written) commits nothing either.
    monkeypatch.setattr(collective, "save_native", real)

    def no_index(*args: Any, **kwargs: Any) -> str:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(collective, "write_native_index", no_index)
    outcomes = save_all(tmp_path, 4, 4, caches)
    assert all(isinstance(o, CheckpointError) for o in outcomes) and "(index)" in str(outcomes[0])
    assert not (tmp_path / "ckpt-4.h5").exists()
    monkeypatch.undo()
    monkeypatch.setattr(time, "time", lambda: CREATED)

    # The next save works, with the cached plans, and is the file a fresh save generates.
    (path,) = set(save_all(tmp_path, 4, 5, caches))
    (tmp_path / "b").mkdir()
    (fresh,) = set(save_all(tmp_path / "b", 4, 5, [None] * 4))
    assert files_of(str(path)) == files_of(str(fresh))
    assert_readable(str(path), 4, 5)


def test_a_failed_rewrite_of_the_same_path_leaves_the_committed_checkpoint(
    tmp_path: Path, fixed_clock: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # ckpt.write("latest.h5") every epoch: the rank files of a save that fails must not have
    # replaced those of the committed checkpoint (they wait in .parts/.staged/ until all ranks
    # wrote theirs).
    caches: list[PlanCache | None] = [PlanCache() for _ in range(4)]
    path = str(tmp_path / "latest-1.h5")
    assert save_all(tmp_path, 4, 1, caches, name="latest") == [path] * 4
    good = files_of(path)
    real = collective.save_native

    def failing(p: str, *args: Any, **kwargs: Any) -> str:
        if "rank-00003" in p:
            raise OSError(28, "No space left on device")
        return real(p, *args, **kwargs)

    monkeypatch.setattr(collective, "save_native", failing)
    for _ in range(2):  # (the second with the plans cached by the first)
        outcomes = save_all(tmp_path, 4, 1, caches, name="latest")
        assert all(isinstance(o, CheckpointError) for o in outcomes), outcomes
        assert files_of(path) == good  # every rank file and the index as committed
        assert_readable(path, 4, 1)
        # What the failed save wrote is removed with it: only the committed rank files remain.
        assert sorted(os.listdir(path + ".parts")) == [
            f"rank-{r:05d}-of-00004.h5" for r in range(4)
        ]
    monkeypatch.setattr(collective, "save_native", real)

    def no_index(*args: Any, **kwargs: Any) -> str:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(collective, "write_native_index", no_index)
    assert all(
        isinstance(o, CheckpointError) for o in save_all(tmp_path, 4, 1, caches, name="latest")
    )
    assert files_of(path) == good
    monkeypatch.undo()
    monkeypatch.setattr(time, "time", lambda: CREATED)

    # A save that succeeds replaces it.
    save_all(tmp_path, 4, 1, caches, name="latest", bump=100)
    assert files_of(path) != good
    with H5Reader(path) as reader:
        assert reader.verify_all() == []
        assert float(reader["m/w"].component(3)[0, 0]) == 100.0
    assert sorted(os.listdir(path + ".parts")) == [f"rank-{r:05d}-of-00004.h5" for r in range(4)]


def index_names(f: h5py.File) -> dict[str, object]:
    """What h5py reads of an index file without following its external links: every group's
    attributes, each link's target and every other dataset's type, shape, attributes and
    value (a virtual value over missing files reads as its fill value)."""
    seen: dict[str, object] = {"/": {k: repr(v) for k, v in f.attrs.items()}}

    def walk(group: h5py.Group, prefix: str) -> None:
        for key in group:
            name = prefix + key
            link = group.get(key, getlink=True)
            if isinstance(link, h5py.ExternalLink):
                seen[name] = ("external", link.filename, link.path)
                continue
            obj = group[key]
            attrs = {k: repr(v) for k, v in obj.attrs.items()}
            if isinstance(obj, h5py.Dataset):
                value = np.asarray(obj[()])
                seen[name] = (attrs, obj.dtype.str, obj.shape, obj.is_virtual, value.tobytes())
            else:
                seen[name] = attrs
                walk(obj, name + "/")

    walk(f, "")
    return seen


def assert_index_reads_as_twin(ours: str, theirs: str) -> None:
    with h5py.File(ours, "r") as fa, h5py.File(theirs, "r") as fb:
        wa, wb = index_names(fa), index_names(fb)
        assert wa.keys() == wb.keys()
        for key in wa:
            assert wa[key] == wb[key], key
        assert links_of(fa) == links_of(fb)


def links_of(f: h5py.File) -> dict[str, tuple[str, str]]:
    out = {}

    def visit(name: str, link: object) -> None:
        if isinstance(link, h5py.ExternalLink):
            out[name] = (link.filename, link.path)

    f.visititems_links(visit)
    return out


@pytest.mark.parametrize("n", [12, 100, 1024])
def test_index_variables_of_many_components(tmp_path: Path, fixed_clock: None, n: int) -> None:
    # Up to 1,024 links a generated group keeps them in its header (libhdf5 moves more than 8
    # into a fractal heap: the same links for h5py).
    def variables(k: int) -> list[LinkedVariable]:
        links = [
            ComponentLink(f"c-{k}.parts/r{i}.h5", "/v/primary", 1000 * k + i) for i in range(n)
        ]
        return [
            LinkedVariable(f"g{j}/v", "mirrored", np.float32, (2,), {}, links) for j in range(3)
        ]

    cache = PlanCache()
    for k in (1, 2):
        path = write_native_index(tmp_path / f"s{k}.h5", variables(k), cache=cache)
        plain = write_h5_index(tmp_path / f"p{k}.h5", variables(k))
        assert_index_reads_as_twin(path, plain)
        assert isinstance(cache.held, native.Prepared)
        with h5py.File(path, "r") as f:
            link = f["g2/v"].get(f"parallel_component_{n - 1}", getlink=True)
            assert link.filename == f"c-{k}.parts/r{n - 1}.h5"


def test_an_index_variable_of_more_components_takes_libhdf5(
    tmp_path: Path, fixed_clock: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Over 1,024 external links in one group: HDF5's dense link storage, written by libhdf5
    # (a symbol table holds hard links only); the structure is remembered as such.
    from parallelvars.checkpoint.h5io import write as write_module

    calls: list[str] = []
    real = write_module.write_h5_index

    def counted(path: str, *args: Any, **kwargs: Any) -> str:
        calls.append(path)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(write_module, "write_h5_index", counted)
    n = 1025
    cache = PlanCache()
    for k in (1, 2):
        links = [ComponentLink(f"p/r{i}.h5", "/v/primary", k + i) for i in range(n)]
        variables = [LinkedVariable("v", "mirrored", np.float32, (2,), {}, links)]
        path = write_native_index(tmp_path / f"s{k}.h5", variables, cache=cache)
        assert isinstance(cache.held, native.Unexpressed)
        plain = real(tmp_path / f"p{k}.h5", variables)
        assert_index_reads_as_twin(path, plain)
    assert len(calls) == 2


def test_a_sharded_index_variable_has_its_stitched_value(tmp_path: Path, fixed_clock: None) -> None:
    # The index file's sharded variable: a virtual value over the shards in the rank files.
    parts = tmp_path / "c.h5.parts"
    parts.mkdir()
    full = np.arange(20, dtype=np.float32).reshape(5, 4)
    offsets = [0, 2, 5]  # each shard's first row; the last shard is empty
    bounds = [*offsets, 5]
    links = []
    for r in range(3):
        shard = full[bounds[r] : bounds[r + 1]]
        write_h5(
            str(parts / f"r{r}.h5"),
            [SaveRecord("single", [shard], shard.shape, {}, path="t")],
        )
        links.append(ComponentLink(f"c.h5.parts/r{r}.h5", "/t/primary", r))
    attrs = {"shard_axis": 0, "shard_offsets": offsets, "devices": ["a", "b", "c"]}
    variables = [LinkedVariable("t", "sharded", np.float32, (5, 4), attrs, links)]
    cwd = os.getcwd()
    os.chdir(tmp_path)  # (links and virtual sources name files from the index file's folder)
    try:
        ours = write_native_index("c.h5", variables)
        theirs = write_h5_index("twin.h5", variables)
        assert_index_reads_as_twin(ours, theirs)
        with h5py.File(ours, "r") as f:
            assert f["t/value"].is_virtual
            np.testing.assert_array_equal(f["t/value"][()], full)
    finally:
        os.chdir(cwd)


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    spec=st.lists(
        st.tuples(
            st.integers(1, 24),  # components (links) of the variable
            st.sampled_from(["mirrored", "on_read", "single"]),
            st.lists(st.integers(0, 9), max_size=3).map(tuple),
            st.dictionaries(
                st.sampled_from(["aggregation", "trainable", "note"]),
                st.one_of(st.booleans(), st.integers(-5, 5), st.text("abcé%", max_size=40)),
                max_size=3,
            ),
            st.sampled_from(["float32", "bfloat16", "int8", "bool", "float8_e4m3fn"]),
        ),
        min_size=1,
        max_size=5,
    ),
    folder=st.text("abcxyz-_.é", min_size=1, max_size=30),
    seed=st.integers(0, 2**32 - 1),
)
def test_any_index_structure_reads_as_its_twin(
    tmp_path_factory: pytest.TempPathFactory,
    fixed_clock: None,
    spec: list[tuple[int, str, tuple[int, ...], dict[str, object], str]],
    folder: str,
    seed: int,
) -> None:

    d = tmp_path_factory.mktemp("idx")
    rng = np.random.default_rng(seed)
    cache = PlanCache()
    first: object = None
    # the same structure again: its plan reused, with new checksums and values, and links into
    # another folder of the same length (another checkpoint's parts)
    # (and the first folder again: the cached image, patched in place, takes it back)
    for k, name in enumerate((folder, folder[::-1], folder.upper(), folder)):
        variables = [
            LinkedVariable(
                f"m/v{j}",
                kind,
                as_dtype(dtype),
                shape,
                attrs,
                [
                    ComponentLink(f"{name}.parts/r{i}.h5", f"/m/v{j}/c", int(rng.integers(2**32)))
                    for i in range(n)
                ],
            )
            for j, (n, kind, shape, attrs, dtype) in enumerate(spec)
        ]
        meta = {"save_counter": k, "step": int(rng.integers(2**40))}
        path = write_native_index(d / f"s{k}.h5", variables, metadata=meta, cache=cache)
        plain = write_h5_index(d / f"p{k}.h5", variables, metadata=meta)
        assert_index_reads_as_twin(path, plain)
        fresh = write_native_index(d / f"f{k}.h5", variables, metadata=meta)
        with h5py.File(path, "r") as f:
            created = float(f.attrs["created"])
        assert created == CREATED
        assert Path(path).read_bytes() == Path(fresh).read_bytes()
        if k:
            assert cache.held is first
        else:
            first = cache.held


class _OneProcess:
    """mpi4py's Comm for a one-process world, the calls the collective writer makes."""

    def Get_rank(self) -> int:
        return 0

    def Get_size(self) -> int:
        return 1

    def gather(self, value: object, root: int = 0) -> list[object]:
        return [value]

    def bcast(self, value: object, root: int = 0) -> object:
        return value


def test_the_collective_writer_lives_with_the_layout(tmp_path: Path) -> None:
    """One layout writer in checkpoint/: the multi-process save is h5io.collective, built on
    the generator's save_native and write_native_index, and needs neither MPI nor the MPI
    strategy."""
    import subprocess
    import sys

    from parallelvars.checkpoint.h5io import H5Reader
    from parallelvars.checkpoint.h5io.collective import parts_dir_for, write_collective
    from parallelvars.checkpoint.registry import SaveRecord

    devices = ["cpu:0", "cpu:1"]
    comps = [np.arange(6, dtype=np.float32).reshape(2, 3), np.ones((2, 3), np.float32)]
    records = [
        SaveRecord("mirrored", comps, (2, 3), {"devices": devices}, path="m/w"),
        SaveRecord("single", [np.array(4, np.int64)], (), {"devices": ["cpu:0"]}, path="step"),
    ]
    path = str(tmp_path / "ckpt.h5")
    stale = Path(parts_dir_for(path)) / "rank-00000-of-00003.h5"
    stale.parent.mkdir()
    stale.write_bytes(b"an earlier save with three processes")
    assert write_collective(_OneProcess(), path, records, devices, devices) == path
    assert sorted(p.name for p in stale.parent.iterdir()) == ["rank-00000-of-00001.h5"]
    with H5Reader(path) as reader:
        assert reader.metadata["processes"] == 1
        w = reader["m/w"]
        assert w.num_components == 2
        assert np.array_equal(w.component(0), comps[0]) and np.array_equal(w.component(1), comps[1])
        assert int(reader["step"].component(0)) == 4
    code = (
        "import sys, parallelvars.checkpoint.h5io.collective\n"
        "print(sorted(m for m in sys.modules if m.startswith(('mpi4py', 'parallelvars.strategy._mpi', 'parallelvars.strategy._coll'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_a_snapshots_copies_are_not_kept_after_a_collective_save(
    tmp_path: Path, fixed_clock: None
) -> None:
    """Repeated collective saves of a non-blocking save's copies (records made ``like=`` the
    live ones): no rank plans their replicas or keeps them, so once the caller drops them the
    copied buffers are freed (a kept copy would hold a whole snapshot until the next save)."""
    import gc
    import weakref

    from parallelvars.checkpoint.snapshot import plan_replicas

    size, local = 2, 2
    devices = [f"cpu:{d}" for d in range(size * local)]
    caches = [PlanCache() for _ in range(size)]
    live = []
    for r in range(size):
        w = np.arange(1000, dtype=np.float32)
        dev = devices[r * local : (r + 1) * local]
        live.append(
            RecordList(
                [SaveRecord("mirrored", [w, w.copy()], (1000,), {"devices": dev}, path="m/w")]
            )
        )
    copies = []
    for r in range(size):
        c = live[r][0].components[0].copy()  # (a replica shares its first component's copy)
        rec = SaveRecord("mirrored", [c, c], (1000,), dict(live[r][0].attrs), path="m/w")
        copies.append(RecordList([rec], like=live[r]))
    assert all(c.copied for c in copies)
    for k in (1, 2, 3):

        def save(comm: ThreadComm, k: int = k) -> str:
            r = comm.Get_rank()
            return write_collective(
                comm,
                str(tmp_path / f"ckpt-{k}.h5"),
                copies[r],
                devices[r * local : (r + 1) * local],
                devices,
                cache=caches[r],
                plan_replicas=plan_replicas,
            )

        assert len(set(run_ranks(size, save))) == 1
        with H5Reader(str(tmp_path / f"ckpt-{k}.h5")) as reader:
            assert reader.verify_all() == []
            assert reader["m/w"].component(3)[7] == 7.0
    buffers = [weakref.ref(c[0].components[0]) for c in copies]
    copies.clear()  # (the caller drops its copies)
    del rec, c
    gc.collect()
    assert [b() for b in buffers] == [None] * size


def test_rank_records_get_a_replica_plan_and_still_see_divergence(
    tmp_path: Path, fixed_clock: None
) -> None:
    """Repeated collective saves of the same records: from the second on, each rank's records
    carry the plan its replicas (its local devices' components) are compared by, as a single
    process's do; a replica that diverges later is still stored apart."""
    from parallelvars.checkpoint.snapshot import plan_replicas

    size, local = 2, 2
    devices = [f"cpu:{d}" for d in range(size * local)]

    def mine(r: int) -> RecordList:
        dev = devices[r * local : (r + 1) * local]
        w = np.arange(3000, dtype=np.float32)
        return RecordList(
            [
                SaveRecord("mirrored", [w, w.copy()], (3000,), {"devices": dev}, path="m/w"),
                SaveRecord("single", [np.array(1, np.int64)], (), {"devices": ["cpu:0"]}, path="n"),
            ]
        )

    kept = [mine(r) for r in range(size)]
    caches = [PlanCache() for _ in range(size)]
    for k in (1, 2, 3):
        if k == 3:
            for r in range(size):
                kept[r][0].components[1][7] = -1.0  # the second local replica diverges

        def save(comm: ThreadComm, k: int = k) -> str:
            r = comm.Get_rank()
            return write_collective(
                comm,
                str(tmp_path / f"ckpt-{k}.h5"),
                kept[r],
                devices[r * local : (r + 1) * local],
                devices,
                cache=caches[r],
                plan_replicas=plan_replicas,
            )

        assert len(set(run_ranks(size, save))) == 1
        planned = [collective._RANK_RECORDS[c][1].replicas for c in caches]
        assert all((p is not False and p is not None) == (k > 1) for p in planned), k
        with H5Reader(str(tmp_path / f"ckpt-{k}.h5")) as reader:
            assert reader.verify_all() == []
            got = [reader["m/w"].component(i)[7] for i in range(size * local)]
            assert got == ([7.0, -1.0] * size if k == 3 else [7.0] * (size * local)), k
