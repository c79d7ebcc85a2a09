"""The one place the compute device is chosen: the accelerator when present, else the CPU."""

import torch
import torch.distributed as dist


def default_device() -> torch.device:
    """The device every tensor of ours lives on; chosen here once, never spelled out elsewhere."""
    accelerator = torch.accelerator.current_accelerator(check_available=True)
    if accelerator is None:
        return torch.device("cpu")
    return torch.device(accelerator.type, torch.accelerator.current_device_index())


def default_backend() -> str:
    """The torch.distributed backend that goes with `default_device()` (gloo on the CPU)."""
    return dist.get_default_backend_for_device(default_device())
