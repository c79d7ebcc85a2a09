"""Activation recomputation with CSBP: megatron-core's full (uniform, block) and selective core-attention
recompute give the same Megatron step as no recompute, and the forward collective runs twice; so does the
selective recompute of every other submodule a BDLM layer has (--recompute-modules), the modules it lacks refused.

One whole Megatron step (DDP, `finalize_model_grads`, `get_forward_backward_func`) of the composition
test's model on 2 gloo ranks, CSBP P=C=2 and the CP baseline, from the same weights and batches. Loss and
every gradient must equal the no-recompute step to 1e-5 relative; the attention ops' byte counters must
read exactly 1.5x (all-gather + reduce-scatter -> all-gather twice + reduce-scatter), and 1.25x when
the block method recomputes 2 of the 4 layers (so the counter is not merely a constant 1.5x).
"""

import dataclasses
import importlib.util

import pytest
import torch

from pretrain_runs import base, run, significant
from spawn import on_cpu_backend, run_ranks
from megatron_step import SEQ, Topology, _as_numpy, _config, _full, _global_name, _relative
from test_megatron_composition import MICRO_BATCH, TOLERANCE, _batches, _build_model

pytest_plugins = ["pretrain_runs"]  # corpus, reference_runs

TOPOLOGIES = [Topology("csbp P=C=2", block_parallel=2, clean_shards=2),
              Topology("cp baseline 2", mode="cp", block_parallel=2, clean_shards=2)]
# (name, TransformerConfig fields, bytes vs no recompute); megatron-core's default recompute_modules is
# ["core_attn"]
VARIANTS = [
    ("none", {}, 1),
    ("full uniform", dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1), 1.5),
    ("full block", dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=4), 1.5),
    ("full block, 2 of 4 layers", dict(recompute_granularity="full", recompute_method="block",
                                       recompute_num_layers=2), 1.25),
    ("selective core_attn", dict(recompute_granularity="selective", recompute_modules=["core_attn"]), 1.5),
]


def _step(topology, fields, weights):
    from megatron.core import parallel_state as mpu
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_csbp.core import comm
    from megatron_csbp.mcore import parallel_state
    from megatron_csbp.bdlm.forward_step import BDLMForwardStep
    from megatron_csbp.bdlm.objective import BDLMObjective
    from megatron_csbp.mcore.model import pipeline_seq_length

    parallel_state.initialize_model_parallel(context_block_parallel_size=topology.block_parallel,
                                             clean_shards=topology.clean_shards)
    try:
        torch.manual_seed(1234)
        model_parallel_cuda_manual_seed(1234)
        config = dataclasses.replace(_config(topology), **fields)
        model, layout = _build_model(topology, config)
        if weights is None:
            weights = {name: param.detach().clone() for name, param in model.named_parameters()}
        for name, param in model.named_parameters():
            param.data.copy_(weights[name])
        ddp = DistributedDataParallel(config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)
        config.finalize_model_grads_func = finalize_model_grads
        config.no_sync_func = ddp.no_sync
        ddp.zero_grad_buffer()
        batches = _batches(topology.seq, mpu.get_data_parallel_rank(), mpu.get_data_parallel_world_size())
        objective = BDLMObjective(block_size=topology.block, mask_token_id=63, seed=99)
        with comm.count_bytes() as counter:
            reports = get_forward_backward_func()(
                forward_step_func=BDLMForwardStep(objective, layout), data_iterator=iter(batches), model=[ddp],
                num_microbatches=len(batches), seq_length=pipeline_seq_length(layout, config),
                micro_batch_size=MICRO_BATCH, forward_only=False)
        total = torch.stack([r["lm loss"] for r in reports]).sum(0)
        torch.distributed.all_reduce(total, group=mpu.get_data_parallel_group(with_context_parallel=True))
        grads = {_global_name(model, n): _full(p, p.main_grad) for n, p in model.named_parameters()}
        return dict(loss=(total[0] / total[1]).item(), grads=grads, bytes_sent=counter.bytes_sent), weights
    finally:
        parallel_state.destroy_model_parallel()


