"""The one place where megatron-core's CUDA assumptions are neutralised, so it runs on CPU (gloo).

megatron-core 0.16 assumes a GPU in spots that have nothing to do with the maths. `enable()` switches
the following on, and only when `torch.cuda.is_available()` is false (on a GPU machine it does
nothing and returns False):

* A `TorchFunctionMode` (`_CudaAsCpu`) on the calling thread that maps every CUDA device to the CPU:
  - `device="cuda"` / `device=torch.cuda.current_device()` in factory calls (`schedules.py` token
    count, optimizer `_scale`/`found_inf`, `clip_grads.py`, `utils.py` l2 norm, grad buffers,
    tensor-parallel gather buffers, p2p shape tensors, checkpoint failure broadcasts);
  - `.cuda()`, `.to("cuda")`, `.pin_memory()` and `pin_memory=True` (RoPE slicing, checkpoint
    exchange) become no-ops on the CPU;
  - `Tensor.type()` of a CPU tensor reports the `torch.cuda.*Tensor` name, because `clip_grads.py`
    asserts `param.grad.type() == 'torch.cuda.FloatTensor'` when `clip_grad > 0`.
  Backward functions run outside any mode; the spots they reach need only the next item.
* `torch.cuda.current_device()` returns the CPU device itself (not an index for the mode to map):
  autograd runs custom backward functions (e.g. the sequence-parallel gathers) outside any
  `TorchFunctionMode`, and they allocate with `device=torch.cuda.current_device()`. And
  `torch.cuda.synchronize()` is a no-op: p2p communication and `dist_checkpointing`'s preload call
  them unconditionally. `torch.cuda.manual_seed` seeds the CPU generator, so
  `model_parallel_cuda_manual_seed` seeds the default state as it does on a GPU.
* The RNG helpers of `tensor_parallel/random.py` (`_get_cuda_rng_state`, `_set_cuda_rng_state` and
  `CudaRNGStatesTracker.add`) use the CPU generator, so the tracker's `fork()` (dropout in
  tensor-parallel regions, weight init) and activation recomputation work. As the CPU generator is
  then both "the CPU state" and "the tracked state", the tracker's "CPU RNG state changed within GPU
  RNG context" warning is expected and filtered out.

Everything is process-wide except the mode, which lives on the thread that called `enable()`.
"""

import logging

import torch
from torch.overrides import TorchFunctionMode

_state = {"mode": None, "undo": []}


_HOST_DEVICE_TYPES = ("cpu", "meta")


def _cpu_if_cuda(device):
    """A device index or accelerator device (what Megatron means by CUDA) becomes the CPU."""
    if isinstance(device, bool) or not isinstance(device, (int, str, torch.device)):
        return device
    if isinstance(device, int) or torch.device(device).type not in _HOST_DEVICE_TYPES:
        return torch.device("cpu")
    return device


class _CudaAsCpu(TorchFunctionMode):
    """Runs torch calls that ask for a CUDA device (or pinned memory) on the CPU instead."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda or func is torch.Tensor.pin_memory:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs and args[0].device.type == "cpu":
            return func(*args).replace("torch.", torch.cuda.__name__ + ".", 1)
        if "device" in kwargs:
            kwargs["device"] = _cpu_if_cuda(kwargs["device"])
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        if func is torch.Tensor.to:
            args = tuple(_cpu_if_cuda(a) for a in args)
        return func(*args, **kwargs)


class _ExpectedRngWarning(logging.Filter):
    def filter(self, record):
        return "CPU RNG state changed within GPU RNG context" not in record.getMessage()


def _cpu_tracker_add(self, name, seed):
    """`CudaRNGStatesTracker.add` on the CPU generator: remember the state `seed` gives."""
    self._is_initialized = True
    if seed in self.seeds_:
        raise Exception(f"seed {seed} already exists")
    if name in self.states_:
        raise Exception(f"rng state {name} already exists")
    self.seeds_.add(seed)
    saved = torch.get_rng_state()
    torch.manual_seed(seed)
    self.states_[name] = torch.get_rng_state()
    torch.set_rng_state(saved)


def _patch(owner, name, value):
    _state["undo"].append((owner, name, getattr(owner, name)))
    setattr(owner, name, value)


def is_enabled() -> bool:
    return _state["mode"] is not None


def enable() -> bool:
    """Neutralises megatron-core's CUDA assumptions when there is no GPU; True if (now) active.

    Idempotent. Never active on a machine with CUDA: there it returns False and changes nothing.
    """
    if torch.cuda.is_available():
        return False
    if is_enabled():
        return True
    from megatron.core.tensor_parallel import random as megatron_random

    _patch(torch.cuda, "current_device", lambda: torch.device("cpu"))
    _patch(torch.cuda, "synchronize", lambda device=None: None)
    _patch(torch.cuda, "manual_seed", torch.manual_seed)
    _patch(megatron_random, "_get_cuda_rng_state",
           lambda device=None, clone=False, graph_safe=False: torch.get_rng_state())
    _patch(megatron_random, "_set_cuda_rng_state",
           lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(new_state))
    _patch(megatron_random.CudaRNGStatesTracker, "add", _cpu_tracker_add)
    rng_filter = _ExpectedRngWarning()
    logging.getLogger(megatron_random.__name__).addFilter(rng_filter)
    _state["rng_filter"] = rng_filter
    mode = _CudaAsCpu()
    mode.__enter__()
    _state["mode"] = mode
    return True


def disable() -> None:
    """Undoes `enable()` (for tests); call it from the thread that enabled it."""
    if not is_enabled():
        return
    _state["mode"].__exit__(None, None, None)
    _state["mode"] = None
    from megatron.core.tensor_parallel import random as megatron_random

    logging.getLogger(megatron_random.__name__).removeFilter(_state.pop("rng_filter"))
    while _state["undo"]:
        owner, name, original = _state["undo"].pop()
        setattr(owner, name, original)
