"""The topology planner: the paper's exact traffic through the CLI, records, valid layouts, YAML."""

import dataclasses
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
                 "fits", "compute_s", "forward_s", "exposed_attention_s", "exposed_other_comm_s", "bubble_s", "step_time_s",
                 "tokens_per_s", "reason", "requested", "ep", "etp", "dense_params_per_rank", "expert_params_per_rank",
                 "parameter_bytes", "gradient_bytes", "optimizer_bytes", "all_to_all_bytes", "exposed_all_to_all_s",
                 "logits_bytes"}


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


QWEN3_8B_256K = ["--num-layers", "36", "--hidden-size", "4096", "--ffn-hidden-size", "12288", "--num-attention-heads",
                 "32", "--group-query-attention", "--num-query-groups", "8", "--kv-channels", "128", "--swiglu",
                 "--untie-embeddings-and-output-weights", "--vocab-size", "151934", "--seq-length", "262144",
                 "--bdlm-block-size", "256", "--recompute-granularity", "full", "--bf16", "--gpu", "h200"]


def test_the_tiled_cross_entropy_holds_one_tile_of_logits_and_runs_the_head_twice():
    """Qwen3-8B's shape at 256K on CSBP 8, vocabulary 151,936: the head's logits per GPU are the rank's 32K noisy rows
    x 151,936 columns in bf16 and their fp32 copy, whole; one tile of 1024 rows in tiles (the trainer's default). The
    memory falls by what the logits held above the recomputed layer's working set, and the head's forward runs again
    in the backward. The CLI prints both."""
    model = plan._model(plan.parse_args(QWEN3_8B_256K))
    cluster, topo = plan.Cluster(8, 8, plan.GPU_PRESETS["h200"]), plan.Topology("csbp", 1, 1, 8, 8, 1)
    whole, tiled = (plan.predict(dataclasses.replace(model, logits_tile_rows=rows), cluster, topo)
                    for rows in (None, 1024))
    assert whole.logits_bytes == 32768 * 151936 * 6 and tiled.logits_bytes == 1024 * 151936 * 6
    assert 0 < whole.memory_bytes - tiled.memory_bytes <= whole.logits_bytes - tiled.logits_bytes
    head_forward_s = 32768 * 2 * 4096 * 151936 / cluster.gpu.linear_rate
    assert math.isclose(tiled.compute_s - whole.compute_s, head_forward_s)
    records, text = run(QWEN3_8B_256K + ["--context-block-parallel", "8", "--cross-entropy-loss-fusion"])
    assert "tiled linear cross-entropy (1024 rows a tile)" in text
    assert (f"LM head logits per GPU: {whole.logits_bytes / plan.GIB:.2f} GiB whole (memory "
            f"{whole.memory_bytes / plan.GIB:.1f} GiB), {tiled.logits_bytes / plan.GIB:.3f} GiB in tiles of 1024 rows"
            ) in text
    requested = next(r for r in records if r["requested"] and r["mode"] == "csbp")
    assert requested["logits_bytes"] == tiled.logits_bytes and requested["memory_bytes"] == tiled.memory_bytes


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
    assert not any(t.tp == 8 or t.p > model.seq_length // model.block_size for t in valid)
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
    tiny = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
            "--bdlm-block-size", "8"]
    with pytest.raises(ValueError, match="no --experimental-attention-variant"):
        run(tiny + ["--linear-attention-freq", "4"])
    result = subprocess.run([sys.executable, "-m", "megatron_csbp.plan", *tiny, "--linear-attention-freq", "4"],
                            capture_output=True, text=True)
    assert result.returncode == 2 and result.stderr.strip().splitlines()[-1].startswith(
        "python -m megatron_csbp.plan: error: --linear-attention-freq picks the Gated DeltaNet layers")


