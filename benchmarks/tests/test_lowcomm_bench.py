"""benchmarks/lowcomm_bench.py's variant names: the inner learning-rate suffix."""
from benchmarks.lowcomm_bench import split_inner_lr


def test_inner_lr_suffix_scales_the_peak_lr_of_any_variant():
    assert split_inner_lr("diloco_h50_olr1.0_om0.5_ilr2") == ("diloco_h50_olr1.0_om0.5", 2.0)
    assert split_inner_lr("ddp_ilr1.41") == ("ddp", 1.41)
    assert split_inner_lr("diloco_h10_olr2.5_om0.0_topk1_int2_c4096_ef0.95") == \
        ("diloco_h10_olr2.5_om0.0_topk1_int2_c4096_ef0.95", 1.0)
