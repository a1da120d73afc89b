"""The torch backend's transports for particular cases, each in a module of its own
(docs/backends.md#pair-sum, docs/backends.md#int16-wire): their rules, without a process group."""
import pytest

torch = pytest.importorskip("torch")

from torch_plugin import int16_wire, pair_sum  # noqa: E402


def test_int16_moves_as_float16_of_the_same_bits_and_comes_back():
    x = torch.tensor([-32768, -1, 0, 1, 31744, 32767], dtype=torch.int16)  # 31744: fp16 +inf's bits
    wire, dtype = int16_wire.movable(x)
    assert wire.dtype == torch.float16 and dtype == torch.int16
    assert wire.data_ptr() == x.data_ptr()  # a view, no copy
    assert torch.equal(int16_wire.restore(wire.clone(), dtype), x)
    y = torch.arange(4, dtype=torch.float32)
    same, none = int16_wire.movable(y)
    assert same is y and none is None and int16_wire.restore(y, None) is y
    assert int16_wire.restore(None, torch.int16) is None


def test_pair_sum_takes_small_contiguous_cpu_sums_on_two_ranks_only():
    small = torch.zeros(pair_sum.MAX_BYTES // 4, dtype=torch.float32)
    assert pair_sum.takes(small, "sum", 2)
    assert not pair_sum.takes(torch.zeros(pair_sum.MAX_BYTES // 4 + 1), "sum", 2)
    assert not pair_sum.takes(small, "sum", 3)
    assert not pair_sum.takes(small, "max", 2)
    assert not pair_sum.takes(small.to(torch.float16), "sum", 2)  # halves keep Gloo's allreduce
    assert not pair_sum.takes(torch.zeros(8, 8)[:, 0], "sum", 2)  # not contiguous


def test_pair_sum_bound_is_a_module_default_tests_can_switch(monkeypatch):
    x = torch.zeros(16)
    monkeypatch.setattr(pair_sum, "MAX_BYTES", 0)
    assert not pair_sum.takes(x, "sum", 2)
    monkeypatch.undo()
    assert pair_sum.takes(x, "sum", 2)