def test_paper_check_reports_beside_published():
    """Each paper row at its own layout: the predicted speedup within ±10% of the published and the peak within
    ±15% (the README table; the 3B's config is a scale-down recipe, see docs/performance.md), the 14B's traffic
    exact, the operator profile printed beside the published one."""
    records, text = run(["--paper-check"])
    assert len(records) == 5 and "210.00 -> 105.00 GiB" in text and "14B operator profile" in text
    for r in records[:3]:
        assert r["published_speedup"] == r["published_csbp_tokens_per_s"] / r["published_cp_tokens_per_s"]
        assert f"{r['published_speedup']:.2f}x" in text
        assert abs(r["predicted_speedup"] / r["published_speedup"] - 1) <= 0.10, r
        for mode in ("cp", "csbp"):
            assert abs(r[f"predicted_{mode}_peak_gib"] / r[f"published_{mode}_peak_gib"] - 1) <= 0.15, r
    fourteen = records[2]
    assert fourteen["predicted_cp_forward_s"] > fourteen["predicted_csbp_forward_s"]


def test_paper_check_prints_the_diffusion_gemma_row_and_its_context_scaling():
    """DiffusionGemma 26B-A4B, DP1/EP2/CP8 -> DP1/EP2/CP8/BP8: published tokens/s, speedup, peaks and traffic beside
    the predicted, the curve (64K-512K) beside the published, the unmodelled parts named where a number misses.
    The traffic by hand: the field's CP sends `2L·7/8` rows of K/V per layer per forward (both copies; forward,
    recomputed forward and half a first pass: 2.5 forwards, and the backward's one), `β = 2·8·256·2` in the 25
    sliding layers and `2·2·512·2` (K and V both sent) in the 5 global ones; CSBP `L·7/8` rows in a global layer,
    the windowed rows (`ParallelMode.exchanged_rows`, the busiest rank) in a sliding one."""
    from megatron_csbp.core import modes
    from megatron_csbp.core.clean_attention import TOKEN_CAUSAL
    from megatron_csbp.core.windows import Sliding

    records, text = run(["--paper-check"])
    gemma = next(r for r in records if r["model"] == "DiffusionGemma 26B-A4B")
    assert gemma["layout"] == "DP1/EP2/CP8" and gemma["published_speedup"] == 15359 / 10557
    line = next(line for line in text.splitlines() if line.strip().startswith("DiffusionGemma 26B-A4B"))
    assert (f"tokens/s published 10557 -> 15359, predicted {gemma['predicted_cp_tokens_per_s']:.0f} -> "
            f"{gemma['predicted_csbp_tokens_per_s']:.0f}; speedup published 1.45x, predicted "
            f"{gemma['predicted_speedup']:.3f}x") in line
    assert f"peak GiB published 118.1 -> 113.6, predicted {gemma['predicted_cp_peak_gib']:.1f}" in line
    assert (f"traffic GiB per GPU per step published 433 -> 28, predicted {gemma['predicted_cp_traffic_gib']:.2f}"
            in line and f"-> {gemma['predicted_csbp_traffic_gib']:.2f}" in line)
    L, sliding, global_ = 262144, 2 * 8 * 256 * 2, 2 * 2 * 512 * 2
    cp = 3.5 * 2 * L * 7 // 8 * (25 * sliding + 5 * global_)
    sent, received = max((modes.CSBP.exchanged_rows(L, 256, 8, 8, rank, TOKEN_CAUSAL, Sliding(1023))
                          for rank in range(8)), key=sum)
    assert 0 < sent < L // 8 and 0 < received < L // 8  # a window's rows, not the chunks
    csbp = 5 * 3.5 * L * 7 // 8 * global_ + 25 * (2.5 * sent + received) * sliding
    assert gemma["predicted_cp_traffic_gib"] == pytest.approx(cp / 2**30, rel=1e-12)
    assert gemma["predicted_csbp_traffic_gib"] == pytest.approx(csbp / 2**30, rel=1e-12)
    assert gemma["predicted_cp_traffic_gib"] != pytest.approx(3 * 2 * L * 7 // 8 * (25 * sliding + 5 * global_)
                                                              / 2**30)  # without the first pass: a miss
    curve = next(curve for curve in text.split(line)[1].splitlines() if "context scaling" in curve)
    assert [point["seq_length"] for point in gemma["scaling"]] == [65536, 131072, 262144, 524288]
    for point, published in zip(gemma["scaling"], ("1.25x", "1.44x", "1.45x", "1.61x")):
        assert f"{point['seq_length'] // 1024}K {published} | {point['predicted_speedup']:.3f}x" in curve
        assert point["predicted_speedup"] > 1
    assert gemma["scaling"][2]["predicted_speedup"] == pytest.approx(gemma["predicted_speedup"])
    outside = "(outside ±10%)" in line or "(outside ±10%)" in curve
    assert outside == ("not modelled: Turbo-dLLM runs DiffusionGemma as two model passes" in text.split(curve)[1])