@on_cpu_backend
def _run(rank, world_size):
    results = {}
    for topology in TOPOLOGIES:
        weights = None
        for name, fields, _ in VARIANTS:
            result, weights = _step(topology, fields, weights)
            results[topology.name, name] = _as_numpy(result)
    return results


def test_recompute_equals_no_recompute_and_sends_the_forward_twice():
    per_rank = run_ranks(_run, 2, timeout=600)
    for topology in TOPOLOGIES:
        for rank, results in enumerate(per_rank):
            plain = results[topology.name, "none"]
            assert plain["bytes_sent"] > 0
            for name, _, factor in VARIANTS[1:]:
                result = results[topology.name, name]
                error = max([abs(result["loss"] - plain["loss"]) / abs(plain["loss"])]
                            + [_relative(result["grads"][p], plain["grads"][p]) for p in plain["grads"]])
                assert set(result["grads"]) == set(plain["grads"])
                assert error <= TOLERANCE, f"{topology.name}, {name}, rank {rank}: relative error {error:.2e}"
                assert 4 * result["bytes_sent"] == 4 * factor * plain["bytes_sent"], \
                    f"{topology.name}, {name}: {result['bytes_sent']} bytes vs {plain['bytes_sent']} without recompute"


def test_selective_recompute_passes_validation():
    """`--recompute-granularity selective` (no method, no layer count) validates and reaches the config as
    megatron-core's selective core-attention recompute."""
    from megatron_csbp.training import arguments, flags, megatron_config

    argv = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", str(SEQ),
            "--bdlm-block-size", "4", "--micro-batch-size", "1", "--train-iters", "1", "--lr", "1e-3",
            "--data-path", "unused", "--tokenizer-type", "NullTokenizer", "--vocab-size", "64",
            "--recompute-granularity", "selective"]
    args = arguments.validate_args(flags.build_parser().parse_args(argv), 1, on_accelerator=False,
                                   check_paths=False)
    config = megatron_config.transformer_config_from_args(args)
    assert config.recompute_granularity == "selective" and config.recompute_modules == ["core_attn"]


def test_training_with_selective_recompute_on_a_simulated_link_logs_the_reference_losses(corpus, reference_runs):
    """scripts/pretrain_bdlm.py on 2 CSBP ranks with `--recompute-granularity selective --link-gbps 1`: the flags
    reach the run (recompute and the slow link change no number) and the losses are the 1-rank run's."""
    done = run(2, base(corpus, context_block_parallel=2, recompute_granularity="selective", link_gbps=1.0))
    expected = {i: significant(v) for i, v in reference_runs["1 rank"].losses.items()}
    assert expected and {i: significant(v) for i, v in done.losses.items()} == expected, done.output


# --- selective recompute of named submodules (--recompute-modules) --------------------------------------------------

# (name, TransformerConfig fields, how many times each probe's forward runs: 1 where not given); the MoE model of
# test_moe: layer 2 dense, the others MoE with a shared expert. Each probe is a module inside what its recompute
# redoes: the core attention, the dense MLP's first linear, the input norm, the MoE layer's router, the shared
# expert's first linear. A shared expert recomputed inside a recomputed MoE layer runs three times (megatron-core
# nests the checkpoints).
# The norms' recompute (output-discarding) needs Transformer Engine: where it is absent it is refused (below), not run.
HAS_TE = importlib.util.find_spec("transformer_engine") is not None
PROBES = ("core_attn", "mlp", "layernorm", "moe", "shared_experts")
RECOMPUTED = tuple(probe for probe in PROBES if HAS_TE or probe != "layernorm")
MODULE_VARIANTS = [
    ("none", {}, {}),
    ("mlp", dict(recompute_granularity="selective", recompute_modules=["mlp"]), dict(mlp=2)),
    *([("layernorm", dict(recompute_granularity="selective", recompute_modules=["layernorm"]), dict(layernorm=2))]
      if HAS_TE else []),
    ("moe", dict(recompute_granularity="selective", recompute_modules=["moe"]), dict(moe=2, shared_experts=2)),
    ("shared_experts", dict(recompute_granularity="selective", recompute_modules=["shared_experts"]),
     dict(shared_experts=2)),
    ("--moe-layer-recompute (core_attn, moe)", dict(moe_layer_recompute=True),
     dict(core_attn=2, moe=2, shared_experts=2)),
    ("all", dict(recompute_granularity="selective", recompute_modules=list(RECOMPUTED)),
     {**{probe: 2 for probe in RECOMPUTED}, "shared_experts": 3}),
]


