"""Readiness of megatron_csbp on one GPU: the flex kernels' exactness and speed, and a ~1B training step.

    python scripts/gpu_check.py [--sections correctness,throughput,train] [--json FILE] [--allow-cpu] [sizes]

* correctness: the CSBP op on one rank (P = C = 1, no process group) against dense fp64 attention
  under the full `2L x 2L` BDLM mask, output and dQ/dK/dV, fp32 and bf16, GQA, in CSBP's two kernels and
  in the field's CP's one masked call (flex with the BDLM block mask). A dense causal mask over the same
  rows is the negative control: the op must be far from it.
* throughput: the op's forward and backward TFLOP/s on the BDLM mask (real pairs `L² + L·B` per
  head) beside dense causal attention (`scaled_dot_product_attention`) over the same `2L` rows, bf16.
* kernels: each mode's per-rank attention kernels on this one device (`--kernel-ranks` P, rank 0's rows and
  plan, `--kernel-seq-lengths` L, default 32K-128K): CSBP's dense block-diagonal and prefix calls, the field's
  CP's one masked call (flex with the BDLM block mask over the rank's `2L/P` rows against all `2L` keys),
  and cp-traffic's; forward and backward seconds and rates in real pairs/s per kernel family, the figures
  the planner's per-kernel rates calibrate on (pairs per head and sample from `ParallelMode.kernel_calls`,
  computed pairs at flex's 128 tile).
* gated-delta: the gated delta rule of Gated DeltaNet layers (`core.kernels.gated_delta.chunk_rule`: `fla`'s
  `chunk_gated_delta_rule` on a GPU where the `fla` extra is installed, else the torch chunked rule) against the
  token-by-token recurrence in fp64, output, final state and every input's gradient (the initial state's
  included), fp32 as the trainer runs it; dropping the initial state is the negative control.
* train: a few AdamW steps of a ~1B-parameter BDLM GPT model on one rank (the Transformer Engine spec
  when it imports): tokens/s, exact BDLM TFLOP/s (`flops.bdlm_step_flops`) and peak memory.

Each section is reported on its own: a failure keeps its traceback and the other sections still run;
the exit status is 1 when any failed. The JSON summary is rewritten after every section, so a run
cut short still leaves what it measured. Without an accelerator the script refuses (status 2) unless
`--allow-cpu`, which runs the same code on the CPU kernels at the (small) sizes given. Flex attention
has no CPU backward, so there the correctness section runs `FlexKernels` twice more: its forward with
eager flex attention, and its whole forward and backward around a dense stand-in for the fused kernel.

`main(argv)` is the command of `scripts/gpu_check.py`.
"""

import argparse
import contextlib
import itertools
import json
import math
import os
import statistics
import sys
import time
import traceback

import torch

from megatron_csbp.core import modes, rules
from megatron_csbp.core.device import default_device
from megatron_csbp.core.model_shape import ModelShape
from megatron_csbp.core.run_config import RunConfig

SECTIONS = ("correctness", "throughput", "kernels", "gated-delta", "train")
CHECKED_MODES = (modes.CSBP, modes.CP)  # CSBP's two kernels and the field's CP's one masked call, on one rank
KERNEL_MODES = (modes.CSBP, modes.CP, modes.CP_TRAFFIC)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
SPECS = ("auto", "te", "local")
NEGATIVE_CONTROL_FACTOR = 10  # the causal-mask control must be at least this many tolerances away

# The trainer's rules (megatron_csbp.core.rules, through each run's `RunConfig`), told this script's flag names.
_TOOL = dict(mode="mode", clean_shards="clean shards", clean_layout="clean layout", kv_channels=None)
_ONE_RANK = dict(_TOOL, parallel_size="ranks")  # P = C = 1
_ATTENTION = dict(num_layers="one layer")  # one attention op: heads x head size, no other layer
CHECK_FLAGS = rules.FLAGS.renamed(seq_length="--check-seq-lengths", block_size="--check-block-size",
                                  heads="--check-heads", query_groups="--check-kv-heads",
                                  hidden_size="--check-heads x --check-head-dim", micro_batch="--check-batch",
                                  **_ATTENTION, **_ONE_RANK)
BENCH_FLAGS = rules.FLAGS.renamed(seq_length="--bench-seq-length", block_size="--bench-block-size",
                                  heads="--bench-heads", query_groups="--bench-kv-heads",
                                  hidden_size="--bench-heads x --bench-head-dim", micro_batch="--bench-batch",
                                  **_ATTENTION, **_ONE_RANK)
KERNEL_FLAGS = BENCH_FLAGS.renamed(seq_length="--kernel-seq-lengths", block_size="--kernel-block-size",
                                   parallel_size="--kernel-ranks")
TRAIN_FLAGS = rules.FLAGS.renamed(seq_length="--train-seq-length", block_size="--train-block-size",
                                  heads="--train-heads", query_groups="--train-query-groups",
                                  hidden_size="--train-hidden-size", num_layers="--train-layers",
                                  micro_batch="--train-micro-batch", **_ONE_RANK)


