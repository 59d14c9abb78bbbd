"""``parallelvars demo``: train, checkpoint, restart on other devices, convert and inspect.

The main job of the README: a two-layer MLP classifier on a synthetic data set, trained with
``MirroredStrategy`` and Adam on virtual CPU devices; checkpoints kept by a
``CheckpointManager``; a simulated restart that restores onto a different number of devices
and continues; the final checkpoint converted to safetensors and to a TensorFlow checkpoint
and inspected. Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import numpy as np

import parallelvars as pv

from ._errors import UsageError
from ._mlp import MLP, accuracy, loss_and_grads, make_blobs
from ._output import Output, counted
from .inspect import collect, render_tree

FEATURES, HIDDEN, CLASSES = 32, 64, 4

_DESCRIPTION = """\
Train a two-layer MLP classifier on a synthetic data set (no downloads) with MirroredStrategy
and Adam on virtual CPU devices, keeping checkpoints with a CheckpointManager; then simulate a
restart by restoring the latest checkpoint onto a different number of devices (half as many)
and finish the training; convert the final checkpoint to safetensors and to a TensorFlow
checkpoint, inspect it, and print where everything is and how the loss went.

Everything is written under --dir (default ./parallelvars-demo)."""
EXAMPLES, BATCH = 8192, 256


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "demo",
        help="train a small model on virtual devices, checkpoint, restart, convert, inspect",
        description=_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n  parallelvars demo\n  parallelvars demo --devices 8 --steps 400 --dir /tmp/demo",
    )
    p.add_argument(
        "--devices", type=int, default=4, help="virtual CPU devices to train on (default 4)"
    )
    p.add_argument("--steps", type=int, default=300, help="training steps in all (default 300)")
    p.add_argument(
        "--dir",
        default="parallelvars-demo",
        help="where to write everything (default ./parallelvars-demo)",
    )
    p.add_argument("--seed", type=int, default=0, help="data and initialisation seed")
    return p


def _restart_devices(n: int) -> int:
    return n // 2 if n > 1 else 2


def _train(
    strategy: pv.Strategy,
    model: MLP,
    opt: Any,
    step_var: Any,
    manager: Any,
    data: tuple[np.ndarray, np.ndarray],
    stop: int,
    out: Output,
    losses: list[float],
    save_every: int,
) -> None:
    """Train from the step ``step_var`` holds up to ``stop``, checkpointing every ``save_every``."""
    start = int(step_var)
    x, y = data
    n = strategy.num_replicas_in_sync

    def step(xb: np.ndarray, yb: np.ndarray) -> float:
        loss, grads = loss_and_grads(model, xb, yb, BATCH)
        opt.apply_gradients(list(zip(grads, model.params, strict=True)))
        model.seen.assign_add(len(yb))  # on-read: each replica counts its own examples
        return loss

    bar = out.progress(total=stop - start, desc=f"training on {counted(n, 'device')}", unit="step")
    for i in range(start, stop):
        j = (i * BATCH) % EXAMPLES
        xb, yb = x[j : j + BATCH], y[j : j + BATCH]
        per_replica = strategy.run(
            step, args=(pv.PerReplica(np.array_split(xb, n)), pv.PerReplica(np.array_split(yb, n)))
        )
        losses.append(float(strategy.reduce(pv.ReduceOp.SUM, per_replica)))
        step_var.assign_add(1)
        if (i + 1) % save_every == 0 or i + 1 == stop:
            manager.save(checkpoint_number=i + 1)
        bar.advance(1)
    bar.close()


def _build(devices: int, seed: int) -> tuple[pv.Strategy, MLP, Any]:
    strategy = pv.MirroredStrategy(devices)
    with strategy.scope():
        model = MLP(FEATURES, HIDDEN, CLASSES, seed=seed)
        opt = pv.optimizers.Adam(learning_rate=0.005)
    return strategy, model, opt


def run(args: argparse.Namespace) -> int:
    from parallelvars import formats

    out: Output = args.out
    if args.devices < 1 or args.steps < 2:
        raise UsageError(
            f"--devices must be >= 1 and --steps >= 2 (found {args.devices} and {args.steps})"
        )
    root = os.path.abspath(args.dir)
    ckpt_dir = os.path.join(root, "checkpoints")
    os.makedirs(ckpt_dir, exist_ok=True)
    t0 = time.perf_counter()
    data = make_blobs(EXAMPLES, FEATURES, CLASSES, seed=args.seed)
    losses: list[float] = []
    first_leg = args.steps // 2
    save_every = max(1, args.steps // 6)

    # Leg 1: train on N devices, checkpointing as we go.
    strategy, model, opt = _build(args.devices, args.seed)
    step_var = pv.Variable(np.int64(0), name="step")  # outside the strategy: one plain counter
    manager = pv.CheckpointManager(
        pv.Checkpoint(model=model, optimizer=opt, step=step_var), ckpt_dir, max_to_keep=3
    )
    try:
        _train(strategy, model, opt, step_var, manager, data, first_leg, out, losses, save_every)
    finally:
        manager.close()
    acc1 = accuracy(model, *data)
    mid_ckpt = manager.latest_checkpoint

    # Leg 2: a "restart" on another number of devices, from the latest checkpoint.
    m = _restart_devices(args.devices)
    strategy2, model2, opt2 = _build(
        m, args.seed + 1
    )  # fresh values: the restore must replace them
    step2 = pv.Variable(np.int64(0), name="step")
    manager2 = pv.CheckpointManager(
        pv.Checkpoint(model=model2, optimizer=opt2, step=step2), ckpt_dir, max_to_keep=3
    )
    try:
        restored = manager2.restore_or_initialize()
        same = all(
            np.array_equal(c, np.asarray(a))
            for a, b in zip(model.params, model2.params, strict=True)
            for c in b.components
        )
        resumed_at = int(step2)
        _train(strategy2, model2, opt2, step2, manager2, data, args.steps, out, losses, save_every)
    finally:
        manager2.close()
    final = manager2.latest_checkpoint
    assert final is not None
    acc2 = accuracy(model2, *data)

    # Convert and inspect the final checkpoint.
    st_path = formats.convert(final, os.path.join(root, "model.safetensors"))
    tf_prefix = formats.convert(final, os.path.join(root, "tf", "ckpt-1"), to_format="tf")
    with formats.open_checkpoint(final) as view:
        inspected = render_tree(collect(view, out))
    elapsed = time.perf_counter() - t0

    result = {
        "devices": [args.devices, m],
        "steps": args.steps,
        "loss_first": losses[0],
        "loss_at_restart": losses[first_leg - 1],
        "loss_last": losses[-1],
        "accuracy_before_restart": acc1,
        "accuracy_final": acc2,
        "restart_restored": restored,
        "resumed_at_step": resumed_at,
        "restart_values_equal": same,
        "examples_seen": int(model2.seen.read_value()),
        "checkpoints": manager2.checkpoints,
        "safetensors": st_path,
        "tf_checkpoint": tf_prefix,
        "seconds": round(elapsed, 2),
    }
    lines = [
        f"trained a {FEATURES}-{HIDDEN}-{CLASSES} MLP for {args.steps} steps with Adam: "
        f"{first_leg} steps on {counted(args.devices, 'device')}, then restarted on {counted(m, 'device')}",
        f"  restart: restored {os.path.basename(mid_ckpt or '?')} onto {counted(m, 'device')} and resumed at step "
        f"{resumed_at} (every component equal to the saved values: {same})",
        f"  loss {losses[0]:.4f} -> {losses[first_leg - 1]:.4f} (restart) -> {losses[-1]:.4f}; "
        f"accuracy {acc1:.3f} -> {acc2:.3f}; examples seen {int(model2.seen.read_value())}",
        f"  checkpoints ({len(manager2.checkpoints)} kept): {ckpt_dir}",
        *[f"    {os.path.basename(p)}" for p in manager2.checkpoints],
        f"  safetensors: {st_path}",
        f"  TensorFlow checkpoint: {tf_prefix}.index / .data-00000-of-00001",
        f"  parallelvars inspect {final}:",
        *[f"    {line}" for line in inspected],
        f"done in {elapsed:.1f} s",
    ]
    out.emit(result, "\n".join(lines))
    return 0
