"""One rule book (megatron_csbp.core.rules): the planner proposes only what the trainer accepts, refuses what the
trainer refuses in the trainer's own words, and the rule book runs on the standard library alone."""

import ast
import copy
import glob
import os
import sys

import pytest
from test_suite_rules import _modules_added_by

from megatron_csbp.tools import plan
from megatron_csbp.core import rules
from megatron_csbp.core.rules import ConfigError
from megatron_csbp.training.arguments import validate_args
from megatron_csbp.training.config import load_config, parse_args

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = sorted(glob.glob(os.path.join(REPO, "configs", "*.yaml")))
# A recipe without a model shape is fine-tuned from an import, whose model.yaml is put in front of it (README,
# "From an autoregressive checkpoint"): here the shape scripts/make_tiny_hf_model.py builds and imports.
TINY_IMPORT = ("num-layers: 2\nhidden-size: 64\nffn-hidden-size: 96\nnum-attention-heads: 4\n"
               "group-query-attention: true\nnum-query-groups: 2\nkv-channels: 16\nswiglu: true\n"
               "normalization: RMSNorm\ndisable-bias-linear: true\n")


def _with_model_shape(path, tmp_path):
    if "num-layers" in load_config(path):
        return path
    whole = tmp_path / os.path.basename(path)
    with open(path, encoding="utf-8") as recipe:
        whole.write_text(TINY_IMPORT + recipe.read())
    return str(whole)


def _trainer_problem(parsed, topo, world):
    """What the trainer's validation says about `topo` (None: accepted): the config's args with the layout's
    flags, as `--tensor-model-parallel-size TP --pipeline-model-parallel-size PP --context-block-parallel P
    --context-block-parallel-clean-shards C --bdlm-parallel-mode MODE` would set them."""
    args = copy.deepcopy(parsed)
    args.tensor_model_parallel_size, args.pipeline_model_parallel_size = topo.tp, topo.pp
    args.context_block_parallel = args.context_parallel_size = topo.p
    args.context_block_parallel_clean_shards, args.bdlm_parallel_mode = topo.c, topo.mode
    try:
        validate_args(args, world, on_accelerator=True, check_paths=False)
    except ConfigError as refusal:
        return str(refusal)
    return None


def _planner(path, gpus, *extra):
    args = plan.parse_args(["--config", path, "--gpus", str(gpus), "--gpus-per-node", str(gpus), *extra])
    return plan._model(args), plan.Cluster(gpus, gpus, plan.GPU_PRESETS["h200"])


# The dense configs: a mixture of experts adds the planner's expert layouts, which the expert-layout test checks.
DENSE_CONFIGS = [path for path in CONFIGS if "num-experts" not in load_config(path)]


@pytest.mark.parametrize("path", DENSE_CONFIGS, ids=os.path.basename)
@pytest.mark.parametrize("gpus", [8, 16])
def test_the_planner_and_the_trainer_agree_on_every_layout_of_the_shipped_configs(path, gpus, tmp_path):
    """Every layout the planner considers, for every shipped config: it proposes exactly those the trainer's
    validation accepts, and refuses the others with the trainer's message. (One node of `gpus`, so the planner's
    own rule that TP stays in a node never applies.)"""
    path = _with_model_shape(path, tmp_path)
    model, cluster = _planner(path, gpus)
    parsed = parse_args(["--config", path])
    proposed = plan.valid_topologies(model, cluster)
    assert proposed, "the planner proposes nothing for a shipped config"
    refused = 0
    for topo in plan.candidate_topologies(cluster):
        trainer = _trainer_problem(parsed, topo, gpus)
        assert plan.topology_problem(model, cluster, topo) == trainer, topo
        refused += trainer is not None
    assert len(proposed) + refused == len(list(plan.candidate_topologies(cluster)))


TINY = os.path.join(REPO, "configs", "tiny_cpu.yaml")  # L 512, B 16, 4 layers, 4 heads, 2 query groups
FOURTEEN_B = os.path.join(REPO, "configs", "nemotron_labs_diffusion_14b_256k.yaml")  # 32 heads, 8 query groups


