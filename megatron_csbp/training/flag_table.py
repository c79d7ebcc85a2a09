"""Every flag of Megatron-LM's parser (tag core_v0.16.1) and what a BDLM run does with it, in one table.

Under `--training-loop megatron-lm` Megatron-LM parses several hundred flags, and our providers (model,
spec, datasets, forward step) implement a subset; a flag that reaches none of them would be silently
ignored, giving the user another model or other data than asked for. So each flag has one of these kinds:

* `Honoured` by the plugin: our model, spec, data or forward step implements it (the suite names the test
  that shows each). Both loops take it (our loop's parser has it).
* `Honoured` by Megatron-LM's training loop (`by=MEGATRON_LM_LOOP`): Megatron-LM's own optimizer,
  schedule, gradient reduction or checkpoint code acts on it; our providers never read it. Our loop does not
  implement it, so there it is refused, saying to use `--training-loop megatron-lm`.
* `Neutral`: logging, timing, profiling, kernel choice, checkpoint format: it cannot change the model or the
  data. Our loop, whose parser lacks most of them, takes them too and says (one warning line) it goes on
  without them.
* `Refused`: set to a non-default value, the run stops before any work with one line naming the flag and
  what we support instead (`refusal`), exit 2, under both loops. (Our loop's parser has no defaults for
  Megatron-LM's flags, so there naming a refused flag at all is refused, even at Megatron-LM's default.)

A flag of the parser missing from the table is refused as not yet classified, and
`python -m megatron_csbp.training.megatron_lm --check-flags` lists it (a new Megatron-LM version shows its new
flags there), with the counts per kind. Standard library only: our loop refuses Megatron-LM's flags without
Megatron-LM installed.
"""

import argparse
import dataclasses
import sys

from megatron_csbp.core import rules
from megatron_csbp.core.rules import ConfigError

PLUGIN = "plugin"
MEGATRON_LM_LOOP = "Megatron-LM's training loop"


@dataclasses.dataclass(frozen=True)
class Honoured:
    by: str = PLUGIN
    only: tuple | None = None  # the values it is honoured with (others are refused), None: all
    why_only: str = ""  # why the other values are refused

    kind = "honoured"


@dataclasses.dataclass(frozen=True)
class Neutral:
    why: str

    kind = "neutral"


@dataclasses.dataclass(frozen=True)
class Refused:
    what: str  # what the flag asks for that the BDLM run does not do
    instead: str  # what to do instead

    kind = "refused"


KINDS = ("honoured", "neutral", "refused")
UNCLASSIFIED = Refused("is not yet classified for BDLM runs (a Megatron-LM flag newer than this plugin's table)",
                       "drop it, or add it to megatron_csbp/training/flag_table.py with a test")


def refusal(flag: str, value, entry: Refused) -> str:
    """The one line every refused flag reads as: the flag (and its value), what it asks, what to do instead."""
    shown = flag if value is True or value is None else f"{flag} {_shown(value)}"
    return f"{shown}: {entry.what}; {entry.instead}"


def _shown(value) -> str:
    if isinstance(value, (list, tuple)):
        return " ".join(map(str, value))
    return str(getattr(value, "name", value))


def megatron_lm_loop_only(flag: str) -> str:
    return (f"{flag} is taken under --training-loop megatron-lm only (Megatron-LM's own code acts on it; our "
            f"megatron-core loop does not): use --training-loop megatron-lm, or drop it")


def our_loop_only(flag: str) -> str:
    return (f"{flag} is our loop's own (--training-loop megatron-core); Megatron-LM's pretrain() has no such "
            f"option: use --training-loop megatron-core, or drop it")


# --- the table ---------------------------------------------------------------------------------------

TABLE: dict[str, Honoured | Neutral | Refused] = {}


def _classify(entry, flags: str) -> None:
    for flag in flags.split():
        if flag in TABLE:
            raise AssertionError(f"flag_table: {flag} classified twice")
        TABLE[flag] = entry


# The model: checked name by name and shape by shape against Megatron-LM's own GPT model.
_classify(Honoured(), "--make-vocab-size-divisible-by")
_classify(Honoured(), """
    --num-layers --hidden-size --num-attention-heads --ffn-hidden-size --kv-channels --group-query-attention
    --num-query-groups --normalization --norm-epsilon --swiglu --disable-bias-linear --add-qkv-bias --qk-layernorm
    --untie-embeddings-and-output-weights --max-position-embeddings
    --rotary-base --rotary-percent --use-rope-scaling --rope-scaling-factor --init-method-std --hidden-dropout""")
