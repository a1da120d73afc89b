"""Train a small CNN on scikit-learn's digits with Keras 3 ``model.fit`` and hvd_commopt.

    python -m hvd_commopt.run -np 2 python examples/keras_digits.py        # 2 local ranks
    python examples/keras_digits.py                                         # 1 process, no MPI
    python examples/keras_digits.py --compression fp16
    python -m hvd_commopt.run -np 2 python examples/keras_digits.py --schedule od   # OD-SGD

The dataset ships inside scikit-learn (1,797 8x8 images), so nothing is downloaded. Keras traces
``train_step`` once; the wrapped optimizer reduces the gradients inside it through one
``tf.py_function`` per step (see tf_plugin.bridge). Integration points are marked
``# hvd_commopt:``.
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


def main(argv=None):
    import keras
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--lr", type=float, default=0.05, help="per rank; scaled by the number of ranks")
    p.add_argument("--momentum", type=float, default=None,
                   help="SGD momentum; default 0.9 (sync) or 0 (od/ssd: a delayed global update with heavy "
                        "momentum trains poorly here, in torch_plugin as in tf_plugin)")
    p.add_argument("--warmup-epochs", type=int, default=2)
    p.add_argument("--compression", default="none", choices=["none", "fp16", "bf16", "topk", "gtopk"])
    p.add_argument("--density", type=float, default=0.05, help="for topk / gtopk")
    p.add_argument("--schedule", default="sync", choices=["sync", "od", "ssd"],
                   help="od/ssd: the core's delayed schedules (global replica + local update)")
    p.add_argument("--warmup-steps", type=int, default=20, help="synchronous steps before od/ssd start")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    hco.init()  # hvd_commopt: rank/size from mpirun (or size 1 without a launcher)
    keras.utils.set_random_seed(args.seed + hco.rank())  # different starts: the broadcast aligns them
    d = load_digits()
    x = (d.images / 16.0).astype(np.float32)[..., None]
    x_tr, x_te, y_tr, y_te = train_test_split(x, d.target, test_size=0.25, random_state=args.seed, stratify=d.target)
    x_tr, y_tr = x_tr[hco.rank()::hco.size()], y_tr[hco.rank()::hco.size()]  # hvd_commopt: this rank's shard
    x_te, y_te = x_te[hco.rank()::hco.size()], y_te[hco.rank()::hco.size()]  # metrics are averaged below

    model = keras.Sequential([
        keras.Input((8, 8, 1)),
        keras.layers.Conv2D(16, 3, padding="same", activation="relu"),
        keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
        keras.layers.MaxPooling2D(2),
        keras.layers.Flatten(),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(10),
    ])
    if args.compression in ("topk", "gtopk"):
        compression = getattr(hco.Compression, args.compression)(density=args.density)
    else:
        compression = getattr(hco.Compression, args.compression)
    if args.momentum is None:
        args.momentum = 0.9 if args.schedule == "sync" else 0.0
    schedule = None
    if args.schedule == "od":
        schedule = hco.Schedule.od(warmup_steps=args.warmup_steps, local_lr=args.lr * hco.size())
    elif args.schedule == "ssd":
        schedule = hco.Schedule.ssd(delay=2, warmup_steps=args.warmup_steps, local_lr=args.lr * hco.size())
    # hvd_commopt: wrap the optimizer (lr scaled by the number of ranks)
    opt = hco.DistributedOptimizer(keras.optimizers.SGD(args.lr * hco.size(), momentum=args.momentum),
                                   compression=compression,
                                   schedule=schedule)
    # hvd_commopt: jit_compile=False: the reduction is a tf.py_function, which XLA cannot compile
    model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"], jit_compile=False)
    callbacks = [
        hco.callbacks.BroadcastGlobalVariablesCallback(0),  # hvd_commopt: same initial weights everywhere
        hco.callbacks.MetricAverageCallback(),               # hvd_commopt: metrics averaged over ranks
        hco.callbacks.LearningRateWarmupCallback(args.lr * hco.size(), warmup_epochs=args.warmup_epochs,
                                                 verbose=1),  # hvd_commopt: gradual warm-up (Goyal et al.)
    ]
    t0 = time.perf_counter()
    hist = model.fit(x_tr, y_tr, batch_size=args.batch_size, epochs=args.epochs, validation_data=(x_te, y_te),
                     callbacks=callbacks, verbose=2 if hco.rank() == 0 else 0)  # hvd_commopt: print on rank 0
    acc = hist.history["val_accuracy"][-1]
    if schedule is not None:
        opt.finalize()  # hvd_commopt: delayed schedules: the model becomes the global replica w_g
        acc = float(hco.allreduce(tf.constant(model.evaluate(x_te, y_te, verbose=0)[1])))
    if hco.rank() == 0:
        print(f"ranks {hco.size()}  time {time.perf_counter() - t0:.1f}s  final test accuracy {acc:.4f}  "
              f"bytes sent per step {opt.comm_stats.get('bytes_sent')}", flush=True)
    return acc


if __name__ == "__main__":
    main()
