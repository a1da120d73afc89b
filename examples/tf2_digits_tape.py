"""Train a small CNN on scikit-learn's digits with TensorFlow 2 and a DistributedGradientTape.

    python -m hvd_commopt.run -np 2 python examples/tf2_digits_tape.py     # 2 local ranks
    python examples/tf2_digits_tape.py                                      # 1 process, no MPI
    python examples/tf2_digits_tape.py --compression topk --density 0.05    # sparse (core's Top-k)

The dataset ships inside scikit-learn (1,797 8x8 images), so nothing is downloaded. The training
step is a ``tf.function``; the gradient reduction inside it is one ``tf.py_function`` (see
tf_plugin.bridge). Integration points are marked ``# hvd_commopt:``.
"""
from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from sklearn.model_selection import train_test_split  # noqa: E402

import tf_plugin as hco  # noqa: E402  hvd_commopt: the one import a Horovod user changes


def build_model() -> tf.keras.Model:
    import keras
    return keras.Sequential([
        keras.Input((8, 8, 1)),
        keras.layers.Conv2D(16, 3, padding="same", activation="relu"),
        keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
        keras.layers.MaxPooling2D(2),
        keras.layers.Flatten(),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(10),
    ])


def load(seed: int):
    d = load_digits()
    x = (d.images / 16.0).astype(np.float32)[..., None]
    return train_test_split(x, d.target.astype(np.int64), test_size=0.25, random_state=seed, stratify=d.target)


def compression_from_args(args):
    if args.compression in ("topk", "gtopk"):
        return getattr(hco.Compression, args.compression)(density=args.density)
    return getattr(hco.Compression, args.compression)


def main(argv=None):
    import keras
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--lr", type=float, default=0.05, help="per rank; scaled by the number of ranks")
    p.add_argument("--compression", default="none", choices=["none", "fp16", "bf16", "topk", "gtopk"])
    p.add_argument("--density", type=float, default=0.05, help="for topk / gtopk")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    hco.init()  # hvd_commopt: rank/size from mpirun (or size 1 without a launcher)
    keras.utils.set_random_seed(args.seed)
    x_tr, x_te, y_tr, y_te = load(args.seed)
    # hvd_commopt: every rank trains on its own shard of the data
    x_tr, y_tr = x_tr[hco.rank()::hco.size()], y_tr[hco.rank()::hco.size()]

    model = build_model()
    opt = keras.optimizers.SGD(args.lr * hco.size(), momentum=0.9)  # hvd_commopt: scale lr by size
    opt.build(model.trainable_variables)
    compression = compression_from_args(args)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        # hvd_commopt: the wrapped tape returns gradients averaged over all ranks
        tape = hco.DistributedGradientTape(tape, compression=compression)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    # hvd_commopt: same initial weights and optimizer state on every rank
    hco.broadcast_variables(model.variables + opt.variables, root_rank=0)

    steps = len(x_tr) // args.batch_size  # the same on every rank (shards differ by at most one sample)
    steps = int(hco.allreduce(tf.constant(float(steps)), op=hco.Sum).numpy() // hco.size())
    rng = np.random.default_rng(args.seed + hco.rank())
    t0 = time.perf_counter()
    acc = 0.0
    for epoch in range(args.epochs):
        perm = rng.permutation(len(x_tr))
        total = 0.0
        for i in range(steps):
            idx = perm[i * args.batch_size:(i + 1) * args.batch_size]
            total += float(train_step(tf.constant(x_tr[idx]), tf.constant(y_tr[idx])))
        logits = model(x_te, training=False)
        acc = float(np.mean(np.argmax(logits, axis=1) == y_te))
        # hvd_commopt: average the metric over ranks
        loss_avg = float(hco.allreduce(tf.constant(total / steps)))
        if hco.rank() == 0:
            print(f"epoch {epoch + 1:2d}  loss {loss_avg:.4f}  test accuracy {acc:.4f}", flush=True)
    if hco.rank() == 0:
        print(f"ranks {hco.size()}  time {time.perf_counter() - t0:.1f}s  final test accuracy {acc:.4f}", flush=True)
    return acc


if __name__ == "__main__":
    main()