_classify(Honoured(only=("local", "transformer_engine")), "--transformer-impl")
_classify(Honoured(), "--position-embedding-type --attention-dropout")  # rope or yarn, and 0 only
_classify(Honoured(), "--window-size --window-attn-skip-freq")  # a left window (RIGHT 0): core.windows
# Gated DeltaNet hybrids (Qwen3.5): mcore.gated_delta_net; block parallelism under our loop only (megatron-core's
# TransformerConfig refuses CP > 1 for them, and Megatron-LM's loop builds it from its flags)
_classify(Honoured(only=("gated_delta_net",), why_only="dsa (DeepSeek sparse attention) is not implemented under "
                   "block diffusion"), "--experimental-attention-variant")
_classify(Honoured(), """
    --linear-attention-freq --linear-conv-kernel-dim --linear-key-head-dim --linear-value-head-dim
    --linear-num-key-heads --linear-num-value-heads --attention-output-gate --apply-layernorm-1p""")
_classify(Honoured(), """
    --yarn-rotary-scaling-factor --yarn-original-max-position-embeddings --yarn-beta-fast --yarn-beta-slow
    --yarn-mscale --yarn-mscale-all-dim --no-yarn-correction-range-round-to-int --llama-4-scaling-beta""")
# Megatron-LM's older spellings, with its meanings: rope; no learned positions (none beside rope); 1 (no interpolation)
_classify(Honoured(), "--use-rotary-position-embeddings --no-position-embedding --rotary-seq-len-interpolation-factor")
_classify(Honoured(), "--spec")
_classify(Honoured(), """
    --seq-length --micro-batch-size --global-batch-size --train-iters --lr --min-lr --lr-decay-style --lr-decay-iters
    --lr-warmup-iters --lr-warmup-fraction --lr-wsd-decay-style --lr-wsd-decay-iters --weight-decay --clip-grad
    --adam-beta1 --adam-beta2 --adam-eps --seed --eval-iters --eval-interval --split --data-path --num-workers
    --tensor-model-parallel-size --pipeline-model-parallel-size --context-parallel-size --sequence-parallel
    --calculate-per-token-loss --distributed-timeout-minutes --log-interval""")
_classify(Honoured(only=("adam", "sgd")), "--optimizer")
_classify(Honoured(), "--use-cpu-initialization")
_classify(Honoured(), "--bf16 --fp16 --use-distributed-optimizer")
_classify(Honoured(), "--recompute-granularity --recompute-method --recompute-num-layers")
_classify(Honoured(), "--recompute-modules --recompute-activations --moe-layer-recompute")
_classify(Honoured(), "--overlap-grad-reduce --overlap-param-gather")  # megatron-core's DDP, in both loops
_classify(Honoured(only=(rules.BYTE_TOKENIZER, "NullTokenizer", "HuggingFaceTokenizer")),
          "--tokenizer-type")
_classify(Honoured(), "--tokenizer-model --vocab-size")
# The head and its loss as the plugin's tiled linear cross-entropy (megatron-core's fused kernels take whole logits).
_classify(Honoured(), "--cross-entropy-loss-fusion --cross-entropy-tile-rows")
_classify(Honoured(only=rules.CROSS_ENTROPY_FUSION_IMPLS,
                   why_only="te names Transformer Engine's cross-entropy kernel, which takes the whole logits; native "
                            "is the plugin's tiled linear cross-entropy"), "--cross-entropy-fusion-impl")
_classify(Honoured(), "--data-cache-path")
_classify(Honoured(), "--save --load --save-interval --finetune --no-load-optim --no-load-rng")
_classify(Honoured(only=("torch_dist",)), "--ckpt-format")
_classify(Honoured(), "--exit-on-missing-checkpoint --exit-interval --exit-duration-in-mins")
_classify(Honoured(), "--exit-signal-handler")
_classify(Honoured(), "--tensorboard-dir")
_classify(Honoured(), """
    --context-block-parallel --context-block-parallel-clean-shards --bdlm-block-size --bdlm-objective
    --bdlm-clean-attention --bdlm-diffusion-loss-weight --bdlm-ar-loss-weight --bdlm-loss-weighting
    --bdlm-self-conditioning-probability --final-logit-softcapping --scale-embeddings --gemma4-moe
    --gemma4-attention --global-kv-channels --global-num-query-groups --global-rotary-base --global-rotary-percent
    --bdlm-noise-range --bdlm-noise-sampling --bdlm-parallel-mode --csbp-transport --link-gbps --link-latency-us
    --csbp-block-schedule --csbp-clean-layout --bdlm-mask-token-id --max-consecutive-bad-steps --config
    --training-loop""")

