"""Run by tests/test_mpi.py under ``mpiexec -n N``: one scenario per invocation.

Usage: ``python _mpi_worker.py SCENARIO OUT_DIR [CHECKPOINT]``; each rank writes
``OUT_DIR/<scenario>-rank<r>.npz`` with what the test checks.
"""

from __future__ import annotations

import os
import sys

import _mpi_model as m
import numpy as np

import parallelvars as pv


def collectives(strategy: pv.MultiWorkerMirroredStrategy, out: dict[str, np.ndarray]) -> None:
    """reduce / batch_reduce / broadcast / merge_call on values that differ per rank."""
    rank, n = strategy.cluster_rank, strategy.num_replicas_in_sync

    def fn() -> np.ndarray:
        ctx = pv.get_replica_context()
        assert ctx.replica_id_in_sync_group == rank
        mine = np.arange(5, dtype=np.float32) * (rank + 1) + 0.1 * rank
        total = ctx.merge_call(lambda s, v: s.reduce(pv.ReduceOp.SUM, v), args=(mine,))
        out["merge_sum"] = np.asarray(total)
        return np.full((rank + 1, 2), rank + 1.0)  # uneven batches

    per = strategy.run(fn)
    out["axis_mean"] = strategy.reduce(pv.ReduceOp.MEAN, per, axis=0)
    out["broadcast"] = np.asarray(
        strategy.experimental_local_results(strategy.broadcast(np.full(3, 7.0 + rank)))[0]
    )
    pairs = [
        (pv.PerReplica([np.full((2, 2), r + 1, np.int32) for r in range(n)]), None),
        (pv.PerReplica([np.full(3, 0.5 * r) for r in range(n)]), None),
        (pv.PerReplica([np.float32(r) for r in range(n)]), None),
    ]
    for i, v in enumerate(strategy.batch_reduce(pv.ReduceOp.SUM, pairs)):
        out[f"batch_{i}"] = np.asarray(v)

    # Every way of writing a mirrored variable in a replica function merges across ranks by
    # its aggregation, as assign() does (not only this rank's copy).
    with strategy.scope():
        scaled = pv.Variable(np.ones(3), name="scaled", aggregation="sum")
        items = pv.Variable(np.zeros(3), name="items", aggregation="mean")

    def writes() -> None:
        scaled.__imul__(rank + 2.0)  # `scaled *= ...`
        items[0] = float(rank)

    strategy.run(writes)
    out["inplace_scaled"] = np.asarray(scaled)
    out["inplace_items"] = np.asarray(items)


def repeat(strategy: pv.MultiWorkerMirroredStrategy, out_dir: str, out: dict) -> None:
    """Repeated saves (with the cached plans) beside saves of the same content without any
    cache, a structure change, and a save that fails in rank 1; every save at one fixed
    ``created`` time."""
    import time

    from parallelvars.checkpoint.h5io import collective

    time.time = lambda: 1_700_000_000.5  # the files of two ways of writing can be compared
    rank, n = strategy.cluster_rank, strategy.num_replicas_in_sync
    model, opt, _ = m.train(strategy, steps=1, seed=rank)
    ckpt = pv.Checkpoint(model=model, optimizer=opt)

    def both(k: int) -> str:
        path = ckpt.write(os.path.join(out_dir, "skel", f"ckpt-{k}.h5"))
        cache, ckpt._pv_plans = ckpt._pv_plans, None
        ckpt.write(os.path.join(out_dir, "plain", f"ckpt-{k}.h5"))  # generated anew
        ckpt._pv_plans = cache
        return path

    def step(k: int) -> None:
        strategy.run(m.replica_step, args=(model, opt, m.batches(k, n)))

    def plans() -> list[int]:
        return [id(ckpt._pv_plans.held)]

    for k in (1, 2, 3):
        step(k)
        both(k)
        out[f"plans_{k}"] = np.asarray(plans())
    with strategy.scope():  # a new variable: a new structure
        model.extra = pv.Variable(np.full(3, 2.0 + rank, np.float32), name="extra")
    both(4)
    out["plan_kept"] = np.asarray(type(ckpt._pv_plans.held).__name__)
    if rank == 0:  # the index file's plan, beside the rank file's
        index = collective.index_cache(ckpt._pv_plans).held
        out["index_plan"] = np.asarray(type(index).__name__)
    real = collective.save_native

    def failing(path: str, *args: object, **kwargs: object) -> str:
        if rank == 1:
            raise OSError(28, "No space left on device")
        return real(path, *args, **kwargs)  # type: ignore[arg-type]

    collective.save_native = failing  # type: ignore[assignment]
    step(5)
    try:
        ckpt.write(os.path.join(out_dir, "skel", "ckpt-5.h5"))
    except pv.ParallelVarsError as exc:
        out["failed"] = np.asarray(str(exc))
    collective.save_native = real
    step(6)
    out["path"] = np.asarray(both(6))
    for name in ("w", "b", "c", "extra"):
        out[name] = np.array(getattr(model, name).components[0])


