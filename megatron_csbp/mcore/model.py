"""The BDLM GPT model: a megatron-core `GPTModel` over this rank's `[noisy ; clean]` CSBP rows.

What differs from a plain `GPTModel`, and why:
* RoPE takes each row's global position from the batch's `position_ids` (the forward step ships the
  layout's `row_positions`, on every pipeline stage), so a token's noisy and clean copy share one
  position; Megatron's RoPE would number the local rows `0..rows*cp` and zigzag-slice them by CP rank,
  which is wrong for CSBP rows. The positions are one source: what the batch gives is what RoPE uses, YaRN's
  frequencies (megatron-core's `YarnRotaryEmbedding`) and Llama 4's query scaling (`core.positions`) alike:
  the query scale of each row is computed here from its RoPE position and reaches the core attention as
  megatron-core's `attention_bias`, the one per-micro-batch input it passes the core attention.
* The LM head runs over noisy rows only (clean rows carry no loss: half the head FLOPs saved), unless the run
  trains an autoregressive co-loss on the clean rows (`clean_logits`: a token-causal clean stream). Only real
  ids take probability: the MASK column and the vocabulary padding after the real ids (`vocab_ids`) are
  -inf on whichever TP rank holds them. Megatron-LM leaves the padding columns in the softmax; an imported
  model's zero padding rows then give logit 0 and take probability from every real token (2-7% of the
  first loss of a tiny import), and a model trained that way learns to push them down instead.
* With `logits_tile_rows` (`--cross-entropy-loss-fusion`) the head and its loss run as a tiled linear
  cross-entropy (`linear_cross_entropy`) whenever labels are given: the same per-token loss, with no
  `[rows x vocab]` logits held whole; without labels the head returns the logits as before.
* With `self_conditioning` (DiffusionGemma's) the canvas (noisy) rows' embeddings pass its block
  (`self_conditioning`); `forward(..., self_conditioned=[b] bool)` first runs the chosen samples once without
  gradient and feeds their canvas rows' expected embedding (`linear_cross_entropy.tiled_soft_embeddings`) to the
  block in the pass that is trained (docs/algorithm.md §2).
* Under sequence parallelism the row count is padded to a multiple of TP; padded rows have position
  0, see no attention and never reach the head.

Contract with `megatron_csbp.bdlm.objective`: `model(input_ids [b, rows], position_ids [b, rows],
attention_mask=None, labels=x0 of noisy rows [b, n_noisy])` returns per-token cross-entropy
`[b, n_noisy]` on the last pipeline stage, or the logits `[b, n_noisy, V/tp]` when `labels` is None (with
`clean_logits`, over all rows: the clean rows' labels, their next tokens, follow the noisy rows').
The samples of a micro-batch share one row layout, so RoPE reads the positions of its first sample: one
`[rows, 1, 1, dim]` table for the batch, the shape Megatron's (and Transformer Engine's fused) RoPE takes.
Packed samples whose positions restart at each document (`per_sample_positions`, `--reset-position-ids`)
take a `[rows, b, 1, dim]` table instead, and `attention_mask` then carries each sample's document ids
`[b, L]` to the core attention (`spec.CSBPCoreAttention`), which cuts every row's keys to its document.
"""

import torch
from megatron.core import tensor_parallel
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

from megatron_csbp.core import transports
from megatron_csbp.core.model_shape import GATED_DELTA_NET
from megatron_csbp.core.positions import ROUNDING, YARN_FLAGS, RotaryPositions
from megatron_csbp.mcore import gemma4_attention, gemma4_moe, spec as csbp_spec
from megatron_csbp.mcore.linear_cross_entropy import softcapped, tiled_linear_cross_entropy, tiled_soft_embeddings
from megatron_csbp.mcore.self_conditioning import SelfConditioning
from megatron_csbp.core.rules import ConfigError, refused_features


SIGNAL_TILE_ROWS = 1024  # rows per tile of the self-conditioning signal without --cross-entropy-loss-fusion's tiles
SIGNAL_TILE_COLUMNS = 32768  # vocabulary columns per tile of the signal (a 262K vocabulary in 8 tiles)