# Megatron-LM's optimizer, schedule, gradient reduction and checkpoint machinery: its code, not our providers.
_classify(Honoured(by=MEGATRON_LM_LOOP), """
    --sgd-momentum --muon-momentum --muon-no-split-qkv --muon-use-nesterov --muon-scale-mode --muon-fp32-matmul-prec
    --muon-num-ns-steps --muon-tp-mode --muon-extra-scale-factor --apply-wd-to-qk-layernorm --no-weight-decay-cond-type
    --lr-decay-samples --lr-wsd-decay-samples --lr-warmup-samples --lr-warmup-init --override-opt_param-scheduler
    --use-checkpoint-opt_param-scheduler --start-weight-decay --end-weight-decay --weight-decay-incr-style
    --decoupled-lr --decoupled-min-lr --train-samples --iterations-to-skip --exit-signal --skip-train
    --full-validation --no-check-for-nan-in-loss-and-grad --check-for-large-grads --check-for-spiky-loss
    --rerun-mode --no-save-optim --no-save-rng --save-retain-interval --load-main-params-from-ckpt
    --pretrained-checkpoint --ckpt-step --no-initialization
    --grad-reduce-in-bf16 --loss-scale --initial-loss-scale --min-loss-scale --loss-scale-window --hysteresis
    --accumulate-allreduce-grads-in-fp32 --no-align-grad-reduce --ddp-num-buckets
    --ddp-bucket-size --ddp-pad-buckets-for-high-nccl-busbw --ddp-reduce-scatter-with-fp32-accumulation
    --ddp-average-in-collective --overlap-param-gather-with-optimizer-step
    --no-align-param-gather --num-distributed-optimizer-instances --distributed-backend
    --use-precision-aware-optimizer --main-grads-dtype --main-params-dtype --exp-avg-dtype --exp-avg-sq-dtype""")

_classify(Neutral("logging, timing and monitoring"), """
    --log-params-norm --log-throughput --log-progress --timing-log-level --timing-log-option --tensorboard-log-interval
    --tensorboard-queue-size --log-timers-to-tensorboard --no-log-loss-scale-to-tensorboard
    --log-validation-ppl-to-tensorboard --log-memory-to-tensorboard --log-memory-interval --log-device-memory-used
    --log-num-zeros-in-grad --no-barrier-with-level-1-timing --log-world-size-to-tensorboard --wandb-project
    --wandb-exp-name --wandb-save-dir --wandb-entity --logging-level --log-energy --log-straggler
    --straggler-ctrlr-port --straggler-minmax-count --disable-straggler-on-startup --run-workload-inspector-server
    --no-one-logger --one-logger-project --one-logger-run-name --one-logger-async --app-tag-run-name
    --app-tag-run-version --config-logger-dir --result-rejected-tracker-filename --dump-param-to-param-group-map
    --check-weight-hash-across-dp-replicas-interval --adlr-autoresume --adlr-autoresume-interval
    --enable-ft-package --calc-ft-timeouts --ft-num-warmup-iters --error-injection-type --disable-msc""")
_classify(Neutral("profiling"), """
    --profile --profile-step-start --profile-step-end --use-pytorch-profiler --profile-ranks --record-memory-history
    --memory-snapshot-path""")
_classify(Neutral("kernel, fusion, memory or communication choice: the same maths"), """
    --no-masked-softmax-fusion --no-bias-gelu-fusion --no-bias-swiglu-fusion --no-bias-dropout-fusion --no-rope-fusion
    --no-persist-layer-norm --no-gradient-accumulation-fusion --disable-jit-fuser --deterministic-mode
    --disable-bf16-reduced-precision-matmul --no-async-tensor-model-parallel-allreduce --use-ring-exchange-p2p
    --overlap-p2p-communication-warmup-flush --no-overlap-p2p-communication --no-scatter-gather-tensors-in-pipeline
    --pipeline-model-parallel-comm-backend --tp-comm-bootstrap-backend --no-clone-scatter-output-in-embedding
    --empty-unused-memory-level --manual-gc --manual-gc-interval --no-manual-gc-eval --train-sync-interval
    --no-pin-cpu-grads --no-pin-cpu-params --high-priority-stream-groups --disable-gloo-process-groups
    --nccl-communicator-config-path --use-sharp --sharp-enabled-group --create-all-gather-group --use-nccl-ub
    --disable-symmetric-registration --local-rank --distributed-timeout-seconds-after-init
    --exit-signal-handler-for-dataloader --dataloader-fast-cache-load --dataloader-defer-npy-index-mmap
    --no-mmap-bin-files --num-dataset-builder-threads --no-create-attention-mask-in-dataloader --use-mcore-models""")
