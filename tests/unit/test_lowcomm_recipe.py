"""benchmarks/lowcomm_bench.py's variant grammar (parse_variant): the outer step, the sparse
(top-k) quantised pseudo-gradient and the dense quantised one (docs/diloco.md#measured)."""
import pytest

pytest.importorskip("torch")
from benchmarks.lowcomm_bench import parse_variant  # noqa: E402
from hvd_commopt.errors import ConfigError  # noqa: E402


def built(name):
    sched, comp = parse_variant(name)
    return sched(), comp()


def test_outer_step_only():
    s, c = built("diloco_h20_olr1.0_om0.5")
    assert (s.period, s.outer_lr, s.outer_momentum) == (20, 1.0, 0.5)
    assert c is None


def test_defaults_are_diloco_papers_outer_step():
    s, c = built("diloco_h50")
    assert (s.period, s.outer_lr, s.outer_momentum, c) == (50, 0.7, 0.9, None)


def test_sparse_quantised_recipe_unchanged():
    s, c = built("diloco_h10_olr2.5_om0.0_topk1_int2_c4096_ef0.95_snd")
    assert (s.period, s.outer_lr, s.outer_momentum) == (10, 2.5, 0.0)
    assert (c.bits, c.density, c.chunk, c.ef_decay, c.mean_over) == (2, 0.01, 4096, 0.95, "senders")


@pytest.mark.parametrize("name, h, bits, block", [
    ("diloco_h20_olr1.0_om0.5_int8", 20, 8, 256),
    ("diloco_h10_int4", 10, 4, 256),
    ("diloco_h25_olr0.7_om0.9_int4_b64", 25, 4, 64),
])
def test_dense_quantised(name, h, bits, block):
    s, c = built(name)
    assert s.period == h
    assert (c.bits, c.density, c.chunk, c.block, c.mean_over) == (bits, None, None, block, "ranks")


def test_dense_quantised_with_a_chunk_is_the_librarys_error():
    with pytest.raises(ConfigError, match="needs a density"):
        built("diloco_h20_int4_c4096")


@pytest.mark.parametrize("name", ["diloco_h20_topk1", "diloco_h20_int", "diloco", "diloco_h20_int4_junk"])
def test_unknown(name):
    with pytest.raises(SystemExit, match="unknown variant"):
        parse_variant(name)