def _probes(model):
    """Each probe's modules in `model`."""
    found = {name: [] for name in PROBES}
    for layer in model.decoder.layers:
        found["core_attn"].append(layer.self_attention.core_attention)
        found["layernorm"].append(layer.input_layernorm)
        if hasattr(layer.mlp, "router"):
            found["moe"].append(layer.mlp.router)
            found["shared_experts"].append(layer.mlp.shared_experts.linear_fc1)
        else:
            found["mlp"].append(layer.mlp.linear_fc1)
    assert all(found.values()), {name: len(modules) for name, modules in found.items()}
    return found


def _module_step(fields, weights):
    """One Megatron step of test_moe's model on CSBP P=C=2 with `fields` in its config, counting each probe's
    forward calls."""
    import test_moe
    from megatron_step import train_step

    from megatron_csbp.bdlm.forward_step import BDLMForwardStep
    from megatron_csbp.bdlm.objective import BDLMObjective

    topology = test_moe.MoETopology("csbp2", block_parallel=2, clean_shards=2)
    calls = {name: 0 for name in PROBES}

    def count_calls(ddp):
        for name, modules in _probes(ddp.module).items():
            for module in modules:
                module.register_forward_hook(lambda *unused, name=name: calls.__setitem__(name, calls[name] + 1))

    objective = BDLMObjective(block_size=topology.block, mask_token_id=63, seed=99)
    return train_step(topology, weights, test_moe._build_model, lambda layout: BDLMForwardStep(objective, layout),
                      lambda dp_rank, dp_size: _batches(topology.seq, dp_rank, dp_size), MICRO_BATCH,
                      make_config=lambda topology: dataclasses.replace(test_moe._config(topology), **fields),
                      before_step=count_calls, after_step=lambda micro_batches: dict(calls=dict(calls)))


@on_cpu_backend
def _module_run(rank, world_size):
    results, weights = [], None
    for _, fields, _ in MODULE_VARIANTS:
        result = _module_step(fields, weights)
        weights = weights if weights is not None else result["initial"]
        results.append(_as_numpy(result))
    return results


def test_recompute_modules_equal_no_recompute_and_rerun_the_named_modules():
    """Each module megatron-core recomputes that a BDLM layer has (the MoE model: a dense layer, MoE layers with a
    shared expert; the norms where Transformer Engine is installed), and --moe-layer-recompute: one step on CSBP
    P=C=2 equals the step without recompute (loss, every gradient and updated parameter, <= 1e-5 relative), and
    exactly the named modules run their forward again."""
    from megatron_step import worst_error

    per_rank = run_ranks(_module_run, 2, timeout=900)
    for rank, results in enumerate(per_rank):
        plain = results[0]
        for (name, _, runs), result in zip(MODULE_VARIANTS[1:], results[1:]):
            error = worst_error([result], plain)
            ratios = {probe: result["calls"][probe] / plain["calls"][probe] for probe in PROBES}
            print(f"recompute {name}, rank {rank}: worst relative error {error:.2e}, forward calls x{ratios}")
            assert error <= TOLERANCE, f"{name}: relative error {error:.2e}"
            assert ratios == {probe: runs.get(probe, 1) for probe in PROBES}, (name, ratios)