def test_paper_check_prints_the_qwen_row_and_its_context_scaling():
    """Qwen3.8-27B, DP1/TP2/CP8 -> DP1/TP2/CP8/BP8: the published tokens/s, speedup and peaks beside the predicted,
    the context-scaling curve (64K, 128K, 256K) beside the published one, and where a number is outside ±10% the
    unmodelled parts named on the next line. CSBP is predicted faster at every length, more so at longer ones
    (as published), and its layers send fewer bytes than CP's."""
    records, text = run(["--paper-check"])
    qwen = records[-1]
    assert (qwen["model"], qwen["layout"]) == ("Qwen3.8-27B", "DP1/TP2/CP8")
    assert qwen["published_speedup"] == 3490 / 2623 and (qwen["published_cp_peak_gib"],
                                                         qwen["published_csbp_peak_gib"]) == (120.7, 111.1)
    line = next(line for line in text.splitlines() if line.strip().startswith("Qwen3.8-27B"))
    assert (f"tokens/s published 2623 -> 3490, predicted {qwen['predicted_cp_tokens_per_s']:.0f} -> "
            f"{qwen['predicted_csbp_tokens_per_s']:.0f}; speedup published 1.33x, predicted "
            f"{qwen['predicted_speedup']:.3f}x") in line
    assert f"peak GiB published 120.7 -> 111.1, predicted {qwen['predicted_cp_peak_gib']:.1f}" in line
    curve = next(curve for curve in text.split(line)[1].splitlines() if "context scaling" in curve)
    assert [point["seq_length"] for point in qwen["scaling"]] == [65536, 131072, 262144]
    speedups = [point["predicted_speedup"] for point in qwen["scaling"]]
    for point, published in zip(qwen["scaling"], ("1.26x", "1.30x", "1.33x")):
        assert f"{point['seq_length'] // 1024}K {published} | {point['predicted_speedup']:.3f}x" in curve
    assert 1 < speedups[0] < speedups[1] < speedups[2] == pytest.approx(qwen["predicted_speedup"])
    assert qwen["predicted_csbp_traffic_gib"] < qwen["predicted_cp_traffic_gib"]
    outside = "(outside ±10%)" in line or "(outside ±10%)" in curve
    named = "not modelled: Turbo-dLLM's Gated DeltaNet layers run head-parallel" in text.split(curve)[1]
    assert outside == named


# A tiny Gated DeltaNet ring (the shapes of tests/test_gated_delta.py): L 32, B 4, 2 key heads and 4 value heads,
# dk 8, dv 6, convolution 4 wide over q, k, v (2·2·8 + 4·6 = 56 channels), fp32.
GDN_L, GDN_B, GDN_HEADS, GDN_DK, GDN_DV, GDN_WIDTH, GDN_CHANNELS = 32, 4, 4, 8, 6, 4, 56


