"""The gated delta rule (Gated DeltaNet's recurrence), chunked: a torch version that runs anywhere, and `fla`'s.

Per value head, with a key/query of size `dk` and a value of size `dv`, the state `S` (`dk x dv`) follows

    S_t = γ_t (I - β_t k_t k_tᵀ) S_{t-1} + β_t k_t v_tᵀ,        o_t = scale · S_tᵀ q_t

with `γ_t = exp(g_t)` (`g <= 0`), `β_t` in `(0, 1)`, and `scale = dk^-1/2`. Inside a chunk of `c` tokens the
updates are solved at once (the WY form): with `Γ_t` the decay from the chunk's start through `t`, the writes
`u_s = β_s (v_s - (γ_s S_{s-1})ᵀ k_s)` satisfy the unit lower-triangular system
`(I + A) u = β v - β Γ K S_0`, `A_sr = β_s (Γ_s / Γ_r) k_sᵀ k_r` for `r < s`; then
`o_t = scale · (Γ_t q_tᵀ S_0 + Σ_{s<=t} (Γ_t / Γ_s) (q_tᵀ k_s) u_s)` and
`S_c = Γ_c S_0 + Σ_s (Γ_c / Γ_s) k_s u_sᵀ`. Chunks follow one another through `S`.

`chunk_rule(q, k, v, g, beta, initial_state)` picks `fla`'s `chunk_gated_delta_rule` on a GPU where `fla` is
installed (the optional extra `fla`), else `torch_chunk_rule`; both return `(output, final_state)` and are
differentiable in every input, the initial state included. Inputs are `[batch, tokens, heads, dim]`, `q` and `k`
already L2-normalised and repeated to the value heads; `g` and `beta` are `[batch, tokens, heads]`.
"""

import functools

import torch

from megatron_csbp.core.rules import GATED_DELTA_CHUNK as CHUNK  # tokens solved at once (fla's chunk size)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """`x / sqrt(|x|² + eps)` over the last dimension, in fp32 (fla's and transformers' normalisation)."""
    x = x.float()
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def torch_chunk_rule(q, k, v, g, beta, initial_state=None, chunk: int = CHUNK):
    """The chunked gated delta rule in torch (fp32), `(output [b, T, H, dv] in q's dtype, final state
    [b, H, dk, dv] fp32)`."""
    dtype = q.dtype
    batch, tokens, heads, dk = k.shape
    dv = v.shape[-1]
    q, k, v = (x.float().transpose(1, 2) for x in (q, k, v))  # [b, H, T, d]
    g, beta = (x.float().transpose(1, 2) for x in (g, beta))  # [b, H, T]
    pad = -tokens % chunk
    if pad:
        q, k, v = (torch.nn.functional.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (torch.nn.functional.pad(x, (0, pad)) for x in (g, beta))
    n = (tokens + pad) // chunk
    q = q.reshape(batch, heads, n, chunk, dk) * dk ** -0.5
    k = k.reshape(batch, heads, n, chunk, dk)
    v = v.reshape(batch, heads, n, chunk, dv)
    g, beta = g.reshape(batch, heads, n, chunk), beta.reshape(batch, heads, n, chunk)
    decay = g.cumsum(-1)  # log Γ_t
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    ratio = (decay[..., :, None] - decay[..., None, :]).masked_fill(~causal, float("-inf")).exp()  # Γ_t / Γ_s, s <= t
    system = (beta[..., None] * (k @ k.transpose(-1, -2)) * ratio).tril(-1)
    system = system + torch.eye(chunk, device=q.device)
    writes = torch.linalg.solve_triangular(system, beta[..., None] * v, upper=False, unitriangular=True)
    reads = torch.linalg.solve_triangular(system, (beta * decay.exp())[..., None] * k, upper=False,
                                          unitriangular=True)
    attention = (q @ k.transpose(-1, -2)) * ratio
    q_decayed = q * decay.exp()[..., None]
    k_to_end = k * (decay[..., -1:] - decay).exp()[..., None]
    chunk_decay = decay[..., -1].exp()[..., None, None]
    state = (torch.zeros(batch, heads, dk, dv, device=q.device) if initial_state is None
             else initial_state.float())
    outputs = []
    for i in range(n):
        u = writes[:, :, i] - reads[:, :, i] @ state
        outputs.append(q_decayed[:, :, i] @ state + attention[:, :, i] @ u)
        state = state * chunk_decay[:, :, i] + k_to_end[:, :, i].transpose(-1, -2) @ u
    out = torch.stack(outputs, 2).reshape(batch, heads, n * chunk, dv)[:, :, :tokens]
    return out.transpose(1, 2).to(dtype), state


@functools.cache
def fla_rule():
    """`fla`'s `chunk_gated_delta_rule`, or None where `fla` is not installed."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError:
        return None
    return chunk_gated_delta_rule


def chunk_rule(q, k, v, g, beta, initial_state=None):
    """`fla`'s kernel on a GPU where installed, else `torch_chunk_rule`: `(output, final state fp32)`."""
    kernel = fla_rule() if q.is_cuda else None
    if kernel is None:
        return torch_chunk_rule(q, k, v, g, beta, initial_state, chunk=min(CHUNK, q.shape[1]))
    out, state = kernel(q, k, v, g=g.float(), beta=beta, initial_state=None if initial_state is None else
                        initial_state.float(), output_final_state=True, use_qk_l2norm_in_kernel=False)
    return out, state.float()
