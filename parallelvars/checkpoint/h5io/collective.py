"""The multi-process layout writer: one logical checkpoint written by every process together.

Every rank writes the components it holds to its own file ``<path>.parts/rank-<r>-of-<n>.h5``
with :func:`~parallelvars.checkpoint.h5raw.native.save_native` (the generated layout, as a
one-process save), in parallel; rank 0 then writes the index file at ``path`` with
:func:`~parallelvars.checkpoint.h5raw.index_file.write_native_index`: the groups and attributes of
our layout with component datasets as external links into the rank files, the per-component
checksums, the object graph and the document list. Both writers keep the generated metadata
of the structure in a cache, so a repeated save writes the bytes and the few values that
change.

Nothing of the last good checkpoint is replaced before every rank has written its file: the
ranks write into ``<path>.parts/.staged/`` and rank 0 writes the index there too; once all
succeeded, rank 0 moves the rank files into ``<path>.parts/`` and then the index onto ``path``
(renames, each directory fsynced). A save that fails in any rank, also one that rewrites the
checkpoint at the same path, leaves the committed checkpoint as it was; only a crash during
the renames of the commit (milliseconds) can leave an index whose checksums catch newer rank
files.
A plain ``h5py.File(path)`` sees every component through the links, and
:class:`~parallelvars.checkpoint.h5io.read.H5Reader` reads and verifies them, with any number
of processes or none.

``Checkpoint`` writes through this writer under a multi-process strategy (see
:mod:`parallelvars.strategy._cluster`), over its communicator; the communicator is duck-typed (``Get_rank``, ``Get_size``, ``gather``, ``bcast``: mpi4py's
``Comm``), so nothing here imports MPI or the strategy.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from parallelvars._fileio import _fsync_path
from parallelvars.checkpoint._h5policy import PARTS_SUFFIX
from parallelvars.checkpoint.h5io.records import PlanCache, RecordList
from parallelvars.checkpoint.h5io.write import ComponentLink, LinkedVariable
from parallelvars.checkpoint.h5raw.index_file import write_native_index
from parallelvars.checkpoint.h5raw.native import save_native
from parallelvars.checkpoint.registry import SaveRecord, component_name
from parallelvars.errors import CheckpointError

__all__ = ["index_cache", "parts_dir_for", "write_collective"]

_RANK_FILE = re.compile(r"rank-\d{5}-of-\d{5}\.h5")
# Where a save's files wait, inside the parts folder, until every rank has written its own.
_STAGED = ".staged"


def parts_dir_for(path: str) -> str:
    """The folder of the per-rank files of the checkpoint at ``path``."""
    return f"{path}{PARTS_SUFFIX}"


def _is_distributed(record: Any, local_devices: Sequence[str]) -> bool:
    """A record of this process's replica (every rank has its own) rather than one value."""
    return (
        record.kind in ("mirrored", "on_read", "independent")
        and record.num_components == len(local_devices)
        and list(record.attrs.get("devices", ())) == list(local_devices)
    )


def _is_rank_shard(record: Any, local_devices: Sequence[str], size: int) -> bool:
    """A record of this process's shard of a variable sharded across the processes: the whole
    variable's shape and offsets, one component (this rank's shard)."""
    return (
        record.kind == "sharded"
        and record.num_components == 1
        and size > 1
        and len(record.attrs.get("shard_offsets", ())) == size
        and list(record.attrs.get("devices", ())) == list(local_devices)
    )


def _shard_record(record: Any) -> SaveRecord:
    """What a rank file holds of a rank-sharded record: the shard, as a one-device variable at
    the variable's path (the index file links its component ``r`` there)."""
    attrs = {k: v for k, v in record.attrs.items() if k not in ("shard_axis", "shard_offsets")}
    shard = record.components[0]
    out = SaveRecord(kind="single", components=(shard,), shape=tuple(shard.shape), attrs=attrs)
    out.path = record.path
    return out


def _mirrored_owners(
    records: Sequence[Any], local_devices: Sequence[str], size: int
) -> dict[str, int]:
    """The rank that writes each mirrored record's (identical) component, for the whole job.

    Largest first, each to the rank with the fewest bytes so far (ties: the lowest rank), so
    the ranks share the writing; the same answer on every rank (the records are the same).
    """
    mirrored = [r for r in records if r.kind == "mirrored" and _is_distributed(r, local_devices)]
    if size <= 1:
        return {}
    load = [0] * size
    owners: dict[str, int] = {}
    for rec in sorted(mirrored, key=lambda r: (-int(r.nbytes), r.path)):
        owner = min(range(size), key=lambda k: (load[k], k))
        owners[rec.path] = owner
        load[owner] += int(rec.nbytes)
    return owners


