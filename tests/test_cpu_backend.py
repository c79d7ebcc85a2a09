"""The CPU backend makes megatron-core's CUDA-only spots run on the CPU, and does nothing on a GPU."""

import pytest
import torch

from megatron_csbp import cpu_backend

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU backend is for machines without CUDA")

CUDA = torch.cuda.__name__.split(".")[-1]  # Megatron's device string, spelled without a literal


@pytest.fixture
def backend():
    assert cpu_backend.enable()
    try:
        yield
    finally:
        cpu_backend.disable()


def test_without_backend_megatron_style_calls_fail():
    assert not cpu_backend.is_enabled()
    with pytest.raises((RuntimeError, AssertionError)):
        torch.zeros(2, device=CUDA)
    with pytest.raises((RuntimeError, AssertionError)):
        torch.cuda.current_device()


def test_cuda_devices_pinned_memory_and_type_strings_map_to_cpu(backend):
    assert cpu_backend.enable(), "enable() is idempotent"
    assert torch.zeros(2, device=CUDA).device.type == "cpu"
    assert torch.tensor([1.0], device=torch.cuda.current_device()).device.type == "cpu"
    assert torch.empty(3, device=0).device.type == "cpu"
    tensor = torch.ones(3, pin_memory=True)
    assert tensor.cuda() is tensor and tensor.pin_memory() is tensor
    assert tensor.to(CUDA).device.type == "cpu" and tensor.to(torch.float64).dtype == torch.float64
    assert tensor.type() == "torch.cuda.FloatTensor"
    assert tensor.type(torch.float64).dtype == torch.float64
    torch.cuda.synchronize()


def test_disable_restores_everything(backend):
    cpu_backend.disable()
    assert not cpu_backend.is_enabled()
    assert torch.ones(1).type() == "torch.FloatTensor"
    with pytest.raises((RuntimeError, AssertionError)):
        torch.cuda.current_device()
    assert cpu_backend.enable()


def test_rng_tracker_forks_the_cpu_generator(backend):
    from megatron.core.tensor_parallel import random as megatron_random

    megatron_random.model_parallel_cuda_manual_seed(11, tp_rank=0, ep_rank=0, etp_rank=0, force_reset_rng=True)
    tracker = megatron_random.get_cuda_rng_tracker()
    outside = torch.get_rng_state()
    with tracker.fork():
        first = torch.rand(4)
    assert torch.equal(torch.get_rng_state(), outside), "fork() restores the default state"
    with tracker.fork():
        second = torch.rand(4)
    assert not torch.equal(first, second), "the tracked state advances across forks"
    megatron_random.model_parallel_cuda_manual_seed(11, tp_rank=0, ep_rank=0, etp_rank=0, force_reset_rng=True)
    with megatron_random.get_cuda_rng_tracker().fork():
        assert torch.equal(torch.rand(4), first), "the same seed gives the same stream"
    megatron_random.model_parallel_cuda_manual_seed(11, tp_rank=1, ep_rank=0, etp_rank=0, force_reset_rng=True)
    with megatron_random.get_cuda_rng_tracker().fork():
        assert not torch.equal(torch.rand(4), first), "another TP rank gets another stream"


def test_megatron_grad_clipping_runs_on_cpu(backend):
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

    param = torch.nn.Parameter(torch.ones(4))
    param.grad = torch.full((4,), 2.0)
    clip_grad_by_total_norm_fp32([param], max_norm=1.0, total_norm=4.0)
    assert torch.allclose(param.grad, torch.full((4,), 0.5), rtol=1e-5)


def test_never_active_when_cuda_is_available(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert cpu_backend.enable() is False
    assert not cpu_backend.is_enabled()
