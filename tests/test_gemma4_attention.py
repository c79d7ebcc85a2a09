"""Gemma 4's attention (`--gemma4-attention`, `mcore/gemma4_attention.py`): our whole DiffusionGemma model against
transformers' `DiffusionGemmaForBlockDiffusion`.

* Exactness: a tiny random `DiffusionGemmaConfig` (fp32, eager; sliding and global layers alternating, a window
  shorter than the prefix, global layers with their own head size and one K/V head, 4 experts, softcap 30), every
  weight and each layer's `layer_scalar` drawn away from its initial value, copied into our model built from the
  trainer's flags. For every block that has a clean prefix, transformers' logits (its encoder reads the prefix into
  the cache, its decoder denoises the block) equal our model's logits on that block's noisy rows, which see the same
  prefix through the token-causal clean stream: without self-conditioning, and with the same self-conditioning logits
  fed to both. On one rank and on CSBP2 (the clean prefix sharded over two ranks, the windowed exchange).
* Negative controls, each of which must miss: global layers with plain RoPE (not proportional), the value norm off,
  the layer scalar ignored, the global layers' key not reused as the value (a value projection of zeros instead).
* Layouts: one training step of the whole architecture (Gemma 4's attention and MoE block, sliding and global layers,
  self-conditioning, softcap, scaled embeddings, the AR co-loss) on CSBP2, EP2 x CSBP2, TP2 x CSBP2 + SP and
  PP2 x CSBP2 (without self-conditioning, refused beside PP) equals one rank: loss, parts, every gradient. Control:
  the layer scalars ignored miss.
* Refusals: the flags it cannot take, in one line, exit 2, before any work.

Block 0 has no clean prefix, and transformers' decoder reads its context from the encoder's cache, which needs at
least one token: it is compared on every other block.
"""

import dataclasses

import pytest
import torch

import drawn_weights
import test_diffusion_gemma as diffusion_gemma
from spawn import on_cpu_backend, run_ranks

pytest.importorskip("transformers")
SEQ, BLOCK, BATCH, WINDOW = 32, 8, 2, 6
HIDDEN, HEADS, GROUPS, HEAD, GLOBAL_GROUPS, GLOBAL_HEAD = 32, 4, 2, 8, 1, 16
DENSE_FFN, EXPERT_FFN, EXPERTS, TOPK = 40, 24, 4, 2
LAYER_TYPES = ("sliding_attention", "full_attention", "sliding_attention", "full_attention")
HF_VOCAB = 63  # NullTokenizer --vocab-size 62: ids 0..61 and EOD 62; our MASK is 63
TOLERANCE = 1e-5
FLAGS = [
    "--num-layers", str(len(LAYER_TYPES)), "--hidden-size", str(HIDDEN), "--num-attention-heads", str(HEADS),
    "--group-query-attention", "--num-query-groups", str(GROUPS), "--kv-channels", str(HEAD),
    "--ffn-hidden-size", str(DENSE_FFN), "--seq-length", str(SEQ), "--micro-batch-size", str(BATCH),
    "--train-iters", "1", "--lr", "0", "--bdlm-block-size", str(BLOCK), "--eval-iters", "0",
    "--training-loop", "megatron-core", "--disable-bias-linear", "--normalization", "RMSNorm", "--norm-epsilon", "1e-6",
    "--num-experts", str(EXPERTS), "--moe-router-topk", str(TOPK), "--moe-ffn-hidden-size", str(EXPERT_FFN),
    "--moe-shared-expert-intermediate-size", str(DENSE_FFN), "--moe-router-load-balancing-type", "none",
    "--gemma4-moe",
    "--window-size", f"{WINDOW - 1},0",
    "--window-attn-skip-freq",
    "[" + ",".join("1" if kind == "sliding_attention" else "0" for kind in LAYER_TYPES) + "]",
    "--position-embedding-type", "rope", "--rotary-base", "10000", "--bdlm-objective", "diffusion-gemma",
    "--bdlm-clean-attention", "token-causal", "--bdlm-ar-loss-weight", "1", "--final-logit-softcapping", "30",
    "--scale-embeddings", "--vocab-size", str(HF_VOCAB - 1), "--tokenizer-type", "NullTokenizer",
    "--use-cpu-initialization", "--data-path", "unused"]