def write_collective(
    comm: Any,
    path: str,
    records: Sequence[Any],
    local_devices: Sequence[str],
    global_devices: Sequence[str],
    *,
    object_graph: Any = None,
    metadata: Any = None,
    cache: PlanCache | None = None,
    plan_replicas: Callable[..., None] | None = None,
) -> str:
    """Write one logical checkpoint from every rank of ``comm``; returns ``path`` on every rank.

    Rank ``r`` writes the components it holds to ``<path>.parts/rank-<r>-of-<size>.h5`` (values
    that are not per-replica, such as the checkpoint's counter, only on rank 0). Rank 0 then
    writes the index file at ``path``: the groups and attributes of our layout with component
    datasets as external links into the rank files, the per-component checksums and the object
    graph. Ranks wait for each other before the index is written (a gather of the checksums).
    Every file is written in ``<path>.parts/.staged/`` first and moved into place only once all
    are written, the index last, so ``path`` exists only for a complete checkpoint and a failed
    save leaves the last good one, at this path too.

    With ``cache`` (the checkpoint's), repeated saves of one structure reuse its generated
    metadata: each rank's file through ``save_native``'s plan, and rank 0's index file through
    ``write_native_index``'s, kept in a second cache that lives as long as ``cache``; with
    ``plan_replicas`` too (the checkpoint's ``snapshot.plan_replicas``), each save of the same
    records hands this rank's records, the same ``RecordList`` as at the last save, to it
    first, as ``plan_replicas(mine, chosen_from=records)`` (from their second save on, the
    plan their replicas are compared by; none for a non-blocking save's copies).

    Raises:
        CheckpointError: on every rank, when any rank failed to write its part.
    """
    path = os.path.abspath(os.fspath(path))
    rank, size = int(comm.Get_rank()), int(comm.Get_size())
    parts = parts_dir_for(path)
    staged = os.path.join(parts, _STAGED)
    rel_parts = os.path.basename(parts)
    part_name = f"rank-{rank:05d}-of-{size:05d}.h5"
    owners = _mirrored_owners(records, local_devices, size)
    mine: list[Any] = []
    for r in records:
        if _is_rank_shard(r, local_devices, size):
            mine.append(_shard_record(r))  # every rank its own shard
        elif r.path in owners:
            if owners[r.path] == rank:  # written once in the job; the others link to it
                mine.append(r)
        elif rank == 0 or _is_distributed(r, local_devices):
            mine.append(r)
    if isinstance(records, RecordList):
        # What this rank writes follows from the records (and this process's rank, size and
        # devices, fixed for them): the rank file's structure is the records' (their token),
        # so a repeated save finds its plan without a key made of every record.
        mine = _rank_records(records, mine, cache)
        if plan_replicas is not None:  # (none for a snapshot's copies: it decides by records)
            plan_replicas(mine, chosen_from=records)
    error: str | None = None
    crcs: dict[str, list[int]] = {}
    try:
        os.makedirs(staged, exist_ok=True)
        save_native(
            os.path.join(staged, part_name),
            mine,
            metadata=metadata,
            cache=cache,
            checksums=crcs,  # as the rank file's index records them
        )
    except Exception as exc:  # reported to every rank below, so no rank waits forever
        error = f"rank {rank}: {type(exc).__name__}: {exc}"
    gathered = comm.gather((error, crcs), root=0)

    outcome: str | None = None
    if rank == 0:
        errors = [e for e, _ in gathered if e is not None]
        if errors:
            outcome = "; ".join(errors)
        else:
            try:
                index = os.path.join(staged, "index.h5")
                _write_index(
                    index,
                    records,
                    local_devices,
                    global_devices,
                    [c for _, c in gathered],
                    rel_parts,
                    size,
                    object_graph,
                    metadata,
                    None if cache is None else index_cache(cache),
                )
                _commit(path, parts, staged, index, size)
            except Exception as exc:
                outcome = f"rank 0 (index): {type(exc).__name__}: {exc}"
            else:
                _remove_stale_parts(parts, size)
        # Every rank has reported (the gather): nothing writes into the staging folder any
        # more, whether the save was committed or failed.
        shutil.rmtree(staged, ignore_errors=True)
        if outcome is not None:
            with contextlib.suppress(OSError):  # (not empty: a committed checkpoint's parts)
                os.rmdir(parts)  # a first save to this path that failed leaves no folder
    outcome = comm.bcast(outcome, root=0)
    if outcome is not None:
        raise CheckpointError("collective save failed", file=path, found=outcome)
    return path


