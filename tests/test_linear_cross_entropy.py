"""The tiled linear cross-entropy (`--cross-entropy-loss-fusion`): the LM head and its loss in tiles of rows.

* In one process: the loss and both gradients equal the whole head's (`F.cross_entropy` over the logits with MASK
  and the padding at -inf) at every tile size, and a step's peak tensor memory holds a tile's logits, not the
  whole logits (the whole head's does: the control).
* One Megatron training step (tests/megatron_step.py) with the tiled loss under CSBP2, TP2xCSBP2 (with and without
  SP) and PP2xCSBP2, with the diffusion loss and with the AR co-loss (the clean rows' logits too), equals the
  one-rank reference with whole logits: the loss (and its parts), every gradient and updated parameter, <= 1e-5
  relative. Control: the MASK column left in the softmax misses.
* The trainer's flags: CSBP2 with `--cross-entropy-loss-fusion` logs the one-rank run's losses and validation;
  `--cross-entropy-fusion-impl te` is refused in one line.
* Memory at vocabulary 151,936 (hidden 64, L=512): TP2xCSBP2 on 4 ranks, a step's peak tensor bytes fall by more
  than the logits' size (CSBP2 on 2 ranks: the bench's `--logits-memory`, tests/test_bench.py).
"""

import argparse
import contextlib

import pytest
import torch
import torch.nn.functional as F

import test_clean_stream_training as ar
import test_megatron_composition as diffusion
from megatron_step import Topology, run_steps, worst_error
from pretrain_runs import base, run, significant, validated_args
from spawn import on_cpu_backend, run_ranks

from megatron_csbp.core.rules import ConfigError
from megatron_csbp.mcore.linear_cross_entropy import tiled_linear_cross_entropy
from megatron_csbp.tools.bench.records import LogitsMemory

pytest_plugins = ["pretrain_runs"]  # the corpus and the reference runs, shared with the training tests
TOLERANCE = 1e-5
TILE = 5  # rows per tile in the training steps: ragged last tiles, many tiles per rank


# --- one process -----------------------------------------------------------------------------------------------

def _head_case(dtype, rows=64, hidden=16, vocab=40, mask=29, ids=30):
    """Hidden rows, a head weight, labels among the real ids, the unpredictable columns (MASK and the padding after
    the `ids` real ids) and a gradient for each row's loss."""
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(rows, hidden, generator=generator, dtype=dtype)
    weight = torch.randn(vocab, hidden, generator=generator, dtype=dtype)
    labels = torch.randint(0, mask, (rows,), generator=generator)
    unpredictable = torch.arange(vocab) >= ids
    unpredictable[mask] = True
    return x, weight, labels, unpredictable, torch.rand(rows, generator=generator, dtype=dtype)


def _loss_and_gradients(loss_of, x, weight, grad):
    x, weight = x.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = loss_of(x, weight)
    (loss * grad).sum().backward()
    return loss.detach(), x.grad, weight.grad


def _whole_head(labels, unpredictable):
    def loss(x, weight):  # the logits in fp32 (fp64 inputs: in fp64), as the head and megatron-core's CE take them
        logits = (x @ weight.t()).to(torch.promote_types(x.dtype, torch.float32))
        return F.cross_entropy(logits.masked_fill(unpredictable, float("-inf")), labels, reduction="none")

    return loss


def _relative(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-6), (torch.float64, 1e-13)])
@pytest.mark.parametrize("tile_rows", [1, 7, 64, 1000])
def test_tiles_give_the_whole_heads_loss_and_gradients(tile_rows, dtype, tolerance):
    x, weight, labels, unpredictable, grad = _head_case(dtype)
    whole = _loss_and_gradients(_whole_head(labels, unpredictable), x, weight, grad)
    tiled = _loss_and_gradients(lambda x, w: tiled_linear_cross_entropy(x, w, labels, tile_rows, unpredictable),
                                x, weight, grad)
    errors = [_relative(mine, theirs) for mine, theirs in zip(tiled, whole)]
    assert max(errors) <= tolerance, errors
    assert tiled[0].dtype == torch.promote_types(dtype, torch.float32) and tiled[2].dtype == dtype
    # Control: without the unpredictable columns at -inf the loss is another one.
    free = _loss_and_gradients(lambda x, w: tiled_linear_cross_entropy(x, w, labels, tile_rows), x, weight, grad)
    assert _relative(free[0], whole[0]) > 1e-3


