"""What compression="auto" prices a bucket at, per method: the wire the reducers really send
(docs/auto-compression.md#sparse-wire) and the compute measured on this machine
(docs/auto-compression.md#model). Exact values: the prices are sums of alpha-beta terms."""
from __future__ import annotations

from hvd_commopt.autocompress import Method
from hvd_commopt.autocompress.pricing import allgather_sparse_time, method_costs
from hvd_commopt.fusion.cost_model import AlphaBeta, CostModel

# distinct alphas and betas, so each term can be told apart
LINK = CostModel(AlphaBeta(0.5, 2.0 ** -10), AlphaBeta(0.25, 2.0 ** -12), None, ranks=2)
MB = 1 << 20


def test_topk_is_one_allgather_of_values_and_indices_packed():
    # 1 MiB = 262144 elements, 1 % = 2621 entries of 4 + 4 bytes: ONE allgather, one alpha
    t = allgather_sparse_time(Method("topk", 0.01), MB, LINK)
    assert t == 0.25 + 2621 * 8 * 2.0 ** -12
    assert method_costs(Method("topk", 0.01), MB, LINK, {})[1] == t


def test_dgc_adds_the_size_round_of_its_varying_count():
    t = allgather_sparse_time(Method("dgc", 0.01), MB, LINK)
    assert t == (0.25 + 2621 * 8 * 2.0 ** -12) + (0.25 + 8 * 2.0 ** -12)


def test_the_fewest_entries_sent_is_min_k_and_at_most_the_bucket():
    assert allgather_sparse_time(Method("topk", 0.01), 400, LINK, min_k=16) == 0.25 + 16 * 8 * 2.0 ** -12
    assert allgather_sparse_time(Method("topk", 0.01), 40, LINK, min_k=16) == 0.25 + 10 * 8 * 2.0 ** -12


def test_one_rank_or_an_empty_bucket_sends_nothing():
    one = CostModel(AlphaBeta(0.5, 1.0), AlphaBeta(0.5, 1.0), None, ranks=1)
    assert allgather_sparse_time(Method("dgc", 0.01), MB, one) == 0.0
    assert allgather_sparse_time(Method("topk", 0.01), 0, LINK) == 0.0


def test_dense_and_casts_are_the_allreduce_of_their_bytes():
    assert method_costs(Method("none"), MB, LINK, {}) == (0.0, 0.5 + MB * 2.0 ** -10)
    fits = {"bf16": (1e-9, 1e-4)}
    assert method_costs(Method("bf16"), MB, LINK, fits) == (1e-4 + 1e-9 * (MB // 4), 0.5 + MB * 2.0 ** -11)