_classify(Neutral("selects Transformer Engine's core-attention kernel (flash, fused, unfused); the core attention "
                  "is CSBP's"), "--attention-backend")
_classify(Neutral("the softmax precision of megatron-core's own core attention; CSBP's kernels accumulate the softmax "
                  "in fp32 (at least) always"), "--attention-softmax-in-fp32")
_classify(Neutral("read only by --tokenizer-type TikTokenizer, which is refused"),
          "--tiktoken-pattern --tiktoken-num-special-tokens")
_classify(Neutral("checkpoint format or save/load parallelism"), """
    --no-ckpt-fully-parallel-save --ckpt-fully-parallel-load --ckpt-assume-constant-structure --ckpt-fully-parallel-save
    --dist-ckpt-save-pre-mcore-014 --dist-ckpt-optim-fully-reshardable --distrib-optim-fully-reshardable-mem-efficient
    --save-wgrads-interval --save-dgrads-interval --no-use-tokenizer-model-from-checkpoint-args""")
_classify(Neutral("inference options: pretraining never reads them"), """
    --inference-batch-times-seqlen-threshold --max-tokens-to-oom --output-bert-embeddings --bert-embedder-type
    --use-legacy-static-engine --inference-max-requests --inference-max-seq-length --inference-max-batch-size
    --inference-dynamic-batching --inference-dynamic-batching-buffer-size-gb
    --inference-dynamic-batching-paused-buffer-size-gb --inference-dynamic-batching-block-size
    --inference-dynamic-batching-max-requests --inference-dynamic-batching-max-tokens
    --inference-dynamic-batching-num-cuda-graphs --inference-dynamic-batching-track-paused-request-events
    --decode-only-cuda-graphs --inference-dynamic-batching-unified-memory-level --nccl-all-reduce-for-prefill
    --enable-chunked-prefill --disable-chunked-prefill --inference-dynamic-batching-cuda-graph-max-tokens
    --inference-dynamic-batching-cuda-graph-mixed-prefill-count --inference-logging-step-interval
    --inference-wandb-logging --inference-coordinator-port --inference-fuse-tp-communication --mlp-chunks-for-prefill""")
_classify(Neutral("in-process restart settings: used only with --inprocess-restart, which is refused"), """
    --inprocess-max-iterations --inprocess-monitor-thread-interval --inprocess-monitor-process-interval
    --inprocess-progress-watchdog-interval --inprocess-heartbeat-interval --inprocess-soft-timeout
    --inprocess-hard-timeout --inprocess-heartbeat-timeout --inprocess-barrier-timeout --inprocess-completion-timeout
    --inprocess-last-call-wait --inprocess-termination-grace-time --inprocess-granularity --inprocess-active-world-size
    --inprocess-empty-cuda-cache""")

_classify(Honoured(), """
    --num-experts --moe-layer-freq --moe-ffn-hidden-size --moe-shared-expert-intermediate-size --moe-router-topk
    --moe-router-score-function --moe-router-dtype --moe-router-load-balancing-type --moe-aux-loss-coeff
    --moe-token-dispatcher-type --expert-model-parallel-size --expert-tensor-parallel-size""")
_classify(Honoured(), "--moe-grouped-gemm")
_classify(Honoured(), "--moe-router-pre-softmax")  # Qwen-MoE's norm_topk_prob false, against transformers
_MOE_SUPPORTED = ("drop it (supported MoE options: --num-experts, --moe-layer-freq, --moe-ffn-hidden-size, "
                  "--moe-shared-expert-intermediate-size, --moe-router-topk, --moe-router-score-function, "
                  "--moe-router-pre-softmax, "
                  "--moe-router-dtype, --moe-router-load-balancing-type aux_loss|none, --moe-aux-loss-coeff, "
                  "--moe-token-dispatcher-type alltoall|allgather, --moe-grouped-gemm, --expert-model-parallel-size, "
                  "--expert-tensor-parallel-size)")