GEMMA4 = ["--gemma4-attention", "--global-kv-channels", str(GLOBAL_HEAD), "--global-num-query-groups",
          str(GLOBAL_GROUPS), "--global-rotary-base", "1000000", "--global-rotary-percent", "0.25"]
CONTROLS = ("global layers with plain RoPE", "value norm off", "layer scalar ignored", "key not the value")


def _transformers_model():
    """transformers' DiffusionGemma (tiny, fp32, eager), every weight and layer scalar drawn."""
    from transformers.models.diffusion_gemma.configuration_diffusion_gemma import (DiffusionGemmaConfig,
                                                                                  DiffusionGemmaTextConfig)
    from transformers.models.diffusion_gemma.modeling_diffusion_gemma import DiffusionGemmaForBlockDiffusion

    text = DiffusionGemmaTextConfig(
        vocab_size=HF_VOCAB, hidden_size=HIDDEN, intermediate_size=DENSE_FFN, moe_intermediate_size=EXPERT_FFN,
        num_experts=EXPERTS, top_k_experts=TOPK, num_hidden_layers=len(LAYER_TYPES), num_attention_heads=HEADS,
        num_key_value_heads=GROUPS, head_dim=HEAD, global_head_dim=GLOBAL_HEAD,
        num_global_key_value_heads=GLOBAL_GROUPS, sliding_window=WINDOW, layer_types=list(LAYER_TYPES),
        rms_norm_eps=1e-6, final_logit_softcapping=30.0)
    torch.manual_seed(0)
    model = DiffusionGemmaForBlockDiffusion(DiffusionGemmaConfig(text_config=text, canvas_length=BLOCK)).float()
    model.config._attn_implementation = "eager"
    model.eval()
    generator = torch.Generator().manual_seed(3)
    drawn_weights.draw(model, generator)
    with torch.no_grad():
        encoder = model.model.encoder.language_model
        for layer, encoder_layer in zip(model.model.decoder.layers, encoder.layers):  # one value, as a checkpoint's
            layer.layer_scalar.copy_(0.5 + torch.rand(1, generator=generator))
            encoder_layer.layer_scalar.copy_(layer.layer_scalar)
    return model


def _interleaved(q, k, v, groups, head):
    """megatron-core's fused QKV rows: per K/V group its query heads, its key head, its value head (none: K = V)."""
    q, k = q.view(groups, -1, q.shape[-1]), k.view(groups, head, -1)
    v = None if v is None else v.view(groups, head, -1)
    return torch.cat([part for g in range(groups) for part in (q[g], k[g], *(() if v is None else (v[g],)))])