def test_gated_delta_bytes_by_hand_and_as_the_layer_sends_them():
    """`flops.gated_delta_bytes` (the planner's count, from the modes' row spans) equals the plan that the layer
    sends by (`core.gated_delta.gated_delta_plan(layout).bytes_sent`, built from the torch layouts; its bytes equal
    the layer's counters in tests/test_gated_delta.py) on every rank of CSBP, CP and BP rings; and by hand on CSBP
    P=C=2 (tests/test_gated_delta.py's count): one history `(W-1)·channels`, one state `Hv·dk·dv` and two chunk maps
    `Hv·dk·(dk+dv)`, fp32, each way. Pure BP sends nothing."""
    from megatron_csbp.bdlm import flops
    from megatron_csbp.core.gated_delta import gated_delta_plan
    from megatron_csbp.core.layout import layout_for

    shape = (GDN_HEADS, GDN_DK, GDN_DV, GDN_CHANNELS)
    by_hand = ((GDN_WIDTH - 1) * GDN_CHANNELS + GDN_HEADS * GDN_DK * GDN_DV
               + 2 * GDN_HEADS * GDN_DK * (GDN_DK + GDN_DV)) * 4
    assert by_hand == 5024
    for rank in range(2):
        assert flops.gated_delta_bytes("csbp", GDN_L, GDN_B, 2, 2, rank, *shape, GDN_WIDTH, 4) == (by_hand, by_hand)
    for mode, P, C in (("csbp", 2, 2), ("cp", 2, 2), ("bp", 2, 1), ("csbp", 4, 2), ("csbp", 4, 4), ("cp", 4, 4)):
        for rank in range(P):
            layout = layout_for(mode, GDN_L, GDN_B, P, C, rank)
            member = layout.ring_ranks.index(layout.rank)
            sent = gated_delta_plan(layout, GDN_WIDTH).bytes_sent(member, 1, *shape, 4)
            assert flops.gated_delta_bytes(mode, GDN_L, GDN_B, P, C, rank, *shape, GDN_WIDTH, 4) == sent, \
                (mode, P, C, rank)
            assert (sum(sent) == 0) == (C == 1)


