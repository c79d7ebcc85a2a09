"""DiffusionGemma's objective (`--bdlm-objective diffusion-gemma`): uniform-state corruption, every canvas token
scored with unit weights, the clean encoder's next-token co-loss, self-conditioning, and Gemma's final-logit softcap
and embedding scale.

* The corruption is uniform-state: a corrupted token becomes a random real id (never MASK, every other id alike),
  exactly at the positions the per-block noise picks, at the rate of its block's noise time; the noise times and
  positions are BD3-LM's draw from `(seed, sample)`, and a sample's draws (and its self-conditioning draw) do not
  depend on the micro-batch it is cut into.
* The self-conditioning block equals transformers' `DiffusionGemmaSelfConditioning` with the same weights; the
  tiled signal (softmax of the head's logits times the input embedding, by tiles of rows and columns) equals the
  whole one; the softcapped tiled loss and its gradients equal autograd's; our head's softcapped logits and scaled
  embeddings equal transformers' DiffusionGemma head and `ScaledWordEmbedding` (controls: without them, both miss).
* One Megatron training step with self-conditioning (probability 0.5, the draw choosing some samples of the batch),
  the softcap and the scale under CSBP2, P=4 C=2 and TP2xCSBP2+SP equals one rank whose core attention is a dense
  mask written from the definition: the loss, both parts and every gradient and updated parameter, <= 1e-5
  relative. PP2xCSBP2 (where self-conditioning is refused: its first pass needs the whole model) equals one rank
  without it; EP2xCSBP2 on a mixture of experts equals its one-rank run. Controls that miss: self-conditioning
  dropped, the softcap off, the embedding scale off, two experts swapped.
* The step's FLOPs count the block and the first pass (torch's counter on the model). The trainer refuses bad
  settings in one line (exit 2); the samplers refuse a uniform-state model; the recipe through the training script
  prints lm / ar / diffusion loss alike on one rank and CSBP2 (packed documents too).
"""

import dataclasses

import pytest
import torch

from megatron_step import BLOCK, MASK, SEQ, VOCAB, Topology, micro_batches, run_steps, train_step, worst_error
from spawn import on_cpu_backend, run_ranks
from test_clean_stream_training import build_token_causal_model

from megatron_csbp.core import objectives

pytest_plugins = ["pretrain_runs"]  # the corpus fixture

MICRO_BATCH, NUM_MICRO = 2, 4
TOLERANCE = 1e-5
CHANCE = 0.5  # the references' self-conditioning probability
SOFTCAP = 2.0  # a cap the tiny model's logits bend under (DiffusionGemma's is 30)
HIDDEN = 32  # megatron_step's hidden size: the embedding scale is its square root


@dataclasses.dataclass(frozen=True)
class Run(Topology):
    self_conditioning: float = CHANCE
    softcap: float | None = SOFTCAP
    scale_embeddings: bool = True


REFERENCE = Run("reference", mode="reference")
REFERENCE_WITHOUT = Run("reference without self-conditioning", mode="reference", self_conditioning=0.0)
WORLD_2 = [Run("csbp P=C=2", block_parallel=2, clean_shards=2),
           Run("control: self-conditioning dropped", block_parallel=2, clean_shards=2, self_conditioning=0.0),
           Run("control: softcap off", block_parallel=2, clean_shards=2, softcap=None),
           Run("control: embedding scale off", block_parallel=2, clean_shards=2, scale_embeddings=False)]
WORLD_4 = [Run("csbp P=4 C=2", block_parallel=4, clean_shards=2),
           Run("tp2 x csbp2 + sp", tp=2, block_parallel=2, clean_shards=2, sequence_parallel=True),
           Run("pp2 x csbp2 (1f1b), without self-conditioning", pp=2, block_parallel=2, clean_shards=2,
               self_conditioning=0.0)]


def _objective(probability=CHANCE, seed=99):
    from megatron_csbp.bdlm.objective import BDLMObjective

    return BDLMObjective(block_size=BLOCK, mask_token_id=MASK, objective=objectives.DIFFUSION_GEMMA, vocab_ids=VOCAB,
                         seed=seed, ar_loss_weight=1.0, self_conditioning_probability=probability)