def _validated(*extra, experts=True):
    from megatron_csbp.training import arguments, flags

    argv = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", str(SEQ),
            "--bdlm-block-size", "4", "--micro-batch-size", "1", "--train-iters", "1", "--lr", "1e-3",
            "--data-path", "unused", "--tokenizer-type", "NullTokenizer", "--vocab-size", "64", *extra]
    if experts:
        argv += ["--num-experts", "4", "--moe-layer-freq", "[1,0,1,1]", "--moe-shared-expert-intermediate-size", "32",
                 "--disable-bias-linear"]
    return arguments.validate_args(flags.build_parser().parse_args(argv), 1, on_accelerator=False, check_paths=False)


def test_recompute_flags_reach_the_config_as_megatron_lm_resolves_them():
    """--recompute-modules, Megatron-LM's shorthand --recompute-activations (selective, core_attn) and its older
    --moe-layer-recompute (selective, core_attn and moe) reach megatron-core's TransformerConfig as Megatron-LM's
    own flags do."""
    from megatron_csbp.training import megatron_config

    for extra, granularity, modules in (
            (["--recompute-granularity", "selective", "--recompute-modules", "mlp", "shared_experts"], "selective",
             ["mlp", "shared_experts"]),
            (["--recompute-activations"], "selective", ["core_attn"]),
            (["--moe-layer-recompute"], "selective", ["core_attn", "moe"]),
            (["--recompute-granularity", "selective", "--recompute-modules", "mlp", "--moe-layer-recompute"],
             "selective", ["mlp", "moe"])):
        config = megatron_config.transformer_config_from_args(_validated(*extra))
        assert (config.recompute_granularity, config.recompute_modules) == (granularity, modules), extra


@pytest.mark.parametrize("extra, experts, line", [
    (["--recompute-granularity", "selective", "--recompute-modules", "moe", "mla_up_proj"], False,
     "--recompute-modules moe mla_up_proj: moe: the model has no MoE layers (--num-experts); mla_up_proj: the model "
     "has no multi-latent attention (refused with CSBP); drop them"),
    (["--recompute-granularity", "selective", "--recompute-modules", "moe_act"], True,
     "--recompute-modules moe_act: moe_act: megatron-core recomputes the experts' activation only in their grouped "
     "GEMM (--moe-grouped-gemm); drop it"),
    (["--recompute-granularity", "selective", "--recompute-modules", "shared_experts"], False,
     "--recompute-modules shared_experts: shared_experts: the model has no shared experts"),
    (["--recompute-granularity", "selective", "--recompute-modules", "attention"], False,
     "--recompute-modules attention: not a module megatron-core recomputes; choose from core_attn, mlp, layernorm, "
     "moe, shared_experts, moe_act"),
    (["--recompute-modules", "mlp"], False,
     "--recompute-modules mlp needs --recompute-granularity selective (megatron-core reads the modules only then)"),
    (["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1",
      "--moe-layer-recompute"], True, "--moe-layer-recompute selects selective recompute of the MoE layers, not "
                                      "beside --recompute-granularity full"),
    (["--moe-layer-recompute"], False, "--moe-layer-recompute: the model has no MoE layers (--num-experts); drop it"),
    *([] if HAS_TE else [(["--recompute-granularity", "selective", "--recompute-modules", "core_attn", "layernorm"],
                          False, "--recompute-modules layernorm: layernorm: megatron-core's output-discarding "
                                 "recompute of the norms needs Transformer Engine, not installed here; drop it")]),
])
def test_recompute_modules_the_model_lacks_are_refused_in_one_line(extra, experts, line):
    from megatron_csbp.core.rules import ConfigError

    with pytest.raises(ConfigError) as refused:
        _validated(*extra, experts=experts)
    assert str(refused.value).startswith(line) and "\n" not in str(refused.value), refused.value


def test_mlp_recompute_in_a_model_of_moe_layers_only_is_refused():
    from megatron_csbp.core.rules import ConfigError

    with pytest.raises(ConfigError, match=r"^--recompute-modules mlp: mlp: every layer is a MoE layer, none has a "
                                          r"dense MLP \(--moe-layer-freq\); drop it$"):
        _validated("--recompute-granularity", "selective", "--recompute-modules", "mlp", "--num-experts", "4",
                   experts=False)