def test_a_step_holds_a_tile_of_logits_not_the_whole():
    from megatron_csbp.tools.bench.memory import peak_tensor_memory

    x, weight, labels, unpredictable, grad = _head_case(torch.float32, rows=512, vocab=4096, mask=4000, ids=4001)
    logits_bytes, tile_rows = 512 * 4096 * 4, 32
    peaks = {}
    for name, loss_of in (("whole", _whole_head(labels, unpredictable)),
                          ("tiled", lambda x, w: tiled_linear_cross_entropy(x, w, labels, tile_rows, unpredictable))):
        with peak_tensor_memory(torch.device("cpu")) as peak:
            _loss_and_gradients(loss_of, x, weight, grad)
        peaks[name] = peak.bytes
    print(f"peak tensor bytes of the head's step: {peaks}, logits {logits_bytes}")
    assert peaks["whole"] >= 2 * logits_bytes  # the logits and their gradient (the control)
    assert peaks["tiled"] < logits_bytes / 4  # a tile's logits, the weight's gradient, the rows' gradient


# --- one Megatron training step under each composition --------------------------------------------------------

STEPS = {"diffusion": diffusion, "ar co-loss": ar}  # the one-step machinery of each loss
WORLD_2 = [("diffusion", Topology(f"csbp P=C=2, tiles of {TILE}", block_parallel=2, clean_shards=2,
                                  logits_tile_rows=TILE)),
           ("ar co-loss", Topology(f"csbp P=C=2, tiles of {TILE}", block_parallel=2, clean_shards=2,
                                   logits_tile_rows=TILE)),
           ("diffusion", Topology("control: the MASK column in the softmax", block_parallel=2, clean_shards=2,
                                  logits_tile_rows=TILE))]
WORLD_4 = [("diffusion", Topology(f"tp2 x csbp2, tiles of {TILE}", tp=2, block_parallel=2, clean_shards=2,
                                  logits_tile_rows=TILE)),
           ("diffusion", Topology(f"tp2 x csbp2 + sp, tiles of {TILE}", tp=2, block_parallel=2, clean_shards=2,
                                  sequence_parallel=True, logits_tile_rows=TILE)),
           ("ar co-loss", Topology(f"tp2 x csbp2 + sp, tiles of {TILE}", tp=2, block_parallel=2, clean_shards=2,
                                   sequence_parallel=True, logits_tile_rows=TILE)),
           ("diffusion", Topology(f"pp2 x csbp2 (1f1b), tiles of {TILE}", pp=2, block_parallel=2, clean_shards=2,
                                  logits_tile_rows=TILE))]


@contextlib.contextmanager
def _mask_column_predictable():
    """Control: the head leaves every column (MASK's too) in the softmax."""
    from megatron_csbp.mcore.model import BDLMGPTModel

    unpredictable = BDLMGPTModel._unpredictable
    BDLMGPTModel._unpredictable = lambda self, columns, device: None
    try:
        yield
    finally:
        BDLMGPTModel._unpredictable = unpredictable


@contextlib.contextmanager
def _counted_tiled_calls(calls):
    """Counts in `calls[0]` the model's calls of the tiled linear cross-entropy."""
    from megatron_csbp.mcore import model

    tiled = model.tiled_linear_cross_entropy

    def counted(*args, **kwargs):
        calls[0] += 1
        return tiled(*args, **kwargs)

    model.tiled_linear_cross_entropy = counted
    try:
        yield
    finally:
        model.tiled_linear_cross_entropy = tiled


def _train_step(item, weights):
    """One step of `item` = (its loss, its topology): that loss's test module's step, and how many times the model
    called the tiled linear cross-entropy."""
    loss, topology = item
    control = topology.name.startswith("control")
    calls = [0]
    with _mask_column_predictable() if control else contextlib.nullcontext(), _counted_tiled_calls(calls):
        return dict(STEPS[loss]._train_step(topology, weights), tiled_calls=calls[0])


@pytest.fixture(scope="module")
def references():
    """Each loss's one-rank step with whole logits, both from the same weights."""
    items = [("diffusion", diffusion.REFERENCE), ("ar co-loss", ar.REFERENCE)]
    results = run_ranks(run_steps, 1, _train_step, items, None, timeout=300)[0]
    assert [result["tiled_calls"] for result in results] == [0, 0]  # the whole logits
    return dict(zip((loss for loss, _ in items), results))


