"""DiffusionGemma's self-conditioning: the canvas (noisy) rows' embeddings take a signal built from a previous
prediction, the expected embedding under its distribution.

transformers' `DiffusionGemmaSelfConditioning` defines it: with `s` the signal (zero where there is none),
`x' = RMS(x + down(gelu_tanh(gate(RMS_w(s))) * up(RMS_w(s))))`, the first norm with a weight, the last without;
a zero signal gives `RMS(x)`, so every canvas row passes the last norm whether or not it is self-conditioned. Only
the canvas takes it: the clean (encoder) rows keep their embedding. The weights are replicated over TP; under
sequence parallelism each TP rank runs its own rows, so they are marked `sequence_parallel` and megatron-core sums
their gradients over TP, as it does the norms'.
"""

import torch


def _rms(x, eps, weight=None):
    """Gemma's RMS norm in fp32 (`x · (mean(x²) + eps)^-1/2`, times `weight`), back in `x`'s dtype."""
    y = x.float()
    y = y * torch.pow(y.pow(2).mean(-1, keepdim=True) + eps, -0.5)
    return (y if weight is None else y * weight.float()).type_as(x)


class SelfConditioning(torch.nn.Module):
    """The canvas rows' self-conditioning block (the module docstring): `forward(x [s, b, h], signal [s, b, h])
    -> [s, b, h]`, over canvas rows only."""

    def __init__(self, config):
        super().__init__()
        hidden, inner = config.hidden_size, config.ffn_hidden_size
        self.eps = config.layernorm_epsilon
        self.pre_norm_weight = torch.nn.Parameter(torch.ones(hidden, dtype=config.params_dtype))
        self.gate = torch.nn.Parameter(torch.empty(inner, hidden, dtype=config.params_dtype))
        self.up = torch.nn.Parameter(torch.empty(inner, hidden, dtype=config.params_dtype))
        self.down = torch.nn.Parameter(torch.empty(hidden, inner, dtype=config.params_dtype))
        for weight, init in ((self.gate, config.init_method), (self.up, config.init_method),
                             (self.down, config.output_layer_init_method)):
            init(weight)
        for param in self.parameters():
            param.sequence_parallel = config.sequence_parallel

    def forward(self, x, signal):
        normed = _rms(signal, self.eps, self.pre_norm_weight)
        gated = torch.nn.functional.gelu(normed @ self.gate.t(), approximate="tanh") * (normed @ self.up.t())
        return _rms(x + gated @ self.down.t(), self.eps)
