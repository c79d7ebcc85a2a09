"""The one place where megatron-core's and Megatron-LM's CUDA assumptions are neutralised, so they run on CPU (gloo).

megatron-core 0.16 and Megatron-LM's `pretrain()` (tag `core_v0.16.1`) assume a GPU in spots that have
nothing to do with the maths. `with active():` switches the following on for the duration of the block,
and only where there is no accelerator of any kind (`torch.accelerator.is_available()` is false: CUDA,
XPU, MPS ... all count); elsewhere it changes nothing and yields False. Leaving the block restores
exactly what it changed.

megatron-core:
* A `TorchFunctionMode` (`_CudaAsCpu`) on the calling thread that maps every CUDA device to the CPU:
  - `device="cuda"` / `device=torch.cuda.current_device()` in factory calls (`schedules.py` token
    count, optimizer `_scale`/`found_inf`, `clip_grads.py`, `utils.py` l2 norm, grad buffers,
    tensor-parallel gather buffers, p2p shape tensors, checkpoint failure broadcasts, Megatron-LM's
    JIT warm-up and loss reductions);
  - `.cuda()`, `.to("cuda")`, `.pin_memory()` and `pin_memory=True` (RoPE slicing, checkpoint
    exchange, Megatron-LM's `get_model`) become no-ops on the CPU;
  - `Tensor.type()` of a CPU tensor reports the `torch.cuda.*Tensor` name, because `clip_grads.py`
    asserts `param.grad.type() == 'torch.cuda.FloatTensor'` when `clip_grad > 0`.
  Backward functions run outside any mode; the spots they reach need only the next item.
* `torch.cuda.current_device()` returns the CPU device itself (not an index for the mode to map):
  autograd runs custom backward functions (e.g. the sequence-parallel gathers) outside any
  `TorchFunctionMode`, and they allocate with `device=torch.cuda.current_device()`. And
  `torch.cuda.synchronize()` is a no-op: p2p communication and `dist_checkpointing`'s preload call
  them unconditionally. `torch.cuda.manual_seed` seeds the CPU generator, so
  `model_parallel_cuda_manual_seed` seeds the default state as it does on a GPU, and
  `torch.cuda.get/set_rng_state` (the rerun state machine's checkpointed state) are the CPU generator's.
* `torch.cuda.Stream`, `current_stream` and `stream` are torch's CPU streams (no-ops): the MoE alltoall token
  dispatcher copies its token counts to the host on a side stream, and Megatron-LM's `get_model` builds DDP on
  one. Its split sizes, which it turns into numpy arrays when it copies them off the GPU, are made numpy
  arrays on the host too (`all_to_all_single` refuses a tensor of sizes).
* The RNG helpers of `tensor_parallel/random.py` (`_get_cuda_rng_state`, `_set_cuda_rng_state` and
  `CudaRNGStatesTracker.add`) use the CPU generator, so the tracker's `fork()` (dropout in
  tensor-parallel regions, weight init) and activation recomputation work. As the CPU generator is
  then both "the CPU state" and "the tracked state", the tracker's "CPU RNG state changed within GPU
  RNG context" warning is expected and filtered out.

Megatron-LM (only when `megatron.training` has been imported before the block is entered):
* `initialize_megatron` asserts CUDA unless given `allow_no_cuda=True`, which `pretrain()` never passes.
* `validate_args` asks `get_device_arch_version()` (a CUDA call) when TP or CP > 1, to enforce
  `CUDA_DEVICE_MAX_CONNECTIONS=1`, a GPU-stream rule: the CPU answers as a GPU without that rule.
* `_initialize_distributed` skips the model-parallel groups when `torch.cuda.device_count() == 0`: the
  CPU counts as one device, and `torch.cuda.set_device` is a no-op.
* `fused_kernels.load` compiles CUDA kernels (needs `CUDA_HOME`): nothing to load on the CPU.
* The JIT warm-up (`set_jit_fusion_options`) draws `torch.rand(device="cuda")`; on the CPU that consumes
  the default generator and would change the initial weights, so the generator is restored around it.
* `megatron.training` imports `triton` (~1 GB, GPU-only) through megatron-core's batch-invariant kernels;
  `triton_free_batch_invariant_kernels()` lets it import without triton (`--batch-invariant-mode` then
  refuses with a message).

The mode lives on the thread that entered the block; the patches are process-wide while it lasts.
"""

import contextlib
import functools
import logging
import sys
import types

import torch
from torch.overrides import TorchFunctionMode

_HOST_DEVICE_TYPES = ("cpu", "meta")
_BATCH_INVARIANT_KERNELS = "megatron.core.transformer.custom_layers.batch_invariant_kernels"


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


class _HostEvent:
    """What `_HostStream.record_event` returns: host work is done when it returns, so waiting is a no-op."""

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def wait(self, stream=None) -> None:
        pass