def _check_world(world_size, items, references, timeout):
    results = run_ranks(run_steps, world_size, _train_step, items, references["diffusion"]["initial"],
                        timeout=timeout)
    for index, (loss, topology) in enumerate(items):
        per_rank, reference = [results[rank][index] for rank in range(world_size)], references[loss]
        # the last pipeline stage's ranks (those reporting losses) compute the loss tiled, once per micro-batch
        calls = [result["tiled_calls"] for result in per_rank]
        assert calls == [STEPS[loss].NUM_MICRO if result["losses"] else 0 for result in per_rank], calls
        parts = max(abs(losses[name] - value) / abs(value) for result in per_rank if result["losses"]
                    for losses in [result["losses"]] for name, value in reference["losses"].items())
        error = max(worst_error(per_rank, reference), parts)
        print(f"{loss}, {topology.name}: worst relative error {error:.2e} (loss parts {parts:.2e})")
        if topology.name.startswith("control"):
            assert error > 1e-3, f"{topology.name} should not match the reference ({error:.2e})"
        else:
            assert error <= TOLERANCE, f"{loss}, {topology.name}: relative error {error:.2e}"


def test_world_2_tiled_cross_entropy_step_equals_one_rank(references):
    assert set(references["ar co-loss"]["losses"]) == {"lm loss", "diffusion loss", "ar loss"}
    _check_world(2, WORLD_2, references, timeout=600)


def test_world_4_tiled_cross_entropy_step_equals_one_rank(references):
    _check_world(4, WORLD_4, references, timeout=900)


# --- the trainer's flags ---------------------------------------------------------------------------------------

@on_cpu_backend
def _providers_tile_rows(rank, world_size, corpus, settings):
    """The tile of the model the run's providers build from the trainer's validated flags `settings`."""
    from megatron_csbp.mcore import parallel_state
    from megatron_csbp.training.providers import RunProviders

    parallel_state.initialize_model_parallel()
    try:
        return RunProviders(validated_args(corpus, **settings)).model_provider().logits_tile_rows
    finally:
        parallel_state.destroy_model_parallel()


def test_the_fusion_flags_train_and_validate_as_the_whole_head(corpus, reference_runs):
    """CSBP2 with the tiled loss (tiles of 7 rows) logs the one-rank whole-logits run's losses and validation NELBO
    (the validation runs the same forward with labels). The flags reach the model the providers build (without
    them it holds the logits whole)."""
    flags = dict(cross_entropy_loss_fusion=True, cross_entropy_fusion_impl="native", cross_entropy_tile_rows=7)
    assert [run_ranks(_providers_tile_rows, 1, corpus, settings)[0] for settings in (flags, {})] == [7, None]
    fused = run(2, base(corpus, context_block_parallel=2, **flags))
    reference = reference_runs["1 rank"]
    for field in ("losses", "validation"):
        expected = {i: significant(v) for i, v in getattr(reference, field).items()}
        assert expected and {i: significant(v) for i, v in getattr(fused, field).items()} == expected, field


def test_the_flags_set_the_runs_tile_and_te_is_refused_in_one_line():
    from megatron_csbp.core.run_config import RunConfig
    from megatron_csbp.training import flag_table
    from megatron_csbp.training.arguments import validate_args
    from megatron_csbp.training.flags import build_parser

    common = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
              "--micro-batch-size", "1", "--train-iters", "10", "--lr", "1e-3", "--data-path", "unused/prefix",
              "--bdlm-block-size", "8", "--cross-entropy-tile-rows", "7"]

    def settings(*extra):
        args = validate_args(build_parser().parse_args(common + list(extra)), 1, on_accelerator=False,
                             check_paths=False)
        return RunConfig.from_args(args)

    assert settings("--cross-entropy-loss-fusion").logits_tile_rows == 7
    assert settings().logits_tile_rows is None  # the tile size alone does not turn it on
    with pytest.raises(ConfigError, match=r"^--cross-entropy-tile-rows must be >= 1; got 0$"):
        settings("--cross-entropy-loss-fusion", "--cross-entropy-tile-rows", "0")
    # Megatron-LM's parser takes te, and the table refuses it (our loop's parser has native only).
    megatron_like = argparse.ArgumentParser()
    megatron_like.add_argument("--cross-entropy-fusion-impl", choices=("native", "te"), default="native")
    flag_table.check_parsed(megatron_like, megatron_like.parse_args(["--cross-entropy-fusion-impl", "native"]))
    with pytest.raises(ConfigError) as refused:
        flag_table.check_parsed(megatron_like, megatron_like.parse_args(["--cross-entropy-fusion-impl", "te"]))
    assert str(refused.value).startswith("--cross-entropy-fusion-impl te: is honoured only with native (te names "
                                         "Transformer Engine's cross-entropy kernel") and "\n" not in str(refused.value)
    with pytest.raises(SystemExit):
        build_parser().parse_args(common + ["--cross-entropy-fusion-impl", "te"])