def _ints(text):
    return [int(item) for item in text.split(",") if item]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="scripts/gpu_check.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {SECTIONS}")
    parser.add_argument("--json", default=os.path.join(os.environ.get("OUT") or ".", "gpu_check.json"),
                        help="summary file (default: $OUT/gpu_check.json, or ./gpu_check.json)")
    parser.add_argument("--allow-cpu", action="store_true",
                        help="run on the CPU when there is no accelerator (small sizes; flex forward only)")
    check = parser.add_argument_group("correctness")
    check.add_argument("--check-seq-lengths", default="1024,4096", help="clean lengths L, comma-separated")
    check.add_argument("--check-dtypes", default="fp32,bf16", help="comma-separated subset of fp32,bf16")
    check.add_argument("--check-block-size", type=int, default=64)
    check.add_argument("--check-batch", type=int, default=2)
    check.add_argument("--check-heads", type=int, default=8)
    check.add_argument("--check-kv-heads", type=int, default=2)
    check.add_argument("--check-head-dim", type=int, default=128)
    check.add_argument("--fp32-tolerance", type=float, default=1e-5, help="relative error, norm-wise")
    check.add_argument("--bf16-tolerance", type=float, default=2e-2, help="relative error, norm-wise")
    bench = parser.add_argument_group("throughput")
    bench.add_argument("--bench-seq-length", type=int, default=32768)
    bench.add_argument("--bench-block-size", type=int, default=64)
    bench.add_argument("--bench-batch", type=int, default=1)
    bench.add_argument("--bench-heads", type=int, default=32)
    bench.add_argument("--bench-kv-heads", type=int, default=8)
    bench.add_argument("--bench-head-dim", type=int, default=128)
    bench.add_argument("--bench-dtype", default="bf16", choices=tuple(DTYPES))
    bench.add_argument("--bench-iters", type=int, default=5, help="timed calls after the first (median)")
    kernels = parser.add_argument_group("kernels (the throughput section's heads, head size, dtype and iterations)")
    kernels.add_argument("--kernel-seq-lengths", default="32768,65536,131072", help="clean lengths L, comma-separated")
    kernels.add_argument("--kernel-ranks", type=int, default=8, help="P whose rank-0 work is timed (C = P)")
    kernels.add_argument("--kernel-block-size", type=int, default=64)
    delta = parser.add_argument_group("gated-delta (fp32, the correctness section's --fp32-tolerance)")
    delta.add_argument("--delta-tokens", type=int, default=320, help="tokens (not a multiple of the 64-token chunk)")
    delta.add_argument("--delta-heads", type=int, default=4)
    delta.add_argument("--delta-key-dim", type=int, default=64)
    delta.add_argument("--delta-value-dim", type=int, default=128)
    train = parser.add_argument_group("train")
    train.add_argument("--train-layers", type=int, default=16)
    train.add_argument("--train-hidden-size", type=int, default=2048)
    train.add_argument("--train-heads", type=int, default=16)
    train.add_argument("--train-query-groups", type=int, default=8)
    train.add_argument("--train-ffn-hidden-size", type=int, default=5632, help="SwiGLU width")
    train.add_argument("--train-vocab-size", type=int, default=32000, help="the last id is MASK")
    train.add_argument("--train-seq-length", type=int, default=8192)
    train.add_argument("--train-block-size", type=int, default=64)
    train.add_argument("--train-micro-batch", type=int, default=1)
    train.add_argument("--train-steps", type=int, default=3, help="timed steps after the warm-up (median)")
    train.add_argument("--train-warmup", type=int, default=1, help="untimed first steps (compilation)")
    train.add_argument("--train-dtype", default="bf16", choices=tuple(DTYPES))
    train.add_argument("--train-spec", default="auto", choices=SPECS,
                       help="te: Transformer Engine spec; local: megatron-core's; auto: te when it imports")
    args = parser.parse_args(argv)

    args.sections = [s for s in args.sections.split(",") if s]
    args.check_seq_lengths = _ints(args.check_seq_lengths)
    args.check_dtypes = [d for d in args.check_dtypes.split(",") if d]
    args.kernel_seq_lengths = _ints(args.kernel_seq_lengths)
    if not args.sections or set(args.sections) - set(SECTIONS):
        parser.error(f"--sections={','.join(args.sections)}: choose from {','.join(SECTIONS)}")
    if not args.check_dtypes or set(args.check_dtypes) - set(DTYPES):
        parser.error(f"--check-dtypes={','.join(args.check_dtypes)}: choose from {','.join(DTYPES)}")
    try:
        list(runs(args))  # every run's RunConfig: the trainer's refusal, in its order
    except rules.ConfigError as error:
        parser.error(str(error))
    if args.train_vocab_size < 2:
        parser.error("--train-vocab-size must leave room for data ids and the MASK id (at least 2)")
    return args


def _attention_shape(heads, kv_heads, head_dim, flags) -> ModelShape:
    """One attention layer of `heads` query heads sharing `kv_heads` K/V heads of `head_dim`."""
    return ModelShape(num_layers=1, hidden_size=heads * head_dim, num_attention_heads=heads,
                      num_query_groups=kv_heads, kv_channels=head_dim, flags=flags)


def correctness_run(args, mode, seq_length) -> RunConfig:
    """One rank's run of `mode` at `seq_length` (P = C = 1) in the correctness section."""
    shape = _attention_shape(args.check_heads, args.check_kv_heads, args.check_head_dim, CHECK_FLAGS)
    return RunConfig(shape, seq_length, args.check_block_size, mode=mode, micro_batch_size=args.check_batch,
                     flags=CHECK_FLAGS)


def _bench_shape(args, flags=BENCH_FLAGS) -> ModelShape:
    return _attention_shape(args.bench_heads, args.bench_kv_heads, args.bench_head_dim, flags)


def throughput_run(args) -> RunConfig:
    """The one-rank CSBP run the throughput section times."""
    return RunConfig(_bench_shape(args), args.bench_seq_length, args.bench_block_size,
                     micro_batch_size=args.bench_batch, flags=BENCH_FLAGS)