def test_gated_delta_rule_flops_against_torchs_counter():
    """The chunked delta rule's FLOPs (`flops.gated_delta_rule_flops`, fla's form with the explicit inverse)
    against torch's FLOP counter over `torch_chunk_rule` (which solves the triangular systems instead): the
    matrix products both run (`2c²dk + c²dv + 3c·dk·dv` multiply-adds per chunk and head) are what the counter
    counts; the inverse (`c³/6`) and the products `T βK`, `T βV` (`c²dk + c²dv`) are fla's, by hand."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from megatron_csbp.bdlm import flops
    from megatron_csbp.core.kernels.gated_delta import l2norm, torch_chunk_rule

    batch, tokens, heads, dk, dv, chunk = 1, 128, 3, 8, 6, 16
    generator = torch.Generator().manual_seed(0)
    q, k = (l2norm(torch.randn(batch, tokens, heads, dk, generator=generator)) for _ in range(2))
    v = torch.randn(batch, tokens, heads, dv, generator=generator)
    g, beta = -torch.rand(batch, tokens, heads, generator=generator), torch.rand(batch, tokens, heads,
                                                                                generator=generator)
    with FlopCounterMode(display=False) as counter:
        torch_chunk_rule(q, k, v, g, beta, torch.zeros(batch, heads, dk, dv), chunk=chunk)
    chunks = tokens // chunk
    fla_only = 2 * heads * chunks * (chunk * chunk * dk + chunk * chunk * dv + chunk ** 3 // 6)
    assert counter.get_total_flops() == 380928
    assert flops.gated_delta_rule_flops(tokens, heads, dk, dv, chunk) - fla_only == counter.get_total_flops()
    assert flops.gated_delta_rule_flops(tokens, heads, dk, dv + 1, chunk) - fla_only != counter.get_total_flops()


def test_gated_delta_layer_flops_and_parameters_by_hand():
    """One Gated DeltaNet layer of h 64, 2 key heads of 8, 4 value heads of 6, convolution 4, SwiGLU FFN 96, no
    biases, RMSNorm: in-projection 64·(2·16 + 2·24 + 2·4) = 5632 weights, convolution 56·4 = 224, A_log and
    dt_bias 4 each, the output norm 6, out-projection 24·64 = 1536, MLP 3·64·96 = 18432, two norms 128; forward
    FLOPs per row 2·(5632 + 224 + 1536) + 2·18432. A gated full-attention layer's QKV projection holds the gate's
    query-sized rows too. The training log's step count (`bdlm_step_flops`) prices the Gated DeltaNet layer as
    that, plus its delta rule (`gated_delta_core_flops` over the L noisy and L clean rows), and no attention pairs."""
    from megatron_csbp.bdlm import flops
    from megatron_csbp.core.model_shape import LinearAttentionShape, ModelShape

    linear = LinearAttentionShape((1, 0), conv_kernel_dim=4, key_head_dim=8, value_head_dim=6, num_key_heads=2,
                                  num_value_heads=4)
    sizes = dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=96, swiglu=True,
                 add_bias_linear=False, layernorm_bias=False)
    shape = ModelShape(**sizes, linear=linear)
    assert flops.gated_delta_layer_parameter_count(shape) == 5632 + 224 + 8 + 6 + 1536 + 18432 + 128
    assert flops.gated_delta_linear_flops_per_row(shape) == 2 * (5632 + 224 + 1536) + 2 * 18432
    plain, gated = ModelShape(**sizes), ModelShape(**sizes, attention_output_gate=True)
    assert flops.layer_parameter_count(gated) - flops.layer_parameter_count(plain) == 64 * 64
    assert flops.linear_flops_per_row(gated) - flops.linear_flops_per_row(plain) == 2 * 64 * 64
    assert flops.parameter_count(shape, 128) == (flops.layer_parameter_count(shape)
                                                 + flops.gated_delta_layer_parameter_count(shape) + 64 + 128 * 64)
    L, B = 16, 4
    step = dict(padded_vocab_size=128, seq_length=L, block_size=B, batch_size=2)
    attention_layer = 2 * L * flops.linear_flops_per_row(shape) + flops.bdlm_attention_pairs(L, B) * 4 * 4 * 16
    gated_delta_layer = (2 * L * (2 * (5632 + 224 + 1536) + 2 * 18432)
                         + flops.gated_delta_core_flops(L, L, B, heads=4, key_dim=8, value_dim=6))
    head = L * 2 * 64 * 128
    assert flops.bdlm_step_flops(shape, **step) == 2 * 3 * (gated_delta_layer + attention_layer + head)
    assert flops.bdlm_step_flops(shape, **step) != flops.bdlm_step_flops(ModelShape(**sizes), **step)  # control


def test_the_planner_prices_gated_delta_layers_apart_from_attention_layers():
    """A hybrid of 4 layers (every 4th full attention) under CSBP P=C=2: the ring carries the one attention layer's
    K/V and the three Gated DeltaNet layers' state sends, nothing else; under pure BP nothing travels; a model of
    only attention layers sends 4 layers' K/V (the negative control)."""
    from megatron_csbp.bdlm import flops

    sizes = dict(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=64, block_size=8, bytes_per_elem=4)
    hybrid = plan.Model(**sizes, experimental_attention_variant="gated_delta_net", linear_attention_freq=4,
                        linear_sizes=(("key_head_dim", 8), ("value_head_dim", 6), ("num_key_heads", 2),
                                      ("num_value_heads", 4)))
    cluster = plan.Cluster(2, 8, plan.GPU_PRESETS["h200"])
    kv = flops.attention_traffic_bytes("csbp", 64, 2, 4, 16, 4)
    states = [sum(flops.gated_delta_bytes("csbp", 64, 8, 2, 2, rank, 4, 8, 6, 56, 4, 4)) for rank in range(2)]
    got = plan.predict(hybrid, cluster, plan.Topology("csbp", 1, 1, 2, 2, 1)).attention_bytes
    assert got == kv + 3 * max(states) and max(states) > 0
    assert plan.predict(hybrid, cluster, plan.Topology("bp", 1, 1, 2, 1, 1)).attention_bytes == 0
    dense = plan.Model(**sizes)
    assert plan.predict(dense, cluster, plan.Topology("csbp", 1, 1, 2, 2, 1)).attention_bytes == 4 * kv


def _attention(kernel_fractions, mode, block_size=256, tile=128):
    gpu = plan.GPU("test", 1000.0, 0.5, 80.0, 100.0, 10.0, kernel_fractions=kernel_fractions, tile=tile)
    model = plan.Model(num_layers=2, hidden_size=256, num_attention_heads=4, seq_length=8192, block_size=block_size)
    topo = plan.Topology(mode, 1, 1, 4, 4, 1)
    return plan.attention_seconds(plan.modes.parallel_mode(mode), model, topo, gpu, 1.0)