def _our_state(theirs, mask_id, padded_vocab):
    """transformers' decoder weights under our model's names (the embedding padded, MASK the mean row)."""
    s = {name: tensor.detach().clone() for name, tensor in theirs.state_dict().items()}
    embedding = s["model.decoder.embed_tokens.weight"]
    table = torch.zeros(padded_vocab, HIDDEN)
    table[:HF_VOCAB], table[mask_id] = embedding, embedding.mean(0)
    ours = {"embedding.word_embeddings.weight": table, "decoder.final_layernorm.weight": s["model.decoder.norm.weight"]}
    for our, their in (("pre_norm_weight", "pre_norm.weight"), ("gate", "gate_proj.weight"), ("up", "up_proj.weight"),
                       ("down", "down_proj.weight")):
        ours["self_conditioning." + our] = s["model.decoder.self_conditioning." + their]
    for i, kind in enumerate(LAYER_TYPES):
        h, o = f"model.decoder.layers.{i}.", f"decoder.layers.{i}."
        sliding = kind == "sliding_attention"
        ours[o + "self_attention.linear_qkv.weight"] = _interleaved(
            s[h + "self_attn.q_proj.weight"], s[h + "self_attn.k_proj.weight"],
            s[h + "self_attn.v_proj.weight"] if sliding else None, GROUPS if sliding else GLOBAL_GROUPS,
            HEAD if sliding else GLOBAL_HEAD)
        pairs = {"layer_scalar": "layer_scalar", "input_layernorm.weight": "input_layernorm.weight",
                 "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
                 "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
                 "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
                 "self_attention.post_attention_layernorm.weight": "post_attention_layernorm.weight",
                 "mlp.router.weight": "router.proj.weight", "mlp.router.scale": "router.scale",
                 "mlp.router.per_expert_scale": "router.per_expert_scale",
                 "mlp.shared_experts.linear_fc2.weight": "mlp.down_proj.weight",
                 "mlp.pre_feedforward_layernorm.weight": "pre_feedforward_layernorm.weight",
                 "mlp.post_dense_layernorm.weight": "post_feedforward_layernorm_1.weight",
                 "mlp.pre_experts_layernorm.weight": "pre_feedforward_layernorm_2.weight",
                 "mlp.post_experts_layernorm.weight": "post_feedforward_layernorm_2.weight",
                 "mlp.post_feedforward_layernorm.weight": "post_feedforward_layernorm.weight"}
        ours.update({o + our: s[h + their] for our, their in pairs.items()})
        ours[o + "mlp.shared_experts.linear_fc1.weight"] = torch.cat([s[h + "mlp.gate_proj.weight"],
                                                                      s[h + "mlp.up_proj.weight"]])
        for e in range(EXPERTS):
            ours[o + f"mlp.experts.local_experts.{e}.linear_fc1.weight"] = s[h + "experts.gate_up_proj"][e]
            ours[o + f"mlp.experts.local_experts.{e}.linear_fc2.weight"] = s[h + "experts.down_proj"][e]
    return ours


def _inputs():
    generator = torch.Generator().manual_seed(5)
    x0 = torch.randint(0, HF_VOCAB, (BATCH, SEQ), generator=generator)
    x_t = torch.randint(0, HF_VOCAB, (BATCH, SEQ), generator=generator)  # uniform-state canvases
    return x0, x_t


def _transformers_logits(model, self_conditioning_logits=None):
    """`[b, L, V]` transformers' logits of every block from its clean prefix (block 0: zeros, not compared), with the
    given self-conditioning logits `[b, L, V]` (None: without)."""
    x0, x_t = _inputs()
    blocks = [torch.zeros(BATCH, BLOCK, HF_VOCAB)]
    with torch.no_grad():
        for start in range(BLOCK, SEQ, BLOCK):
            signal = None if self_conditioning_logits is None else self_conditioning_logits[:, start:start + BLOCK]
            blocks.append(model(input_ids=x0[:, :start], decoder_input_ids=x_t[:, start:start + BLOCK],
                                self_conditioning_logits=signal).logits)
    return torch.cat(blocks, dim=1)