# --- the corruption ---------------------------------------------------------------------------------------------

def test_corruption_is_uniform_state_at_the_blocks_noise():
    from megatron_csbp.bdlm.objective import BDLMObjective
    from megatron_csbp.core.layout import CSBPLayout

    length, block, samples = 64, 8, 400
    objective = BDLMObjective(block_size=block, mask_token_id=MASK, objective=objectives.DIFFUSION_GEMMA,
                              vocab_ids=VOCAB, seed=5, ar_loss_weight=1.0)
    tokens = torch.randint(0, MASK, (samples, length), generator=torch.Generator().manual_seed(1))
    index = torch.arange(samples) + 1000
    noise = objective.noise(index, length)
    layout = CSBPLayout(length, block, 1, 1, 0, clean_attention="token-causal")
    rows = objective.rows(tokens, index, layout)
    noisy = torch.empty_like(tokens)
    noisy[:, layout.noisy_positions] = rows.input_ids[:, :length]  # P = 1: every noisy row, in the layout's order
    assert not bool((noisy == MASK).any()), "a uniform-state corruption never writes MASK"
    replaced = noise.masked
    assert torch.equal(noisy[replaced], noise.replacement[replaced])
    assert torch.equal(noisy[~replaced], tokens[~replaced])
    counts = torch.bincount(noise.replacement[replaced], minlength=VOCAB)
    assert counts[MASK] == 0 and bool((counts[:MASK] > 0).all()), "every real id but MASK is a replacement"
    expected = replaced.sum().item() / MASK  # uniform over the 63 real ids: a chi-square test at 63 - 1 dof
    chi2 = ((counts[:MASK] - expected) ** 2 / expected).sum().item()
    assert chi2 < 110, f"replacement ids not uniform (chi2 {chi2:.1f} on 62 dof)"
    rate = replaced.view(samples, -1, block).float().mean(-1)  # [samples, blocks] against each block's time
    fitted = torch.linalg.lstsq(noise.t.float().reshape(-1, 1), rate.reshape(-1, 1)).solution.item()
    assert abs(fitted - 1) < 0.03, f"per-block corruption rate = {fitted:.3f} t, expected t"
    assert bool((rows.loss_weights == 1).all()) and rows.num_tokens.item() == samples * length  # every token, unit
    bd3lm = BDLMObjective(block_size=block, mask_token_id=MASK, seed=5).noise(index, length)
    assert torch.equal(bd3lm.t, noise.t) and torch.equal(bd3lm.masked, noise.masked)  # the same draw as BD3-LM's


def test_draws_follow_the_sample_not_the_micro_batch():
    objective = _objective()
    whole = objective.noise(torch.arange(8) + 100, SEQ)
    halves = [objective.noise(torch.arange(4) + 100 + 4 * h, SEQ) for h in range(2)]
    for field in ("t", "masked", "replacement", "self_conditioned"):
        assert torch.equal(getattr(whole, field), torch.cat([getattr(h, field) for h in halves]))
    chosen = objective.noise(torch.arange(4000), SEQ).self_conditioned.float().mean().item()
    assert abs(chosen - CHANCE) < 0.03, chosen


def test_the_objective_states_its_facts_and_refuses():
    from megatron_csbp.core import rules
    from megatron_csbp.core.clean_attention import CLEAN_ATTENTIONS

    kind = objectives.DIFFUSION_GEMMA
    assert (kind.label_shift, kind.corruption, kind.default_weighting, kind.self_conditioning_probability) == (
        0, objectives.UNIFORM_STATE, objectives.UNIT, 0.5)
    assert "token-causal" in rules.causal_encoder_problem(kind, CLEAN_ATTENTIONS("block-causal"))
    assert "--bdlm-self-conditioning-probability" in rules.self_conditioning_problem(objectives.BD3LM, 0.5)
    assert "--pipeline-model-parallel-size" in rules.self_conditioning_problem(kind, 0.5, 2)
    assert rules.self_conditioning_problem(kind, 0.0, 2) is None


