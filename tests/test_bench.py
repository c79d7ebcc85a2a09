"""The benchmark runs all the modes side by side and reports exact, machine-independent traffic and kernel work."""

import dataclasses
import json
import statistics

import pytest
import torch

from megatron_csbp.core import modes
from megatron_csbp.core.layout import CSBPLayout
from megatron_csbp.tools.bench import cli, command, experts, kernel_check, mode_run, report
from megatron_csbp.tools.bench.records import Calibration, RankCalibration


def test_rank_attention_pairs_sum_to_the_bdlm_mask():
    L, B, P = 256, 16, 4
    per_rank = [mode_run.rank_attention_pairs(CSBPLayout(L, B, P, P, r)) for r in range(P)]
    assert sum(per_rank) == L * L + L * B
    assert len(set(per_rank)) == 1  # dual-end blocks + zigzag clean shards: equal work per rank


def test_kernel_plans_check_times_each_mode_on_its_own_rows():
    """CSBP and cp-traffic give a rank the same real and padded pairs, cut into different row groups; the field's
    CP the same real pairs in one masked call over 128-row tiles, which computes more. Hand-derived at L=2048,
    B=64, P=2, tiles of 512 keys and at most 512 rows: CSBP rank 0 holds positions 0-511 and 1536-2047; its
    visible rows' limits end in key tile 0 (960 rows: 2 groups), 2 (64 rows) and 3 (960 rows: 2 groups).
    cp-traffic rank 0 holds noisy 0-1023 and clean 1024-2047: limits ending in tiles 0-3, 512, 448, 448, 512
    rows; cp's 2048 rows are 16 query tiles of 128."""
    args = cli.parse_args(["--seq-lengths", "2048", "--block-size", "64", "--nproc", "2", "--kernel-check"])
    results = kernel_check.kernel_plans_check(cli.kernel_check_runs(args), repeats=1)
    by_case = {(r.mode, r.rank): r for r in results}
    assert list(by_case) == [(mode, rank) for mode in (modes.CSBP, modes.CP, modes.CP_TRAFFIC) for rank in range(2)]
    for rank in range(2):
        csbp, traffic, cp = by_case[modes.CSBP, rank], by_case[modes.CP_TRAFFIC, rank], by_case[modes.CP, rank]
        assert csbp.real_pairs == traffic.real_pairs == cp.real_pairs == (2048 * 2048 + 2048 * 64) // 2
        assert csbp.padded_pairs == traffic.padded_pairs >= csbp.real_pairs
        assert cp.padded_pairs > cp.real_pairs
        assert csbp.forward_s > 0 and traffic.backward_s > 0 and cp.backward_s > 0
    assert by_case[modes.CSBP, 0].row_groups == 5 and by_case[modes.CP_TRAFFIC, 0].row_groups == 4
    assert by_case[modes.CP, 0].row_groups == 16
    assert [r.record()["mode"] for r in results[::2]] == ["kernel-csbp", "kernel-cp", "kernel-cp-traffic"]


def test_bad_flags_are_refused(capsys):
    with pytest.raises(SystemExit):
        cli.parse_args(["--modes", "csbp,ring"])
    assert "--modes" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.parse_args(["--seq-lengths", "100", "--block-size", "16"])
    assert "--seq-lengths 100 is not a multiple of --block-size 16; use --seq-lengths 96" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # CP's 2 x nproc chunks of [x_t ; x_0] hold whole blocks: the trainer's rule
        cli.parse_args(["--seq-lengths", "80", "--block-size", "16", "--modes", "cp"])
    assert "--seq-lengths 80 must be a multiple of 32 (--nproc x --block-size)" in capsys.readouterr().err
    args = cli.parse_args(["--seq-lengths", "80", "--block-size", "16", "--modes", "csbp,bp"])  # 5 blocks: fine
    assert args.seq_lengths == [80] and args.ffn_hidden_size == 4 * args.hidden_size
    # ... but not for what --predict (one rank's L/2 = 40 rows) and --kernel-check (CP's layout too) build
    with pytest.raises(SystemExit):
        cli.parse_args(["--seq-lengths", "80", "--block-size", "16", "--modes", "csbp,bp", "--predict"])
    assert ("--predict's calibration: half of --seq-lengths, 40 is not a multiple of --block-size 16"
            in capsys.readouterr().err)
    with pytest.raises(SystemExit):
        cli.parse_args(["--seq-lengths", "80", "--block-size", "16", "--modes", "csbp,bp", "--kernel-check"])
    assert "--seq-lengths 80 must be a multiple of 32 (--nproc x --block-size)" in capsys.readouterr().err