def test_kernel_families_priced_by_their_rates():
    """With one rate for every family, CSBP and the field's CP cost the same attention time when the block size
    is a multiple of the tile (same pairs, no tile waste): the negative control. With the SM90 families the
    masked kernel is slower per pair than the prefix; with blocks smaller than the tile the masked kernel
    computes whole partly masked tiles, with blocks of whole tiles none."""
    baseline = next(name for name in plan.MODES if plan.modes.parallel_mode(name).is_baseline)
    same = ()
    assert sum(_attention(same, baseline)) == pytest.approx(sum(_attention(same, "csbp")), rel=1e-3)
    assert _attention(plan.SM90_KERNELS, baseline)[0] > 1.2 * _attention(plan.SM90_KERNELS, "csbp")[0]
    masked = lambda block_size: plan.modes.parallel_mode(baseline).kernel_calls(8192, block_size, 4, 4, 0, 128)
    assert all(c.computed_pairs > c.real_pairs for c in masked(16))
    assert all(c.computed_pairs == c.real_pairs for c in masked(256))


@pytest.mark.parametrize("mode", ["csbp", "cp"])
def test_kernel_calls_cover_the_mask(mode):
    """Over the ranks of one ring, the kernel calls' real pairs are the whole BDLM mask's pairs, and every call
    computes at least its real pairs (`ParallelMode.kernel_calls`, the planner's input)."""
    from megatron_csbp.bdlm import flops

    parallel_mode = plan.modes.parallel_mode(mode)
    calls = [c for rank in range(4) for c in parallel_mode.kernel_calls(4096, 64, 4, 4, rank, 128)]
    assert sum(c.real_pairs for c in calls) == flops.bdlm_attention_pairs(4096, 64)
    assert all(c.computed_pairs >= c.real_pairs for c in calls)


@pytest.mark.parametrize("name", ["tiny_cpu", "nemotron_labs_diffusion_3b_256k", "nemotron_labs_diffusion_8b_256k",
                                  "nemotron_labs_diffusion_14b_256k", "qwen3_8_27b_fast_dllm_v2_256k",
                                  "diffusion_gemma_26b_a4b_256k"])
def test_shipped_configs_plan_with_their_sections(name):
    """The plugin's flags sit in `bdlm:` / `csbp:` sections of the shipped configs; the planner reads them
    as training does (the block size, for one, only lives there)."""
    import pathlib

    path = pathlib.Path(__file__).parent.parent / "configs" / f"{name}.yaml"
    args = plan.parse_args(["--config", str(path), "--gpus", "16", "--gpus-per-node", "8"])
    assert args.bdlm_block_size in (16, 64, 256) and args.context_block_parallel >= 2


# A tiny MoE BDLM for the expert-parallel checks: 2 layers (layer 0 MoE, layer 1 dense), h 64, 4 heads of 16
# (MHA), dense FFN 128, 4 experts of FFN 32, top-2, a shared expert of FFN 48, no biases, RMSNorm, tied
# embeddings of 254 ids + EOD + MASK = 256 rows (already a multiple of 128), bf16, fp32 router.
TINY_MOE = dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128, seq_length=64,
                block_size=16, vocab_size=254, bytes_per_elem=2, num_experts=4, moe_router_topk=2,
                moe_ffn_hidden_size=32, moe_shared_expert_intermediate_size=48, moe_layer_freq=[1, 0],
                moe_router_dtype="fp32")