# --- the model's pieces -----------------------------------------------------------------------------------------

def _tiny_text_config():
    from transformers.models.diffusion_gemma.configuration_diffusion_gemma import DiffusionGemmaTextConfig

    return DiffusionGemmaTextConfig(hidden_size=32, intermediate_size=48, rms_norm_eps=1e-6)


def test_self_conditioning_block_equals_transformers():
    from megatron.core.transformer import TransformerConfig
    from transformers.models.diffusion_gemma.modeling_diffusion_gemma import DiffusionGemmaSelfConditioning

    from megatron_csbp.mcore.self_conditioning import SelfConditioning

    theirs = DiffusionGemmaSelfConditioning(_tiny_text_config()).double()
    config = TransformerConfig(num_layers=1, hidden_size=32, ffn_hidden_size=48, num_attention_heads=4,
                               layernorm_epsilon=1e-6, use_cpu_initialization=True)
    ours = SelfConditioning(config).double()
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in (("pre_norm_weight", theirs.pre_norm.weight), ("gate", theirs.gate_proj.weight),
                            ("up", theirs.up_proj.weight), ("down", theirs.down_proj.weight)):
            param.copy_(torch.randn(param.shape, generator=generator, dtype=torch.float64))
            getattr(ours, name).copy_(param)
    x = torch.randn(6, 2, 32, generator=generator, dtype=torch.float64)
    signal = torch.randn(6, 2, 32, generator=generator, dtype=torch.float64)
    out = ours(x, signal)
    expected = theirs(x.transpose(0, 1), signal.transpose(0, 1)).transpose(0, 1)
    assert torch.allclose(out, expected, rtol=1e-12, atol=1e-12)
    zero = ours(x, torch.zeros_like(x))  # no signal: the last norm alone, as transformers' zeros
    assert torch.allclose(zero, theirs(x.transpose(0, 1), torch.zeros_like(x).transpose(0, 1)).transpose(0, 1))


def test_tiled_signal_equals_the_whole_one():
    from megatron_csbp.mcore.linear_cross_entropy import tiled_soft_embeddings

    generator = torch.Generator().manual_seed(4)
    hidden, head, embedding = (torch.randn(shape, generator=generator, dtype=torch.float64)
                               for shape in ((13, 8), (20, 8), (20, 8)))
    unpredictable = torch.zeros(20, dtype=torch.bool)
    unpredictable[[5, 19]] = True
    logits = (hidden @ head.t()).masked_fill(unpredictable, float("-inf"))
    whole = logits.softmax(-1) @ embedding
    for tile in (1, 4, 13, 64):
        for columns in (None, 1, 3, 7, 20):  # the vocabulary in tiles too (the padding's tile: every logit -inf)
            assert torch.allclose(tiled_soft_embeddings(hidden, head, embedding, tile, unpredictable,
                                                        tile_columns=columns), whole, rtol=1e-12, atol=1e-12)


# --- one training step on every layout ---------------------------------------------------------------------------

def _build_model(topology, config):
    return build_token_causal_model(
        topology, config, self_conditioning=True, final_logit_softcapping=topology.softcap,
        embedding_scale=HIDDEN ** 0.5 if topology.scale_embeddings else None)


def _batches(dp_rank, dp_size):
    return micro_batches(dp_rank, dp_size, micro_batch=MICRO_BATCH, num_micro=NUM_MICRO, seed=2024)


def _train_step(topology, weights):
    from megatron_csbp.bdlm.forward_step import BDLMForwardStep

    objective = _objective(topology.self_conditioning)
    return train_step(topology, weights, _build_model, lambda layout: BDLMForwardStep(objective, layout),
                      _batches, MICRO_BATCH)


def test_the_draw_self_conditions_some_samples_of_each_step():
    chosen = _objective().noise(torch.arange(MICRO_BATCH * NUM_MICRO) + 100, SEQ).self_conditioned
    assert 0 < chosen.sum() < chosen.numel(), chosen  # the step runs both kinds of sample


