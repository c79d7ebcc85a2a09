"""The benchmark runs all three modes side by side and reports exact, machine-independent traffic."""

import json

import pytest

from megatron_csbp import bench
from megatron_csbp.layout import CSBPLayout


def test_rank_attention_pairs_sum_to_the_bdlm_mask():
    L, B, P = 256, 16, 4
    per_rank = [bench.rank_attention_pairs(CSBPLayout(L, B, P, P, r)) for r in range(P)]
    assert sum(per_rank) == L * L + L * B
    assert len(set(per_rank)) == 1  # dual-end blocks + zigzag clean shards: equal work per rank


def test_bad_flags_are_refused(capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(["--modes", "csbp,ring"])
    assert "--modes" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.parse_args(["--seq-lengths", "100", "--block-size", "16"])
    assert "multiple of 2 x nproc x block size = 64" in capsys.readouterr().err


def test_three_modes_side_by_side(tmp_path):
    out_json, out_png = tmp_path / "bench.json", tmp_path / "bench.png"
    bench.main(["--seq-lengths", "128", "--block-size", "16", "--num-layers", "1", "--hidden-size", "64",
                "--steps", "1", "--warmup", "0", "--json", str(out_json), "--plot", str(out_png)])
    records = {r["mode"]: r for r in json.loads(out_json.read_text())}
    assert set(records) == {"csbp", "cp", "bp"}
    for record in records.values():
        assert {"mode", "seq_length", "block_size", "nproc", "bytes_sent_per_rank", "step_time_s",
                "peak_memory_bytes", "tokens_per_s"} <= set(record)
        assert record["step_time_s"] > 0 and record["tokens_per_s"] > 0
    beta = 2 * 2 * (64 // 4) * 4  # K+V bytes per token per layer: 2 query groups x head dim 16, fp32
    assert records["cp"]["bytes_sent_per_rank"] == 4 * 128 * 1 // 2 * beta
    assert 2 * records["csbp"]["bytes_sent_per_rank"] == records["cp"]["bytes_sent_per_rank"]
    assert records["bp"]["bytes_sent_per_rank"] == 0
    # CSBP keeps only the clean K/V it gathered (L tokens) for backward; CP keeps all 2L
    assert records["csbp"]["saved_activation_bytes"] < records["cp"]["saved_activation_bytes"]
    assert records["bp"]["rows_per_rank"] > records["csbp"]["rows_per_rank"] == records["cp"]["rows_per_rank"]
    assert out_png.stat().st_size > 10_000
