"""dhelix.compat.cpu: megatron-core's CUDA assumptions met on CPU, and only there."""
import torch

from dhelix.compat import cpu as cpu_compat


def test_apply_only_without_cuda():
    assert cpu_compat.apply() is (not torch.cuda.is_available())
    assert cpu_compat.apply() == cpu_compat.is_applied()   # idempotent


def test_buffers_land_on_cpu_in_patched_modules_only():
    cpu_compat.apply()
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.tensor_parallel import mappings
    assert mappings.torch.cuda.current_device() == "cpu"
    assert schedules.torch.zeros([], dtype=torch.int, device="cuda").device.type == "cpu"
    assert mappings.torch.matmul is torch.matmul           # everything else is torch
    assert torch.cuda.current_device is not mappings.torch.cuda.current_device


def test_rng_tracker_keeps_cpu_states():
    cpu_compat.apply()
    from megatron.core.tensor_parallel import random as mrandom
    tracker = mrandom.get_cuda_rng_tracker()
    tracker.reset()
    tracker.add("a", 11)
    torch.manual_seed(0)
    outside = torch.get_rng_state()
    with tracker.fork("a"):
        x1 = torch.rand(3)
    assert torch.equal(torch.get_rng_state(), outside)      # default stream untouched
    with tracker.fork("a"):
        x2 = torch.rand(3)                                  # the tracked stream continues
    torch.manual_seed(11)
    assert torch.equal(x1, torch.rand(3)) and torch.equal(x2, torch.rand(3))


def test_model_parallel_seed_on_cpu():
    cpu_compat.apply()
    from megatron.core.tensor_parallel import random as mrandom
    mrandom.model_parallel_cuda_manual_seed(5, tp_rank=0, ep_rank=0, etp_rank=0)
    s0 = mrandom.get_cuda_rng_tracker().get_states()["model-parallel-rng"].clone()
    mrandom.model_parallel_cuda_manual_seed(5, tp_rank=1, ep_rank=0, etp_rank=0)
    s1 = mrandom.get_cuda_rng_tracker().get_states()["model-parallel-rng"]
    assert not torch.equal(s0, s1)                           # TP ranks differ