@pytest.fixture(scope="module")
def references():
    with_it = run_ranks(run_steps, 1, _train_step, [REFERENCE], None, timeout=300)[0][0]
    without = run_ranks(run_steps, 1, _train_step, [REFERENCE_WITHOUT], with_it["initial"], timeout=300)[0][0]
    return {CHANCE: with_it, 0.0: without}


def _check_world(world_size, topologies, references, timeout):
    initial = references[CHANCE]["initial"]
    results = run_ranks(run_steps, world_size, _train_step, topologies, initial, timeout=timeout)
    for index, topology in enumerate(topologies):
        control = topology.name.startswith("control")
        reference = references[CHANCE if control else topology.self_conditioning]
        assert set(reference["losses"]) == {"lm loss", "diffusion loss", "ar loss"}, reference["losses"]
        per_rank = [results[rank][index] for rank in range(world_size)]
        parts = [r["losses"] for r in per_rank if r["losses"]]
        part_error = max(abs(losses[name] - value) / abs(value)
                         for losses in parts for name, value in reference["losses"].items())
        error = max(worst_error(per_rank, reference), part_error)
        print(f"{topology.name}: worst relative error {error:.2e} (loss parts {part_error:.2e})")
        if control:
            # the loss parts miss by well over the tolerance, the gradients by far more
            assert part_error > 10 * TOLERANCE and error > 1e-3, f"{topology.name} should miss ({part_error:.2e})"
        else:
            assert error <= TOLERANCE, f"{topology.name}: relative error {error:.2e}"


def test_self_conditioning_changes_the_step(references):
    with_it, without = references[CHANCE], references[0.0]
    assert abs(with_it["losses"]["diffusion loss"] - without["losses"]["diffusion loss"]) > 1e-4
    grads = with_it["grads"]
    assert float(torch.as_tensor(grads["self_conditioning.gate"]).abs().sum()) > 0, "the block takes gradients"


def test_world_2_diffusion_gemma_step_equals_one_rank(references):
    _check_world(2, WORLD_2, references, timeout=600)


def test_world_4_diffusion_gemma_step_equals_one_rank(references):
    _check_world(4, WORLD_4, references, timeout=900)


def test_a_mask_only_sampler_refuses_a_uniform_state_model():
    from megatron_csbp.core.rules import ConfigError
    from megatron_csbp.tools.sampling import STRATEGY, SamplingSettings

    for strategy in [name for name, method in STRATEGY.items() if method.corruption == objectives.MASK_STATE]:
        with pytest.raises(ConfigError, match="decodes from MASK tokens"):
            SamplingSettings(block_size=4, mask_token_id=MASK, steps_per_block=4, strategy=strategy,
                             corruption=objectives.DIFFUSION_GEMMA.corruption)
    SamplingSettings(block_size=4, mask_token_id=MASK, steps_per_block=4, corruption=objectives.BD3LM.corruption)


TRAINER = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
           "--micro-batch-size", "1", "--train-iters", "10", "--lr", "1e-3", "--bdlm-block-size", "8",
           "--eval-iters", "0", "--training-loop", "megatron-core", "--bdlm-objective", "diffusion-gemma"]
CAUSAL = ["--bdlm-clean-attention", "token-causal", "--bdlm-ar-loss-weight", "1"]
TRAINER_REFUSALS = [
    ([], "--bdlm-objective diffusion-gemma reads the clean tokens with a causal encoder, not block-causal clean "
         "attention: add --bdlm-clean-attention token-causal"),
    (CAUSAL + ["--bdlm-block-size", "12"], "--seq-length 64 is not a multiple of --bdlm-block-size 12; use "
                                           "--seq-length 60 or a block size dividing 64"),
    (CAUSAL + ["--bdlm-self-conditioning-probability", "1.5"],
     "--bdlm-self-conditioning-probability 1.5 must lie in [0, 1]"),
    (["--bdlm-objective", "bd3lm", "--bdlm-self-conditioning-probability", "0.5"],
     "--bdlm-self-conditioning-probability 0.5 does not go with --bdlm-objective bd3lm, whose model takes no "
     "self-conditioning signal: drop it"),
    (CAUSAL + ["--final-logit-softcapping", "0"], "--final-logit-softcapping 0.0 must be > 0 (omit it: no cap)"),
]


