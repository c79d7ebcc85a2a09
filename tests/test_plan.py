"""The topology planner: the paper's exact traffic through the CLI, records, valid layouts, YAML."""

import io
import json
import math
import subprocess
import sys

import pytest

from megatron_csbp.tools import plan

FOURTEEN_B = ["--num-layers", "40", "--hidden-size", "5120", "--ffn-hidden-size", "16384",
              "--num-attention-heads", "32", "--group-query-attention", "--num-query-groups", "8",
              "--kv-channels", "128", "--swiglu", "--seq-length", "262144", "--bdlm-block-size", "32",
              "--recompute-granularity", "full", "--bf16", "--gpus", "16", "--gpu", "h200"]


def run(argv):
    out = io.StringIO()
    records = plan.main(argv, out=out)
    return records, out.getvalue()


def test_paper_traffic_exact_through_cli(tmp_path):
    path = tmp_path / "plan.json"
    records, text = run(FOURTEEN_B + ["--context-block-parallel", "8", "--json", str(path)])
    section = text.split("your layout")[1].split("\n\n")[0]
    lines = {line.split()[0]: line for line in section.splitlines()[1:]}
    assert "210.00 GiB" in lines["cp"] and "105.00 GiB" in lines["csbp"] and "0.00 GiB" in lines["bp"]
    requested = {r["mode"]: r for r in json.loads(path.read_text()) if r["requested"]}
    assert requested["cp"]["attention_bytes"] == 210 * 2 ** 30
    assert requested["csbp"]["attention_bytes"] == 105 * 2 ** 30
    assert (requested["csbp"]["p"], requested["csbp"]["c"], requested["csbp"]["dp"]) == (8, 8, 2)
    assert json.loads(path.read_text()) == json.loads(json.dumps(records))


def test_module_entry_point():
    done = subprocess.run([sys.executable, "-m", "megatron_csbp.tools.plan", *FOURTEEN_B, "--context-block-parallel", "8",
                           "--top", "3"], capture_output=True, text=True, timeout=120, check=True)
    assert "210.00 GiB" in done.stdout and "105.00 GiB" in done.stdout and "best layouts" in done.stdout


RECORD_FIELDS = {"mode", "tp", "pp", "p", "c", "dp", "noisy_rows", "clean_rows", "flops_per_rank",
                 "attention_bytes", "attention_traffic_gib_per_step", "ring_link", "bytes_intra_node",
                 "bytes_inter_node", "activation_bytes", "state_bytes", "memory_bytes", "memory_limit_bytes",
                 "fits", "compute_s", "exposed_attention_s", "exposed_other_comm_s", "bubble_s", "step_time_s",
                 "tokens_per_s", "reason", "requested"}


def test_records_fields_and_halving():
    records, _ = run(FOURTEEN_B + ["--top", "3"])
    assert records and all(set(r) == RECORD_FIELDS for r in records)
    for r in records:
        assert r["tp"] * r["pp"] * r["p"] * r["dp"] == 16
        assert math.isclose(r["bytes_intra_node"] + r["bytes_inter_node"], r["attention_bytes"])
        assert r["reason"] and r["step_time_s"] > 0
    cp = {(r["tp"], r["pp"], r["c"]): r for r in records if r["mode"] == "cp"}
    pairs = [(r, cp[r["tp"], r["pp"], r["c"]]) for r in records if r["mode"] == "csbp" and r["p"] == r["c"]]
    assert pairs
    for csbp, same_cp in pairs:
        assert 2 * csbp["attention_bytes"] == same_cp["attention_bytes"]
        assert csbp["step_time_s"] <= same_cp["step_time_s"] and csbp["memory_bytes"] <= same_cp["memory_bytes"]
    assert all(r["attention_bytes"] == 0 for r in records if r["mode"] == "bp")


def test_invalid_topologies_excluded():
    """The planner refuses with the trainer's rules and words (megatron_csbp.core.rules); tests/test_rules.py checks
    that the two agree on every shipped config."""
    model = plan.Model(num_layers=6, hidden_size=96, num_attention_heads=12, num_query_groups=4, seq_length=64,
                       block_size=16)
    cluster = plan.Cluster(8, 8, plan.GPU_PRESETS["h100"])
    problem = lambda *t: plan.topology_problem(model, cluster, plan.Topology(*t))
    assert "does not divide --num-attention-heads 12" in problem("cp", 8, 1, 1, 1, 1)
    assert "GPUs" in problem("csbp", 1, 1, 3, 3, 2)
    too_few = "--seq-length 64 has 4 blocks of 16, too few for --context-block-parallel 8"
    assert too_few in problem("csbp", 1, 1, 8, 8, 1) and too_few in problem("bp", 1, 1, 8, 1, 1)
    assert too_few in problem("cp", 1, 1, 8, 8, 1)  # CP's chunks are whole blocks too
    assert problem("cp", 1, 1, 4, 4, 2) is None
    assert "--pipeline-model-parallel-size 4 does not divide --num-layers 6" in problem("cp", 1, 4, 2, 2, 1)
    assert "is not a multiple of --context-block-parallel-clean-shards 3" in problem("csbp", 1, 1, 4, 3, 2)
    gqa = plan.Model(num_layers=6, hidden_size=128, num_attention_heads=16, num_query_groups=4, seq_length=64,
                     block_size=16)  # megatron-core splits the K/V heads over TP; it does not replicate them
    assert "does not divide --num-query-groups 4" in plan.topology_problem(gqa, cluster,
                                                                          plan.Topology("cp", 8, 1, 1, 1, 1))
    assert "--bdlm-parallel-mode bp replicates" in problem("bp", 1, 1, 4, 2, 2)
    assert "--bdlm-parallel-mode cp shards both copies" in problem("cp", 1, 1, 4, 2, 2)
    valid = plan.valid_topologies(model, cluster)
    assert valid and all(plan.topology_problem(model, cluster, t) is None for t in valid)
    assert not any(t.tp == 8 or t.p > model.num_blocks for t in valid)
    assert {t.mode for t in valid} == set(plan.MODES)
    with pytest.raises(ValueError, match=too_few):
        plan.predict(model, cluster, plan.Topology("csbp", 1, 1, 8, 8, 1))


