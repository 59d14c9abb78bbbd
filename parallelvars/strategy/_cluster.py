"""The strategy whose processes act together, for what every process must do at once.

A multi-process strategy (``MultiWorkerMirroredStrategy``) registers itself here when it is
created, for the process's life: a dropped strategy must not turn the next checkpoint save
into every rank writing the same file. What a checkpoint needs of it, and reads from here
(the strategy never imports the checkpoint package):

* ``comm``: the communicator (``Get_rank``, ``Get_size``, ``gather``, ``bcast``: mpi4py's
  ``Comm``), through which the ranks write one logical checkpoint together;
* ``cluster_rank``: this process's rank (rank 0 keeps a checkpoint manager's books);
* ``parameter_devices`` / ``worker_devices``: this process's devices and all of them.
"""

from __future__ import annotations

from typing import Any

__all__ = ["cluster_strategy", "set_cluster_strategy"]

_CLUSTER: list[Any] = []


def set_cluster_strategy(strategy: Any) -> None:
    """Make ``strategy`` this process's multi-process strategy (None: there is none)."""
    _CLUSTER[:] = [] if strategy is None else [strategy]


def cluster_strategy() -> Any:
    """This process's multi-process strategy, or None."""
    return _CLUSTER[0] if _CLUSTER else None
