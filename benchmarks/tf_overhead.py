"""Per-step cost of tf_plugin's ``tf.function`` strategy (one ``tf.py_function`` per step).

    python -m benchmarks.tf_overhead                       # size 1: the adapter's own overhead
    python -m hvd_commopt.run -np 2 python -m benchmarks.tf_overhead   # plus the real allreduce

For each model size it times a traced training step (forward, backward, SGD update) four ways:

* ``plain``: no hvd_commopt (the non-distributed step);
* ``py_function``: plain plus an identity ``tf.py_function`` over the gradient list (the bare
  cost of leaving the graph and coming back, no engine);
* ``tape``: ``DistributedGradientTape`` (py_function + engine: packing into the fusion buffer,
  reducer, unpacking; at size 1 no communication);
* ``keras_opt``: the Keras ``DistributedOptimizer`` wrapper (same path through ``apply``);
* ``keras_od``: the wrapper with ``Schedule.od(warmup_steps=0)``: the core's scheduler runs the
  global update (the Keras optimizer on the replica, eagerly inside the py_function) and the
  local update every step.

and prints the median per-step time and the overhead over ``plain`` in milliseconds.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

__all__ = ["main"]


def _model(width: int, depth: int, d_in: int):
    import keras
    layers = [keras.Input((d_in,))]
    layers += [keras.layers.Dense(width, activation="relu") for _ in range(depth)]
    layers += [keras.layers.Dense(10)]
    return keras.Sequential(layers)


def _bench(step, x, y, iters: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        step(x, y)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        step(x, y).numpy()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run_case(width: int, depth: int, batch: int, iters: int) -> dict[str, float]:
    import keras

    import tf_plugin as hco
    d_in = 64
    rng = np.random.default_rng(0)
    x = tf.constant(rng.standard_normal((batch, d_in)).astype(np.float32))
    y = tf.constant(rng.integers(0, 10, batch))
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    out: dict[str, float] = {}

    def make(kind: str):
        keras.utils.set_random_seed(0)
        model = _model(width, depth, d_in)
        opt = keras.optimizers.SGD(0.01)
        if kind == "keras_opt":
            opt = hco.DistributedOptimizer(opt)
        elif kind == "keras_od":
            opt = hco.DistributedOptimizer(opt, schedule=hco.Schedule.od(warmup_steps=0))
        opt.build(model.trainable_variables)

        @tf.function
        def step(x, y):
            with tf.GradientTape() as tape:
                loss = loss_fn(y, model(x, training=True))
            if kind == "tape":
                tape = hco.DistributedGradientTape(tape)
            grads = tape.gradient(loss, model.trainable_variables)
            if kind == "py_function":
                grads = tf.py_function(lambda *g: list(g), grads, [g.dtype for g in grads])
            opt.apply_gradients(zip(grads, model.trainable_variables))
            return loss
        n = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
        return step, n

    for kind in ("plain", "py_function", "tape", "keras_opt", "keras_od"):
        step, n = make(kind)
        out[kind] = _bench(step, x, y, iters)
        out["params"] = n
        out["tensors"] = 2 * (depth + 1)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--threads", type=int, default=1, help="TF intra/inter-op threads")
    args = p.parse_args(argv)
    tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    tf.config.threading.set_inter_op_parallelism_threads(args.threads)
    import tf_plugin as hco
    hco.init()
    cases = [(64, 2), (256, 4), (1024, 4)]
    if hco.rank() == 0:
        print(f"ranks {hco.size()}  batch {args.batch}  median of {args.iters} steps  (TF {tf.__version__})")
        print(f"{'model':>22} {'plain ms':>9} {'py_func ms':>10} {'tape ms':>8} {'keras ms':>9} {'od ms':>8} "
              f"{'py_func +':>9} {'tape +':>8} {'keras +':>8} {'od +':>8}")
    for width, depth in cases:
        r = run_case(width, depth, args.batch, args.iters)
        if hco.rank() == 0:
            ms = {k: v * 1e3 for k, v in r.items() if k not in ("params", "tensors")}
            label = f"{int(r['params']) / 1e6:.2f}M params/{int(r['tensors'])}t"
            print(f"{label:>22} {ms['plain']:9.2f} {ms['py_function']:10.2f} {ms['tape']:8.2f} {ms['keras_opt']:9.2f} "
                  f"{ms['keras_od']:8.2f} {ms['py_function'] - ms['plain']:9.2f} {ms['tape'] - ms['plain']:8.2f} "
                  f"{ms['keras_opt'] - ms['plain']:8.2f} {ms['keras_od'] - ms['plain']:8.2f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