def kernel_run(args, mode, seq_length) -> RunConfig:
    """`mode` at `seq_length` on `--kernel-ranks` ranks, whose rank 0 the kernels section times."""
    return RunConfig(_bench_shape(args, KERNEL_FLAGS), seq_length, args.kernel_block_size, mode=mode,
                     block_parallel_size=args.kernel_ranks, micro_batch_size=args.bench_batch, flags=KERNEL_FLAGS)


def train_run(args) -> RunConfig:
    """The one-rank CSBP training run of the train section (SwiGLU, RMSNorm, no linear biases)."""
    shape = ModelShape(num_layers=args.train_layers, hidden_size=args.train_hidden_size,
                       num_attention_heads=args.train_heads, num_query_groups=args.train_query_groups,
                       ffn_hidden_size=args.train_ffn_hidden_size, swiglu=True, add_bias_linear=False,
                       layernorm_bias=False, flags=TRAIN_FLAGS)
    return RunConfig(shape, args.train_seq_length, args.train_block_size, micro_batch_size=args.train_micro_batch,
                     flags=TRAIN_FLAGS)


def runs(args):
    """Every run the sections make, section by section (`ConfigError` at the first the trainer would refuse)."""
    for seq_length in args.check_seq_lengths:
        for mode in CHECKED_MODES:
            yield correctness_run(args, mode, seq_length)
    yield throughput_run(args)
    for seq_length in args.kernel_seq_lengths:
        for mode in KERNEL_MODES:
            yield kernel_run(args, mode, seq_length)
    yield train_run(args)


def _sync(device):
    if device.type != "cpu":
        torch.accelerator.synchronize()


def _free(device):
    if device.type != "cpu":
        torch.get_device_module(device).empty_cache()


def _reset_peak(device):
    if device.type != "cpu":
        torch.accelerator.reset_peak_memory_stats()


def _peak_bytes(device):
    return torch.accelerator.max_memory_allocated() if device.type != "cpu" else None


def relative_error(actual, expected) -> float:
    """Norm-wise `||a - b|| / ||b||`, in fp64."""
    return ((actual.double() - expected.double()).norm() / expected.double().norm()).item()


def bdlm_mask(seq_length, block_size, device):
    """`[2L, 2L]` bool over `[x_t ; x_0]`, from the mask table of docs/algorithm.md §3 (noisy rows first)."""
    block = torch.arange(seq_length, device=device) // block_size
    qb, kb = block.view(-1, 1), block.view(1, -1)
    return torch.cat([torch.cat([qb == kb, kb < qb], 1), torch.cat([torch.zeros_like(qb == kb), kb <= qb], 1)], 0)


def causal_mask(seq_length, device):
    """What a causal attention over the `2L` rows would see: the negative control."""
    return torch.ones(2 * seq_length, 2 * seq_length, dtype=torch.bool, device=device).tril()


def dense_attention(query, key, value, mask, scale):
    """`[2L, b, heads, d]`, `[2L, b, kv_heads, d]` -> `[2L, b, heads·d]` in fp64; GQA by repeating K/V."""
    group = query.shape[2] // key.shape[2]
    q = query.double().permute(1, 2, 0, 3)
    k = key.double().repeat_interleave(group, dim=2).permute(1, 2, 0, 3)
    v = value.double().repeat_interleave(group, dim=2).permute(1, 2, 0, 3)
    scores = (q @ k.transpose(-1, -2) * scale).masked_fill(~mask, float("-inf"))
    return (torch.softmax(scores, dim=-1) @ v).permute(2, 0, 1, 3).flatten(2)


@contextlib.contextmanager
def ieee_fp32():
    """fp32 matmuls in full precision (no TF32) in cuBLAS, cuDNN and the flex templates, restored after."""
    saved = torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.fp32_precision
    torch.backends.cuda.matmul.fp32_precision = "ieee"
    torch.backends.cudnn.fp32_precision = "ieee"
    try:
        yield
    finally:
        torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.fp32_precision = saved


class DenseFlexStandIn:
    """`flex_attention`'s contract (block mask, scale, natural-log LSE) computed densely under autograd.

    Lets the CPU run `FlexKernels`' own code (block masks, GQA folding, backward by recomputation with
    the LSE-merge gradient) forward and backward; only the fused kernel itself is replaced.
    """

    def __call__(self, query, key, value, block_mask, scale, return_aux, enable_gqa=False):
        from torch.nn.attention.flex_attention import create_mask

        if enable_gqa:  # query head h reads K/V head h // (query heads per K/V head), as flex does
            group = query.shape[1] // key.shape[1]
            key, value = key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1)
        scores = query.float() @ key.float().transpose(-1, -2) * scale
        if block_mask is not None:  # none: every key visible
            visible = create_mask(block_mask.mask_mod, 1, 1, query.shape[2], key.shape[2], query.device)
            scores = scores.masked_fill(~visible, float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)
        probs = torch.exp(scores - torch.where(torch.isinf(lse), 0.0, lse).unsqueeze(-1))
        return (probs @ value.float()).to(query.dtype), argparse.Namespace(lse=lse)


def kernel_variants(device):
    """(label, kernels or None for the op's own choice, whether the backward runs) to check on `device`."""
    from megatron_csbp.core.kernels import FlexKernels, default_kernels

    own = [(type(default_kernels(device)).__name__, None, True)]
    if device.type != "cpu":
        return own
    stand_in = FlexKernels(compile=False)
    stand_in._flex = DenseFlexStandIn()
    return own + [("FlexKernels (eager, forward only)", FlexKernels(compile=False), False),
                  ("FlexKernels (dense stand-in for flex_attention)", stand_in, True)]