def test_ring_placement_follows_rank_order():
    model = plan.Model(num_layers=4, hidden_size=512, num_attention_heads=8, seq_length=8192, block_size=64,
                       recompute="full")
    cluster = plan.Cluster(16, 8, plan.GPU_PRESETS["h200"])
    inside = plan.predict(model, cluster, plan.Topology("csbp", 1, 1, 8, 8, 2))
    across = plan.predict(model, cluster, plan.Topology("csbp", 2, 1, 8, 8, 1))
    assert inside.ring_link == "NVLink" and inside.bytes_inter_node == 0
    assert across.ring_link == "inter-node" and across.bytes_inter_node > 0
    replicated = plan.predict(model, cluster, plan.Topology("csbp", 1, 1, 16, 8, 1))
    assert replicated.ring_link == "NVLink"  # two rings of 8, one per node
    bp = plan.predict(model, cluster, plan.Topology("bp", 1, 1, 8, 1, 2))
    assert bp.flops_per_rank > inside.flops_per_rank and bp.attention_bytes == 0


def test_yaml_config_with_either_spelling_and_cli_override(tmp_path):
    config = tmp_path / "model.yaml"
    config.write_text("num-layers: 40\nhidden_size: 5120\nffn-hidden-size: 16384\nnum_attention_heads: 32\n"
                      "num-query-groups: 8\nkv_channels: 128\nswiglu: true\nseq_length: 131072\n"
                      "recompute-granularity: full\nbf16: true\nlr: 3.0e-4\ndata-path: [1.0, /data/x]\n"
                      "csbp:\n  context-block-parallel: 8\n  bdlm-block-size: 32\n")
    _, text = run(["--config", str(config), "--gpus", "16"])
    assert "L = 131072" in text and "105.00 GiB" in text  # 6·128K·7/8·4096·40 bytes
    _, text = run(["--config", str(config), "--gpus", "16", "--seq-length", "262144"])
    assert "L = 262144" in text and "210.00 GiB" in text


def test_bad_input_names_the_flag():
    with pytest.raises(SystemExit):
        plan.parse_args(["--num-layers", "2"])
    with pytest.raises(ValueError, match="--bdlm-block-size"):
        run(["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "100",
             "--bdlm-block-size", "16"])
    with pytest.raises(ValueError, match="--context-block-parallel"):
        run(["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "128",
             "--bdlm-block-size", "16", "--context-block-parallel", "3", "--gpus", "8"])


def test_paper_check_reports_beside_published():
    records, text = run(["--paper-check"])
    assert len(records) == 3 and "210.00 -> 105.00 GiB" in text
    for r in records:
        assert r["predicted_speedup"] >= 1.0 and r["predicted_speedup"] <= r["traffic_bound_speedup"] + 1e-9
        assert r["published_speedup"] == r["published_csbp_tokens_per_s"] / r["published_cp_tokens_per_s"]
        assert f"{r['published_speedup']:.2f}x" in text


@pytest.mark.parametrize("name", ["tiny_cpu", "nemotron_diffusion_3b_64k", "nemotron_diffusion_8b_256k",
                                  "nemotron_diffusion_14b_256k"])
def test_shipped_configs_plan_with_their_sections(name):
    """The plugin's flags sit in `bdlm:` / `csbp:` sections of the shipped configs; the planner reads them
    as training does (the block size, for one, only lives there)."""
    import pathlib

    path = pathlib.Path(__file__).parent.parent / "configs" / f"{name}.yaml"
    args = plan.parse_args(["--config", str(path), "--gpus", "16", "--gpus-per-node", "8"])
    assert args.bdlm_block_size == 16 and args.context_block_parallel >= 2


def test_paper_gap_names_how_far_each_term_must_move():
    """The solved CP kernel efficiency and link slowdown each reach the target speedup, and just short of them
    the model stays below it."""
    import dataclasses

    model = plan.Model(seq_length=262144, block_size=32, swiglu=True, recompute="full", **plan.PAPER_SETTINGS[0][1])
    cluster = plan.Cluster(16, 8, plan.GPU_PRESETS["h200"])
    gap = plan.paper_gap(model, cluster, 1.18)
    assert 0 < gap["cp_kernel_efficiency"] < 1 and 0 < gap["link_scale"] < 1
    gpu = cluster.gpu
    kernel = lambda k: dataclasses.replace(cluster, gpu=dataclasses.replace(gpu, cp_attention_fraction=k * 0.45))
    assert plan._speedup(model, kernel(gap["cp_kernel_efficiency"])) >= 1.18
    assert plan._speedup(model, kernel(gap["cp_kernel_efficiency"] * 1.01)) < 1.18
    links = lambda f: dataclasses.replace(cluster, gpu=dataclasses.replace(
        gpu, nvlink_gb_s=gpu.nvlink_gb_s * f, internode_gb_s=gpu.internode_gb_s * f))
    assert plan._speedup(model, links(gap["link_scale"])) >= 1.18 > plan._speedup(model, links(gap["link_scale"] * 1.01))
    assert gap["cp_exposed_needed_s"] > gap["cp_exposed_s"]