_classify(Refused("token dropping keeps each expert's first tokens in the rank's row order, which CSBP's "
                  "[noisy ; clean] rows change, so no layout would train like another", _MOE_SUPPORTED), """
    --moe-expert-capacity-factor --moe-pad-expert-input-to-capacity --moe-token-drop-policy""")
_classify(Refused("is a mixture-of-experts option not supported with the BDLM model", _MOE_SUPPORTED), """
    --moe-use-upcycling --moe-upcycling-granularity --moe-pad-experts-for-cuda-graph-inference --moe-extended-tp
    --moe-shared-expert-gate --moe-shared-expert-overlap --moe-enable-routing-replay
    --moe-router-padding-for-quantization --moe-router-padding-for-fp8 --moe-router-num-groups --moe-router-group-topk
    --moe-router-topk-scaling-factor --moe-router-enable-expert-bias
    --moe-router-bias-update-rate --moe-router-force-load-balancing --moe-use-legacy-grouped-gemm --moe-z-loss-coeff
    --moe-input-jitter-eps --moe-enable-deepep --moe-flex-dispatcher-backend --moe-per-layer-logging
    --moe-permute-fusion --moe-router-fusion --moe-apply-probs-on-input --moe-latent-size
    --moe-deepep-num-sms --moe-hybridep-num-sms --ep-overlap-early-attn-memory-release
    --overlap-moe-expert-parallel-comm""")
_classify(Honoured(), "--reset-position-ids --reset-attention-mask --eod-mask-loss")
_classify(Refused("selects data the plugin's datasets provider does not build",
                  "give --data-path PREFIX (or a weighted blend) and --split"), """
    --train-data-path --valid-data-path --test-data-path --data-args-path --per-split-data-args-path
    --per-dataset-sequences-path --mock-data --phase-transition-iterations --multiple-validation-sets
    --object-storage-cache-path --mid-level-dataset-surplus --allow-ambiguous-pad-tokens --dataloader-type
    --fim-data --fim-rate --fim-spm-rate --fim-split-sample --fim-fragment-rate --fim-no-prefix --fim-prefix-token
    --fim-middle-token --fim-suffix-token --fim-pad-token --fim-eod-token --sft --sft-tokenizer-prompt-format""")
_classify(Refused("is not a decoder-only GPT option (BERT, T5, retrieval or vision models)",
                  "drop it: the BDLM is a GPT-style decoder"), """
    --encoder-num-layers --decoder-num-layers --encoder-seq-length --decoder-seq-length --relative-attention-num-buckets
    --relative-attention-max-distance --bert-no-binary-head --sample-rate --mask-prob --short-seq-prob
    --ict-head-size --biencoder-projection-dim --biencoder-shared-query-context-model --ict-load --bert-load
    --titles-data-path --query-in-block-prob --use-one-sent-docs --evidence-data-path --retriever-report-topk-accuracies
    --retriever-score-scaling --block-data-path --embedding-path --indexer-batch-size --indexer-log-interval
    --num-classes --img-h --img-w --num-channels --patch-dim --classes-fraction --data-per-class-fraction
    --no-data-sharding --head-lr-mult --vision-pretraining --vision-pretraining-type --vision-backbone-type
    --swin-backbone-type --mask-type --mask-factor --iter-per-epoch --dino-local-img-size --dino-local-crops-number
    --dino-head-hidden-size --dino-bottleneck-size --dino-freeze-last-layer --dino-norm-last-layer
    --dino-warmup-teacher-temp --dino-teacher-temp --dino-warmup-teacher-temp-epochs --use-legacy-models""")