LANDED = ("w", "b", "c", "big")


def landing_model(seed: int) -> pv.Module:
    """The small variables of ``m.Model`` and a mirrored one of 256 KiB components."""
    model = m.Model(seed=seed)
    model.big = pv.Variable(np.arange(1 << 16, dtype=np.float32) + seed, name="big")
    return model


def landing_restore(
    strategy: pv.MultiWorkerMirroredStrategy, path: str, how: str, other: str, out: dict
) -> None:
    """Restore ``path`` while rank 0 changes the rank files (see main); every rank records
    its values, the error it raised, and whether its variables are as they were."""
    import shutil

    from parallelvars.checkpoint import matching
    from parallelvars.checkpoint.h5io import H5Reader

    rank = strategy.cluster_rank
    with strategy.scope():
        model = landing_model(500 + rank)
    before = {name: np.array(getattr(model, name).components[0]) for name in LANDED}
    parts = sorted(os.listdir(path + ".parts"))
    change, when = how.split("-")

    def changed() -> None:
        if rank != 0:
            return
        for name in parts:
            mine = os.path.join(path + ".parts", name)
            if change == "rewritten":  # in place, as another process writing it would
                with (
                    open(os.path.join(other + ".parts", name), "rb") as src,
                    open(mine, "r+b") as dst,
                ):
                    shutil.copyfileobj(src, dst)
            else:
                os.truncate(mine, os.path.getsize(mine) // 3)

    done: list[int] = []
    if when == "after":
        apply = matching.RestorePlan.apply

        def after_the_checks(self: object) -> None:
            if not done:
                done.append(1)
                changed()
                strategy.barrier()  # every rank copies after the change
            apply(self)  # type: ignore[arg-type]

        matching.RestorePlan.apply = after_the_checks  # type: ignore[method-assign]
    else:
        stage = H5Reader.stage

        def before_the_reads(self: H5Reader, *args: object) -> object:
            if not done:
                done.append(1)
                changed()
            return stage(self, *args)  # type: ignore[arg-type]

        H5Reader.stage = before_the_reads  # type: ignore[method-assign, assignment]
    try:
        pv.Checkpoint(model=model).restore(path).expect_partial()
    except pv.errors.CheckpointError as exc:
        out["error"] = np.asarray(f"{type(exc).__name__}: {exc}")
    out.update({name: np.array(getattr(model, name).components[0]) for name in LANDED})
    out["unchanged"] = np.asarray(all(np.array_equal(before[name], out[name]) for name in LANDED))


def main() -> None:
    scenario, out_dir = sys.argv[1], sys.argv[2]
    strategy = pv.MultiWorkerMirroredStrategy()
    rank = strategy.cluster_rank
    out: dict[str, np.ndarray] = {}
    if scenario == "train":
        # Each rank starts from its own random values: the broadcast from rank 0 must win.
        model, opt, losses = m.train(strategy, steps=3, seed=rank)
        out.update(m.state(model, opt))
        out["losses"] = np.asarray(losses)
        with strategy.scope():
            out["seen"] = strategy.read_var(model.seen)
        collectives(strategy, out)
    elif scenario == "save":
        model, opt, _ = m.train(strategy, steps=2, seed=rank)
        path = pv.Checkpoint(model=model, optimizer=opt).save(os.path.join(out_dir, "ckpt", "run"))
        out.update(m.state(model, opt))
        out["path"] = np.asarray(path)
        out["index_exists"] = np.asarray(os.path.exists(path))
    elif scenario == "restore":
        with strategy.scope():
            model = m.Model(seed=100 + rank)
            opt = pv.optimizers.Adam(0.05)
        ckpt = pv.Checkpoint(model=model, optimizer=opt)
        status = ckpt.restore(sys.argv[3])
        # Slots and the step counter are created by the first step and restored then.
        with strategy.scope():
            out["seen_restored"] = strategy.read_var(model.seen)  # the on-read total, across ranks
        strategy.run(m.replica_step, args=(model, opt, m.batches(0, strategy.num_replicas_in_sync)))
        status.assert_consumed()
        out.update(m.state(model, opt))
        # A write to a mirrored variable in a replica function merges across processes.
        with strategy.scope():
            mean_var = pv.Variable(
                np.float32(5.0), name="mean_var", aggregation=pv.Aggregation.MEAN
            )
        strategy.run(lambda: mean_var.assign_add(np.float32(1.0 + rank)))
        out["mean_var"] = np.array(mean_var.components[0])
    elif scenario == "manager":
        # Every process has a manager on the one directory; rank 0 keeps the books.
        model, opt, _ = m.train(strategy, steps=1, seed=rank)
        directory = os.path.join(out_dir, "managed")
        manager = pv.CheckpointManager(
            pv.Checkpoint(model=model, optimizer=opt), directory, max_to_keep=2
        )
        saved = []
        for step in range(3):
            strategy.run(
                m.replica_step,
                args=(model, opt, m.batches(step + 1, strategy.num_replicas_in_sync)),
            )
            saved.append(manager.save())
        try:
            manager.save(blocking=False)
        except ValueError as exc:
            out["async_refused"] = np.asarray("multi-process" in str(exc))
        # The manager's saves (ckpt-1 .. ckpt-3, one structure) kept their generated plans.
        from parallelvars.checkpoint.h5io import collective

        plans = manager._checkpoint._pv_plans
        out["rank_plan"] = np.asarray(type(plans.held).__name__)
        if rank == 0:
            index = collective.index_cache(plans).held
            out["index_plan"] = np.asarray(type(index).__name__)
        strategy.barrier()
        out["latest"] = np.asarray(manager.latest_checkpoint)
        out["kept"] = np.asarray(manager.checkpoints)
        out["listing"] = np.asarray(sorted(os.listdir(directory)))
        out.update(m.state(model, opt))
        manager.close()
    elif scenario.startswith("sharded_train"):  # sharded_train-<optimizer>
        model, opt = m.train_sharded(strategy, steps=3, seed=rank, optimizer=scenario[14:])
        with strategy.scope():
            out.update(m.sharded_state(strategy, model, opt))
        out["local_e"] = np.array(model.e)  # reads give the local shard
        out["local_e_shape"] = np.asarray(model.e.shape)
        f_slots = [s for v, _, s in opt._checkpoint_slots() if v is model.f]
        out["local_f_slot"] = np.array(f_slots[0].components[0])
    elif scenario == "sharded_save":
        model, opt = m.train_sharded(strategy, steps=2, seed=rank)
        path = pv.Checkpoint(model=model, optimizer=opt).save(os.path.join(out_dir, "ckpt", "run"))
        with strategy.scope():
            out.update(m.sharded_state(strategy, model, opt))
        out["path"] = np.asarray(path)
    elif scenario == "sharded_restore":
        # Another process count than the save's: rank r gets the re-split shard r and its slots.
        with strategy.scope():
            model = m.ShardedModel(seed=300 + rank)
            opt = pv.optimizers.Adagrad(0.1)
        status = pv.Checkpoint(model=model, optimizer=opt).restore(sys.argv[3])
        with strategy.scope():
            opt.build(model.trainable())
        status.assert_consumed()
        with strategy.scope():
            out.update(m.sharded_state(strategy, model, opt))
        out["local_e"] = np.array(model.e)
        # One more step trains on from the restored state (checked against one process).
        m.train_more(strategy, model, opt, step=2)
        with strategy.scope():
            out.update({f"next/{k}": v for k, v in m.sharded_state(strategy, model, opt).items()})
    elif scenario == "sharded_restore_refused":
        # A restore that one rank cannot serve raises on every rank; no variable changes.
        with strategy.scope():
            model = m.ShardedModel(seed=300 + rank)
        before = {v.name: np.array(v.components[0]) for v in model.trainable()}
        try:
            pv.Checkpoint(model=model).restore(sys.argv[3])
        except pv.errors.CheckpointError as exc:
            out["error"] = np.asarray(f"{type(exc).__name__}: {exc}")
        out["unchanged"] = np.asarray(
            all(np.array_equal(before[v.name], v.components[0]) for v in model.trainable())
        )
    elif scenario == "sharded_dtypes":
        # Every dtype: scattered from rank 0, gathered back, saved by every rank.
        values = m.sweep_values(seed=rank)
        with strategy.scope():
            sweep = pv.Module()
            for name, _, axis in m.SWEEP:
                setattr(sweep, name, pv.Variable(values[name], name=name, shard_axis=axis))
            for name, _, _ in m.SWEEP:
                out[f"full/{name}"] = m.bits(strategy.gather(getattr(sweep, name)))
                out[f"local/{name}"] = m.bits(getattr(sweep, name))
        out["path"] = np.asarray(
            pv.Checkpoint(sweep=sweep).save(os.path.join(out_dir, "sweep", "run"))
        )
    elif scenario == "sharded_collectives":
        # The MPI calls of one step with the tables' full values given: per dtype one
        # reduce-scatter (dense sharded), one all-gather of sparse rows, one all-reduce (mirrored).
        model, opt = m.train_sharded(strategy, steps=1, seed=rank)
        full = m.full_values(strategy, model)
        counts: dict[str, int] = {}
        comm = strategy._comm

        class Counting:
            def __getattr__(self, name: str) -> object:
                counts[name] = counts.get(name, 0) + 1
                return getattr(comm, name)

        strategy._comm = Counting()
        strategy.run(
            m.sharded_step,
            args=(model, opt, full, m.sharded_batches(1, strategy.num_replicas_in_sync)),
        )
        strategy._comm = comm
        out["calls"] = np.asarray(sorted(f"{k}={v}" for k, v in counts.items()))
    elif scenario == "repeat":
        repeat(strategy, out_dir, out)
    elif scenario == "restore_exact":
        with strategy.scope():
            model = m.Model(seed=200 + rank)
            model.extra = pv.Variable(np.zeros(3, np.float32), name="extra")
        pv.Checkpoint(model=model).restore(sys.argv[3]).expect_partial()
        for name in ("w", "b", "c", "extra"):
            out[name] = np.array(getattr(model, name).components[0])
    elif scenario == "landing_save":  # argv[3]: the seed of the values
        seed = int(sys.argv[3])
        with strategy.scope():
            model = landing_model(seed)
        path = pv.Checkpoint(model=model).save(os.path.join(out_dir, "ckpt", "run"))
        out["path"] = np.asarray(path)
        out.update({name: np.array(getattr(model, name).components[0]) for name in LANDED})
    elif scenario == "landing_restore":
        # argv[3]: the checkpoint; argv[4]: what rank 0 does to its rank files ("rewritten"
        # or "truncated") and when ("after": once every check of the restore passed on every
        # rank; "before": before its components are read); argv[5]: a checkpoint of the same
        # layout with other values (what "rewritten" copies in).
        path, how, other = sys.argv[3], sys.argv[4], sys.argv[5]
        landing_restore(strategy, path, how, other, out)
    elif scenario == "raise":
        if rank == 1:
            raise ValueError("boom on purpose in rank 1")
        strategy.reduce(
            pv.ReduceOp.SUM, pv.PerReplica([np.ones(2)] * strategy.num_replicas_in_sync)
        )
        strategy.barrier()  # never reached: rank 1 aborted the job
    else:
        raise SystemExit(f"unknown scenario {scenario!r}")
    np.savez(os.path.join(out_dir, f"{scenario}-rank{rank}.npz"), **out)


if __name__ == "__main__":
    main()