@on_cpu_backend
def _our_logits(rank, world, state, self_conditioning_logits, controls):
    """{case: (this rank's noisy positions, our logits `[b, noisy rows, V]` on them)} with the self-conditioning
    signal of the given logits `[b, L, V]` (None: without), for our model and each control."""
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_csbp.mcore import gemma4_attention, parallel_state
    from megatron_csbp.training import providers
    from megatron_csbp.training.arguments import validate_args
    from megatron_csbp.training.flags import build_parser

    args = validate_args(build_parser().parse_args(FLAGS + GEMMA4 + ["--context-block-parallel", str(world)]), world,
                         check_paths=False, on_accelerator=False)
    parallel_state.initialize_model_parallel(1, 1, context_block_parallel_size=world, clean_shards=world)
    try:
        results = {}
        for case in ("model", *controls):
            model_parallel_cuda_manual_seed(1234)
            run_providers = providers.RunProviders(args)
            model = run_providers.model_provider()
            missing, unexpected = model.load_state_dict(state, strict=False)
            assert not unexpected and all(name.endswith("_extra_state") for name in missing), (missing, unexpected)
            attentions = [layer.self_attention for layer in model.decoder.layers]
            if case == "global layers with plain RoPE":
                plain = 1.0 / (1_000_000.0 ** (torch.arange(0, GLOBAL_HEAD, 2).float() / GLOBAL_HEAD))
                model.rotary_pos_emb.global_inverse_frequencies = plain
            elif case == "value norm off":
                gemma4_attention.value_norm, kept = (lambda value, eps: value), gemma4_attention.value_norm
            elif case == "layer scalar ignored":
                for layer in model.decoder.layers:
                    layer.layer_scalar.fill_(1.0)
            elif case == "key not the value":
                for attention in attentions:
                    if attention.shared_key_value:
                        attention.get_query_key_value_tensors = (
                            lambda hidden, *a, attention=attention, **k: _zero_value(attention, hidden))
            layout = run_providers.run.layout
            x0, x_t = _inputs()
            ids = torch.cat([x_t[:, layout.noisy_positions], x0[:, layout.clean_positions]], dim=1)
            positions = layout.row_positions.expand(BATCH, -1).contiguous()
            model.eval()
            with torch.no_grad():
                signal = None
                if self_conditioning_logits is not None:  # their logits, our columns (MASK and padding -inf)
                    columns = model.embedding.word_embeddings.weight.shape[0]
                    logits = torch.full((BATCH, layout.num_noisy_rows, columns), float("-inf"))
                    logits[..., :HF_VOCAB] = self_conditioning_logits[:, layout.noisy_positions]
                    probabilities = logits.softmax(-1).transpose(0, 1)
                    signal = probabilities @ model.embedding.word_embeddings.weight * HIDDEN ** 0.5
                decoder_input = model._canvas_input(ids, positions, signal)
                logits = model(ids, positions, decoder_input=decoder_input)
            if case == "value norm off":
                gemma4_attention.value_norm = kept
            results[case] = (layout.noisy_positions, logits[:, :layout.num_noisy_rows, :HF_VOCAB])
        return results
    finally:
        parallel_state.destroy_model_parallel()


def _zero_value(attention, hidden):
    """The global layer's query and key as ours makes them, with a value of zeros (no K = V)."""
    query, key, _ = type(attention).get_query_key_value_tensors(attention, hidden)
    return query, key, torch.zeros_like(key)