_classify(Refused("reinforcement learning (train_rl.py) is not part of BDLM pretraining", "drop it"), """
    --perform-rl-step --rl-prompts-per-eval --grpo-prompts-per-step --grpo-group-size --grpo-iterations
    --grpo-clamp-eps-lower --grpo-clamp-eps-upper --grpo-kl-beta --grpo-entropy-term-weight
    --grpo-filter-groups-with-same-reward --langrl-inference-server-type --langrl-inference-server-conversation-template
    --langrl-external-server --langrl-env-config --rl-default-temperature --rl-default-top-p --rl-default-top-k
    --rl-offload-optimizer-during-inference --rl-offload-kv-cache-during-training --rl-remove-kv-cache-during-training
    --rl-reset-cuda-graphs --rl-partial-rollouts --rl-inference-logprobs-is-correction
    --rl-importance-sampling-truncation-coef --rl-use-sequence-packing --rl-sequence-packing-max-sequences-per-bin
    --rl-sequence-packing-algo --rl-training-cuda-graphs --rl-inference-tensor-model-parallel-size
    --rl-inference-pipeline-model-parallel-size --rl-inference-expert-model-parallel-size
    --rl-inference-expert-tensor-model-parallel-size --rl-inference-model-unified-memory-level
    --rl-offload-inference-model-weights-when-idle --refit-method --rl-verify-model-weights-swap
    --rl-parallel-generation-tasks --rl-skip-bos-token""")
_ARCHITECTURE_INSTEAD = ("drop it (the model's options: --normalization, --swiglu, --qk-layernorm, --add-qkv-bias, "
                         "--num-query-groups, --kv-channels, --ffn-hidden-size, the RoPE flags)")
_classify(Refused("is an architecture option the BDLM model does not implement", _ARCHITECTURE_INSTEAD), """
    --fp32-residual-connection --apply-residual-connection-post-layernorm --glu-linear-offset
    --activation-func-clamp-value --rotary-interleaved --qk-l2-norm --qk-clip --qk-clip-alpha --qk-clip-threshold
    --softmax-type --embedding-init-method-std --init-method-xavier-uniform
    --apply-query-key-layer-scaling --use-fused-weighted-squared-relu --openai-gelu
    --squared-relu --quick-geglu --no-rope-freq
    --rope-type --mrope-section --onnx-safe --fp16-lm-cross-entropy
    --log-max-attention-logit
    --dsa-indexer-n-heads --dsa-indexer-head-dim --dsa-indexer-topk --dsa-indexer-loss-coeff
    --dsa-indexer-use-sparse-loss --heterogeneous-layers-config-path
    --heterogeneous-layers-config-encoded-json --is-hybrid-model --mamba-state-dim --mamba-head-dim --mamba-num-groups
    --mamba-num-heads --disable-mamba-mem-eff-path --hybrid-attention-ratio --hybrid-mlp-ratio
    --hybrid-override-pattern --enable-experimental --padded-vocab-size --data-parallel-random-init""")
_classify(Refused("is a multi-latent-attention option (MLA is not supported with CSBP)",
                  "drop it; use standard (GQA) attention"), """
    --q-lora-rank --kv-lora-rank --qk-head-dim --qk-pos-emb-head-dim --v-head-dim --rotary-scaling-factor --mscale
    --mscale-all-dim --cache-mla-latents --multi-latent-attention""")
_classify(Refused("selects a core attention, and the core attention is CSBP's", "drop it"), """
    --use-flash-attn --flash-decode --use-kitchen-attention --kitchen-attention-backend""")
_classify(Refused("is a low-precision (FP8/FP4) or Transformer Engine feature not tested with CSBP attention",
                  "train in --bf16 (or fp32)"), """
    --fp8-format --fp8-recipe --fp8-quantizer-factory --fp8-margin --fp8-interval --fp8-amax-history-len
    --fp8-amax-compute-algo --no-fp8-wgrad --first-last-layers-bf16 --num-layers-at-start-in-bf16
    --num-layers-at-end-in-bf16 --fp4-format --fp4-recipe --fp4-param-gather --fp4-quantizer-factory --fp8-param-gather
    --te-precision-config-file --reuse-grad-buf-for-mxfp8-param-ag --keep-fp8-transpose-cache --use-te-activation-func
    --te-rng-tracker --inference-rng-tracker --symmetric-ar-type --batch-invariant-mode""")