# --- memory at a real vocabulary ---------------------------------------------------------------------------------

VOCAB_151936 = dict(vocab=151_936, hidden=64, seq=512, block=64, tile_rows=64)


@on_cpu_backend
def _logits_memory(rank, world_size, tensor_parallel, dtype=torch.float32):
    """This rank's `bench.memory.logits_memory` of a TP x CSBP2 step at `VOCAB_151936`, weights in `dtype`."""
    from megatron.core import parallel_state as mpu
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig

    from megatron_csbp.bdlm.forward_step import BDLMForwardStep
    from megatron_csbp.bdlm.objective import BDLMObjective
    from megatron_csbp.core.layout import layout_for
    from megatron_csbp.mcore import parallel_state
    from megatron_csbp.mcore.model import model_provider
    from megatron_csbp.tools.bench.memory import logits_memory

    case = VOCAB_151936
    parallel_state.initialize_model_parallel(tensor_parallel, 1, context_block_parallel_size=2, clean_shards=2)
    try:
        config = TransformerConfig(num_layers=2, hidden_size=case["hidden"], num_attention_heads=4,
                                   num_query_groups=2, tensor_model_parallel_size=tensor_parallel,
                                   context_parallel_size=2, normalization="RMSNorm", use_cpu_initialization=True,
                                   calculate_per_token_loss=True, hidden_dropout=0.0, attention_dropout=0.0,
                                   params_dtype=dtype, bf16=dtype == torch.bfloat16)
        layout = layout_for("csbp", case["seq"], case["block"], 2, 2, rank=mpu.get_context_parallel_rank())
        mask = case["vocab"] - 1

        def build_model(tile_rows):
            torch.manual_seed(1234)
            model_parallel_cuda_manual_seed(1234)
            return model_provider(config=config, layout=layout, vocab_size=case["vocab"], mask_token_id=mask,
                                  group=parallel_state.get_block_parallel_groups(),
                                  logits_tile_rows=tile_rows).to(dtype)

        step = BDLMForwardStep(BDLMObjective(block_size=case["block"], mask_token_id=mask, seed=7), layout)
        tokens = torch.randint(0, mask, (1, case["seq"]), generator=torch.Generator().manual_seed(42))
        return logits_memory(build_model, step, {"tokens": tokens, "sample_index": torch.arange(1)}, 1,
                             torch.device("cpu"), case["tile_rows"])
    finally:
        parallel_state.destroy_model_parallel()


def test_world_4_tp2_csbp2_step_at_vocabulary_151936_saves_the_logits():
    """The step's peak over its ranks (what each GPU must hold) falls by more than the logits: the ranks whose head
    has the MASK column keep the logits and their masked copy. Each rank's peak falls by its whole logits less what
    the tiled loss holds instead: one tile's logits, and within 1% of the logits a few numbers a row (its label,
    target column, log-sum-exp) and the allocation order's jitter (~128 KiB here)."""
    per_rank = run_ranks(_logits_memory, 4, 2, timeout=600)
    rows = 256  # this rank's noisy rows
    logits_bytes = rows * 151_936 // 2 * 4  # x half the vocabulary, fp32
    held_instead = logits_bytes * VOCAB_151936["tile_rows"] // rows + logits_bytes // 100
    for rank, memory in enumerate(per_rank):
        saved = memory.whole_logits_step_peak_bytes - memory.tiled_logits_step_peak_bytes
        print(f"TP2 x CSBP2 rank {rank}: logits {memory.logits_bytes:,} B, step peak whole "
              f"{memory.whole_logits_step_peak_bytes:,} B, tiled {memory.tiled_logits_step_peak_bytes:,} B, "
              f"saved {saved:,} B")
    for memory in per_rank:
        assert memory.logits_bytes == logits_bytes
        assert memory.whole_logits_step_peak_bytes - memory.tiled_logits_step_peak_bytes >= logits_bytes - held_instead
    largest = LogitsMemory.largest(per_rank)
    assert largest.whole_logits_step_peak_bytes - largest.tiled_logits_step_peak_bytes >= logits_bytes, largest