def _relative(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _worst_block_error(per_rank, case, reference):
    """The worst relative error over the blocks with a clean prefix, each block's rows gathered from its rank."""
    assembled = torch.zeros_like(reference)
    for results in per_rank:
        positions, logits = results[case]
        assembled[:, positions] = logits
    return max(_relative(assembled[:, start:start + BLOCK], reference[:, start:start + BLOCK])
               for start in range(BLOCK, SEQ, BLOCK))


@pytest.mark.parametrize("world", [1, 2], ids=["1 rank", "csbp2"])
def test_logits_per_block_equal_transformers_with_and_without_self_conditioning(world):
    theirs = _transformers_model()
    state = _our_state(theirs, mask_id=HF_VOCAB, padded_vocab=128)
    first = _transformers_logits(theirs)
    controls = CONTROLS if world == 1 else ()
    for name, signal in (("without self-conditioning", None), ("self-conditioned", first)):
        reference = first if signal is None else _transformers_logits(theirs, signal)
        per_rank = run_ranks(_our_logits, world, state, signal, controls if signal is None else (), timeout=600)
        error = _worst_block_error(per_rank, "model", reference)
        print(f"world {world}, {name}: worst relative error over blocks {error:.2e}")
        assert error <= TOLERANCE, (name, error)
        for control in (controls if signal is None else ()):
            wrong = _worst_block_error(per_rank, control, reference)
            print(f"control '{control}': {wrong:.2e}")
            assert wrong > 100 * TOLERANCE, (control, wrong)


REFUSALS = [
    ([flag for flag in FLAGS if flag != "--gemma4-moe"] + GEMMA4,
     "--gemma4-attention builds DiffusionGemma's layers, whose feed-forward block is Gemma 4's: add --gemma4-moe"),
    (FLAGS + GEMMA4 + ["--global-num-query-groups", "3"],
     "--global-num-query-groups 3 does not divide --num-attention-heads 4: each K/V head of a global layer serves the "
     "same number of query heads"),
    (FLAGS + GEMMA4 + ["--global-rotary-percent", "0"],
     "--global-rotary-percent 0.0 must be in (0, 1]: the share of each global head's frequencies that rotate"),
    (FLAGS + GEMMA4 + ["--global-kv-channels", "0"], "--global-kv-channels must be >= 1; got 0"),
    (FLAGS + GEMMA4 + ["--position-embedding-type", "yarn", "--yarn-rotary-scaling-factor", "4",
                        "--yarn-original-max-position-embeddings", "16"],
     "--gemma4-attention takes plain RoPE on sliding layers and proportional RoPE on global ones: drop "
     "--position-embedding-type yarn and --llama-4-scaling-beta"),
]


def test_the_flags_refuse_in_one_line_exit_2_and_reach_the_model_config(tmp_path, capsys):
    from megatron.core.transformer import TransformerConfig

    from megatron_csbp.core.rules import ConfigError
    from megatron_csbp.core.run_config import RunConfig
    from megatron_csbp.mcore.model import set_shape_config
    from megatron_csbp.training import pretrain
    from megatron_csbp.training.arguments import validate_args
    from megatron_csbp.training.flags import build_parser

    prefix = tmp_path / "corpus"
    for suffix in (".bin", ".idx"):
        (tmp_path / ("corpus" + suffix)).write_bytes(b"")
    flags = lambda given: [str(prefix) if value == "unused" else value for value in given]  # noqa: E731
    for given, message in REFUSALS:
        assert pretrain.main(flags(given)) == 2, given
        captured = capsys.readouterr()
        assert captured.err.strip().splitlines() == [f"pretrain_bdlm.py: error: {message}"], given
    # control: the recipe passes; the shape holds the global layers' sizes; the model's config gets them
    args = validate_args(build_parser().parse_args(flags(FLAGS + GEMMA4 + ["--global-rotary-base", "5e5"])), 1,
                         on_accelerator=False)
    shape = RunConfig.from_args(args).shape.gemma4_attention
    assert (shape.global_kv_channels, shape.global_query_groups, shape.global_rotary_base,
            shape.global_rotary_fraction) == (GLOBAL_HEAD, GLOBAL_GROUPS, 5e5, 0.25)
    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4)
    set_shape_config(config, RunConfig.from_args(args).shape)
    assert config.gemma4_attention == shape and config.qk_layernorm and config.softmax_scale == 1.0
    args.tensor_model_parallel_size = 2  # on two ranks, one K/V head cannot be split
    with pytest.raises(ConfigError) as refused:
        RunConfig.from_args(args, world_size=2)
    assert str(refused.value) == ("--tensor-model-parallel-size 2 does not divide --global-num-query-groups 1: each TP "
                                  "rank holds whole K/V heads of the global layers")
    without = validate_args(build_parser().parse_args(flags(FLAGS)), 1, on_accelerator=False)
    assert RunConfig.from_args(without).shape.gemma4_attention is None  # control: the flag is what turns it on


# --- one training step of the whole architecture on every layout -------------------------------------------------

STEP_LEFT = 5  # sliding layers see 5 keys before their block (megatron_step's blocks are 4 tokens, its clean chunks 8)


def _step_config(topology):
    """`megatron_step._config` as DiffusionGemma: Gemma 4's MoE block and attention in every layer (global layers
    of head size 16 with 2 K/V heads, so TP2 splits them), sliding layers 1 and 3 of 4, the load-balancing loss on."""
    from megatron_csbp.core.model_shape import Gemma4AttentionShape, ModelShape, MoEShape
    from megatron_csbp.mcore.model import set_shape_config
    import megatron_step

    config = megatron_step._config(
        topology, num_moe_experts=EXPERTS, moe_router_topk=TOPK, moe_ffn_hidden_size=EXPERT_FFN, moe_layer_freq=1,
        moe_shared_expert_intermediate_size=DENSE_FFN, moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=1e-2, moe_token_dispatcher_type=topology.dispatcher, moe_router_dtype="fp32",
        add_bias_linear=False, kv_channels=HEAD, window_size=(STEP_LEFT, 0), window_attn_skip_freq=[1, 0, 1, 0])
    shape = ModelShape(num_layers=4, hidden_size=32, num_attention_heads=4, num_query_groups=2, kv_channels=HEAD,
                       add_bias_linear=False, moe=MoEShape(EXPERTS, TOPK, EXPERT_FFN, 4, DENSE_FFN, gemma4=True),
                       gemma4_attention=Gemma4AttentionShape(GLOBAL_HEAD, 2))
    set_shape_config(config, shape)
    return config