_classify(Refused("is a performance feature (overlap, offload, CUDA graphs, FSDP, virtual pipeline) not tested with "
                  "the BDLM model", "drop it (supported: TP, SP, PP, CSBP, DP, the distributed optimizer, recompute)"),
          """
    --tp-comm-overlap --no-tp-comm-bulk-wgrad --no-tp-comm-bulk-dgrad --no-tp-comm-overlap-ag --no-tp-comm-overlap-rs
    --tp-comm-overlap-rs-dgrad --no-tp-comm-split-ag --no-tp-comm-split-rs --tp-comm-overlap-cfg --delay-wgrad-compute
    --defer-embedding-wgrad-compute --wgrad-deferral-limit --cpu-offloading-num-layers --enable-cuda-graph
    --cuda-graph-warmup-steps --external-cuda-graph --cuda-graph-impl --cuda-graph-scope
    --fine-grained-activation-offloading --offload-modules --min-offloaded-tensor-size --distribute-saved-activations
    --init-model-with-meta-device --optimizer-cpu-offload --optimizer-offload-fraction
    --use-torch-optimizer-for-cpu-offload --overlap-cpu-optimizer-d2h-h2d --use-megatron-fsdp
    --data-parallel-sharding-strategy --outer-dp-sharding-strategy --no-gradient-reduce-div-fusion --fsdp-double-buffer
    --suggested-communication-unit-size --enable-full-sharding-in-hsdp --use-torch-fsdp2
    --torch-fsdp2-no-reshard-after-forward --fsdp-manual-registration --no-strict-fsdp-dtensor-load
    --num-layers-per-virtual-pipeline-stage --num-virtual-stages-per-pipeline-rank --pipeline-model-parallel-layout
    --decoder-first-pipeline-num-layers --decoder-last-pipeline-num-layers --account-for-embedding-in-pipeline-split
    --account-for-loss-in-pipeline-split --microbatch-group-size-per-virtual-pipeline-stage --use-tp-pp-dp-mapping
    --fake-process-group --lazy-mpu-init --max-seqlen-per-dp-cp-rank --rampup-batch-size
    --decrease-batch-size-if-needed --inprocess-restart --error-injection-rate""")
_classify(Refused("is a checkpoint mode the plugin's checkpoints (manifest, checksums, save lock) do not cover",
                  "use --save/--load with --ckpt-format torch_dist"), """
    --non-persistent-save-interval --non-persistent-ckpt-type --non-persistent-global-ckpt-dir
    --non-persistent-local-ckpt-dir --non-persistent-local-ckpt-algo --async-save --use-persistent-ckpt-worker
    --replication --replication-jump --replication-factor --auto-detect-ckpt-format --ckpt-convert-format
    --ckpt-convert-save --ckpt-convert-update-legacy-dist-opt-format --dist-ckpt-strictness --use-checkpoint-args
    --use-mp-args-from-checkpoint-args""")
_classify(Refused("selects a tokenizer the plugin does not support",
                  f"use --tokenizer-type {rules.BYTE_TOKENIZER}, NullTokenizer or HuggingFaceTokenizer "
                  f"--tokenizer-model DIR"), """
    --vocab-file --merge-file --vocab-extra-ids --tokenizer-metadata --tokenizer-special-tokens --legacy-tokenizer
    --tiktoken-special-tokens --tokenizer-sentencepiece-legacy
    --tokenizer-hf-use-fast --tokenizer-hf-include-special-tokens""")
_classify(Refused("would run code from the tokenizer's directory", "drop it: loading never runs code"),
          "--trust-remote-code")
_classify(Refused("is deprecated in Megatron-LM", "use its replacement (see Megatron-LM's --help)"), """
    --batch-size --checkpoint-activations --warmup --model-parallel-size --use-dist-ckpt
    --dist-ckpt-format --test-mode""")
_classify(Refused("replaces the parsed arguments after the plugin has checked them", "use --config FILE.yaml"),
          "--yaml-cfg")
_classify(Refused("is a ring-CP feature; CSBP has its own rings (--context-block-parallel-clean-shards)",
                  "drop it"), "--hierarchical-context-parallel-sizes --cp-comm-type --hybrid-context-parallel")
_classify(Refused("multi-token prediction is not supported with BDLM", "drop it"),
          "--mtp-num-layers --mtp-loss-scaling-factor --mtp-standalone")

# Our loop's flags that Megatron-LM's parser does not have (refused there, one line).
OUR_LOOP_ONLY = ("--load-fallback-to-previous",)


# --- applying it ---------------------------------------------------------------------------------------

def entry(flag: str) -> Honoured | Neutral | Refused:
    return TABLE.get(flag, UNCLASSIFIED)


def _value_refusal(flag: str, value, honoured: Honoured) -> str:
    why = f" ({honoured.why_only})" if honoured.why_only else ""
    return refusal(flag, value, Refused(f"is honoured only with {', '.join(map(str, honoured.only))}{why}",
                                        "use one of those"))


