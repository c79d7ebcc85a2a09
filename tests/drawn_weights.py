"""transformers' reference modules with every weight drawn away from its initialisation, so a comparison with
ours cannot pass on zeros, ones or a symmetry the init happens to have: norms and scales around 1 (as trained ones
are), every other weight `0.3 · N(0, 1)`. The draw follows the parameters' sorted names, so it is the same on
every run; the caller's generator goes on to whatever it draws next."""

import torch


def draw(module: torch.nn.Module, generator: torch.Generator) -> torch.nn.Module:
    with torch.no_grad():
        for name, param in sorted(module.named_parameters()):
            if "norm" in name or name.endswith("scale"):
                param.copy_(1 + 0.5 * (torch.rand(param.shape, generator=generator) - 0.5))
            else:
                param.copy_(0.3 * torch.randn(param.shape, generator=generator))
    return module