def _step(topology, weights):
    from megatron_step import train_step
    from megatron_csbp.bdlm.forward_step import BDLMForwardStep

    def drawn_scalars(ddp):  # each layer's scalar away from 1, alike on every layout (a buffer: not in `weights`)
        for layer in ddp.module.decoder.layers:
            layer.layer_scalar.fill_(1.0 if topology.scalar_ignored else 0.75 + 0.125 * layer.layer_number)

    objective = diffusion_gemma._objective(topology.self_conditioning)
    return train_step(topology, weights, diffusion_gemma._build_model,
                      lambda layout: BDLMForwardStep(objective, layout),
                      diffusion_gemma._batches, diffusion_gemma.MICRO_BATCH, make_config=_step_config,
                      before_step=drawn_scalars)


@dataclasses.dataclass(frozen=True)
class StepRun(diffusion_gemma.MoERun):
    scalar_ignored: bool = False  # negative control: every layer scalar left at 1


def _step_runs():
    reference = StepRun("one rank", block_parallel=1, clean_shards=1)
    return {
        "reference": reference,
        "reference without self-conditioning": StepRun("one rank, no self-conditioning", block_parallel=1,
                                                       clean_shards=1, self_conditioning=0.0),
        2: [StepRun("csbp2", block_parallel=2, clean_shards=2),
            StepRun("ep2 x csbp2", ep=2, block_parallel=2, clean_shards=2),
            StepRun("control: csbp2, layer scalars ignored", block_parallel=2, clean_shards=2, scalar_ignored=True)],
        4: [StepRun("tp2 x csbp2 + sp", tp=2, block_parallel=2, clean_shards=2, sequence_parallel=True),
            StepRun("pp2 x csbp2, without self-conditioning", pp=2, block_parallel=2, clean_shards=2,
                    self_conditioning=0.0)],
    }


@pytest.fixture(scope="module")
def step_references():
    from megatron_step import run_steps

    runs = _step_runs()
    with_it = run_ranks(run_steps, 1, _step, [runs["reference"]], None, timeout=300)[0][0]
    without = run_ranks(run_steps, 1, _step, [runs["reference without self-conditioning"]], with_it["initial"],
                        timeout=300)[0][0]
    return {True: with_it, False: without}


@pytest.mark.parametrize("world", [2, 4])
def test_one_step_on_every_layout_equals_one_rank(world, step_references):
    """The loss, each of its parts (lm, diffusion, ar), the grad norm and every gradient and updated parameter of one
    step of the whole DiffusionGemma architecture (Gemma 4's attention and MoE block, sliding and global layers,
    self-conditioning, softcap, scaled embeddings, the AR co-loss) equal the one-rank step. Control: the layer
    scalars ignored miss."""
    from megatron_step import run_steps, worst_error

    topologies = _step_runs()[world]
    results = run_ranks(run_steps, world, _step, topologies, step_references[True]["initial"], timeout=900)
    for index, topology in enumerate(topologies):
        reference = step_references[topology.self_conditioning > 0]
        assert set(reference["losses"]) == {"lm loss", "diffusion loss", "ar loss"}, reference["losses"]
        per_rank = [results[rank][index] for rank in range(world)]
        part_error = max(abs(r["losses"][name] - value) / abs(value)
                         for r in per_rank if r["losses"] for name, value in reference["losses"].items())
        error = max(worst_error(per_rank, reference, scalars=("grad_norm",)), part_error)
        print(f"{topology.name}: worst relative error {error:.2e} (loss parts {part_error:.2e})")
        if topology.name.startswith("control"):
            assert part_error > 10 * TOLERANCE and error > 1e-3, (topology.name, part_error, error)
        else:
            assert error <= TOLERANCE, (topology.name, error)
