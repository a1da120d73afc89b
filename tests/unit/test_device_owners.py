"""Which ranks would share a GPU under NCCL (hvd_commopt/comm/device_owners.py,
docs/backends.md#one-gpu-per-rank): the pure decision, on ids the test makes up."""
import pytest

from hvd_commopt.comm.device_owners import DeviceId, check_one_device_per_rank, shared_devices
from hvd_commopt.errors import ConfigError


def gpu(host, uuid, index=0):
    return DeviceId(host, uuid, index)


def test_one_gpu_per_rank_passes():
    ids = [gpu("a", "GPU-0", 0), gpu("a", "GPU-1", 1), gpu("b", "GPU-0", 0), gpu("b", "GPU-1", 1)]
    assert shared_devices(ids) == []
    check_one_device_per_rank(ids)


def test_the_same_uuid_on_two_hosts_is_not_shared():
    # visible-device fallbacks ("0#0") repeat across hosts: the host tells them apart
    assert shared_devices([gpu("a", "0#0"), gpu("b", "0#0")]) == []


def test_ranks_without_a_gpu_share_nothing():
    assert shared_devices([None, None, gpu("a", "GPU-0")]) == []


def test_two_ranks_on_one_gpu_are_found_with_every_group():
    ids = [gpu("a", "GPU-0"), gpu("a", "GPU-0"), gpu("b", "GPU-7", 1), gpu("a", "GPU-1", 1), gpu("b", "GPU-7", 1)]
    assert shared_devices(ids) == [[0, 1], [2, 4]]


def test_the_error_names_the_ranks_the_device_and_every_fix():
    ids = [gpu("node1", "GPU-abc", 0), gpu("node1", "GPU-abc", 0)]
    with pytest.raises(ConfigError) as e:
        check_one_device_per_rank(ids, "nccl")
    text = str(e.value)
    for part in ("2 ranks would share one GPU", "cuda:0", "GPU-abc", "ranks 0, 1 on node1",
                 "CUDA_VISIBLE_DEVICES", "--nproc-per-node", 'backend="gloo"', "HVD_COMMOPT_BACKEND=gloo"):
        assert part in text, (part, text)


def test_the_decision_is_the_same_on_every_rank():
    # every rank holds the same gathered list, so every rank raises the same words
    ids = [gpu("h", "GPU-0"), gpu("h", "GPU-1"), gpu("h", "GPU-0")]
    texts = set()
    for _ in range(3):
        with pytest.raises(ConfigError) as e:
            check_one_device_per_rank(list(ids))
        texts.add(str(e.value))
    assert len(texts) == 1 and "ranks 0, 2 on h" in texts.pop()
