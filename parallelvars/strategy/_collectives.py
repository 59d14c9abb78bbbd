"""The MPI collectives of :class:`~parallelvars.MultiWorkerMirroredStrategy`.

Collectives use the buffer interface of mpi4py on numpy arrays, in place, without pickling;
arrays travel as raw bytes (``MPI.BYTE``), so every dtype works, bfloat16 and float8 included.
Sums are added in rank order (a reduce-scatter / all-gather in which MPI only moves bytes), so
they are bit-identical on every process and from run to run; see :mod:`._mpi` for the design.
"""

from __future__ import annotations

from typing import Any

import numpy as np

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