def check_parsed(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuses (ConfigError, one line) the first flag of `parser` whose value in freshly parsed `args` differs
    from its default and which the table does not take with that value.

    `rules.RING_CP_REFUSALS` keeps its own wording for the flags it names (the same line under both loops)."""
    for action in parser._actions:
        if not action.option_strings or action.dest == "help" or not hasattr(args, action.dest):
            continue
        value = getattr(args, action.dest)
        if value == parser.get_default(action.dest):
            continue
        flag = action.option_strings[0]
        found = entry(flag)
        if isinstance(found, Refused):
            for message in rules.refused_features(argparse.Namespace(**{action.dest: value})):
                raise ConfigError(message)
            raise ConfigError(refusal(flag, None if action.nargs == 0 else value, found))
        if isinstance(found, Honoured) and found.only is not None and value not in found.only:
            raise ConfigError(_value_refusal(flag, value, found))


class _RefusedHere(argparse.Action):
    """A Megatron-LM flag our loop's parser does not take: naming it stops the parse with the table's line."""

    def __init__(self, option_strings, dest, message: str, **kwargs):
        self.message = message
        super().__init__(option_strings, dest=argparse.SUPPRESS, nargs="*", default=argparse.SUPPRESS,
                         help=argparse.SUPPRESS)

    def __call__(self, parser, namespace, values, option_string=None):
        raise ConfigError(self.message)


class _IgnoredHere(argparse.Action):
    """A neutral Megatron-LM flag our loop has no use for: taken (both loops accept it), said once, not stored."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest=argparse.SUPPRESS, nargs="*", default=argparse.SUPPRESS,
                         help=argparse.SUPPRESS)

    def __call__(self, parser, namespace, values, option_string=None):
        import os

        if os.environ.get("RANK", "0") == "0":
            print(f"WARNING: {option_string}: {entry(self.option_strings[0]).why}; our megatron-core loop has no such "
                  f"option and goes on without it", file=sys.stderr, flush=True)


def our_loop_message(flag: str) -> str:
    """Why our loop does not take `flag`, a Megatron-LM flag its parser lacks (not a neutral one)."""
    found = entry(flag)
    if isinstance(found, Refused):
        legacy = {f"--{name.replace('_', '-')}": message for name, _, message in rules.RING_CP_REFUSALS}
        return legacy.get(flag) or refusal(flag, None, found)
    return megatron_lm_loop_only(flag)


def add_refusals(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Our loop's parser: every flag of the table it lacks, taken when neutral, else refused by name with the
    table's line."""
    for flag in TABLE:
        if flag not in parser._option_string_actions:
            if isinstance(entry(flag), Neutral):
                parser.add_argument(flag, action=_IgnoredHere)
            else:
                parser.add_argument(flag, action=_RefusedHere, message=our_loop_message(flag))
    return parser


def add_our_loop_only_refusals(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron-LM's parser: our loop's own flags, refused by name."""
    for flag in OUR_LOOP_ONLY:
        if flag not in parser._option_string_actions:
            parser.add_argument(flag, action=_RefusedHere, message=our_loop_only(flag))
    return parser


# --- the check against Megatron-LM's parser ------------------------------------------------------------

def counts() -> dict[str, int]:
    """Flags per kind (honoured split by who honours it)."""
    result = {kind: 0 for kind in KINDS}
    result["honoured by the plugin"] = result["honoured by Megatron-LM's loop"] = 0
    for value in TABLE.values():
        result[value.kind] += 1
        if isinstance(value, Honoured):
            result["honoured by the plugin" if value.by == PLUGIN else "honoured by Megatron-LM's loop"] += 1
    return result


def summary() -> str:
    return ", ".join(f"{kind}: {number}" for kind, number in counts().items()) + f" (total {len(TABLE)})"


def parser_flags(parser: argparse.ArgumentParser) -> list[str]:
    """Each action's first option string (the table's key), in the parser's order."""
    return [action.option_strings[0] for action in parser._actions
            if action.option_strings and action.dest != "help"
            and not isinstance(action, (_RefusedHere, _IgnoredHere))]


def mismatches(parser: argparse.ArgumentParser) -> tuple[list[str], list[str]]:
    """(flags of `parser` missing from the table, flags of the table `parser` lacks)."""
    flags = parser_flags(parser)
    return [flag for flag in flags if flag not in TABLE], [flag for flag in TABLE if flag not in set(flags)]