def correctness_case(args, device, label, kernels, backward, dtype_name, seq_length, mode):
    """One (kernels, mode, dtype, L) case: the op's errors against the fp64 reference, and the negative control.
    `kernels`: the kernel family the op's plan is made for (None: the device's own)."""
    from megatron_csbp.core import ops

    dtype, block = DTYPES[dtype_name], args.check_block_size
    tolerance = args.fp32_tolerance if dtype is torch.float32 else args.bf16_tolerance
    layout = correctness_run(args, mode, seq_length).layout(0)
    rows = torch.cat([layout.noisy_positions, seq_length + layout.clean_positions]).to(device)
    generator = torch.Generator().manual_seed(seq_length)
    batch, heads, kv_heads, head_dim = args.check_batch, args.check_heads, args.check_kv_heads, args.check_head_dim
    q, k, v = (torch.randn(2 * seq_length, batch, n, head_dim, generator=generator).to(device, dtype)
               for n in (heads, kv_heads, kv_heads))
    grad = torch.randn(2 * seq_length, batch, heads * head_dim, generator=generator).to(device, dtype)
    scale = head_dim ** -0.5

    inputs = [x[rows].detach().requires_grad_(backward) for x in (q, k, v)]
    precision = ieee_fp32() if dtype is torch.float32 and device.type != "cpu" else contextlib.nullcontext()
    start = time.perf_counter()
    with precision:
        fp32_precision = torch.backends.cuda.matmul.fp32_precision  # "ieee": no TF32
        plan = ops.ring_plan(layout, device, kernels)
        out = ops.context_sharded_block_attention(*inputs, layout, softmax_scale=scale, plan=plan)
        if backward:
            out.backward(grad[rows])
    _sync(device)
    elapsed = time.perf_counter() - start

    reference_inputs = [x.double().requires_grad_(backward) for x in (q, k, v)]
    reference = dense_attention(*reference_inputs, bdlm_mask(seq_length, block, device), scale)
    errors = {"out": relative_error(out.detach(), reference.detach()[rows])}
    if backward:
        reference.backward(grad.double())
        for name, mine, theirs in zip(("dq", "dk", "dv"), inputs, reference_inputs):
            errors[name] = relative_error(mine.grad, theirs.grad[rows])
    del reference, reference_inputs
    with torch.no_grad():
        negative = relative_error(out, dense_attention(q, k, v, causal_mask(seq_length, device), scale)[rows])
    dtype_ok = out.dtype == dtype
    passed = (dtype_ok and all(error <= tolerance for error in errors.values())  # False for NaN
              and negative >= NEGATIVE_CONTROL_FACTOR * tolerance)
    return dict(kernels=label, mode=mode.name, dtype=dtype_name, seq_length=seq_length, block_size=block, batch=batch,
                heads=heads, kv_heads=kv_heads, head_dim=head_dim, backward=backward, errors=errors,
                tolerance=tolerance,
                negative_control_error=negative, output_dtype=str(out.dtype).replace("torch.", ""),
                fp32_precision=fp32_precision, seconds=elapsed, passed=passed)


def correctness(args, device, records, variants=None):
    """Every case of every kernel family in `variants` (default: `kernel_variants(device)`), failures kept."""
    for label, kernels, backward in variants or kernel_variants(device):
        for mode, dtype_name, seq_length in itertools.product(CHECKED_MODES, args.check_dtypes,
                                                              args.check_seq_lengths):
            case = dict(kernels=label, mode=mode.name, dtype=dtype_name, seq_length=seq_length)
            try:
                case = correctness_case(args, device, label, kernels, backward, dtype_name, seq_length, mode)
            except Exception:
                case.update(passed=False, error=traceback.format_exc())
            records.append(case)
            print(_correctness_line(case), flush=True)
            _free(device)


def _correctness_line(r):
    if "error" in r:
        return (f"{r['kernels']} {r['mode']} {r['dtype']} L={r['seq_length']}: ERROR "
                f"{r['error'].strip().splitlines()[-1]}")
    errors = " ".join(f"{name} {value:.1e}" for name, value in r["errors"].items())
    expected_dtype = str(DTYPES[r["dtype"]]).replace("torch.", "")
    dtype_note = "" if r["output_dtype"] == expected_dtype else f", OUTPUT {r['output_dtype']} (not {expected_dtype})"
    return (f"{r['kernels']} {r['mode']} {r['dtype']} L={r['seq_length']}: {errors} (tol {r['tolerance']:.0e}); "
            f"causal control {r['negative_control_error']:.2f}{dtype_note}")


def attention_flops(pairs_per_head, heads, head_dim, batch):
    """(forward, backward) model FLOPs of the (query, key) pairs of every head: `flops.attention_flops_per_pair`
    forward, `rules.BACKWARD_FLOPS_PER_FORWARD` times that backward (a flash kernel's recomputed scores are not
    counted, as in the trainer's TFLOP/s)."""
    from megatron_csbp.bdlm.flops import attention_flops_per_pair

    forward = pairs_per_head * batch * attention_flops_per_pair(heads, head_dim)
    return forward, rules.BACKWARD_FLOPS_PER_FORWARD * forward


def causal_pairs(rows: int) -> int:
    return rows * (rows + 1) // 2