# Each checkpoint's (cache's) last records and this rank's records made of them.
_RANK_RECORDS: weakref.WeakKeyDictionary[PlanCache, tuple[RecordList, RecordList]] = (
    weakref.WeakKeyDictionary()
)


def _rank_records(records: RecordList, mine: list[Any], cache: PlanCache | None) -> RecordList:
    """This rank's records ``mine`` of ``records`` as a ``RecordList`` like them: the one of
    the last save when it holds the same records (a repeated save of the same live records),
    so that from its second save on it may carry the plan its replicas are compared by, as a
    single process's records do (a mirrored model's replicas on this rank's devices compared
    by runs of their arena rows, while the bytes are written). A snapshot's copies
    (``records.copied``: new at each save) are never kept: held here, they would stay alive
    until the next save."""
    if records.copied:
        return RecordList(mine, like=records)
    held = None if cache is None else _RANK_RECORDS.get(cache)
    if (
        held is not None
        and held[0] is records
        and len(held[1]) == len(mine)
        and all(a is b for a, b in zip(held[1], mine, strict=True))
    ):
        out = held[1]
    else:
        out = RecordList(mine, like=records)
        if cache is not None:
            _RANK_RECORDS[cache] = (records, out)
    return out


# The index files' plan cache of each checkpoint's cache (rank 0 writes both files).
_INDEX_PLANS: weakref.WeakKeyDictionary[PlanCache, PlanCache] = weakref.WeakKeyDictionary()


def index_cache(cache: PlanCache) -> PlanCache:
    """The cache of the index files of the checkpoint whose rank files use ``cache``."""
    out = _INDEX_PLANS.get(cache)
    if out is None:
        out = _INDEX_PLANS[cache] = PlanCache()
    return out


def _commit(path: str, parts: str, staged: str, index: str, size: int) -> None:
    """Rank 0, once every rank has written its file: move the staged rank files into the parts
    folder, then the staged index onto ``path``, fsyncing each folder."""
    for r in range(size):
        name = f"rank-{r:05d}-of-{size:05d}.h5"
        os.replace(os.path.join(staged, name), os.path.join(parts, name))
    _fsync_path(parts, directory=True)
    os.replace(index, path)
    _fsync_path(os.path.dirname(path), directory=True)


def _remove_stale_parts(parts: str, size: int) -> None:
    """Delete rank files of an earlier save with another number of processes.

    Called once the new index is committed: until then they belong to the last good checkpoint.
    """
    current = f"-of-{size:05d}.h5"
    with contextlib.suppress(OSError):
        for name in os.listdir(parts):
            if _RANK_FILE.fullmatch(name) and not name.endswith(current):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(os.path.join(parts, name))


def _write_index(
    path: str,
    records: Sequence[Any],
    local_devices: Sequence[str],
    global_devices: Sequence[str],
    rank_crcs: Sequence[dict[str, list[int]]],
    rel_parts: str,
    size: int,
    object_graph: Any,
    metadata: Any,
    cache: PlanCache | None = None,
) -> None:
    """Rank 0: the index file, through the generator (``write_native_index``).

    A per-replica record gets one component per rank (rank ``r``'s components follow rank
    ``r - 1``'s) and the global device list; any other record is rank 0's.
    """

    part = [f"{rel_parts}/rank-{r:05d}-of-{size:05d}.h5" for r in range(size)]
    names = [component_name(j) for j in range(max((r.num_components for r in records), default=0))]
    everyone = list(range(size))
    owners = _mirrored_owners(records, local_devices, size)
    variables = []
    for rec in records:
        local_n = rec.num_components
        sources = everyone[:1]  # the rank whose file holds each component of `ranks`
        if _is_rank_shard(rec, local_devices, size):
            ranks = sources = everyone
            attrs = dict(rec.attrs, devices=list(global_devices))
        elif _is_distributed(rec, local_devices):
            ranks = everyone
            sources = [owners[rec.path]] * size if rec.path in owners else everyone
            attrs = dict(rec.attrs, devices=list(global_devices))
        else:
            ranks = everyone[:1]
            attrs = dict(rec.attrs)
        links = []
        for _, src in zip(ranks, sources, strict=True):
            crcs = rank_crcs[src][rec.path]
            links += [
                ComponentLink(part[src], f"/{rec.path}/{names[j]}", crcs[j]) for j in range(local_n)
            ]
        variables.append(
            LinkedVariable(rec.path, rec.kind, rec.dtype, tuple(rec.shape), attrs, links)
        )
    write_native_index(
        path,
        variables,
        object_graph=object_graph,
        metadata=dict(metadata or {}, processes=size),
        cache=cache,
    )
