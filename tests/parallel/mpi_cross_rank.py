"""Rank-side settings that differ across ranks, one scenario per argv[1] (argv[2]: "torch" or
"tf"); run by test_cross_rank.py under mpirun. Every rank must raise RankMismatchError at wrap
time (torch) or at the first step (TensorFlow), print it, and exit 0: no crash, no hang."""
import os
import sys
import time

scenario, framework = sys.argv[1], sys.argv[2]
R = int(os.environ.get("OMPI_COMM_WORLD_RANK", "0"))


def compression(hco):
    if scenario == "density":  # gTop-k with densities that differ across ranks
        return hco.Compression.gtopk(density=0.01 if R == 0 else 0.02)
    if scenario == "kind":
        return hco.Compression.topk(0.01) if R == 0 else hco.Compression.fp16
    return None  # "threshold_env": HVD_COMMOPT_FUSION_THRESHOLD is set on one rank only (by mpirun -x)


if framework == "torch":
    import torch

    import torch_plugin as hco
    from hvd_commopt.errors import RankMismatchError

    hco.init()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    # 2.9 MB of float32 weights: one 25 MiB bucket on one rank, three 1 MiB buckets on the other
    model = torch.nn.Sequential(torch.nn.Linear(600, 600), torch.nn.Linear(600, 600), torch.nn.Linear(600, 10))
    hco.broadcast_object(0)  # line the ranks up: the time printed is the check's, not start-up skew
    t0 = time.perf_counter()
    try:
        hco.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                 named_parameters=model.named_parameters(), compression=compression(hco))
    except RankMismatchError as e:
        print(f"rank {R}: RankMismatchError after {time.perf_counter() - t0:.3f} s: {e}".replace("\n", " | "),
              flush=True)
        sys.exit(0)
    sys.exit(f"rank {R}: no error raised for settings that differ across ranks")

import tensorflow as tf  # noqa: E402

import tf_plugin as hco  # noqa: E402
from hvd_commopt.errors import RankMismatchError  # noqa: E402

hco.init()
tf.random.set_seed(0)
w = [tf.Variable(tf.ones([600, 600])), tf.Variable(tf.ones([600, 600])), tf.Variable(tf.ones([600, 10]))]
x = tf.ones([4, 600])
try:
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(x @ w[0] @ w[1] @ w[2])
    tape = hco.DistributedGradientTape(tape, compression=compression(hco))
    tape.gradient(loss, w)
except RankMismatchError as e:
    print(f"rank {R}: RankMismatchError: {e}".replace("\n", " | "), flush=True)
    sys.exit(0)
except tf.errors.OpError as e:  # the error may arrive wrapped by the py_function
    if "RankMismatchError" in str(e) or "differs across ranks" in str(e):
        print(f"rank {R}: RankMismatchError: {e.message}".replace("\n", " | "), flush=True)
        sys.exit(0)
    raise
sys.exit(f"rank {R}: no error raised for settings that differ across ranks")
