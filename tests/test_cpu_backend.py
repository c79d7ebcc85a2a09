"""The CPU backend makes megatron-core's (and Megatron-LM's) CUDA-only spots run on the CPU while its block
lasts, restores exactly what it changed, and does nothing where an accelerator exists."""

import logging

import pytest
import torch

from megatron_csbp.mcore import cpu_backend

pytestmark = pytest.mark.skipif(torch.accelerator.is_available(),
                                reason="the CPU backend is for machines without an accelerator")

CUDA = torch.cuda.__name__.split(".")[-1]  # Megatron's device string, spelled without a literal


@pytest.fixture
def backend():
    with cpu_backend.active() as active:
        assert active
        yield


def test_without_backend_megatron_style_calls_fail():
    with pytest.raises((RuntimeError, AssertionError)):
        torch.zeros(2, device=CUDA)
    with pytest.raises((RuntimeError, AssertionError)):
        torch.cuda.current_device()


def test_cuda_devices_pinned_memory_and_type_strings_map_to_cpu(backend):
    assert torch.zeros(2, device=CUDA).device.type == "cpu"
    assert torch.tensor([1.0], device=torch.cuda.current_device()).device.type == "cpu"
    assert torch.empty(3, device=0).device.type == "cpu"
    tensor = torch.ones(3, pin_memory=True)
    assert tensor.cuda() is tensor and tensor.pin_memory() is tensor
    assert tensor.to(CUDA).device.type == "cpu" and tensor.to(torch.float64).dtype == torch.float64
    assert tensor.type() == "torch.cuda.FloatTensor"
    assert tensor.type(torch.float64).dtype == torch.float64
    torch.cuda.synchronize()


def test_leaving_the_block_restores_everything():
    from megatron.core.tensor_parallel import random as megatron_random

    watched = [(torch.cuda, name) for name in ("current_device", "synchronize", "manual_seed", "get_rng_state",
                                                "set_rng_state", "device_count", "set_device", "Stream",
                                                "current_stream", "stream")]
    watched += [(megatron_random, "_get_cuda_rng_state"), (megatron_random, "_set_cuda_rng_state"),
                (megatron_random.CudaRNGStatesTracker, "add")]
    before = [getattr(owner, name) for owner, name in watched]
    filters = list(logging.getLogger(megatron_random.__name__).filters)
    with cpu_backend.active():
        assert torch.ones(1).type() == "torch.cuda.FloatTensor"
        assert [getattr(owner, name) for owner, name in watched] != before
        with cpu_backend.active():  # nested: the inner block restores what the outer one set
            pass
        assert torch.zeros(1, device=CUDA).device.type == "cpu"
    assert [getattr(owner, name) for owner, name in watched] == before
    assert logging.getLogger(megatron_random.__name__).filters == filters
    assert torch.ones(1).type() == "torch.FloatTensor"
    with pytest.raises((RuntimeError, AssertionError)):
        torch.cuda.current_device()


def test_an_error_inside_the_block_still_restores():
    with pytest.raises(KeyError):
        with cpu_backend.active():
            raise KeyError("boom")
    assert torch.ones(1).type() == "torch.FloatTensor"


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


def test_never_active_when_any_accelerator_is_available(monkeypatch):
    """Any accelerator (CUDA, XPU, MPS ...) turns the backend off: it must never move real device work to the CPU."""
    original_type = torch.Tensor.type
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    with cpu_backend.active() as active:
        assert active is False
        assert torch.ones(1).type() == "torch.FloatTensor"
        with pytest.raises((RuntimeError, AssertionError)):
            torch.zeros(1, device=CUDA)
    assert torch.Tensor.type is original_type


def test_megatron_lm_spots_are_patched_only_when_megatron_training_is_loaded(monkeypatch):
    """Megatron-LM's own assumptions are neutralised only for a run that imported `megatron.training`."""
    import sys

    monkeypatch.delitem(sys.modules, "megatron.training", raising=False)
    count = torch.cuda.device_count
    with cpu_backend.active():
        assert torch.cuda.device_count is count


def test_triton_free_stand_in_refuses_batch_invariant_mode(monkeypatch):
    import importlib.util
    import sys

    name = "megatron.core.transformer.custom_layers.batch_invariant_kernels"
    monkeypatch.delitem(sys.modules, name, raising=False)
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "triton" else real_find_spec(n, *a))
    assert cpu_backend.triton_free_batch_invariant_kernels()
    stand_in = sys.modules[name]
    assert stand_in.is_batch_invariant_mode_enabled() is False
    with pytest.raises(RuntimeError, match="--batch-invariant-mode needs triton"):
        stand_in.enable_batch_invariant_mode()
    assert not cpu_backend.triton_free_batch_invariant_kernels(), "installed once"