def test_the_trainer_refuses_in_one_line_exit_2(tmp_path, capsys):
    from megatron_csbp.training import pretrain
    from megatron_csbp.training.arguments import validate_args
    from megatron_csbp.training.flags import build_parser

    prefix = tmp_path / "corpus"
    for suffix in (".bin", ".idx"):
        (tmp_path / ("corpus" + suffix)).write_bytes(b"")
    for extra, message in TRAINER_REFUSALS:
        assert pretrain.main(TRAINER + ["--data-path", str(prefix)] + extra) == 2, extra
        captured = capsys.readouterr()
        assert captured.err.strip().splitlines() == [f"pretrain_bdlm.py: error: {message}"], extra
    from megatron_csbp.core.run_config import RunConfig
    from megatron_csbp.training.providers import objective_for

    for given, resolved in (([], 0.5), (["--bdlm-self-conditioning-probability", "0.25"], 0.25)):
        args = validate_args(build_parser().parse_args(TRAINER + CAUSAL + given + ["--data-path", str(prefix)]), 1,
                             on_accelerator=False)  # control: the recipe passes, the chance read once
        settings = RunConfig.from_args(args)
        assert settings.self_conditioning_probability == resolved and settings.self_conditioning
        objective = objective_for(settings, MASK, VOCAB)
        assert (objective.objective, objective.self_conditioning_probability) == (objectives.DIFFUSION_GEMMA, resolved)
        assert settings.final_logit_softcapping is None and settings.embedding_scale is None
    pieces = ["--final-logit-softcapping", "30", "--scale-embeddings", "--data-path", str(prefix)]
    args = validate_args(build_parser().parse_args(TRAINER + CAUSAL + pieces), 1, on_accelerator=False)
    settings = RunConfig.from_args(args)
    assert (settings.final_logit_softcapping, settings.embedding_scale) == (30.0, 8.0)  # sqrt(--hidden-size 64)


# --- with a mixture of experts ----------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class MoERun(Run):
    dispatcher: str = "alltoall"
    swap_experts: bool = False  # negative control: two experts' weights exchanged on the first layer that has them


MOE_REFERENCE = MoERun("moe, one rank", block_parallel=1, clean_shards=1)
MOE_WORLD_2 = [MoERun("moe ep2 x csbp2", ep=2, block_parallel=2, clean_shards=2, logits_tile_rows=5),
               MoERun("control: moe ep2 x csbp2, one expert swapped", ep=2, block_parallel=2, clean_shards=2,
                      swap_experts=True)]


def _moe_train_step(topology, weights):
    import test_moe
    from megatron_csbp.bdlm.forward_step import BDLMForwardStep

    def swap(ddp):
        from megatron.core import parallel_state as mpu

        if not topology.swap_experts or mpu.get_expert_model_parallel_rank() != 0:
            return
        experts = next(module for name, module in ddp.module.named_modules() if name.endswith("local_experts"))
        with torch.no_grad():
            for first, second in zip(experts[0].parameters(), experts[1].parameters()):
                held = first.detach().clone()
                first.copy_(second)
                second.copy_(held)

    objective = _objective(topology.self_conditioning)
    return train_step(topology, weights, _build_model, lambda layout: BDLMForwardStep(objective, layout),
                      _batches, MICRO_BATCH, make_config=test_moe._config, before_step=swap)


def test_moe_ep2_diffusion_gemma_step_equals_one_rank():
    """The same step on test_moe's mixture of experts (4 experts, top-2, a shared expert, the load-balancing loss),
    our model on one rank against EP2 x CSBP2, self-conditioning on. Control: two experts swapped misses."""
    reference = run_ranks(run_steps, 1, _moe_train_step, [MOE_REFERENCE], None, timeout=300)[0][0]
    references = {CHANCE: reference}
    results = run_ranks(run_steps, 2, _moe_train_step, MOE_WORLD_2, reference["initial"], timeout=600)
    for index, topology in enumerate(MOE_WORLD_2):
        per_rank = [results[rank][index] for rank in range(2)]
        part_error = max(abs(r["losses"][name] - value) / abs(value)
                         for r in per_rank if r["losses"] for name, value in references[CHANCE]["losses"].items())
        error = max(worst_error(per_rank, reference), part_error)
        print(f"{topology.name}: worst relative error {error:.2e} (loss parts {part_error:.2e})")
        if topology.swap_experts:
            assert part_error > 5 * TOLERANCE and error > 1e-3, (part_error, error)
        else:
            assert error <= TOLERANCE, error


