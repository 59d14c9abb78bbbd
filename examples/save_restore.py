"""Save a mirrored model on 4 devices, restore it onto 2 devices and onto one (no strategy).

python examples/save_restore.py [--dir DIR]
"""

from __future__ import annotations

import argparse
import tempfile

import numpy as np

import parallelvars as pv


class Dense(pv.Module):
    def __init__(self, n_in: int, n_out: int, rng: np.random.Generator) -> None:
        self.kernel = pv.Variable(
            rng.standard_normal((n_in, n_out)).astype(np.float32), name="kernel"
        )
        self.bias = pv.Variable(np.zeros(n_out, np.float32), name="bias")


def build(rng: np.random.Generator) -> pv.Module:
    model = pv.Module()
    model.layers = [Dense(8, 16, rng), Dense(16, 4, rng)]
    model.embedding = pv.Variable(
        rng.standard_normal((10, 8)).astype(np.float32), name="embedding", shard_axis=0
    )
    model.seen = pv.Variable(np.int64(0), name="seen", synchronization="on_read", aggregation="sum")
    return model


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--dir", default=None, help="checkpoint directory (default: a temporary one)")
    args = ap.parse_args()
    directory = args.dir or tempfile.mkdtemp(prefix="parallelvars-")

    with pv.MirroredStrategy(4).scope():
        model = build(np.random.default_rng(0))
    for i, c in enumerate(model.seen.components):  # per-replica counters
        c[...] = 100 * (i + 1)
    path = pv.Checkpoint(model=model).save(f"{directory}/model")
    print(f"saved {len(model.variables)} variables on 4 devices to {path}")

    with pv.MirroredStrategy(2).scope():
        two = build(np.random.default_rng(1))
    pv.Checkpoint(model=two).restore(path).assert_consumed()
    one = build(np.random.default_rng(2))  # no strategy: single-device variables
    pv.Checkpoint(model=one).restore(path).assert_consumed()

    same = all(np.array_equal(c, model.layers[0].kernel) for c in two.layers[0].kernel.components)
    print(f"restored onto 2 devices: every component equal to the saved primary: {same}")
    print(
        f"embedding shards: 4 devices {[c.shape[0] for c in model.embedding.components]} -> "
        f"2 devices {[c.shape[0] for c in two.embedding.components]} -> 1 device {one.embedding.shape}"
    )
    print(
        f"on-read SUM counter: saved total {model.seen.read_value()}, "
        f"restored on 2 devices {two.seen.read_value()}, on 1 device {int(one.seen)}"
    )
    ok = (
        same
        and np.array_equal(one.embedding, model.embedding)
        and int(one.seen) == model.seen.read_value()
    )
    print("round trip OK" if ok else "round trip FAILED")
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