class _HostStream(torch.cpu.Stream):
    """torch's CPU stream (a no-op stand-in), whose `record_event` gives an event to synchronize on, as the MoE
    alltoall token dispatcher does after copying its token counts to the host."""

    def record_event(self, event=None) -> _HostEvent:
        return _HostEvent()


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


class _Patches:
    """Attribute replacements undone, last first, when the run's `ExitStack` closes."""

    def __init__(self, stack: contextlib.ExitStack):
        self.stack = stack

    def __call__(self, owner, name, value):
        original = getattr(owner, name)
        setattr(owner, name, value)
        self.stack.callback(setattr, owner, name, original)


def _host_copy(tensor, as_numpy: bool = False, record_stream: bool = False):
    """`moe_utils.maybe_move_tensor_to_cpu` for tensors already on the host: the numpy array it gives a GPU
    tensor (the alltoall dispatcher's split sizes, which `all_to_all_single` takes as a sequence of ints)."""
    if torch.is_tensor(tensor) and as_numpy:
        return tensor.numpy()
    return tensor


def _neutralise_megatron_core(patch: _Patches) -> None:
    from megatron.core.tensor_parallel import random as megatron_random
    from megatron.core.transformer.moe import token_dispatcher

    patch(torch.cuda, "current_device", lambda: torch.device("cpu"))
    patch(torch.cuda, "synchronize", lambda device=None: None)
    patch(torch.cuda, "manual_seed", torch.manual_seed)
    patch(torch.cuda, "Stream", _HostStream)
    patch(token_dispatcher, "maybe_move_tensor_to_cpu", _host_copy)
    patch(torch.cuda, "current_stream", torch.cpu.current_stream)
    patch(torch.cuda, "stream", torch.cpu.stream)
    patch(torch.cuda, "get_rng_state", lambda device=None: torch.get_rng_state())
    patch(torch.cuda, "set_rng_state", lambda new_state, device=None: torch.set_rng_state(new_state))
    patch(megatron_random, "_get_cuda_rng_state",
          lambda device=None, clone=False, graph_safe=False: torch.get_rng_state())
    patch(megatron_random, "_set_cuda_rng_state",
          lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(new_state))
    patch(megatron_random.CudaRNGStatesTracker, "add", _cpu_tracker_add)
    logger, rng_filter = logging.getLogger(megatron_random.__name__), _ExpectedRngWarning()
    logger.addFilter(rng_filter)
    patch.stack.callback(logger.removeFilter, rng_filter)


def _keeping_cpu_generator(function):
    @functools.wraps(function)
    def wrapped(*args, **kwargs):
        with torch.random.fork_rng(devices=[]):
            return function(*args, **kwargs)
    return wrapped


def _neutralise_megatron_lm(patch: _Patches) -> None:
    from megatron.legacy import fused_kernels
    from megatron.training import arguments, training

    patch(training, "initialize_megatron", functools.partial(training.initialize_megatron, allow_no_cuda=True))
    patch(arguments, "get_device_arch_version", lambda: 10)
    patch(torch.cuda, "device_count", lambda: 1)
    patch(torch.cuda, "set_device", lambda device: None)
    patch(fused_kernels, "load", lambda args: None)
    patch(training, "set_jit_fusion_options", _keeping_cpu_generator(training.set_jit_fusion_options))


def triton_free_batch_invariant_kernels() -> bool:
    """Lets `megatron.training` import where triton is absent (True if a stand-in was installed).

    Megatron-LM imports megatron-core's batch-invariant kernels (triton programs) at start-up only to
    offer `--batch-invariant-mode`. Without triton, a stand-in module takes their place; asking for the
    mode then fails with a message instead of the whole of Megatron-LM failing to import.
    """
    import importlib.util

    if importlib.util.find_spec("triton") is not None or _BATCH_INVARIANT_KERNELS in sys.modules:
        return False

    def unavailable(*args, **kwargs):
        raise RuntimeError("--batch-invariant-mode needs triton (a GPU package): pip install triton on a GPU "
                           "machine, or drop --batch-invariant-mode")

    stand_in = types.ModuleType(_BATCH_INVARIANT_KERNELS, doc=triton_free_batch_invariant_kernels.__doc__)
    stand_in.enable_batch_invariant_mode = stand_in.disable_batch_invariant_mode = unavailable
    stand_in.set_batch_invariant_mode = unavailable
    stand_in.is_batch_invariant_mode_enabled = lambda: False
    sys.modules[_BATCH_INVARIANT_KERNELS] = stand_in
    return True


@contextlib.contextmanager
def active():
    """Neutralises the CUDA assumptions (see the module doc) while the block runs; yields whether it did.

    Never active on a machine with an accelerator: there it changes nothing and yields False.
    """
    if torch.accelerator.is_available():
        yield False
        return
    with contextlib.ExitStack() as stack:
        patch = _Patches(stack)
        _neutralise_megatron_core(patch)
        if "megatron.training" in sys.modules:
            _neutralise_megatron_lm(patch)
        stack.enter_context(_CudaAsCpu())
        yield True