def _time_forward_backward(run, inputs, grad, iters, device):
    """First call (compilation included) and the medians of `iters` more, forward and backward apart."""
    def once():
        for x in inputs:
            x.grad = None
        _sync(device)
        start = time.perf_counter()
        out = run()
        _sync(device)
        middle = time.perf_counter()
        out.backward(grad)
        _sync(device)
        return middle - start, time.perf_counter() - middle

    first = once()
    timed = [once() for _ in range(iters)]
    forward, backward = statistics.median(t[0] for t in timed), statistics.median(t[1] for t in timed)
    return dict(first_call_s=sum(first), compile_s=max(sum(first) - forward - backward, 0.0),
                forward_s=forward, backward_s=backward)


def throughput(args, device, records):
    from megatron_csbp.bdlm.flops import bdlm_attention_pairs
    from megatron_csbp.core.ops import context_sharded_block_attention

    L, block, batch = args.bench_seq_length, args.bench_block_size, args.bench_batch
    heads, kv_heads, head_dim = args.bench_heads, args.bench_kv_heads, args.bench_head_dim
    dtype = DTYPES[args.bench_dtype]
    layout = throughput_run(args).layout(0)
    q = torch.randn(2 * L, batch, heads, head_dim, device=device, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(2 * L, batch, kv_heads, head_dim, device=device, dtype=dtype, requires_grad=True)
            for _ in range(2))
    grad = torch.randn(2 * L, batch, heads * head_dim, device=device, dtype=dtype)
    shape = dict(seq_length=L, block_size=block, batch=batch, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                 dtype=args.bench_dtype, iters=args.bench_iters)

    _reset_peak(device)
    bdlm = _time_forward_backward(lambda: context_sharded_block_attention(q, k, v, layout), (q, k, v), grad,
                                  args.bench_iters, device)
    bdlm_peak = _peak_bytes(device)
    del q, k, v, grad
    _free(device)

    group = heads // kv_heads
    dense_q = torch.randn(batch, heads, 2 * L, head_dim, device=device, dtype=dtype, requires_grad=True)
    dense_k, dense_v = (torch.randn(batch, kv_heads, 2 * L, head_dim, device=device, dtype=dtype)
                        .repeat_interleave(group, dim=1).requires_grad_() for _ in range(2))
    dense_grad = torch.randn_like(dense_q)
    _reset_peak(device)
    causal = _time_forward_backward(
        lambda: torch.nn.functional.scaled_dot_product_attention(dense_q, dense_k, dense_v, is_causal=True),
        (dense_q, dense_k, dense_v), dense_grad, args.bench_iters, device)
    causal_peak = _peak_bytes(device)

    for name, timing, pairs, peak in [("bdlm", bdlm, bdlm_attention_pairs(L, block), bdlm_peak),
                                      ("causal", causal, causal_pairs(2 * L), causal_peak)]:
        forward_flops, backward_flops = attention_flops(pairs, heads, head_dim, batch)
        records.append(dict(shape, attention=name, pairs_per_head=pairs, forward_flops=forward_flops,
                            backward_flops=backward_flops, peak_memory_bytes=peak,
                            forward_tflops=forward_flops / timing["forward_s"] / 1e12,
                            backward_tflops=backward_flops / timing["backward_s"] / 1e12, **timing))
    bdlm_record, causal_record = records[-2], records[-1]
    bdlm_record["time_vs_causal"] = ((bdlm["forward_s"] + bdlm["backward_s"])
                                     / (causal["forward_s"] + causal["backward_s"]))
    bdlm_record["pairs_vs_causal"] = bdlm_record["pairs_per_head"] / causal_record["pairs_per_head"]
    for record in records[-2:]:
        print(_throughput_line(record), flush=True)