# --- the final-logit softcap and the embedding scale ------------------------------------------------------------

def test_tiled_loss_and_signal_take_the_softcap():
    from megatron_csbp.mcore.linear_cross_entropy import tiled_linear_cross_entropy, tiled_soft_embeddings

    generator = torch.Generator().manual_seed(6)
    hidden = torch.randn(11, 8, generator=generator, dtype=torch.float64, requires_grad=True)
    head = torch.randn(20, 8, generator=generator, dtype=torch.float64, requires_grad=True)
    embedding = torch.randn(20, 8, generator=generator, dtype=torch.float64)
    labels = torch.randint(0, 19, (11,), generator=generator)
    unpredictable = torch.zeros(20, dtype=torch.bool)
    unpredictable[19] = True
    logits = (SOFTCAP * torch.tanh(hidden @ head.t() / SOFTCAP)).masked_fill(unpredictable, float("-inf"))
    expected = torch.nn.functional.cross_entropy(logits, labels, reduction="none")
    weights = torch.rand(11, generator=generator, dtype=torch.float64)
    want = torch.autograd.grad((expected * weights).sum(), (hidden, head))
    for tile in (1, 4, 11):
        loss = tiled_linear_cross_entropy(hidden, head, labels, tile, unpredictable, softcap=SOFTCAP)
        got = torch.autograd.grad((loss * weights).sum(), (hidden, head))
        assert torch.allclose(loss, expected, rtol=1e-12)
        assert all(torch.allclose(g, w, rtol=1e-10, atol=1e-12) for g, w in zip(got, want))
        signal = tiled_soft_embeddings(hidden.detach(), head.detach(), embedding, tile, unpredictable, softcap=SOFTCAP)
        assert torch.allclose(signal, logits.detach().softmax(-1) @ embedding, rtol=1e-12, atol=1e-12)
    uncapped = tiled_linear_cross_entropy(hidden, head, labels, 4, unpredictable)  # control: the cap matters
    assert (uncapped - expected).abs().max() > 1e-2