def test_expert_parallel_memory_per_rank_by_hand():
    """Parameters, gradients and optimizer state per rank of the tiny MoE on 4 GPUs as CSBP P2 x DP2 with EP2
    (EP carved from DP x CP), written out by hand:
    * one rank's dense parameters: attention (QKV 64 x 192 + projection 64 x 64 = 16384) and two norms (128) in
      each layer = 2 x 16512; layer 1's MLP 64 x 128 x 2 = 16384; layer 0's router 4 x 64 = 256 and shared
      expert 64 x 48 x 2 = 6144; embeddings 256 x 64 = 16384; final norm 64: 72256;
    * its expert parameters: 2 of the 4 experts (EP2) of 64 x 32 x 2 = 4096 each: 8192;
    * weights bf16: (72256 + 8192) x 2 = 160896 bytes; fp32 gradients, whole: 80448 x 4 = 321792;
    * distributed optimizer (fp32 master + 2 Adam moments = 12 bytes a parameter): the dense state sharded over
      DP x CP = 4 ranks, 72256 x 12 / 4 = 216768; the experts' over the expert-data-parallel group, 4 ranks /
      EP2 = 2, 8192 x 12 / 2 = 49152; total 265920.
    With EP1 each rank holds all 4 experts (16384) and shards their state over 4 ranks."""
    model = plan.Model(**TINY_MOE)
    cluster = plan.Cluster(4, 8, plan.GPU_PRESETS["h200"])
    ep2 = plan.predict(model, cluster, plan.Topology("csbp", 1, 1, 2, 2, 2, ep=2))
    assert (ep2.dense_params_per_rank, ep2.expert_params_per_rank) == (72256, 8192)
    assert (ep2.parameter_bytes, ep2.gradient_bytes, ep2.optimizer_bytes) == (160896, 321792, 216768 + 49152)
    assert ep2.state_bytes == 160896 + 321792 + 265920
    ep1 = plan.predict(model, cluster, plan.Topology("csbp", 1, 1, 2, 2, 2, ep=1))
    assert ep1.expert_params_per_rank == 16384 and ep1.dense_params_per_rank == 72256
    assert ep1.optimizer_bytes == (72256 + 16384) * 12 / 4
    # ZeRO-2 (sharded gradients): the dense gradients over 4 ranks, the experts' over 2
    sharded = plan.predict(dataclasses.replace(model, sharded_gradients=True), cluster,
                           plan.Topology("csbp", 1, 1, 2, 2, 2, ep=2))
    assert sharded.gradient_bytes == 72256 * 4 / 4 + 8192 * 4 / 2
    # the whole model, as the trainer counts it (flops.parameter_count), is one EP group's experts + the dense part
    from megatron_csbp.bdlm import flops
    from megatron_csbp.core.model_shape import ModelShape

    whole = flops.parameter_count(ModelShape(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128,
                                             add_bias_linear=False, layernorm_bias=False, moe=model.moe), 256)
    assert whole == ep2.dense_params_per_rank + 2 * ep2.expert_params_per_rank


def test_expert_parallel_all_to_all_bytes_by_hand():
    """All-to-all bytes per rank per step of the tiny MoE's one MoE layer as CSBP P2 (each rank 32 noisy + 32
    clean rows, all routed) with EP2, uniform routing, by hand: 64 rows x top-2 = 128 (row, expert) pairs, half
    of them to the other EP rank: 64 pairs out, and 64 in. Forward: the dispatch sends 64 rows of 64 bf16 (8192
    bytes) and their 64 fp32 probabilities (256), the combine sends back the 64 rows it received (8192); the
    backward the same in reverse: 2 x 16640 = 33280 bytes. Full recompute runs the forward's 16640 again; EP1
    sends nothing; 3 micro-batches send 3x."""
    model = plan.Model(**TINY_MOE)
    cluster = plan.Cluster(4, 8, plan.GPU_PRESETS["h200"])
    topo = plan.Topology("csbp", 1, 1, 2, 2, 2, ep=2)
    assert plan.predict(model, cluster, topo).all_to_all_bytes == 33280
    assert plan.predict(dataclasses.replace(model, recompute="full"), cluster, topo).all_to_all_bytes == 33280 + 16640
    assert plan.predict(model, cluster, dataclasses.replace(topo, ep=1)).all_to_all_bytes == 0
    assert plan.predict(dataclasses.replace(model, global_batch_size=6), cluster, topo).all_to_all_bytes == 3 * 33280
    # BP keeps every clean row on each rank: 32 noisy + 64 clean rows routed, 96 pairs out
    assert plan.predict(model, cluster, dataclasses.replace(topo, mode="bp", c=1)).all_to_all_bytes == \
        2 * (96 * (64 * 2 + 4) + 96 * 64 * 2)
    # bf16 probabilities when the router runs in the model's dtype
    assert plan.predict(dataclasses.replace(model, moe_router_dtype=None), cluster, topo).all_to_all_bytes == \
        2 * (64 * (64 * 2 + 2) + 64 * 64 * 2)