def kernels(args, device, records):
    """Rank 0's attention kernels of each mode at `--kernel-ranks` P, on this one device: every kernel call of one
    layer, forward then backward, timed apart (the medians of `--bench-iters` after a first, compiling call)."""
    from megatron_csbp.bdlm.flops import attention_flops_per_pair
    from megatron_csbp.core import kernel_work, ops
    from megatron_csbp.core.kernels import default_kernels

    kernel_family, P, block = default_kernels(device), args.kernel_ranks, args.kernel_block_size
    batch, heads, kv_heads, head_dim = args.bench_batch, args.bench_heads, args.bench_kv_heads, args.bench_head_dim
    dtype, tile = DTYPES[args.bench_dtype], getattr(kernel_family, "masked_tile", 128)
    scale = head_dim ** -0.5
    for L in args.kernel_seq_lengths:
        for mode in KERNEL_MODES:
            run = kernel_run(args, mode, L)
            C, layout = run.clean_shards, run.layout(0)
            ring = ops.ring_plan(layout, device, kernel_family)
            calls = {call.kind: call for call in mode.kernel_calls(L, block, P, C, 0, tile)}

            def keys(rows):  # `[b, kv_heads, rows, d]`
                return torch.randn(batch, kv_heads, rows, head_dim, device=device, dtype=dtype)

            n, noisy = layout.num_rows, layout.num_noisy_rows
            q = torch.randn(batch, kv_heads, heads // kv_heads, n, head_dim, device=device, dtype=dtype)
            parts = {}
            if ring.block_diagonal:
                nk, nv = keys(noisy), keys(noisy)
                parts[kernel_work.DENSE] = (
                    lambda: kernel_family.block_diagonal_forward(q[..., :noisy, :], nk, nv, block, scale),
                    lambda o, l, d: kernel_family.block_diagonal_backward(d, q[..., :noisy, :], nk, nv, o, l, block,
                                                                          scale))
            k, v = keys(ring.num_keys), keys(ring.num_keys)
            parts[ring.kind] = (lambda: ring.remote_forward(q, k, v, ring.gathered, scale),
                                lambda o, l, d: ring.remote_backward(d, q, k, v, o, l, ring.gathered, scale))
            for kind, (forward, backward) in parts.items():
                out, lse = forward()
                dout = torch.randn_like(out)
                backward(out, lse, dout)
                times = []
                for _ in range(args.bench_iters):
                    _sync(device)
                    start = time.perf_counter()
                    out, lse = forward()
                    _sync(device)
                    middle = time.perf_counter()
                    backward(out, lse, dout)
                    _sync(device)
                    times.append((middle - start, time.perf_counter() - middle))
                forward_s = statistics.median(t[0] for t in times)
                backward_s = statistics.median(t[1] for t in times)
                call = calls[kind]
                real = call.real_pairs * call.calls * batch * heads
                records.append(dict(mode=mode.name, kind=kind, seq_length=L, ranks=P, clean_shards=C, block_size=block,
                                    rows=noisy if kind == kernel_work.DENSE else n,
                                    keys=noisy if kind == kernel_work.DENSE else ring.num_keys,
                                    batch=batch, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                                    dtype=args.bench_dtype, tile=tile, real_pairs_per_head=call.real_pairs,
                                    computed_pairs_per_head=call.computed_pairs, forward_s=forward_s,
                                    backward_s=backward_s, forward_pairs_per_s=real / forward_s,
                                    backward_pairs_per_s=real / backward_s,
                                    forward_tflops=real * attention_flops_per_pair(1, head_dim) / forward_s / 1e12))
                print(_kernel_line(records[-1]), flush=True)
                del out, lse, dout
            del q, k, v, parts
            _free(device)


def _kernel_line(r):
    return (f"{r['mode']:<10} {r['kind']:<6} L={r['seq_length']} P={r['ranks']} rank 0: {r['rows']} rows x "
            f"{r['keys']} keys, real {r['real_pairs_per_head']:,} computed {r['computed_pairs_per_head']:,} pairs/head "
            f"(tile {r['tile']}); forward {r['forward_s'] * 1e3:.2f} ms {r['forward_pairs_per_s']:.3g} pairs/s "
            f"({r['forward_tflops']:.3g} TFLOP/s), backward {r['backward_s'] * 1e3:.2f} ms "
            f"{r['backward_pairs_per_s']:.3g} pairs/s")


def _throughput_line(r):
    text = (f"{r['attention']:<6} L={r['seq_length']}: forward {r['forward_s'] * 1e3:.1f} ms "
            f"{r['forward_tflops']:.3g} TFLOP/s, backward {r['backward_s'] * 1e3:.1f} ms {r['backward_tflops']:.3g} "
            f"TFLOP/s, first call {r['first_call_s']:.1f} s")
    if "time_vs_causal" in r:
        text += f"; time vs causal {r['time_vs_causal']:.2f} (pairs {r['pairs_vs_causal']:.2f})"
    return text


def _transformer_engine():
    """(version, None) when Megatron's Transformer Engine spec can be built, else (None, the reason)."""
    try:
        import transformer_engine
        from megatron.core.models.gpt import gpt_layer_specs
    except Exception as error:  # an unusable install fails in many ways, not only ImportError
        return None, f"transformer_engine does not import: {type(error).__name__}: {error}"
    if not gpt_layer_specs.HAVE_TE:
        return None, "megatron-core cannot use the installed transformer_engine (HAVE_TE is False)"
    return getattr(transformer_engine, "__version__", "unknown"), None


@contextlib.contextmanager
def single_rank(device):
    """torch.distributed (world size 1) and megatron_csbp's parallel state with P = C = 1."""
    import torch.distributed as dist

    from megatron_csbp.mcore import cpu_backend, parallel_state
    from megatron_csbp.core.device import default_backend
    from megatron_csbp.runtime.launch import free_port

    with cpu_backend.active():  # only on a machine without an accelerator
        created = not dist.is_initialized()
        if created:
            dist.init_process_group(default_backend(), init_method=f"tcp://127.0.0.1:{free_port()}",
                                    world_size=1, rank=0)
        try:
            parallel_state.initialize_model_parallel()
            yield parallel_state.get_block_parallel_groups()
        finally:
            if parallel_state.is_initialized():
                parallel_state.destroy_model_parallel()
            if created:
                dist.destroy_process_group()


def train(args, device, records):
    te_version, te_missing = _transformer_engine()
    if args.train_spec == "te" and te_version is None:
        raise RuntimeError(f"--train-spec te: {te_missing}; use --train-spec local or auto")
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig

    from megatron_csbp.bdlm.forward_step import BDLMForwardStep
    from megatron_csbp.bdlm.objective import BDLMObjective
    from megatron_csbp.bdlm.flops import bdlm_step_flops
    from megatron_csbp.mcore.model import model_provider

    use_te = args.train_spec == "te" or (args.train_spec == "auto" and te_version is not None)
    spec_note = (f"Transformer Engine {te_version}" if use_te else
                 "local (megatron-core)" + (f"; {te_missing}" if args.train_spec == "auto" else ""))
    print(f"train: spec {spec_note}", flush=True)

    L, block, micro_batch, vocab = args.train_seq_length, args.train_block_size, args.train_micro_batch, \
        args.train_vocab_size
    dtype = DTYPES[args.train_dtype]
    run = train_run(args)
    layout = run.layout(0)
    with single_rank(device) as groups:
        torch.manual_seed(1234)
        model_parallel_cuda_manual_seed(1234)
        config = TransformerConfig(
            num_layers=args.train_layers, hidden_size=args.train_hidden_size, num_attention_heads=args.train_heads,
            num_query_groups=args.train_query_groups, ffn_hidden_size=args.train_ffn_hidden_size,
            normalization="RMSNorm", gated_linear_unit=True, activation_func=torch.nn.functional.silu,
            add_bias_linear=False, bf16=dtype is torch.bfloat16, params_dtype=dtype, pipeline_dtype=dtype,
            calculate_per_token_loss=True, hidden_dropout=0.0, attention_dropout=0.0,
            use_cpu_initialization=device.type == "cpu")
        mask_token = vocab - 1
        model = model_provider(config=config, layout=layout, vocab_size=vocab, mask_token_id=mask_token, group=groups,
                               use_transformer_engine=use_te).to(device)
        parameters = sum(p.numel() for p in model.parameters())
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.0)
        forward_step = BDLMForwardStep(BDLMObjective(block_size=block, mask_token_id=mask_token, seed=1234), layout)
        generator = torch.Generator().manual_seed(42)
        times, losses = [], []
        _reset_peak(device)
        for step in range(args.train_warmup + args.train_steps):
            batch = {"tokens": torch.randint(0, mask_token, (micro_batch, L), generator=generator),
                     "sample_index": torch.arange(step * micro_batch, (step + 1) * micro_batch)}
            _sync(device)
            start = time.perf_counter()
            output, loss_func = forward_step(iter([batch]), model)
            loss_sum, num_tokens, _ = loss_func(output)
            (loss_sum / num_tokens.clamp(min=1)).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            _sync(device)
            times.append(time.perf_counter() - start)
            losses.append((loss_sum / num_tokens.clamp(min=1)).item())
            print(f"train: step {step + 1}/{args.train_warmup + args.train_steps} {times[-1]:.2f} s, "
                  f"loss {losses[-1]:.3f}", flush=True)
        peak = _peak_bytes(device)

    step_time = statistics.median(times[args.train_warmup:])
    step_flops = bdlm_step_flops(run.shape, padded_vocab_size=vocab, seq_length=L, block_size=block,
                                 batch_size=micro_batch)
    record = dict(spec="transformer_engine" if use_te else "local", spec_note=spec_note, dtype=args.train_dtype,
                  parameters=parameters, layers=args.train_layers, hidden_size=args.train_hidden_size,
                  heads=args.train_heads, query_groups=args.train_query_groups,
                  ffn_hidden_size=args.train_ffn_hidden_size, vocab_size=vocab, seq_length=L, block_size=block,
                  micro_batch=micro_batch, warmup_steps=args.train_warmup, first_step_s=times[0],
                  step_time_s=step_time, tokens_per_s=micro_batch * L / step_time, step_flops=step_flops,
                  tflops=step_flops / step_time / 1e12, peak_memory_bytes=peak, losses=losses,
                  passed=all(math.isfinite(loss) for loss in losses))
    records.append(record)
    print(_train_line(record), flush=True)
    if not record["passed"]:
        raise FloatingPointError(f"non-finite training loss: {losses}")