@on_cpu_backend
def _pieces_against_transformers(rank, world_size):
    """Our model's embedding output and head logits, with and without the pieces, against transformers'
    DiffusionGemma modules given the same weights and final hidden states: the relative errors."""
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from transformers.models.diffusion_gemma.configuration_diffusion_gemma import DiffusionGemmaConfig
    from transformers.models.diffusion_gemma.modeling_diffusion_gemma import (DiffusionGemmaForBlockDiffusion,
                                                                              DiffusionGemmaTextScaledWordEmbedding)

    from megatron_csbp.core.layout import CSBPLayout
    from megatron_csbp.mcore import parallel_state
    from megatron_csbp.mcore.model import model_provider
    from megatron_step import _config

    parallel_state.initialize_model_parallel(1, 1, context_block_parallel_size=1, clean_shards=1)
    try:
        torch.manual_seed(0)
        model_parallel_cuda_manual_seed(0)
        layout = CSBPLayout(SEQ, BLOCK, 1, 1, clean_attention="token-causal")
        theirs = DiffusionGemmaForBlockDiffusion(DiffusionGemmaConfig(text_config=dict(
            hidden_size=HIDDEN, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
            head_dim=16, vocab_size=VOCAB, final_logit_softcapping=SOFTCAP, num_experts=2, top_k_experts=1,
            moe_intermediate_size=16, layer_types=["full_attention"])))
        scaled = DiffusionGemmaTextScaledWordEmbedding(VOCAB, HIDDEN, 0, embed_scale=HIDDEN ** 0.5)
        errors = {}
        for cap, scale in ((SOFTCAP, HIDDEN ** 0.5), (None, None)):
            model = model_provider(config=_config(Run("one rank")), layout=layout, vocab_size=VOCAB, mask_token_id=MASK,
                                   share_embeddings_and_output_weights=True, final_logit_softcapping=cap,
                                   embedding_scale=scale)
            generator = torch.Generator().manual_seed(5)
            for param in model.parameters():
                param.data.add_(0.3 * torch.randn(param.shape, generator=generator))
            weight = model.embedding.word_embeddings.weight
            with torch.no_grad():
                scaled.weight.copy_(weight)
                theirs.lm_head.weight.copy_(weight)
            tokens = torch.randint(0, MASK, (2, SEQ), generator=generator)
            ids, positions = tokens[:, layout.row_positions], layout.row_positions.repeat(2, 1)
            finals = []
            hook = model.decoder.register_forward_hook(lambda module, args, output: finals.append(output))
            with torch.no_grad():
                embedded = model._embedded(ids, positions) if scale else model.embedding(ids, positions)
                logits = model(ids, positions)  # [b, n_noisy, V]: the head over the canvas rows
            hook.remove()
            hidden = finals[0][:layout.num_noisy_rows].transpose(0, 1)  # the decoder's final (normed) states
            theirs.model = _Stub(hidden)
            with torch.no_grad():
                reference = theirs(input_ids=ids[:, :1]).logits
                reference_embedded = scaled(ids).transpose(0, 1)
            real = torch.arange(VOCAB) != MASK
            name = "pieces on" if cap else "pieces off"
            errors[name] = (_relative(logits[..., real], reference[..., real]),
                            _relative(embedded, reference_embedded))
        return errors
    finally:
        parallel_state.destroy_model_parallel()


class _Stub(torch.nn.Module):
    """transformers' DiffusionGemma inner model replaced by the final hidden states it would give."""

    def __init__(self, hidden):
        super().__init__()
        self.hidden = hidden

    def forward(self, *args, **kwargs):
        from types import SimpleNamespace

        return SimpleNamespace(last_hidden_state=self.hidden, hidden_states=None, attentions=None, cache=None,
                               encoder_last_hidden_state=None)