def test_all_modes_side_by_side(tmp_path, capsys):
    """Every mode's step, bytes and kernel work; the kernel figures the bench counted off the kernels' plans
    equal each mode's analytic `kernel_calls` (the CPU kernels' tiles: 512 for the prefix, flex's 128 masked)."""
    from megatron_csbp.core.kernels import DEFAULT_TILE, MASKED_TILE

    out_json, out_png = tmp_path / "bench.json", tmp_path / "bench.png"
    command.main(["--seq-lengths", "512", "--block-size", "16", "--num-layers", "1", "--hidden-size", "64",
                  "--steps", "1", "--warmup", "0", "--json", str(out_json), "--plot", str(out_png)])
    records = {r["mode"]: r for r in json.loads(out_json.read_text())}
    assert set(records) == {"csbp", "cp", "cp-traffic", "bp"}
    for name, record in records.items():
        mode = modes.parallel_mode(name)
        tile = MASKED_TILE if mode.masked_attention else DEFAULT_TILE
        c = mode.clean_shards(2)
        expected = [[dataclasses.asdict(call) for call in mode.kernel_calls(512, 16, 2, c, rank, tile)]
                    for rank in range(2)]
        assert record["kernel_work_by_rank"] == expected, name
        assert record["kernel_computed_pairs"] >= record["kernel_real_pairs"] > 0
    assert records["cp"]["kernels"] == "masked" and records["cp-traffic"]["kernels"] == "dense+prefix"
    assert records["cp"]["kernel_real_pairs"] == records["cp-traffic"]["kernel_real_pairs"]
    table = capsys.readouterr().out
    assert "computed" in table and "cp-traffic" in table and "masked" in table
    for record in records.values():
        assert {"mode", "seq_length", "block_size", "nproc", "bytes_sent_per_rank", "step_time_s",
                "peak_memory_bytes", "tokens_per_s"} <= set(record)
        assert record["step_time_s"] > 0 and record["tokens_per_s"] > 0
    beta = 2 * 2 * (64 // 4) * 4  # K+V bytes per token per layer: 2 query groups x head dim 16, fp32
    assert records["cp"]["bytes_sent_per_rank"] == records["cp-traffic"]["bytes_sent_per_rank"] == 4 * 512 // 2 * beta
    assert 2 * records["csbp"]["bytes_sent_per_rank"] == records["cp"]["bytes_sent_per_rank"]
    assert records["bp"]["bytes_sent_per_rank"] == 0
    assert all(r["all_to_all_bytes_per_rank"] == 0 for r in records.values())  # a dense model: no all-to-all
    assert "experts:" not in table
    # CSBP keeps only the clean K/V it gathered (L tokens) for backward; CP keeps all 2L
    assert records["csbp"]["saved_activation_bytes"] < records["cp"]["saved_activation_bytes"]
    assert records["bp"]["rows_per_rank"] > records["csbp"]["rows_per_rank"] == records["cp"]["rows_per_rank"]
    assert out_png.stat().st_size > 10_000


def test_interleaved_modes_measure_what_their_own_runs_do(tmp_path, capsys):
    """`--interleave` runs every mode in the same ranks, steps alternating: each mode must still run its own
    layout and rings (bytes, saved activations, rows, pairs and kernel work equal to the modes' own runs), and the
    table says how peak memory was taken. Flags that need runs of their own are refused in one line."""
    common = ["--seq-lengths", "512", "--block-size", "16", "--num-layers", "1", "--hidden-size", "64",
              "--steps", "2", "--warmup", "0"]
    apart = {r["mode"]: r for r in command.main(common)}
    paired = {r["mode"]: r for r in command.main(common + ["--interleave", "--json", str(tmp_path / "il.json")])}
    assert list(paired) == ["csbp", "cp", "cp-traffic", "bp"]
    exact = ("bytes_sent_per_rank", "saved_activation_bytes", "rows_per_rank", "attention_pairs_per_rank",
             "kernel_work_by_rank", "kernel_calls", "kernel_computed_pairs")
    for mode, record in paired.items():
        assert {key: record[key] for key in exact} == {key: apart[mode][key] for key in exact}, mode
        assert record["interleaved"] and not apart[mode]["interleaved"]
        assert record["step_time_s"] > 0 and record["peak_memory_bytes"] > record["saved_activation_bytes"] > 0
    assert paired["csbp"]["bytes_sent_per_rank"] * 2 == paired["cp"]["bytes_sent_per_rank"]  # rings of their own
    csbp, cp = paired["csbp"]["step_times_s"], paired["cp"]["step_times_s"]  # round by round, side by side
    assert len(csbp) == len(cp) == 2 and paired["csbp"]["step_vs_cp"] == statistics.median(
        [csbp[0] / cp[0], csbp[1] / cp[1]]) and paired["cp"]["step_vs_cp"] == 1
    assert all(0 < cpu for record in paired.values() for cpu in record["cpu_times_s"]) and \
        paired["cp"]["cpu_vs_cp"] == 1
    assert "peak mem: exact tensor bytes of one step" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli.parse_args(common + ["--interleave", "--predict", "--link-gbps", "1"])
    assert "--interleave measures the backend's own link only; run --link-gbps, --predict without it" in \
        capsys.readouterr().err


def test_exposed_communication_link_sweep_overlap_check_and_planner(tmp_path, capsys):
    """Every condition of one run reports exposed communication with its share; a simulated link changes the
    time, never the bytes; the serialised run and the calibrated planner appear beside the measurements."""
    out_json, link_png = tmp_path / "bench.json", tmp_path / "link.png"
    command.main(["--modes", "csbp,cp", "--seq-lengths", "128", "--block-size", "16", "--num-layers", "1",
                  "--hidden-size", "64", "--steps", "1", "--warmup", "0", "--link-gbps", "10,0.5",
                  "--overlap-check", "--predict", "--json", str(out_json), "--link-plot", str(link_png)])
    text = capsys.readouterr().out
    records = json.loads(out_json.read_text())
    measured = [r for r in records if r["mode"] in ("csbp", "cp")]
    assert [(r["link_gbps"], r["overlap"]) for r in measured] == [(None, True), (10.0, True), (0.5, True),
                                                                (None, False)] * 2
    for r in measured:
        assert 0 <= r["exposed_comm_s"] and r["exposed_share"] == r["exposed_comm_s"] / r["step_time_s"]
        assert 0 < r["best_step_time_s"] <= r["step_time_s"]
        if r["overlap"]:
            assert r["predicted_step_time_s"] > 0 and r["predicted_exposed_comm_s"] >= 0
    for mode in ("csbp", "cp"):
        assert len({r["bytes_sent_per_rank"] for r in measured if r["mode"] == mode}) == 1
    for r in measured:
        assert r["calibration"]["linear_gflops"] > 0 and r["calibration"]["attention_gflops"] > 0
        assert r["calibration"]["backend_gb_s"] > 0
    assert "exposed (s)" in text and "share" in text
    sweep = text.split("simulated link sweep")[1].split("\n\n")[0]
    assert "0.5 Gb/s" in sweep and "10 Gb/s" in sweep and "CSBP/CP" in sweep
    assert "overlap check" in text and "serialised" in text and "calibration (in each run's ranks" in text
    planner = text.split("planner (calibrated on this machine) vs bench")[1]
    assert planner.count("0.5 Gb/s") == 2 and "serialised" not in planner and "largest |error|" in planner
    assert link_png.stat().st_size > 10_000


def test_recompute_in_the_bench_sends_the_forward_twice(tmp_path):
    out_json = tmp_path / "bench.json"
    command.main(["--modes", "csbp", "--seq-lengths", "128", "--block-size", "16", "--num-layers", "2",
                  "--hidden-size", "64", "--steps", "1", "--warmup", "0", "--recompute-granularity", "full",
                  "--json", str(out_json)])
    record, = json.loads(out_json.read_text())
    beta = 2 * 2 * (64 // 4) * 4
    assert record["recompute"] == "full"
    assert record["bytes_sent_per_rank"] == 2 * 3 * 128 // 2 * beta  # 2 layers x (gather twice + reduce-scatter)


def test_link_flags_are_checked(capsys):
    with pytest.raises(SystemExit):
        cli.parse_args(["--link-gbps", "10,fast"])
    assert "--link-gbps" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.parse_args(["--link-gbps", "0"])
    assert "--link-gbps" in capsys.readouterr().err


def test_transport_memory_reports_both_transports(tmp_path, capsys):
    out_json = tmp_path / "bench.json"
    command.main(["--modes", "csbp,bp", "--seq-lengths", "128", "--block-size", "16", "--num-layers", "1",
                  "--hidden-size", "64", "--steps", "1", "--warmup", "0", "--transport-memory",
                  "--json", str(out_json)])
    records = {r["mode"]: r for r in json.loads(out_json.read_text())}
    keys = {f"{transport}_{part}_peak_bytes" for transport in ("collective", "streaming")
            for part in ("step", "attention_forward", "attention")}  # the keys the JSON holds
    assert all(records["csbp"][key] > 0 for key in keys)
    assert not keys & set(records["bp"])  # no ring, nothing to compare
    table = capsys.readouterr().out.split("transport memory")[1]
    assert "collective" in table and "streaming" in table


def test_logits_memory_at_vocabulary_151936_falls_by_more_than_the_logits(tmp_path, capsys):
    """CSBP2 on 2 ranks, hidden 64, L = 512, vocabulary 151,936, fp32: a step's exact peak tensor bytes with the LM
    head's logits whole and as the tiled linear cross-entropy (tiles of 64 of the rank's 256 noisy rows). The whole
    head holds the logits and their masked copy (MASK's column is on the rank); the tiled one a tile."""
    out_json = tmp_path / "bench.json"
    command.main(["--modes", "csbp", "--seq-lengths", "512", "--nproc", "2", "--hidden-size", "64", "--vocab-size",
                  "151936", "--steps", "1", "--warmup", "0", "--logits-memory", "--cross-entropy-tile-rows", "64",
                  "--json", str(out_json)])
    (record,) = json.loads(out_json.read_text())
    logits, whole, tiled = (record[key] for key in ("logits_bytes", "whole_logits_step_peak_bytes",
                                                    "tiled_logits_step_peak_bytes"))
    print(f"logits {logits:,} B; a step's peak: whole {whole:,} B, tiled {tiled:,} B, saved {whole - tiled:,} B")
    assert logits == 256 * 151936 * 4
    assert whole - tiled >= logits
    table = capsys.readouterr().out.split("logits memory")[1]
    assert f"{logits / 2 ** 20:.1f}" in table and f"{(whole - tiled) / 2 ** 20:.1f}" in table


def test_the_planner_gets_the_least_disturbed_of_two_calibrations():
    before = RankCalibration(linear_gflops=80.0, attention_gflops=30.0, gather_bytes=4096, gather_s=0.02,
                             latency_s=2e-4)
    after = RankCalibration(linear_gflops=40.0, attention_gflops=60.0, gather_bytes=4096, gather_s=0.01,
                            latency_s=3e-4)
    assert before.least_disturbed(after) == RankCalibration(linear_gflops=80.0, attention_gflops=60.0,
                                                            gather_bytes=4096, gather_s=0.01, latency_s=2e-4)


def test_kernel_efficiency_on_one_thread_and_its_prefix_part():
    threads = torch.get_num_threads()
    e = kernel_check.kernel_efficiency(512, 64, heads=4, head_dim=16, repeats=1)
    assert torch.get_num_threads() == threads and e.threads == 1
    for fraction in (e.forward_fraction, e.train_fraction, e.prefix_forward_fraction):
        assert 0 < fraction < 10, e
    assert e.load_average >= 0 and e.record()["mode"] == "kernel"


def test_load_warning_and_held_out_calibration_file(tmp_path, capsys):
    assert report.load_warning(1.9, cores=2) is None
    assert "load average 2.5 above the 2 cores" in report.load_warning(2.5, cores=2)
    empty = tmp_path / "none.json"
    empty.write_text(json.dumps([{"mode": "csbp", "seq_length": 256, "link_gbps": None}]))
    with pytest.raises(SystemExit):
        cli.parse_args(["--seq-lengths", "256", "--calibrate-from", str(empty)])
    assert f"--calibrate-from {empty}: no calibration in it" in capsys.readouterr().err
    partial = tmp_path / "partial.json"
    partial.write_text(json.dumps([{"mode": "cp", "seq_length": 512, "link_gbps": None,
                                    "calibration": {"linear_gflops": 1.0}}]))
    with pytest.raises(SystemExit):
        cli.parse_args(["--seq-lengths", "256", "--calibrate-from", str(partial)])
    assert f"--calibrate-from {partial}: its calibration is not a bench's" in capsys.readouterr().err
    calibration = dict(linear_gflops=1.0, attention_gflops=0.5, gather_s=0.01, latency_s=1e-4, backend_gb_s=2.0)
    recorded = tmp_path / "calibrated.json"
    recorded.write_text(json.dumps([{"mode": "cp", "seq_length": 512, "link_gbps": None, "calibration": calibration}]))
    args = cli.parse_args(["--seq-lengths", "256", "--calibrate-from", str(recorded)])
    assert args.held_out_calibration == Calibration(**calibration, origin=f"cp L=512 of {recorded}")
    assert args.held_out_calibration.record() == calibration  # where it came from is not a measurement


MOE_BENCH = ["--modes", "csbp", "--seq-lengths", "64", "--block-size", "16", "--nproc", "2", "--num-layers", "2",
             "--hidden-size", "32", "--num-attention-heads", "4", "--num-query-groups", "2", "--vocab-size", "256",
             "--steps", "1", "--warmup", "0", "--num-experts", "4", "--moe-router-topk", "2",
             "--moe-ffn-hidden-size", "16", "--moe-shared-expert-intermediate-size", "8"]


def _moe_bench(tmp_path, *extra):
    out_json = tmp_path / "moe.json"
    command.main(MOE_BENCH + ["--json", str(out_json), *extra])
    record, = json.loads(out_json.read_text())
    return record


def _bytes_from_routing(record, rank, hidden=32):
    """By hand, from the routing the routers took: rank r's rows sent `out` (row, expert) pairs to the other EP
    rank's experts (both layers are MoE), and received `in` from it. The dispatch sends each pair's row (hidden
    fp32 values) and probability (one fp32), the combine returns each received pair's output row; the backward
    runs both exchanges in reverse: `out x (4h + 4) + in x 4h` forward, `out x 4h + in x (4h + 4)` backward."""
    other = 1 - rank
    routed = record["routed_pairs_to_ep_ranks_by_rank"]
    pairs_out = sum(layer[other] for layer in routed[rank])
    pairs_in = sum(layer[rank] for layer in routed[other])
    forward = pairs_out * (4 * hidden + 4) + pairs_in * 4 * hidden
    backward = pairs_out * 4 * hidden + pairs_in * (4 * hidden + 4)
    return forward + backward, pairs_out, pairs_in


def test_moe_all_to_all_bytes_and_expert_memory_measured_against_hand_counts(tmp_path, capsys):
    """EP2 x CSBP2 on 2 ranks, 4 experts (2 per rank), top-2, both layers MoE, fp32. Each rank routes its 32 noisy
    and 32 clean rows: 64 rows x 2 = 128 (row, expert) pairs per layer.
    * Routing forced uniform (round robin): 64 pairs per layer leave each rank and 64 arrive, so by hand
      2 layers x (64 x (4·32 + 4) + 64 x 4·32) x 2 passes = 66560 bytes per rank: measured off the collectives,
      from the routing taken, and the planner's uniform figure, all equal.
    * The trained router's own routing: measured = the count from its top-k choices (exact); the planner's
      uniform figure is not what a random router does (negative control: it differs).
    * Parameters per rank, counted off the model, equal the planner's: dense 2 layers x (QKV 32 x 64 + projection
      32 x 32 + 2 norms x 32 + router 4 x 32 + shared expert 2 x 32 x 8 = 3776) + embedding and output layer
      2 x 256 x 32 + final norm 32 = 23968; expert 2 layers x 2 experts x (2 x 32 x 16) = 4096. Adam's state
      (fp32 moments, 8 bytes a parameter) after a step of megatron-core's distributed optimizer: the experts'
      whole on each rank (expert-DP 1: 4096 x 8), the dense parameters' sharded over the 2 CP ranks (the two
      shards add up to 23968 x 8)."""
    uniform = _moe_bench(tmp_path, "--expert-model-parallel-size", "2", "--moe-round-robin-routing")
    table = capsys.readouterr().out
    assert uniform["ep_group_by_rank"] == [[0, 1], [0, 1]] and uniform["ep_rank_by_rank"] == [0, 1]
    for rank in range(2):
        by_routing, pairs_out, pairs_in = _bytes_from_routing(uniform, rank)
        assert (pairs_out, pairs_in) == (2 * 64, 2 * 64)
        assert uniform["all_to_all_bytes_by_rank"][rank] == by_routing == 66560
        assert uniform["all_to_all_calls_by_rank"][rank] == 2 * 6  # per layer: rows, probabilities, combine; x 2
        assert uniform["routed_rows_by_rank"][rank] == [64, 64]
    planned = experts.planned_experts(cli.parse_args(MOE_BENCH + ["--expert-model-parallel-size", "2"]), modes.CSBP,
                                      uniform["seq_length"])
    assert planned.all_to_all_bytes == 66560
    assert uniform["dense_parameters_by_rank"] == [23968, 23968] == [planned.dense_params_per_rank] * 2
    assert uniform["expert_parameters_by_rank"] == [4096, 4096] == [planned.expert_params_per_rank] * 2
    assert uniform["optimizer_expert_state_bytes_by_rank"] == [4096 * 8] * 2
    assert sum(uniform["optimizer_dense_state_bytes_by_rank"]) == 23968 * 8
    assert planned.optimizer_bytes == 23968 * 8 / 2 + 4096 * 8
    assert "experts: 4 per MoE layer, top-2, EP2, alltoall dispatcher (round robin: uniform)" in table
    assert "66,560       66,560" in table

    routed = _moe_bench(tmp_path, "--expert-model-parallel-size", "2")
    measured = routed["all_to_all_bytes_by_rank"]
    assert measured == [_bytes_from_routing(routed, rank)[0] for rank in range(2)]
    assert measured != [66560, 66560]  # negative control: the router's own choices are not uniform

    dense = _moe_bench(tmp_path, "--expert-model-parallel-size", "1")
    assert dense["all_to_all_bytes_by_rank"] == [0, 0]  # EP1: nothing leaves a rank, though every row is routed
    assert [sum(layer) for layer in dense["routed_pairs_to_ep_ranks_by_rank"][0]] == [128, 128]
    assert dense["expert_parameters_by_rank"] == [8192, 8192] and dense["dense_parameters_by_rank"] == [23968] * 2
    # EP1: expert-DP = DP x CP = 2, every parameter's state sharded over both ranks (megatron-core keeps the experts
    # with the dense parameters then)
    assert sum(dense["optimizer_dense_state_bytes_by_rank"] + dense["optimizer_expert_state_bytes_by_rank"]) \
        == (23968 + 8192) * 8


def test_moe_bench_flags_are_the_trainers_rules(capsys):
    with pytest.raises(SystemExit):
        cli.parse_args(MOE_BENCH + ["--expert-model-parallel-size", "3"])
    assert "--expert-model-parallel-size 3 does not divide --num-experts 4" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.parse_args(MOE_BENCH + ["--moe-router-topk", "5"])
    assert "--moe-router-topk 5 must be in [1, --num-experts 4]" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.parse_args(["--expert-model-parallel-size", "2"])
    assert "--expert-model-parallel-size 2 needs experts" in capsys.readouterr().err