def _train_line(r):
    peak = f"{r['peak_memory_bytes'] / 2 ** 30:.1f} GiB" if r["peak_memory_bytes"] is not None else "n/a (CPU)"
    return (f"{r['spec']} spec, {r['parameters'] / 1e9:.3g}B params, L={r['seq_length']} x {r['micro_batch']}: "
            f"{r['step_time_s']:.2f} s/step, {r['tokens_per_s']:,.0f} tokens/s, {r['tflops']:.3g} TFLOP/s (BDLM), "
            f"peak {peak}, first step {r['first_step_s']:.1f} s")


def delta_recurrence(q, k, v, g, beta, initial_state):
    """The gated delta rule token by token, in fp64 (`core.kernels.gated_delta`'s definition, not its chunked
    form): `S_t = γ_t (I - β_t k_t k_tᵀ) S_{t-1} + β_t k_t v_tᵀ`, `o_t = dk^-1/2 · S_tᵀ q_t`."""
    q, k, v, g, beta = (x.double() for x in (q, k, v, g, beta))
    state, outputs = initial_state.double(), []
    for t in range(q.shape[1]):
        kt, vt = k[:, t], v[:, t]  # [b, H, d]
        state = state * g[:, t].exp()[..., None, None]
        correction = vt - torch.einsum("bhkv,bhk->bhv", state, kt)
        state = state + torch.einsum("bhk,bhv->bhkv", beta[:, t, :, None] * kt, correction)
        outputs.append(torch.einsum("bhkv,bhk->bhv", state, q[:, t]) * q.shape[-1] ** -0.5)
    return torch.stack(outputs, 1), state