def _relative(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def test_softcap_and_embedding_scale_equal_transformers():
    errors = run_ranks(_pieces_against_transformers, 1, timeout=300)[0]
    print(errors)
    logits, embedded = errors["pieces on"]
    assert logits <= 1e-6 and embedded <= 1e-7, errors
    logits_off, embedded_off = errors["pieces off"]  # control: without them, both miss
    assert logits_off > 1e-2 and embedded_off > 1e-2, errors


# --- the training script ------------------------------------------------------------------------------------------

RECIPE = dict(bdlm_objective="diffusion-gemma", bdlm_clean_attention="token-causal", bdlm_ar_loss_weight=1.0,
              final_logit_softcapping=30.0, scale_embeddings=True)
LOSS_LINE = (r"iteration\s+(\d+)/.*?lm loss:\s*(\S+) \| ar loss:\s*(\S+) \| diffusion loss:\s*(\S+) \|"
             r".*?grad norm:\s*(\S+) \|")


def _printed(run) -> dict:
    import re

    return {int(m.group(1)): m.groups()[1:] for m in re.finditer(LOSS_LINE, run.output)}


def test_the_training_script_prints_the_parts_alike_on_one_rank_and_csbp2(corpus):
    """The recipe from the command line (our loop, the providers' model with the self-conditioning block, the softcap
    and the scale): each printed lm loss, ar loss, diffusion loss and grad norm of CSBP2 equals one rank's
    (<= 1e-5). Control: without self-conditioning the first step's diffusion loss moves."""
    from pretrain_runs import run

    settings = dict(data_path=corpus, train_iters=2, eval_iters=0, lr_warmup_iters=1, **RECIPE)
    one = _printed(run(1, settings))
    assert sorted(one) == [1, 2], one
    two = _printed(run(2, {**settings, "context_block_parallel": 2}))
    assert two.keys() == one.keys() and all(abs(float(a) - float(b)) <= TOLERANCE * abs(float(b))
                                            for i in one for a, b in zip(two[i], one[i])), (two, one)
    off = _printed(run(1, {**settings, "train_iters": 1, "lr_warmup_iters": 0,
                           "bdlm_self_conditioning_probability": 0.0}))
    assert off[1][2] != one[1][2] and off[1][1] == one[1][1], (off, one)


def test_packed_documents_print_alike_on_one_rank_and_csbp2(corpus):
    """The recipe on packed documents (`--reset-position-ids --reset-attention-mask --eod-mask-loss`: each sample's
    blocks dealt by its documents, the first pass over the chosen samples' own documents): CSBP2 prints one rank's
    numbers (<= 1e-5)."""
    from pretrain_runs import run

    settings = dict(data_path=corpus, train_iters=2, eval_iters=0, lr_warmup_iters=1, reset_position_ids=True,
                    reset_attention_mask=True, eod_mask_loss=True, **RECIPE)
    one = _printed(run(1, settings))
    assert sorted(one) == [1, 2], one
    two = _printed(run(2, {**settings, "context_block_parallel": 2}))
    assert two.keys() == one.keys() and all(abs(float(a) - float(b)) <= TOLERANCE * abs(float(b))
                                            for i in one for a, b in zip(two[i], one[i])), (two, one)


@on_cpu_backend
def _counted_step_flops(rank, world_size):
    """torch's FLOP counter over one forward and backward of the DiffusionGemma model with a dense attention (every
    pair of the `2L x 2L` grid computed), every sample self-conditioned and none."""
    from torch.utils.flop_counter import FlopCounterMode

    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_csbp.mcore import parallel_state
    from megatron_step import _config

    parallel_state.initialize_model_parallel(1, 1, context_block_parallel_size=1, clean_shards=1)
    try:
        torch.manual_seed(0)
        model_parallel_cuda_manual_seed(0)
        reference = Run("reference", mode="reference", softcap=None, scale_embeddings=False)
        model, layout = _build_model(reference, _config(reference))  # its dense attention: every pair counted
        objective = _objective(1.0)
        rows = objective.rows(torch.randint(0, MASK, (2, SEQ)), torch.tensor([1, 2]), layout)
        counted = []
        for chosen in (torch.ones(2, dtype=torch.bool), None):
            with FlopCounterMode(display=False) as counter:
                model(rows.input_ids, rows.position_ids, labels=rows.labels, self_conditioned=chosen).sum().backward()
            counted.append(counter.get_total_flops())
        return counted
    finally:
        parallel_state.destroy_model_parallel()


def test_step_flops_count_the_first_pass_and_the_block():
    from megatron_csbp.bdlm import flops
    from megatron_csbp.core.clean_attention import CLEAN_ATTENTIONS
    from megatron_csbp.core.model_shape import ModelShape

    every, none = run_ranks(_counted_step_flops, 1, timeout=300)[0]
    causal = CLEAN_ATTENTIONS("token-causal")
    shape = ModelShape(num_layers=4, hidden_size=HIDDEN, num_attention_heads=4, num_query_groups=2,
                       ffn_hidden_size=64)
    common = dict(padded_vocab_size=VOCAB, seq_length=SEQ, block_size=BLOCK, batch_size=2, clean_attention=causal,
                  clean_logits=True)
    per_pair = flops.attention_flops_per_pair(4, 8)
    # one forward's attention: the dense grid the reference computes, less the BDLM pairs the formula counts
    dense_extra = 2 * 4 * ((2 * SEQ) ** 2 - flops.bdlm_attention_pairs(SEQ, BLOCK, causal)) * per_pair
    counted = {p: flops.bdlm_step_flops(shape, **common, self_conditioning=p) for p in (None, 0.0, 1.0)}
    assert none == counted[0.0] + 3 * dense_extra  # the trained pass: forward and backward
    assert every == counted[1.0] + 4 * dense_extra  # and the first pass's forward
    assert none != counted[None] + 3 * dense_extra  # control: without the block's FLOPs the count misses
