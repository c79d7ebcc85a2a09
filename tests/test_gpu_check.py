"""scripts/gpu_check.{sh,py} (`megatron_csbp.tools.gpu_check`) on the CPU: the parts that run without a GPU (CPU kernels; FlexKernels'
forward in eager flex, and its whole forward/backward code around a dense stand-in for the fused kernel;
a tiny training step), its refusals, the JSON summary and the shell wrapper's timeout.
The GPU numbers themselves come only from a GPU run."""

import functools
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_csbp.tools import gpu_check

ROOT = Path(__file__).resolve().parent.parent
SCRIPT, SHELL = ROOT / "scripts" / "gpu_check.py", ROOT / "scripts" / "gpu_check.sh"

TINY_CHECK = ["--check-seq-lengths", "64", "--check-block-size", "8", "--check-batch", "2", "--check-heads", "4",
              "--check-kv-heads", "2", "--check-head-dim", "16"]
TINY_BENCH = ["--bench-seq-length", "256", "--bench-block-size", "16", "--bench-heads", "4", "--bench-kv-heads", "2",
              "--bench-head-dim", "16", "--bench-iters", "2"]
TINY_KERNELS = ["--kernel-seq-lengths", "256", "--kernel-ranks", "2", "--kernel-block-size", "16"]
TINY_DELTA = ["--delta-tokens", "80", "--delta-heads", "2", "--delta-key-dim", "16", "--delta-value-dim", "8"]
TINY_TRAIN = ["--train-layers", "2", "--train-hidden-size", "64", "--train-heads", "4", "--train-query-groups", "2",
              "--train-ffn-hidden-size", "128", "--train-vocab-size", "128", "--train-seq-length", "64",
              "--train-block-size", "8", "--train-steps", "2", "--train-spec", "local"]
FP32 = ["--check-dtypes", "fp32", "--bench-dtype", "fp32", "--train-dtype", "fp32"]
CPU = torch.device("cpu")


needs_no_accelerator = pytest.mark.skipif(torch.accelerator.is_available(), reason="this machine has an accelerator")


@functools.lru_cache(maxsize=1)
def path_without_torch() -> str:
    """PATH without any folder whose `python`/`python3` imports torch: a script that reaches for "the"
    Python on PATH instead of the one it is given then fails here, as on a fresh CI machine."""
    kept = []
    for folder in os.environ.get("PATH", "").split(os.pathsep):
        pythons = [os.path.join(folder, name) for name in ("python", "python3")
                   if os.access(os.path.join(folder, name), os.X_OK)]
        if not any(subprocess.run([python, "-c", "import torch"], capture_output=True).returncode == 0
                   for python in pythons):
            kept.append(folder)
    return os.pathsep.join(kept)


def _run(command, out_dir, **env):
    """The script under the suite's interpreter (PYTHON), with no torch-carrying Python left on PATH."""
    environment = dict(os.environ, OUT=str(out_dir), OMP_NUM_THREADS="1", PYTHON=sys.executable,
                       PATH=path_without_torch(), **env)
    return subprocess.run(command, cwd=ROOT, env=environment, capture_output=True, text=True, timeout=400)


def test_path_without_torch_really_has_none():
    """The negative control's premise: on the stripped PATH no `python` or `python3` imports torch."""
    for name in ("python", "python3"):
        found = shutil.which(name, path=path_without_torch())
        if found:
            assert subprocess.run([found, "-c", "import torch"], capture_output=True).returncode != 0, found


