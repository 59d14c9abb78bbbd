"""The MPI collectives of :class:`~parallelvars.MultiWorkerMirroredStrategy`.

Collectives use the buffer interface of mpi4py on numpy arrays, in place, without pickling;
arrays travel as raw bytes (``MPI.BYTE``), so every dtype works, bfloat16 and float8 included.
Sums are added in rank order (a reduce-scatter / all-gather in which MPI only moves bytes), so
they are bit-identical on every process and from run to run; see :mod:`._mpi` for the design.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from parallelvars._geometry import shard_slices
from parallelvars.errors import DistributedValueError


def _bytes_of(arr: np.ndarray) -> np.ndarray:
    """A flat uint8 view of a C-contiguous array."""
    return arr.reshape(-1).view(np.uint8)


class MPICollectives:
    """Broadcast, all-gather and the rank-ordered all-reduce over one communicator.

    A mixin of the strategy: it uses the strategy's ``_MPI`` module, ``_comm`` communicator,
    ``_rank`` and ``_size``.
    """

    _MPI: Any
    _comm: Any
    _rank: int
    _size: int

    def _bcast_inplace(self, arr: np.ndarray, root: int = 0) -> None:
        """Overwrite ``arr`` with rank ``root``'s bytes (``arr`` has the same shape everywhere)."""
        if self._size == 1 or arr.size == 0:
            return
        if arr.dtype.kind == "O":
            arr[...] = self._comm.bcast(arr if self._rank == root else None, root=root)
            return
        if arr.flags.c_contiguous:
            self._comm.Bcast([_bytes_of(arr), self._MPI.BYTE], root=root)
        else:
            tmp = np.ascontiguousarray(arr)
            self._comm.Bcast([_bytes_of(tmp), self._MPI.BYTE], root=root)
            arr[...] = tmp

    def _bcast_array(self, arr: np.ndarray, root: int = 0) -> np.ndarray:
        """Rank ``root``'s array on every rank, checking that shapes and dtypes agree."""
        arr = np.array(arr, copy=True, order="C")
        if self._size == 1:
            return arr
        spec = self._comm.bcast((arr.shape, arr.dtype.str), root=root)
        if (arr.shape, arr.dtype.str) != spec:
            raise DistributedValueError(
                f"broadcast on rank {self._rank}: every rank must pass a value of one shape and "
                f"dtype (expected {spec} as on rank {root}, found {(arr.shape, arr.dtype.str)})"
            )
        self._bcast_inplace(arr, root)
        return arr

    def _allgather_rows(self, row: np.ndarray) -> np.ndarray:
        """``(size, *row.shape)``: every rank's ``row``, in rank order (one in-place Allgather)."""
        out = np.empty((self._size, *row.shape), row.dtype)
        out[self._rank] = row
        if self._size > 1 and out.size:
            if out.dtype.kind == "O":
                raise DistributedValueError(
                    f"cannot reduce byte strings across processes (found dtype {out.dtype})"
                )
            self._comm.Allgather(self._MPI.IN_PLACE, [_bytes_of(out), self._MPI.BYTE])
        return out

    def _allreduce_ordered(self, local: np.ndarray) -> np.ndarray:
        """The sum over ranks of ``local``, added in rank order, identical on every rank.

        A deterministic reduce-scatter + all-gather: the flat buffer is cut into one chunk per
        rank; ``Alltoall`` hands rank ``j`` every rank's chunk ``j``, which it adds in rank
        order; ``Allgather`` then gives everyone every summed chunk. Each element is added in
        the same order as ``_sum_rows`` would, moving ~2 buffers per rank instead of ``size``.
        """
        size = self._size
        flat = local.reshape(-1)
        if size == 1 or flat.size < 4 * size or flat.dtype.kind == "O":
            return self._sum_rows(self._allgather_rows(local))
        chunk = -(-flat.size // size)
        send = np.zeros((size, chunk), flat.dtype)
        send.reshape(-1)[: flat.size] = flat
        recv = np.empty_like(send)
        byte = self._MPI.BYTE
        self._comm.Alltoall([_bytes_of(send), byte], [_bytes_of(recv), byte])
        gathered = send  # reused: its contents were sent
        gathered[self._rank] = self._sum_rows(recv)
        self._comm.Allgather(self._MPI.IN_PLACE, [_bytes_of(gathered), byte])
        return gathered.reshape(-1)[: flat.size].reshape(local.shape)

    def _sum_rows(self, rows: np.ndarray) -> np.ndarray:
        """Add the rows in rank order (the order ``add_n`` uses), into a fresh array."""
        total = np.empty(rows.shape[1:], rows.dtype)
        total[...] = rows[0]
        for r in range(1, rows.shape[0]):
            np.add(total, rows[r], out=total, casting="unsafe")
        return total

    # ------------------------------------------------------------------ sharded variables
    def _displacements(self, counts: Sequence[int]) -> list[int]:
        out, at = [], 0
        for c in counts:
            out.append(at)
            at += c
        return out

    def _scatter_shards(self, full: np.ndarray, axis: int, offsets: Sequence[int]) -> np.ndarray:
        """This rank's shard (``offsets`` along ``axis``) of rank 0's ``full`` (one Scatterv).

        Every rank passes its own ``full`` of one shape and dtype (checked); only rank 0's
        bytes travel, shard ``j`` to rank ``j``.
        """
        slices = shard_slices(full.shape, axis, offsets)
        if self._size == 1:
            return np.array(full[slices[0]], copy=True, order="C")
        spec = self._comm.bcast((full.shape, full.dtype.str), root=0)
        if (full.shape, full.dtype.str) != spec:
            raise DistributedValueError(
                f"sharded initial value on rank {self._rank}: every rank must pass a value of "
                f"one shape and dtype (expected {spec} as on rank 0, found "
                f"{(full.shape, full.dtype.str)})"
            )
        local = np.empty(full[slices[self._rank]].shape, full.dtype)
        if full.dtype.kind == "O":
            local[...] = self._comm.scatter(
                [full[sl] for sl in slices] if self._rank == 0 else None, root=0
            )
            return local
        counts = [full[sl].nbytes for sl in slices]
        send = None
        if self._rank == 0:
            send = np.empty(full.nbytes, np.uint8)
            at = 0
            for sl, n in zip(slices, counts, strict=True):
                piece = full[sl]
                np.copyto(send[at : at + n].view(full.dtype).reshape(piece.shape), piece)
                at += n
        byte = self._MPI.BYTE
        self._comm.Scatterv(
            [send, (counts, self._displacements(counts)), byte] if send is not None else None,
            [_bytes_of(local), byte],
            root=0,
        )
        return local

    def _reduce_scatter_shards(
        self, items: Sequence[tuple[np.ndarray, int, Sequence[int]]]
    ) -> list[np.ndarray]:
        """Rank ``r``'s shard of the sum over ranks of each full-shape array, in one collective.

        ``items``: ``(array, shard axis, shard offsets)``, every array of one dtype, the same
        list (shapes, order) on every rank. Shard ``j`` of every array is packed for rank ``j``;
        one ``Alltoallv`` hands each rank every rank's copy of its shards, which it adds in rank
        order (the order a one-process sum of the replicas uses), so the result is
        bit-identical to slicing the rank-ordered all-reduce, with half of its traffic: each
        rank sends ``(size - 1) / size`` of its buffer once.
        """
        size, rank = self._size, self._rank
        slices = [shard_slices(a.shape, axis, offs) for a, axis, offs in items]
        if size == 1:
            return [
                np.array(a[sl[0]], copy=True) for (a, _, _), sl in zip(items, slices, strict=True)
            ]
        dtype = items[0][0].dtype
        if dtype.kind == "O":
            raise DistributedValueError(
                f"cannot reduce byte strings across processes (found dtype {dtype})"
            )
        shapes = [[a[s].shape for s in sl] for (a, _, _), sl in zip(items, slices, strict=True)]
        sizes = [[int(np.prod(sh)) for sh in row] for row in shapes]
        counts = [sum(row[j] for row in sizes) for j in range(size)]
        send = np.empty(sum(counts), dtype)
        at = 0
        for j in range(size):
            for (a, _, _), sl, sz, sh in zip(items, slices, sizes, shapes, strict=True):
                np.copyto(send[at : at + sz[j]].reshape(sh[j]), a[sl[j]])
                at += sz[j]
        mine = counts[rank]
        recv = np.empty((size, mine), dtype)
        item = dtype.itemsize
        byte = self._MPI.BYTE
        send_counts = [c * item for c in counts]
        recv_counts = [mine * item] * size
        self._comm.Alltoallv(
            [_bytes_of(send), (send_counts, self._displacements(send_counts)), byte],
            [_bytes_of(recv), (recv_counts, self._displacements(recv_counts)), byte],
        )
        total = self._sum_rows(recv)
        out, at = [], 0
        for sz, sh in zip(sizes, shapes, strict=True):
            out.append(total[at : at + sz[rank]].reshape(sh[rank]))
            at += sz[rank]
        return out

    def _allgather_along(self, local: np.ndarray, axis: int) -> np.ndarray:
        """Every rank's ``local`` concatenated along ``axis`` in rank order (one Allgatherv
        after a gather of the shapes): the other axes and the dtype must agree."""
        arr = np.ascontiguousarray(np.moveaxis(np.asarray(local), axis, 0))
        if self._size == 1:
            return np.moveaxis(arr.copy(), 0, axis)
        specs = self._comm.allgather((arr.shape, arr.dtype.str))
        if any((s[0][1:], s[1]) != (arr.shape[1:], arr.dtype.str) for s in specs):
            raise DistributedValueError(
                f"gather on rank {self._rank}: every rank's value must agree except along axis "
                f"{axis} (found shapes and dtypes {specs})"
            )
        rows = [s[0][0] for s in specs]
        out = np.empty((sum(rows), *arr.shape[1:]), arr.dtype)
        if arr.dtype.kind == "O":
            parts = self._comm.allgather(arr)
            np.concatenate(parts, axis=0, out=out)
        else:
            row_bytes = int(np.prod(arr.shape[1:], dtype=np.int64)) * arr.dtype.itemsize
            counts = [r * row_bytes for r in rows]
            byte = self._MPI.BYTE
            self._comm.Allgatherv(
                [_bytes_of(arr), byte],
                [_bytes_of(out), (counts, self._displacements(counts)), byte],
            )
        return np.moveaxis(out, 0, axis)

    def _allgather_sparse(
        self, items: Sequence[tuple[np.ndarray, np.ndarray]]
    ) -> list[tuple[np.ndarray, np.ndarray]]:
        """Every rank's ``(indices, values)`` of each sparse gradient, concatenated in rank
        order: one all-gather of the row counts, then one ``Allgatherv`` per dtype of values
        (each rank's indices, as int64, ahead of its values). ``items`` is the same list
        (row shapes, dtypes, order) on every rank."""
        if self._size == 1:
            return [(np.asarray(i, np.int64), np.asarray(v)) for i, v in items]
        size = self._size
        nnz = self._allgather_rows(np.array([len(i) for i, _ in items], np.int64))  # (size, k)
        out: list[Any] = [None] * len(items)
        groups: dict[np.dtype, list[int]] = {}
        for k, (_, v) in enumerate(items):
            groups.setdefault(np.asarray(v).dtype, []).append(k)
        byte = self._MPI.BYTE
        for dtype in sorted(groups, key=lambda dt: dt.str):
            ks = groups[dtype]
            if dtype.kind == "O":
                raise DistributedValueError(
                    f"cannot gather byte-string gradients across processes (found dtype {dtype})"
                )
            rows = [int(np.prod(np.asarray(items[k][1]).shape[1:], dtype=np.int64)) for k in ks]

            # rank r's part: its indices (int64) then its values, item by item
            per_row = [8 + row * dtype.itemsize for row in rows]
            counts = [
                sum(int(nnz[r, k]) * b for k, b in zip(ks, per_row, strict=True))
                for r in range(size)
            ]
            send = np.empty(counts[self._rank], np.uint8)
            at = 0
            for k in ks:
                idx = np.ascontiguousarray(items[k][0], np.int64)
                send[at : at + idx.nbytes] = _bytes_of(idx)
                at += idx.nbytes
            for k in ks:
                val = np.ascontiguousarray(items[k][1])
                send[at : at + val.nbytes] = _bytes_of(val)
                at += val.nbytes
            recv = np.empty(sum(counts), np.uint8)
            self._comm.Allgatherv([send, byte], [recv, (counts, self._displacements(counts)), byte])
            per_rank: list[list[tuple[np.ndarray, np.ndarray]]] = []
            at = 0
            for r in range(size):
                idxs = []
                for k in ks:
                    n = int(nnz[r, k])
                    idxs.append(recv[at : at + 8 * n].view(np.int64))
                    at += 8 * n
                mine = []
                for k, row, idx in zip(ks, rows, idxs, strict=True):
                    n = int(nnz[r, k])
                    shape = (n, *np.asarray(items[k][1]).shape[1:])
                    nb = n * row * dtype.itemsize
                    mine.append((idx, recv[at : at + nb].view(dtype).reshape(shape)))
                    at += nb
                per_rank.append(mine)
            for pos, k in enumerate(ks):
                out[k] = (
                    np.concatenate([per_rank[r][pos][0] for r in range(size)]),
                    np.concatenate([per_rank[r][pos][1] for r in range(size)]),
                )
        return out