def padded_row_count(layout, config) -> int:
    """Rows each rank runs through the model: the layout's, padded to a multiple of TP under SP."""
    multiple = config.tensor_model_parallel_size if config.sequence_parallel else 1
    return -(-layout.num_rows // multiple) * multiple


def pipeline_seq_length(layout, config) -> int:
    """The `seq_length` to give `get_forward_backward_func()(...)`: Megatron divides it by the CP size
    (and TP under SP) to size the pipeline's activation messages."""
    return padded_row_count(layout, config) * layout.block_parallel_size


def predictable_columns(first_column: int, columns: int, vocab_ids: int, mask_token_id: int | None,
                        device=None) -> torch.Tensor:
    """Which of the vocabulary columns `first_column .. first_column + columns - 1` (one TP rank's slice) are
    ids the model may predict: a real id (`< vocab_ids`), not MASK."""
    ids = torch.arange(first_column, first_column + columns, device=device)
    allowed = ids < vocab_ids
    if mask_token_id is not None:
        allowed &= ids != mask_token_id
    return allowed


def validate_config(config, layout, vocab_size=None, mask_token_id=None) -> None:
    """Refuses, before any work, the settings CSBP cannot honour; each message names the flag and fix."""
    def require(condition, message):
        if not condition:
            raise ConfigError(message)

    for message in refused_features(config):
        raise ConfigError(message)
    require(config.context_parallel_size == layout.block_parallel_size,
            f"--context-parallel-size={config.context_parallel_size} must equal the block-parallel size "
            f"{layout.block_parallel_size}: CSBP occupies Megatron's context-parallel slot")
    if vocab_size is not None and mask_token_id is not None:
        require(0 <= mask_token_id < vocab_size,
                f"--bdlm-mask-token-id={mask_token_id} is outside the model vocabulary of {vocab_size}: MASK "
                f"needs its own id, so make --vocab-size (or the padded vocabulary) at least {mask_token_id + 1}")


def set_rotary_config(config, positions: RotaryPositions) -> None:
    """megatron-core reads YaRN off the `TransformerConfig` (its GPTModel builds `YarnRotaryEmbedding` from the
    `yarn_*` fields, its attention multiplies cos and sin by their concentration factor), fields Megatron-LM's
    `core_transformer_config_from_args` does not fill: they are set where a model is built, from `positions`, and
    taken away from a config without YaRN."""
    fields = positions.yarn.config_fields() if positions.yarn is not None else {}
    for name in (*YARN_FLAGS, ROUNDING):
        if name in fields:
            setattr(config, name, fields[name])
        elif name in vars(config):
            delattr(config, name)


def set_shape_config(config, shape) -> None:
    """The fields of the run's `ModelShape` (`core.model_shape`) megatron-core reads off the `TransformerConfig`
    beside the sizes: Gated DeltaNet layers (`shape.linear`), the attention output gate, the `1 + w` norms, Gemma 4's
    MoE block (`gemma4_moe`, with its gated GELU-tanh MLPs). Our
    loop's config gets them here, from the `RunConfig`; Megatron-LM's holds them already. Set after the config is
    made: its `__post_init__` refuses Gated DeltaNet beside `context_parallel_size > 1`, which here is the block
    parallel size `P`, under which the layer runs (`mcore.gated_delta_net`)."""
    linear = shape.linear
    config.attention_output_gate = shape.attention_output_gate
    config.layernorm_zero_centered_gamma = shape.layernorm_1p
    config.experimental_attention_variant = None if linear is None else GATED_DELTA_NET
    config.linear_attention_freq = None if linear is None else list(linear.pattern)
    config.gemma4_moe = shape.moe is not None and shape.moe.gemma4
    config.gemma4_attention = shape.gemma4_attention
    if config.gemma4_attention is not None:  # its query and key norms set the scores' scale (`gemma4_attention`)
        config.qk_layernorm, config.softmax_scale = True, 1.0
        # global and sliding layers' attention differ in shape: each layer gets checkpoint keys of its own
        config.hetereogenous_dist_checkpoint = True
    if config.gemma4_moe:  # Gemma 4's MLPs, dense and experts: gated GELU-tanh
        config.gated_linear_unit, config.activation_func = True, gemma4_moe.gelu_tanh
    if linear is not None:
        for name in ("conv_kernel_dim", "key_head_dim", "value_head_dim", "num_key_heads", "num_value_heads"):
            setattr(config, "linear_" + name, getattr(linear, name))


def global_inverse_frequencies(config):
    """Gemma 4's global layers' RoPE frequencies (`gemma4_attention`), or None."""
    shape = getattr(config, "gemma4_attention", None)
    if shape is None:
        return None
    return gemma4_attention.proportional_inverse_frequencies(shape.global_kv_channels, shape.global_rotary_base,
                                                             shape.global_rotary_fraction)


def query_scales(positions: RotaryPositions, position_ids):
    """`[rows, b, 1, 1]` the query scale of each row at `position_ids [b, rows]` (None: no query scaling), the
    core attention's `attention_bias`."""
    if positions.query_scaling is None:
        return None
    return positions.query_scaling.scales(position_ids).t()[:, :, None, None]


class PositionTableRotaryEmbedding(torch.nn.Module):
    """Megatron's RoPE (or YaRN) table over every position of the sequence, neither numbered by local row nor
    sliced by CP rank: `BDLMGPTModel` indexes it with the batch's `position_ids`. YaRN's table comes with its
    concentration factor, as megatron-core's does (the attention reads that off the config)."""

    def __init__(self, rotary, seq_length: int, global_inverse_frequencies=None):
        super().__init__()
        self.rotary = rotary
        self.seq_length = seq_length  # known here, so forward never syncs with the device
        self.global_inverse_frequencies = global_inverse_frequencies  # Gemma 4's global layers' (None: one table)

    def get_rotary_seq_len(self, *args, **kwargs) -> int:
        return self.seq_length

    def forward(self, *args, **kwargs):
        table = self.rotary.get_emb(self.seq_length)  # [positions, 1, 1, dim] (YaRN: and its factor)
        if self.global_inverse_frequencies is None:
            return table
        return gemma4_attention.side_by_side(table, self.global_inverse_frequencies)  # each layer takes its own


class BDLMGPTModel(GPTModel):
    """`GPTModel` over CSBP rows; see the module docstring. `layout`: this rank's row layout; `vocab_ids`: the
    real ids before the vocabulary padding (default: no padding, all `vocab_size` columns); `positions`: YaRN and
    the query scaling (default: plain RoPE), with `position_embedding_type` its `embedding_type`."""

    def __init__(self, config, transformer_layer_spec, vocab_size, *args, layout, mask_token_id=None, vocab_ids=None,
                 per_sample_positions=False, clean_logits=False, positions: RotaryPositions | None = None,
                 logits_tile_rows=None, self_conditioning=False, final_logit_softcapping=None, embedding_scale=None,
                 **kwargs):
        validate_config(config, layout, vocab_size, mask_token_id)  # before any weight is allocated
        vocab_ids = vocab_size if vocab_ids is None else vocab_ids
        if not 0 < vocab_ids <= vocab_size:
            raise ConfigError(f"the model's {vocab_size} vocabulary rows cannot hold {vocab_ids} real ids: raise "
                              f"--make-vocab-size-divisible-by or check --vocab-size")
        positions = positions or RotaryPositions()
        position_embedding_type = kwargs.get("position_embedding_type", "learned_absolute")
        if position_embedding_type not in (positions.embedding_type, "learned_absolute", "none"):
            raise ValueError(f"--position-embedding-type={position_embedding_type} is not supported by "
                             f"BDLM with these positions: use {positions.embedding_type}")
        set_rotary_config(config, positions)
        if getattr(config, "gemma4_attention", None) is not None and (
                positions.yarn is not None or positions.query_scaling is not None
                or kwargs.get("rotary_percent", 1.0) != 1.0):
            raise ConfigError("--gemma4-attention takes plain RoPE on sliding layers and proportional RoPE on global "
                              "ones: drop YaRN, the query scaling and --rotary-percent")
        super().__init__(config, transformer_layer_spec, vocab_size, *args, **kwargs)
        self.positions = positions
        self.layout = layout
        self.mask_token_id = mask_token_id
        self.vocab_ids = vocab_ids
        self.per_sample_positions = per_sample_positions  # packed samples, positions restarted per document
        self.clean_logits = clean_logits  # the LM head runs over the clean rows too (their next-token loss)
        self.logits_tile_rows = logits_tile_rows  # the loss as a tiled linear cross-entropy (None: whole logits)
        # the canvas rows' self-conditioning block (DiffusionGemma's), on the stage that embeds
        self.self_conditioning = SelfConditioning(self.config) if self_conditioning and self.pre_process else None
        self._signal_pass = False  # the self-conditioning's first pass: the head returns the signal, not logits
        self.final_logit_softcapping = final_logit_softcapping  # logits = cap · tanh(logits / cap) (None: off)
        self.embedding_scale = embedding_scale  # the input embeddings' multiplier (Gemma's sqrt(hidden); None: 1)
        self._predictable = None  # this TP rank's unpredictable columns, made on the first forward
        self.padded_rows = padded_row_count(layout, self.config)
        if self.position_embedding_type == positions.embedding_type:
            self.rotary_pos_emb = PositionTableRotaryEmbedding(self.rotary_pos_emb, layout.seq_length,
                                                               global_inverse_frequencies(config))

    def _pad_rows(self, ids):
        if ids is None or ids.shape[1] == self.padded_rows:
            return ids
        if ids.shape[1] != self.layout.num_rows:
            raise ValueError(f"got {ids.shape[1]} rows, but this rank's layout has {self.layout.num_rows}")
        return torch.nn.functional.pad(ids, (0, self.padded_rows - ids.shape[1]))

    def forward(self, input_ids, position_ids, attention_mask=None, decoder_input=None, labels=None,
                packed_seq_params=None, self_conditioned=None, **kwargs):
        if packed_seq_params is not None:
            raise ValueError("packed_seq_params (THD packed sequences) cannot be used with BDLM/CSBP rows: "
                             "give one sample per row set")
        if position_ids is None:
            raise ValueError("position_ids are needed: each row's global position ([b, rows], the layout's "
                             "row_positions), which RoPE takes")
        position_ids = self._pad_rows(position_ids)
        scales = query_scales(self.positions, position_ids if self.per_sample_positions else position_ids[:1])
        if scales is not None:
            kwargs["extra_block_kwargs"] = {**(kwargs.get("extra_block_kwargs") or {}), "attention_bias": scales}
        input_ids = self._pad_rows(input_ids)
        if self.self_conditioning is not None and decoder_input is None:
            signal = None
            if self_conditioned is not None and bool(self_conditioned.any()):
                signal = self._self_conditioning_signal(input_ids, position_ids, attention_mask, self_conditioned,
                                                        **kwargs)
            decoder_input = self._canvas_input(input_ids, position_ids, signal)
        elif self.embedding_scale is not None and self.pre_process and decoder_input is None:
            decoder_input = self._embedded(input_ids, position_ids)
        if self_conditioned is not None and self.self_conditioning is None:
            raise ValueError("self_conditioned samples were given to a model built without self_conditioning "
                             "(or not on its first pipeline stage)")
        return super().forward(input_ids, position_ids, attention_mask,
                               decoder_input=decoder_input, labels=labels, **kwargs)

    def _canvas_input(self, input_ids, position_ids, signal):
        """The decoder's input: the embeddings, the canvas (noisy) rows through the self-conditioning block with
        `signal [n_noisy, b, h]` (None: zero). Under sequence parallelism this TP rank's rows of both."""
        embedded = self._embedded(input_ids, position_ids)
        rows, first = embedded.shape[0], 0
        if self.config.sequence_parallel:
            first = self.pg_collection.tp.rank() * rows
        canvas = min(max(self.layout.num_noisy_rows - first, 0), rows)  # the canvas rows lead: a prefix of these
        if signal is None:
            signal = embedded.new_zeros((canvas, *embedded.shape[1:]))
        else:
            signal = signal[first:first + canvas].to(embedded.dtype)
        return torch.cat([self.self_conditioning(embedded[:canvas], signal), embedded[canvas:]])

    def _embedded(self, input_ids, position_ids):
        """The input embeddings, times the embedding scale (in their dtype, as transformers' Gemma scales them)."""
        embedded = self.embedding(input_ids=input_ids, position_ids=position_ids)
        if self.embedding_scale is None:
            return embedded
        return embedded * torch.tensor(self.embedding_scale, dtype=embedded.dtype)

    def _self_conditioning_signal(self, input_ids, position_ids, attention_mask, self_conditioned, **kwargs):
        """The first, detached pass over the self-conditioned samples: their canvas rows' expected embedding under
        the predicted distribution `[n_noisy, b, h]` (zero for the other samples), computed by tiles of rows
        (`linear_cross_entropy.tiled_soft_embeddings`), the logits never whole."""
        chosen = self_conditioned.nonzero().squeeze(1)
        pick = (lambda t: None if t is None else t.index_select(0, chosen.to(t.device)))
        with torch.no_grad():
            self._signal_pass = True
            try:
                ids, positions = pick(input_ids), pick(position_ids)
                if self.per_sample_positions:  # each chosen sample's own query scales
                    scales = query_scales(self.positions, positions)
                    if scales is not None:
                        kwargs["extra_block_kwargs"] = {**kwargs["extra_block_kwargs"], "attention_bias": scales}
                signal = super().forward(ids, positions, pick(attention_mask),
                                         decoder_input=self._canvas_input(ids, positions, None), labels=None, **kwargs)
            finally:
                self._signal_pass = False
            full = signal.new_zeros((signal.shape[0], input_ids.shape[0], signal.shape[2]))
            full[:, chosen.to(full.device)] = signal
        return full

    def _signal(self, hidden):
        """The self-conditioning signal of the canvas rows' final hidden states `[n_noisy, b, h]`: softmax of the
        head's logits (MASK and padding excluded) times the input embedding."""
        rows, batch = hidden.shape[:2]
        head = self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights else None
        head = self.output_layer.weight if head is None else head
        signal = tiled_soft_embeddings(hidden.reshape(rows * batch, -1), head, self.embedding.word_embeddings.weight,
                                       self.logits_tile_rows or SIGNAL_TILE_ROWS,
                                       self._unpredictable(head.shape[0], hidden.device), self.pg_collection.tp,
                                       softcap=self.final_logit_softcapping, tile_columns=SIGNAL_TILE_COLUMNS)
        if self.embedding_scale is not None:
            signal = signal * torch.tensor(self.embedding_scale, dtype=signal.dtype)
        return signal.view(rows, batch, -1)

    def _preprocess(self, input_ids, position_ids, *args, **kwargs):
        """Megatron's preprocessing, with RoPE at the batch's positions (first sample: see the module doc)."""
        output = super()._preprocess(input_ids, position_ids, *args, **kwargs)
        if self.position_embedding_type != self.positions.embedding_type:
            return output
        table = output[1]
        if self.per_sample_positions:  # `[rows, b, 1, dim]`: each sample's own positions (unfused RoPE broadcasts)
            return (output[0], table[position_ids.to(table.device)][:, :, 0].transpose(0, 1), *output[2:])
        return (output[0], table[position_ids[0].to(table.device)], *output[2:])

    def _postprocess(self, hidden_states, input_ids, position_ids, labels, *args, **kwargs):
        """LM head over the noisy rows (and the clean rows, with `clean_logits`): replaces
        `GPTModel._postprocess`."""
        if not self.post_process:
            return hidden_states
        output_layer = self.output_layer
        if output_layer.sequence_parallel:
            # All-gather the rows; the backward only takes this rank's slice, because the head's own
            # input-gradient all-reduce (sequence_parallel switched off below) already sums over TP.
            hidden_states = tensor_parallel.gather_from_sequence_parallel_region(
                hidden_states, tensor_parallel_output_grad=False, group=self.pg_collection.tp)
        if self._signal_pass:
            return self._signal(hidden_states[:self.layout.num_noisy_rows])
        head_rows = self.layout.num_rows if self.clean_logits else self.layout.num_noisy_rows
        noisy_hidden = hidden_states[:head_rows]
        weight = self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights else None
        if labels is not None and self.logits_tile_rows is not None:
            return self._tiled_loss(noisy_hidden, output_layer.weight if weight is None else weight, labels)
        sequence_parallel, output_layer.sequence_parallel = output_layer.sequence_parallel, False
        try:
            logits, _ = output_layer(noisy_hidden, weight=weight)
        finally:
            output_layer.sequence_parallel = sequence_parallel
        if self.final_logit_softcapping is not None:  # in fp32, as transformers' Gemma caps them
            logits = softcapped(logits.float(), self.final_logit_softcapping)
        logits = self._exclude_unpredictable_logits(logits)
        if labels is None:
            return logits.transpose(0, 1).contiguous()
        return self.compute_language_model_loss(labels, logits)

    def _tiled_loss(self, hidden, weight, labels):
        """Per-token cross-entropy `[b, rows]` of the head's rows `hidden [rows, b, h]` as a tiled linear
        cross-entropy (`linear_cross_entropy`): the same loss, no whole `[rows x vocab]` logits."""
        rows, batch = hidden.shape[:2]
        loss = tiled_linear_cross_entropy(hidden.reshape(rows * batch, -1), weight, labels.t().reshape(-1),
                                          self.logits_tile_rows, self._unpredictable(weight.shape[0], hidden.device),
                                          self.pg_collection.tp, self.final_logit_softcapping)
        return loss.view(rows, batch).t().contiguous()

    def _unpredictable(self, columns, device):
        """This TP rank's columns whose logits are -inf (MASK, the padding: see `predictable_columns`), or None."""
        if self._predictable is None or self._predictable[0].device != device:
            allowed = predictable_columns(self.pg_collection.tp.rank() * columns, columns, self.vocab_ids,
                                          self.mask_token_id, device=device)
            self._predictable = (~allowed, bool(allowed.all()))  # one device sync, here only
        hidden, none_hidden = self._predictable
        return None if none_hidden else hidden

    def _exclude_unpredictable_logits(self, logits):
        """MASK's and the padding's logits to -inf."""
        unpredictable = self._unpredictable(logits.shape[-1], logits.device)
        return logits if unpredictable is None else logits.masked_fill(unpredictable, float("-inf"))


def model_provider(pre_process=True, post_process=True, *, config, vocab_size, layout=None, mask_token_id=None,
                   vocab_ids=None, group=None, transport=transports.COLLECTIVE, context=None,
                   use_transformer_engine=False, vp_stage=None, base_spec=None, per_sample_positions=False,
                   **gpt_kwargs) -> BDLMGPTModel:
    """Builds this rank's `BDLMGPTModel` (the `model_provider` Megatron's `get_model` expects, once
    `config`, `layout` and the rest are bound with `functools.partial`).

    `context`: the attention context to bind (the run's, `providers.BDLMRun.attention`); without one it is
    made of `layout`, `group` (the block-parallel group(s), `parallel_state.get_block_parallel_groups()`) and
    `transport`.
    """
    if context is None:
        context = csbp_spec.AttentionContext(layout=layout, group=group, transport=transport)
    layout = context.layout
    if getattr(config, "gemma4_moe", False) and (base_spec is not None or config.experimental_attention_variant):
        raise ConfigError("--gemma4-moe builds megatron-core's MoE layers with Gemma 4's block: drop --spec and "
                          "--experimental-attention-variant")
    if config.experimental_attention_variant is not None:  # Gated DeltaNet hybrid
        from megatron_csbp.mcore.gated_delta_net import get_csbp_hybrid_block_spec

        if base_spec is not None or use_transformer_engine:
            raise ConfigError("--experimental-attention-variant gated_delta_net builds its layers from megatron-core's "
                              "local modules: drop --spec and use --transformer-impl local")
        layer_spec = get_csbp_hybrid_block_spec(config, context, vp_stage=vp_stage)
    elif getattr(config, "gemma4_moe", False):  # Gemma 4's MoE block in every layer
        layer_spec = gemma4_moe.get_gemma4_block_spec(config, use_transformer_engine, context, vp_stage=vp_stage)
    elif config.num_moe_experts and base_spec is None:  # megatron-core's MoE and dense layers, per --moe-layer-freq
        layer_spec = csbp_spec.get_csbp_block_spec(config, use_transformer_engine, context, vp_stage=vp_stage)
    else:
        layer_spec = csbp_spec.get_csbp_layer_spec(use_transformer_engine=use_transformer_engine, context=context,
                                                   base_spec=base_spec, qk_layernorm=config.qk_layernorm)
    if not use_transformer_engine and not isinstance(layer_spec, TransformerBlockSubmodules):  # final norm: SP too
        layer_spec = TransformerBlockSubmodules(
            layer_specs=[layer_spec] * get_num_layers_to_build(config, vp_stage=vp_stage),
            layer_norm=csbp_spec.SequenceParallelTorchNorm)
    gpt_kwargs.setdefault("max_sequence_length", layout.seq_length)
    gpt_kwargs.setdefault("position_embedding_type", (gpt_kwargs.get("positions") or RotaryPositions()).embedding_type)
    with gemma4_moe.quiet_about_its_layer(getattr(config, "gemma4_moe", False)):
        model = BDLMGPTModel(config=config, transformer_layer_spec=layer_spec, vocab_size=vocab_size,
                             pre_process=pre_process, post_process=post_process, vp_stage=vp_stage, layout=layout,
                             mask_token_id=mask_token_id, vocab_ids=vocab_ids,
                             per_sample_positions=per_sample_positions, **gpt_kwargs)
    return _experts_apart(model)


def _experts_apart(model):
    """Marks every expert weight expert-parallel (`allreduce = False`) on every EP size, local or grouped experts;
    megatron-core marks them only when EP > 1. So the experts always get megatron-core's expert gradient buffers
    (reduced over the expert-data-parallel group, which is DP x CP at EP 1: the same sum) and an optimizer of their
    own, and a checkpoint's optimizer state loads into another EP size (at EP 1 it would otherwise sit in the dense
    optimizer, with other parameter groups)."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    for module in model.modules():
        if isinstance(module, MoELayer):
            for parameter in module.experts.parameters():
                parameter.allreduce = False
    return model