def test_expert_flops_per_rank_are_the_training_count():
    """One rank holding a whole sample (P1): the planner's FLOPs per rank equal the trainer's TFLOP/s count of one
    sample (`flops.bdlm_step_flops` with the MoE: router, top-k experts, shared expert), whatever the EP."""
    from megatron_csbp.bdlm import flops
    from megatron_csbp.core.model_shape import ModelShape

    model = plan.Model(**TINY_MOE)
    sizes, step = dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128), dict(
        padded_vocab_size=256, seq_length=64, block_size=16)
    expected = flops.bdlm_step_flops(ModelShape(**sizes, moe=model.moe), **step)
    dense = flops.bdlm_step_flops(ModelShape(**sizes), **step)
    assert expected != dense  # negative control: the experts change the count
    for ep in (1, 2, 4):
        cluster = plan.Cluster(4, 8, plan.GPU_PRESETS["h200"])
        assert plan.predict(model, cluster, plan.Topology("csbp", 1, 1, 1, 1, 4, ep=ep)).flops_per_rank == expected


def test_expert_layouts_refused_with_the_trainers_words():
    """EP not dividing the experts, EP x ETP x PP not dividing the world: the trainer's rules
    (`rules.expert_parallel_problem`, through `RunConfig`), in its words; the planner proposes EP layouts."""
    from megatron_csbp.core import rules

    model = plan.Model(**TINY_MOE)
    cluster = plan.Cluster(4, 8, plan.GPU_PRESETS["h200"])
    for topo in (plan.Topology("csbp", 1, 1, 2, 2, 2, ep=3), plan.Topology("csbp", 2, 1, 2, 2, 1, ep=4)):
        expected = rules.expert_parallel_problem(4, topo.ep, topo.etp, topo.tp, topo.pp, 4)
        assert expected and plan.topology_problem(model, cluster, topo) == expected
    valid = plan.valid_topologies(model, cluster)
    assert {t.ep for t in valid} == {1, 2, 4} and all(4 % t.ep == 0 for t in valid)
    assert plan.Topology("csbp", 1, 1, 2, 2, 2, ep=2) in valid
    dense = plan.Model(**{k: v for k, v in TINY_MOE.items() if not k.startswith(("num_experts", "moe_"))})
    assert {t.ep for t in plan.valid_topologies(dense, cluster)} == {1}


def test_moe_flags_and_table():
    """The MoE flags as training reads them (a --moe-layer-freq pattern too): the requested EP layout's line and the
    table name the experts, their state and the all-to-all bytes."""
    argv = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--ffn-hidden-size", "128",
            "--seq-length", "64", "--bdlm-block-size", "16", "--vocab-size", "254", "--bf16", "--gpus", "4",
            "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32",
            "--moe-shared-expert-intermediate-size", "48", "--moe-layer-freq", "[1]+[0]", "--moe-router-dtype", "fp32",
            "--context-block-parallel", "2", "--expert-model-parallel-size", "2"]
    records, text = run(argv)
    requested = {r["mode"]: r for r in records if r["requested"]}
    assert requested["csbp"]["ep"] == 2 and requested["csbp"]["all_to_all_bytes"] == 33280
    assert requested["csbp"]["expert_params_per_rank"] == 8192
    assert "experts: 4 per MoE layer in 1 of 2 layers, top-2" in text and "(TP1 PP1 P2 C2 EP2)" in text
    assert "EP2: 8.19K expert + 72.3K dense params per rank, expert state over expert-DP 2" in text
    assert "a2a GiB" in text and "state GiB" in text