@pytest.mark.parametrize("path, extra, topology, message", [
    (FOURTEEN_B, ["--num-query-groups", "4"], ("csbp", 8, 1, 2, 2, 1),
     "--tensor-model-parallel-size 8 does not divide --num-query-groups 4; use a TP size dividing 4 or more query "
     "groups"),
    (TINY, ["--seq-length", "400"], ("cp", 1, 1, 8, 8, 1),
     "--bdlm-parallel-mode cp cuts [x_t ; x_0] into 16 chunks of whole blocks: --seq-length 400 must be a multiple "
     "of 128 (--context-block-parallel x --bdlm-block-size)"),
    (TINY, ["--seq-length", "64"], ("csbp", 1, 1, 8, 8, 1),
     "--seq-length 64 has 4 blocks of 16, too few for --context-block-parallel 8 (every rank needs a block); use "
     "--seq-length >= 128 or a smaller block size"),
    (TINY, ["--seq-length", "18", "--bdlm-block-size", "3"], ("csbp", 1, 1, 2, 2, 1),
     "--seq-length 18 cannot be cut into 4 equal clean chunks (--csbp-clean-layout zigzag, "
     "--context-block-parallel-clean-shards 2); use a multiple of 4"),
    (TINY, [], ("csbp", 1, 1, 4, 3, 1),
     "--context-block-parallel 4 is not a multiple of --context-block-parallel-clean-shards 3; use a divisor of 4 "
     "(default 4)"),
    (TINY, [], ("bp", 1, 1, 4, 2, 1),
     "--bdlm-parallel-mode bp replicates the clean sequence (one clean shard); drop "
     "--context-block-parallel-clean-shards 2 or use --bdlm-parallel-mode csbp"),
    (TINY, [], ("cp", 1, 1, 4, 2, 1),
     "--bdlm-parallel-mode cp shards both copies over all 4 ranks; drop --context-block-parallel-clean-shards 2"),
    (TINY, [], ("cp", 8, 1, 1, 1, 1),
     "--tensor-model-parallel-size 8 does not divide --num-attention-heads 4; use a TP size dividing 4"),
    (TINY, [], ("csbp", 1, 3, 2, 2, 1),
     "--pipeline-model-parallel-size 3 does not divide --num-layers 4; use a PP size dividing 4"),
    (TINY, [], ("csbp", 1, 1, 2, 2, 4),
     "--global-batch-size 4 is not a multiple of --micro-batch-size 2 x data-parallel size 4; use a multiple of 8"),
])
def test_the_planner_refuses_what_the_trainer_refuses_with_its_message(path, extra, topology, message):
    topo = plan.Topology(*topology)
    model, cluster = _planner(path, topo.gpus, *extra)
    assert _trainer_problem(parse_args(["--config", path, *extra]), topo, topo.gpus) == message
    assert plan.topology_problem(model, cluster, topo) == message
    assert topo not in plan.valid_topologies(model, cluster)


def test_one_clean_shard_rule_for_every_mode_and_a_tools_own_flag_names():
    assert rules.PARALLEL_MODES.names == ("csbp", "cp", "cp-traffic", "bp")
    assert [rules.clean_shards(mode, 8) for mode in rules.PARALLEL_MODES] == [8, 8, 8, 1]
    assert [rules.clean_shards(mode, 8, 4) for mode in rules.PARALLEL_MODES] == [4, 8, 8, 1]
    assert rules.clean_shards_problem("csbp", 8, 4) is None and rules.clean_shards_problem("bp", 8, 1) is None
    assert "choose one of csbp, cp, cp-traffic, bp" in rules.clean_shards_problem("ring", 8)
    assert "--bdlm-parallel-mode cp-traffic shards both copies" in rules.clean_shards_problem("cp-traffic", 4, 2)
    assert rules.sequence_problem("csbp", 48, 16, 3, 3) is None  # 3 blocks for 3 ranks, 6 clean chunks of 8
    bench_flags = rules.FLAGS.renamed(parallel_size="--nproc")  # the bench calls P --nproc
    assert "too few for --nproc 4" in rules.sequence_problem("csbp", 48, 16, 4, 4, flags=bench_flags)


def test_the_flop_convention_is_model_flops():
    """Backward = 2 x forward, as flops.py, the planner, the bench and gpu_check all count."""
    assert rules.BACKWARD_FLOPS_PER_FORWARD == 2
    assert (rules.step_passes(), rules.step_passes(recompute=True)) == (3, 4)