def test_defaults_are_the_single_gpu_check_and_bad_flags_are_refused(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("OUT", str(tmp_path))
    args = gpu_check.parse_args([])
    assert args.json == str(tmp_path / "gpu_check.json")
    assert args.sections == ["correctness", "throughput", "kernels", "gated-delta", "train"] and args.check_dtypes == ["fp32", "bf16"]
    assert args.kernel_seq_lengths == [32768, 65536, 131072] and args.kernel_ranks == 8
    assert args.check_seq_lengths == [1024, 4096] and args.check_block_size == 64
    assert (args.bench_seq_length, args.bench_heads, args.bench_kv_heads, args.bench_head_dim) == (32768, 32, 8, 128)
    assert (args.train_layers, args.train_hidden_size, args.train_heads, args.train_query_groups,
            args.train_ffn_hidden_size, args.train_seq_length) == (16, 2048, 16, 8, 5632, 8192)
    for argv, flag in [(["--sections", "correctness,speed"], "--sections"),
                       (["--check-dtypes", "fp16"], "--check-dtypes"),
                       (["--check-seq-lengths", "1000"], "--check-seq-lengths"),
                       (["--bench-heads", "6", "--bench-kv-heads", "4"], "--bench-heads"),
                       (["--train-hidden-size", "1000"], "--train-hidden-size"),
                       (["--kernel-seq-lengths", "1000"], "--kernel-seq-lengths")]:
        with pytest.raises(SystemExit):
            gpu_check.parse_args(argv)
        assert flag in capsys.readouterr().err


def test_pair_and_flop_counts_match_the_counted_masks():
    from megatron_csbp.bdlm.flops import bdlm_attention_pairs

    for seq_length, block in [(64, 8), (96, 32)]:
        assert bdlm_attention_pairs(seq_length, block) == int(gpu_check.bdlm_mask(seq_length, block, CPU).sum())
        assert gpu_check.causal_pairs(2 * seq_length) == int(gpu_check.causal_mask(seq_length, CPU).sum())
    # Model FLOPs, the trainer's convention (megatron_csbp.core.rules): backward = 2 x forward.
    assert gpu_check.attention_flops(10, heads=3, head_dim=8, batch=2) == (4 * 8 * 60, 8 * 8 * 60)


class _WrongScale:
    """CPU kernels whose noisy block-diagonal part and masked call use a slightly wrong softmax scale."""

    def __init__(self):
        from megatron_csbp.core.kernels import CPUKernels

        self.inner = CPUKernels()

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def block_diagonal_forward(self, q, k, v, block_size, scale):
        return self.inner.block_diagonal_forward(q, k, v, block_size, scale * 1.01)

    def masked_forward(self, q, k, v, plan, scale):
        return self.inner.masked_forward(q, k, v, plan, scale * 1.01)


class _NaNs(_WrongScale):
    def block_diagonal_forward(self, q, k, v, block_size, scale):
        out, lse = self.inner.block_diagonal_forward(q, k, v, block_size, scale)
        return out * float("nan"), lse

    def masked_forward(self, q, k, v, plan, scale):
        out, lse = self.inner.masked_forward(q, k, v, plan, scale)
        return out * float("nan"), lse


class _Broken:
    def plan(self, *args, **options):  # the op plans first (ops.ring_plan), then the kernel fails
        return None

    def masked_plan(self, *args, **options):
        return None

    def block_diagonal_forward(self, *args):
        raise RuntimeError("kernel exploded")

    prefix_forward = prefix_backward = masked_forward = masked_backward = block_diagonal_forward


def test_correctness_section_fails_on_a_wrong_kernel_and_keeps_going():
    args = gpu_check.parse_args(["--allow-cpu", "--check-dtypes", "fp32"] + TINY_CHECK)
    variants = [("right", None, True), ("wrong", _WrongScale(), True), ("nan", _NaNs(), True),
                ("broken", _Broken(), False)]
    records = []
    gpu_check.correctness(args, CPU, records, variants)
    assert [r["mode"] for r in records] == ["csbp", "cp"] * 4  # each variant: CSBP's kernels, cp's masked call
    for mode in ("csbp", "cp"):
        right, wrong, nan, broken = (r for r in records if r["mode"] == mode)
        assert right["passed"] and max(right["errors"].values()) < 1e-6
        assert not wrong["passed"] and wrong["errors"]["out"] > 1e-4
        assert not nan["passed"] and math.isnan(nan["errors"]["out"])
        assert not broken["passed"] and "kernel exploded" in broken["error"]


def test_bf16_correctness_on_the_cpu_kernels_and_eager_flex():
    args = gpu_check.parse_args(["--allow-cpu", "--check-dtypes", "bf16"] + TINY_CHECK)
    records = []
    gpu_check.correctness(args, CPU, records)
    failures = [gpu_check._correctness_line(r) for r in records if not r["passed"]]
    assert len(records) == 6 and not failures, failures


@needs_no_accelerator
def test_refuses_to_run_without_an_accelerator(tmp_path):
    result = _run([sys.executable, str(SCRIPT)], tmp_path)
    assert result.returncode == 2 and "--allow-cpu" in result.stderr
    assert not (tmp_path / "gpu_check.json").exists()


def test_shell_script_bounds_the_run_with_a_timeout(tmp_path):
    assert os.access(SHELL, os.X_OK)
    result = _run([str(SHELL), "--allow-cpu"], tmp_path, GPU_CHECK_TIMEOUT_S="1")
    assert result.returncode == 124  # timeout's status: the check was stopped, not left running


@needs_no_accelerator
def test_every_section_runs_on_the_cpu_through_the_shell_script(tmp_path):
    out_dir = tmp_path / "out"
    result = _run([str(SHELL), "--allow-cpu"] + TINY_CHECK + TINY_BENCH + TINY_KERNELS + TINY_DELTA + TINY_TRAIN + FP32,
                  out_dir)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "gpu_check summary" in result.stdout and "overall: PASSED" in result.stdout
    summary = json.loads((out_dir / "gpu_check.json").read_text())
    assert summary["complete"] and summary["passed"] and summary["device"] == "cpu"
    sections = summary["sections"]
    assert list(sections) == ["correctness", "throughput", "kernels", "gated-delta", "train"]
    assert all(s["status"] == "passed" and s["error"] is None and s["elapsed_s"] > 0 for s in sections.values())
    (delta,) = sections["gated-delta"]["records"]
    assert delta["kernel"] == "torch" and delta["tokens"] == 80  # fla runs only on a GPU
    assert set(delta["errors"]) == {"out", "state", "dq", "dk", "dv", "dg", "dbeta", "dinitial_state"}
    assert max(delta["errors"].values()) <= 1e-5 and delta["negative_control_error"] > 0.1

    by_mode = {mode: [r for r in sections["correctness"]["records"] if r["mode"] == mode] for mode in ("csbp", "cp")}
    assert [len(cases) for cases in by_mode.values()] == [3, 3]  # CSBP's two kernels and cp's one masked call
    for cpu_case, flex_case, stand_in_case in by_mode.values():
        _check_correctness_cases(cpu_case, flex_case, stand_in_case)

    kernel_records = sections["kernels"]["records"]
    assert [(r["mode"], r["kind"]) for r in kernel_records] == [("csbp", "dense"), ("csbp", "prefix"), ("cp", "masked"),
                                                                ("cp-traffic", "dense"), ("cp-traffic", "prefix")]
    for r in kernel_records:
        assert r["forward_s"] > 0 and r["backward_s"] > 0 and r["forward_pairs_per_s"] > 0
        assert r["computed_pairs_per_head"] >= r["real_pairs_per_head"] > 0
    masked, = (r for r in kernel_records if r["kind"] == "masked")
    assert (masked["rows"], masked["keys"]) == (256, 512)  # rank 0's 2L/P rows against all 2L keys
    assert masked["real_pairs_per_head"] == sum(r["real_pairs_per_head"] for r in kernel_records
                                                if r["mode"] == "cp-traffic")  # same rows, same real pairs
    _rest_of_the_sections(sections)


def _check_correctness_cases(cpu_case, flex_case, stand_in_case):
    assert cpu_case["kernels"] == "CPUKernels" and set(cpu_case["errors"]) == {"out", "dq", "dk", "dv"}
    assert flex_case["kernels"].startswith("FlexKernels (eager") and set(flex_case["errors"]) == {"out"}
    assert stand_in_case["kernels"].startswith("FlexKernels (dense stand-in") and len(stand_in_case["errors"]) == 4
    for case in (cpu_case, flex_case, stand_in_case):
        assert max(case["errors"].values()) <= 1e-5 and case["negative_control_error"] > 0.5
        assert case["output_dtype"] == "float32"


def _rest_of_the_sections(sections):
    from megatron_csbp.bdlm.flops import ModelShape, bdlm_attention_pairs, bdlm_step_flops

    bdlm, causal = sections["throughput"]["records"]
    assert (bdlm["attention"], causal["attention"]) == ("bdlm", "causal")
    assert bdlm["pairs_per_head"] == bdlm_attention_pairs(256, 16) and causal["pairs_per_head"] == 512 * 513 // 2
    for record in (bdlm, causal):
        assert record["forward_flops"] == 4 * 16 * record["pairs_per_head"] * 4
        assert record["backward_flops"] == 2 * record["forward_flops"] == 8 * 16 * record["pairs_per_head"] * 4
        assert record["forward_tflops"] > 0 and record["backward_tflops"] > 0 and record["first_call_s"] > 0
    assert bdlm["time_vs_causal"] > 0 and bdlm["pairs_vs_causal"] == pytest.approx(256 * 272 / (512 * 513 / 2))

    (run,) = sections["train"]["records"]
    assert run["spec"] == "local" and run["dtype"] == "fp32" and len(run["losses"]) == 3
    assert all(math.isfinite(loss) for loss in run["losses"])
    assert run["step_flops"] == bdlm_step_flops(
        ModelShape(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128, num_query_groups=2,
                   swiglu=True), padded_vocab_size=128, seq_length=64, block_size=8)
    assert run["tokens_per_s"] == pytest.approx(64 / run["step_time_s"])
    assert run["parameters"] > 0 and run["peak_memory_bytes"] is None


@needs_no_accelerator
def test_a_failing_section_is_reported_while_the_others_run(tmp_path):
    if gpu_check._transformer_engine()[0] is not None:
        pytest.skip("Transformer Engine is installed here")
    result = _run([str(SHELL), "--allow-cpu", "--sections", "train,throughput", "--train-spec", "te"]
                  + TINY_BENCH + FP32, tmp_path)
    assert result.returncode == 1
    summary = json.loads((tmp_path / "gpu_check.json").read_text())
    assert summary["complete"] and not summary["passed"]
    train, throughput = summary["sections"]["train"], summary["sections"]["throughput"]
    assert train["status"] == "failed" and "--train-spec te" in train["error"] and "Traceback" in train["error"]
    assert throughput["status"] == "passed" and len(throughput["records"]) == 2
    assert "[FAILED] train" in result.stdout and "overall: FAILED" in result.stdout


def test_the_gated_delta_check_fails_a_rule_that_drops_the_initial_state(monkeypatch, tmp_path):
    """The section's own negative control: a delta rule that ignores the state it is handed must fail it."""
    from megatron_csbp.core.kernels import gated_delta

    rule = gated_delta.chunk_rule
    monkeypatch.setattr(gated_delta, "chunk_rule", lambda *a, initial_state=None, **k: rule(*a, **k))
    summary_path = tmp_path / "gpu_check.json"
    assert gpu_check.main(["--allow-cpu", "--sections", "gated-delta", "--json", str(summary_path)] + TINY_DELTA) == 1
    (record,) = json.loads(summary_path.read_text())["sections"]["gated-delta"]["records"]
    assert not record["passed"] and record["errors"]["out"] > 1e-2
