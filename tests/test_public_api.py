"""The public API of DESIGN.md (a contract that checks outside the repository call) stays importable."""

from __future__ import annotations

import pytest

import parallelvars as pv
from parallelvars import formats

TOP_LEVEL = [
    "ParallelDevice",
    "ParallelVariable",
    "ShardedVariable",
    "Variable",
    "Module",
    "MirroredStrategy",
    "OneDeviceStrategy",
    "MultiWorkerMirroredStrategy",
    "PerReplica",
    "ParallelValue",
    "get_replica_context",
    "get_cross_replica_context",
    "has_strategy",
    "get_strategy",
    "ReduceOp",
    "Synchronization",
    "Aggregation",
    "outside_compilation",
    "optimizers",
    "IndexedSlices",
    "clip_by_global_norm",
    "GradientBuffers",
    "Checkpoint",
    "CheckpointManager",
    "latest_checkpoint",
    "independent_buffers",
    "replicated_scope",
    "variable_creator_scope",
    "errors",
    "ComponentVariable",
    "ReplicatedVariable",
    "compute_average_loss",
    "scale_regularization_loss",
]
STRATEGY_METHODS = [
    "scope",
    "run",
    "reduce",
    "batch_reduce",
    "broadcast",
    "update",
    "update_non_slot",
    "colocate_vars_with",
    "non_slot_devices",
    "experimental_local_results",
    "experimental_distribute_dataset",
    "num_replicas_in_sync",
    "group",
    "read_var",
    "worker_devices",
    "parameter_devices",
]
VARIABLE_MEMBERS = [
    "components",
    "device",
    "name",
    "kind",
    "synchronization",
    "aggregation",
    "trainable",
    "assign",
    "assign_add",
    "assign_sub",
    "read_value",
    "get_shape",
    "get",
]


@pytest.mark.parametrize("name", TOP_LEVEL)
def test_top_level_names(name: str) -> None:
    assert hasattr(pv, name), name
    assert name in pv.__all__


@pytest.mark.parametrize(
    "name",
    ["SGD", "Momentum", "Adam", "AdamW", "Adagrad", "RMSProp", "Optimizer", "GradientBuffers"],
)
def test_optimizers(name: str) -> None:
    assert hasattr(pv.optimizers, name)


def test_strategy_and_variable_members() -> None:
    strategy = pv.MirroredStrategy(2)
    assert [m for m in STRATEGY_METHODS if not hasattr(strategy, m)] == []
    with strategy.scope():
        v = pv.Variable(1.0)
    assert [m for m in VARIABLE_MEMBERS if not hasattr(v, m)] == []
    assert {r.value for r in pv.ReduceOp} == {"sum", "mean"}
    assert {a.name for a in pv.Aggregation} == {"NONE", "SUM", "MEAN", "ONLY_FIRST_REPLICA"}
    assert {s.name for s in pv.Synchronization} == {"AUTO", "ON_WRITE", "ON_READ"}


def test_formats_surface() -> None:
    assert callable(formats.convert) and callable(formats.reshard)
    assert set(formats.FORMAT_NAMES) == {
        "hdf5",
        "safetensors",
        "npz",
        "keras",
        "keras-legacy",
        "tf",
    }


def test_every_public_name_resolves_lazily() -> None:
    """parallelvars loads its public names on first use (``_LAZY``); a name listed in
    ``__all__`` but missing from that table would raise AttributeError only when used."""
    import parallelvars as pv

    missing = [n for n in pv.__all__ if n != "__version__" and n not in pv._LAZY]
    assert missing == []
    for name in pv.__all__:
        assert getattr(pv, name) is not None