def _imported_modules(source: str) -> set:
    """Top-level packages a module imports when it is imported (module-level statements, not those inside a
    function, which run only when the function does)."""
    found = set()
    for node in ast.parse(source).body:
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            found.add("." if node.level else node.module.split(".")[0])
    return found


def test_rules_import_nothing_but_the_standard_library():
    from megatron_csbp.core import modes, objectives, transports

    for module in (rules, modes, objectives, transports):  # the variants the rules ask: standard library too
        with open(module.__file__, encoding="utf-8") as handle:
            imported = _imported_modules(handle.read())
        assert imported - {"megatron_csbp"} <= set(sys.stdlib_module_names), (module.__name__, imported)
    loaded = _modules_added_by(["megatron_csbp.core.rules"], after=None)
    assert set(loaded) - set(sys.stdlib_module_names) == {"megatron_csbp"}, loaded
    # Negative controls: both checks see a module that is not the standard library.
    assert _imported_modules("import torch\nfrom yaml import safe_load\n") == {"torch", "yaml"}
    assert _imported_modules("def views():\n    import torch\n") == set()  # runs only when called
    assert "torch" in _modules_added_by(["megatron_csbp.core.layout"], after=None)


def test_the_planner_and_the_trainer_agree_on_expert_layouts(tmp_path):
    """The tiny config as a MoE (4 experts, alltoall): every layout the planner considers on 8 GPUs, with every EP
    and ETP it enumerates, is proposed exactly when the trainer's validation accepts it (with sequence parallelism
    under TP, which the planner's TP model assumes), and refused with the trainer's message otherwise."""
    moe = ["--num-experts", "4", "--moe-token-dispatcher-type", "alltoall", "--disable-bias-linear"]
    model, cluster = _planner(TINY, 8, "--num-experts", "4")
    parsed = parse_args(["--config", TINY, *moe])
    candidates = list(plan.candidate_topologies(cluster, model))
    assert {t.ep for t in candidates} == {1, 2, 4} and {t.etp for t in candidates} == {None, 1}
    accepted, expert_refusals = 0, 0
    for topo in candidates:
        args = copy.deepcopy(parsed)
        args.expert_model_parallel_size, args.expert_tensor_parallel_size = topo.ep, topo.etp
        args.sequence_parallel = topo.tp > 1
        trainer = _trainer_problem(args, topo, 8)
        assert plan.topology_problem(model, cluster, topo) == trainer, topo
        accepted += trainer is None
        expert_refusals += trainer is not None and "--expert-model-parallel-size" in trainer
    assert accepted == len(plan.valid_topologies(model, cluster)) and accepted > 0 and expert_refusals > 0
    assert any(t.ep == 4 for t in plan.valid_topologies(model, cluster))


def test_a_variant_crosses_a_process_boundary_as_itself():
    """Pickled (to a spawned rank) or copied, a variant comes back as the registered object, so `registry(variant)`
    and identity hold in every rank; a RunConfig and a layout holding variants round-trip equal."""
    import copy
    import pickle

    from megatron_csbp.core import clean_attention, modes, objectives, schedule, transports
    from megatron_csbp.core.model_shape import ModelShape
    from megatron_csbp.core.run_config import RunConfig

    registries = (modes.PARALLEL_MODES, objectives.OBJECTIVES, transports.TRANSPORTS, schedule.SCHEDULES,
                  schedule.CLEAN_LAYOUTS, clean_attention.CLEAN_ATTENTIONS)
    for registry in registries:
        for variant in registry.values():
            assert pickle.loads(pickle.dumps(variant)) is variant and copy.deepcopy(variant) is variant, variant
            assert registry(pickle.loads(pickle.dumps(variant))) is variant
    # schedules and clean layouts share a name ("contiguous"): each comes back as its own kind
    assert pickle.loads(pickle.dumps(schedule.CONTIGUOUS_CLEAN)) is not schedule.CONTIGUOUS_BLOCKS
    settings = RunConfig(ModelShape(2, 64, 4), seq_length=64, block_size=8, mode=modes.CP.name, block_parallel_size=2,
                         transport=transports.STREAMING.name)
    assert pickle.loads(pickle.dumps(settings)) == settings and pickle.loads(pickle.dumps(settings)).mode is modes.CP
    layout = settings.layout(1)
    assert pickle.loads(pickle.dumps(layout)) == layout