def gated_delta_case(args, device):
    """`chunk_rule` on this device against `delta_recurrence`: output, final state, gradients of all six inputs,
    in fp32 (the trainer's Gated DeltaNet core feeds the rule fp32)."""
    from megatron_csbp.core.kernels import gated_delta

    tolerance = args.fp32_tolerance
    generator = torch.Generator().manual_seed(7)
    batch, tokens, heads, dk, dv = 1, args.delta_tokens, args.delta_heads, args.delta_key_dim, args.delta_value_dim

    def draw(*shape):
        return torch.randn(*shape, generator=generator)
    q, k = (gated_delta.l2norm(draw(batch, tokens, heads, dk)) for _ in range(2))
    inputs = dict(q=q, k=k, v=draw(batch, tokens, heads, dv),
                  g=torch.nn.functional.logsigmoid(draw(batch, tokens, heads) + 3),  # decays near 1, as trained
                  beta=torch.sigmoid(draw(batch, tokens, heads)), initial_state=draw(batch, heads, dk, dv))
    out_grad, state_grad = draw(batch, tokens, heads, dv), draw(batch, heads, dk, dv)
    mine = {name: x.to(device).clone().requires_grad_() for name, x in inputs.items()}
    kernel = "fla" if gated_delta.fla_rule() is not None and mine["q"].is_cuda else "torch"
    precision = ieee_fp32() if device.type != "cpu" else contextlib.nullcontext()
    with precision:
        out, state = gated_delta.chunk_rule(**mine)
        ((out.float() * out_grad.to(device)).sum() + (state * state_grad.to(device)).sum()).backward()
    _sync(device)
    theirs = {name: x.to(device, torch.float64).requires_grad_() for name, x in inputs.items()}
    reference_out, reference_state = delta_recurrence(**theirs)
    ((reference_out * out_grad.to(device).double()).sum()
     + (reference_state * state_grad.to(device).double()).sum()).backward()
    errors = {"out": relative_error(out.detach(), reference_out.detach()),
              "state": relative_error(state.detach(), reference_state.detach())}
    errors.update({f"d{name}": math.inf if mine[name].grad is None  # an input the rule did not use
                   else relative_error(mine[name].grad, theirs[name].grad) for name in inputs})
    with torch.no_grad(), precision:
        dropped, _ = gated_delta.chunk_rule(**{**{n: x.detach() for n, x in mine.items()}, "initial_state": None})
    negative = relative_error(dropped, reference_out)
    passed = all(error <= tolerance for error in errors.values()) and negative >= NEGATIVE_CONTROL_FACTOR * tolerance
    return dict(kernel=kernel, dtype="fp32", tokens=tokens, heads=heads, key_dim=dk, value_dim=dv, errors=errors,
                tolerance=tolerance, negative_control_error=negative, passed=passed)


def gated_delta(args, device, records):
    case = dict(kernel="?", dtype="fp32")
    try:
        case = gated_delta_case(args, device)
    except Exception:
        case.update(passed=False, error=traceback.format_exc())
    records.append(case)
    print(_gated_delta_line(case), flush=True)


def _gated_delta_line(r):
    if "error" in r:
        return f"gated delta {r['kernel']} {r['dtype']}: ERROR {r['error'].strip().splitlines()[-1]}"
    errors = " ".join(f"{name} {value:.1e}" for name, value in r["errors"].items())
    return (f"gated delta ({r['kernel']}) {r['dtype']} T={r['tokens']} H={r['heads']} dk={r['key_dim']} "
            f"dv={r['value_dim']}: {errors} (tol {r['tolerance']:.0e}); no initial state {r['negative_control_error']:.2f}")


SECTION_RUNNERS = {"correctness": correctness, "throughput": throughput, "kernels": kernels,
                   "gated-delta": gated_delta, "train": train}
SUMMARY_LINES = {"correctness": _correctness_line, "throughput": _throughput_line, "kernels": _kernel_line,
                 "gated-delta": _gated_delta_line, "train": _train_line}


def environment(device):
    info = dict(device=str(device), torch=torch.__version__, cuda=torch.version.cuda, python=sys.version.split()[0])
    if device.type != "cpu":
        info["device_name"] = torch.get_device_module(device).get_device_name(device)
    return info


def write_summary(path, summary):
    """Atomically, so a run cut short leaves the last complete summary."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    temporary = f"{path}.tmp"
    with open(temporary, "w") as handle:
        json.dump(summary, handle, indent=2)
    os.replace(temporary, path)


def print_table(summary, out=sys.stdout):
    print("\n== gpu_check summary ==", file=out)
    for name, section in summary["sections"].items():
        print(f"[{section['status'].upper():6}] {name} ({section['elapsed_s']:.1f} s)", file=out)
        for record in section["records"]:
            print(f"           {SUMMARY_LINES[name](record)}", file=out)
        if section["error"]:
            print(f"           {section['error'].strip().splitlines()[-1]}", file=out)
    print(f"overall: {'PASSED' if summary['passed'] else 'FAILED'}", file=out)


def main(argv=None) -> int:
    args = parse_args(argv)
    device = default_device()
    if device.type == "cpu" and not args.allow_cpu:
        print("gpu_check: no accelerator found (torch.accelerator reports none). Run it on a GPU machine, or pass "
              "--allow-cpu with small sizes to exercise the CPU-testable parts.", file=sys.stderr)
        return 2
    # One compiled flex attention serves every shape here (4 graphs per shape and dtype); past dynamo's
    # default limit of 8 it would fall back to eager flex, which materialises the scores.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    started = time.perf_counter()
    summary = dict(environment(device), allow_cpu=args.allow_cpu, arguments=vars(args), sections={},
                   complete=False, passed=False)
    for name in args.sections:
        records, error = [], None
        section_start = time.perf_counter()
        print(f"== {name} ==", flush=True)
        try:
            SECTION_RUNNERS[name](args, device, records)
        except Exception:
            error = traceback.format_exc()
            print(error, file=sys.stderr, flush=True)
        _free(device)
        failed = error is not None or not all(r.get("passed", True) for r in records)
        summary["sections"][name] = dict(status="failed" if failed else "passed", records=records, error=error,
                                         elapsed_s=time.perf_counter() - section_start)
        summary["elapsed_s"] = time.perf_counter() - started
        write_summary(args.json, summary)
    summary.update(complete=True, passed=all(s["status"] == "passed" for s in summary["sections"].values()))
    write_summary(args.json, summary)
    print_table(summary)
    print(f"summary written to {args.json}")
    return 0 if summary["passed"] else 1
