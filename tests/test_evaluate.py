"""scripts/evaluate_bdlm.py end to end, on a tiny model trained briefly: the NELBO does not depend on the layout
(1 rank against CSBP over 2 ranks, same seed and sequences), the noise's standard error shrinks as 1/sqrt(K)
and matches the spread of the draws, the JSON holds the printed numbers, refusals are one line (exit 2), and a
different seed gives a different estimate (so the agreement between layouts is not that of a constant)."""

import json
import math
import os
import re
import statistics
import subprocess
import sys

import pytest

from pretrain_runs import REPO, TINY, base, environment, run
from spawn import on_cpu_backend

pytest_plugins = ["pretrain_runs"]  # the corpus fixture
SCRIPT = os.path.join(REPO, "scripts", "evaluate_bdlm.py")
TRAIN_ITERS = 100  # ~5 s of training: the loss is well below its start, the model far from uniform
SEQUENCES = 32
SUMMARY = re.compile(r" evaluation at iteration (\d+) \| split: (\w+) \| sequences: (\d+) \| "
                     r"noise samples per sequence: (\d+) \| lm loss value \(NELBO per token\): (\S+) \| "
                     r"standard error \(sequences\): (\S+) \| standard error \(noise\): (\S+) \| "
                     r"lm loss PPL \(upper bound\): (\S+) \| tokens/s: (\S+) \| sequences/s: (\S+) \|")
PROGRESS = re.compile(r" \[[\d :-]+\] evaluated +(\d+)/ +(\d+) sequences x noise samples "
                      r"\(noise sample (\d+)/(\d+)\) \| sequences/s: [\d.]+ \| tokens/s: [\d.]+ \|")


def evaluate(nproc: int, *flags: str, expect: int = 0) -> str:
    """The script as users run it: python for one rank, our torchrun launcher for several."""
    launcher = [sys.executable] if nproc == 1 else [sys.executable, "-m", "megatron_csbp.torchrun", "--standalone",
                                                    "--nproc-per-node", str(nproc)]
    done = subprocess.run([*launcher, SCRIPT, *map(str, flags)], cwd=REPO, env=environment(), timeout=300,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert done.returncode == expect, f"exit status {done.returncode}, expected {expect}:\n{done.stdout[-6000:]}"
    return done.stdout


@pytest.fixture(scope="module")
def training(corpus, tmp_path_factory):
    """The tiny config trained for TRAIN_ITERS iterations, saved, and validated once at the end (the split's
    first eval_iters x global batch = 8 sequences)."""
    root = tmp_path_factory.mktemp("evaluate")
    return root, run(1, base(corpus, train_iters=TRAIN_ITERS, eval_interval=TRAIN_ITERS, save=root / "run",
                             save_interval=TRAIN_ITERS, log_interval=50))


@pytest.fixture(scope="module")
def trained(training):
    return training[0]


@pytest.fixture(scope="module")
def evaluations(trained, corpus):
    """{name: (output, JSON record)}: the same sequences at seed 7 on 1 rank and CSBP2 (K=4; CSBP2 with the loss as
    a tiled linear cross-entropy), at K=16, and at seed 8 (K=4)."""
    runs = {"1 rank": (1, 7, 4, ["--tensorboard-dir", trained / "tb"]),
            "csbp2": (2, 7, 4, ["--context-block-parallel", "2", "--cross-entropy-loss-fusion",
                                "--cross-entropy-tile-rows", "5"]),
            "K=16": (1, 7, 16, []),
            "seed 8": (1, 8, 4, [])}
    results = {}
    for name, (nproc, seed, samples, extra) in runs.items():
        target = trained / f"{name.replace(' ', '_')}.json"
        output = evaluate(nproc, "--load", trained / "run", "--data-path", corpus, "--eval-sequences", SEQUENCES,
                          "--seed", seed, "--noise-samples", samples, "--log-interval", 32, "--output-json", target,
                          *extra)
        with open(target, encoding="utf-8") as handle:
            results[name] = (output, json.load(handle))
    return results


def _relative(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def test_one_rank_and_csbp2_give_the_same_nelbo(evaluations):
    one, csbp = evaluations["1 rank"][1], evaluations["csbp2"][1]
    assert one["layout"]["context_block_parallel"] == 1 and csbp["layout"]["context_block_parallel"] == 2
    assert one["layout"]["logits_tile_rows"] is None and csbp["layout"]["logits_tile_rows"] == 5
    assert csbp["layout"]["world_size"] == 2 and csbp["sequences"] == one["sequences"] == SEQUENCES
    print(f"NELBO 1 rank {one['nelbo']!r}, CSBP2 {csbp['nelbo']!r}, relative difference "
          f"{_relative(csbp['nelbo'], one['nelbo']):.1e}")
    for key in ("nelbo", "ppl", "stderr", "noise_stderr"):
        assert _relative(csbp[key], one[key]) <= 1e-5, (key, csbp[key], one[key])
    for mine, theirs in zip(csbp["nelbo_per_draw"], one["nelbo_per_draw"], strict=True):
        assert _relative(mine, theirs) <= 1e-5


def test_the_noise_standard_error_shrinks_as_one_over_root_k(evaluations):
    """The noise's standard error (of the NELBO of these sequences, over the draws) at K=4 and K=16: draws
    0..3 are the same in both runs (their seeds come from (seed, k)), and the error shrinks by sqrt(16/4) = 2,
    up to how well 32 x 3 and 32 x 15 draws estimate one variance. Independently, the spread of the 16 draws'
    own NELBOs must be what the error claims for one draw (noise_stderr x sqrt(K))."""
    four, sixteen = evaluations["1 rank"][1], evaluations["K=16"][1]
    assert sixteen["nelbo_per_draw"][:4] == pytest.approx(four["nelbo_per_draw"], rel=1e-9)
    ratio = four["noise_stderr"] / sixteen["noise_stderr"]
    spread = statistics.stdev(sixteen["nelbo_per_draw"]) / (sixteen["noise_stderr"] * math.sqrt(16))
    print(f"noise standard error K=4 {four['noise_stderr']:.4e}, K=16 {sixteen['noise_stderr']:.4e}, ratio "
          f"{ratio:.3f} (1/sqrt(K): 2); standard error over sequences K=4 {four['stderr']:.4e}, K=16 "
          f"{sixteen['stderr']:.4e}; spread of the 16 draws / claimed {spread:.3f}")
    assert 1.6 <= ratio <= 2.5, ratio
    assert 0.5 <= spread <= 2.0, spread
    # Over sequences, the error holds the noise's (over K) and the data's own spread: never below the noise's.
    assert sixteen["stderr"] >= 0.9 * sixteen["noise_stderr"] and four["stderr"] >= 0.9 * four["noise_stderr"]


def test_the_json_holds_the_printed_numbers(evaluations, trained):
    for name, (output, record) in evaluations.items():
        found = SUMMARY.findall(output)
        assert len(found) == 1, output
        (iteration, split, sequences, samples, nelbo, stderr, noise_stderr, ppl, tokens_per_second,
         sequences_per_second) = found[0]
        assert (int(iteration), split, int(sequences), int(samples)) == (
            record["iteration"], record["split"], record["sequences"], record["noise_samples"]) == (
            TRAIN_ITERS, "valid", SEQUENCES, 16 if name == "K=16" else 4), name
        for printed, key in ((nelbo, "nelbo"), (stderr, "stderr"), (noise_stderr, "noise_stderr"), (ppl, "ppl")):
            assert printed == f"{record[key]:.6E}", (name, key, printed, record[key])
        assert tokens_per_second == f"{record['tokens_per_second']:.1f}"
        assert sequences_per_second == f"{record['sequences_per_second']:.2f}"
        assert record["ppl"] == pytest.approx(math.exp(record["nelbo"]), rel=1e-12) and record["ppl_is_upper_bound"]
        assert record["tokens"] == SEQUENCES * record["noise_samples"] * 64
        assert record["tokens_per_second"] == pytest.approx(record["tokens"] / record["seconds"], rel=1e-9)
        assert "expected NELBO" in record["stderr_of"] and "these sequences" in record["noise_stderr_of"]
        progress = PROGRESS.findall(output)
        assert [int(done) for done, *_ in progress] == list(range(32, SEQUENCES * int(samples) + 1, 32)), output
    assert not [name for name in os.listdir(trained) if name.startswith(".")]  # no private temporary left
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(trained / "tb"))
    events.Reload()
    (scalar,) = events.Scalars("evaluation/nelbo")
    assert scalar.step == TRAIN_ITERS and scalar.value == pytest.approx(evaluations["1 rank"][1]["nelbo"], rel=1e-6)


def test_refusals_are_one_line_before_any_work(trained, corpus, tmp_path):
    checkpoint, existing = trained / "run", tmp_path / "earlier.json"
    existing.write_text('{"nelbo": 1.0}\n')
    cases = [
        ("--load", ["--load", tmp_path / "no_run", "--data-path", corpus]),
        ("--data-path", ["--load", checkpoint, "--data-path", tmp_path / "no_data"]),
        ("--noise-samples", ["--load", checkpoint, "--data-path", corpus, "--noise-samples", 0]),
        # each draw's NELBO is kept for the record: more draws than the memory holds (it once allocated draws x
        # sequences after loading the model)
        ("--noise-samples 1000000000000: the evaluation keeps each draw's NELBO for the record, 59,604.6 GiB, more "
         "than the", ["--load", checkpoint, "--data-path", corpus, "--noise-samples", 10 ** 12]),
        ("--output-json", ["--load", checkpoint, "--data-path", corpus, "--output-json", existing]),
        (f"--output-json {existing}/numbers.json: {existing} is not a writable directory",
         ["--load", checkpoint, "--data-path", corpus, "--output-json", existing / "numbers.json"]),
        ("--context-block-parallel", ["--load", checkpoint, "--data-path", corpus, "--context-block-parallel", 2]),
    ]
    before = existing.read_bytes()
    for flag, arguments in cases:
        output = evaluate(1, *arguments, expect=2)
        lines = output.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("evaluate_bdlm.py: error: ") and flag in lines[0], output
    assert existing.read_bytes() == before and sorted(os.listdir(tmp_path)) == ["earlier.json"]
    # Under the launcher every rank refuses; they leave together, so it is still one line and exit status 2.
    output = evaluate(2, "--load", checkpoint, "--data-path", corpus, "--tensor-model-parallel-size", 3, expect=2)
    lines = output.strip().splitlines()
    assert len(lines) == 1 and "--tensor-model-parallel-size 3 does not divide" in lines[0], output


@pytest.fixture
def small_disk(tmp_path):
    """A 64 KiB tmpfs. Needs root (mount); tests/test_refusals.py covers the same paths with a patched disk."""
    mount = tmp_path / "small_disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here ({done.stderr.decode().strip()})")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def test_a_full_disk_at_the_output_json_is_found_before_the_evaluation(trained, corpus, small_disk):
    """On a real 64 KiB disk: a record of 10^5 draws (~3 MiB) is refused before any work; a record written
    there anyway (the disk filling during the run) is one line naming the file, nothing left behind."""
    from megatron_csbp.core.rules import ConfigError
    from megatron_csbp.tools.evaluation import record_bytes, write_json

    target = small_disk / "numbers.json"
    output = evaluate(1, "--load", trained / "run", "--data-path", corpus, "--noise-samples", 10 ** 5,
                      "--output-json", target, expect=2)
    need = record_bytes(10 ** 5) / 2 ** 20
    assert output.strip().splitlines() == [f"evaluate_bdlm.py: error: --output-json {target}: {need:.1f} MiB are to "
                                           f"be written but only 0.1 MiB are free there; free space or give another "
                                           f"--output-json"], output
    with pytest.raises(ConfigError) as caught:
        write_json(str(target), {"nelbo_per_draw": [1.0] * 10 ** 5}, overwrite=False)
    assert str(caught.value) == (f"--output-json {target}: cannot write it (No space left on device); nothing was "
                                 f"written: free space there or give another file")
    assert os.listdir(small_disk) == []


def test_streamed_sums_give_the_estimate_of_all_draws_at_once():
    """`Tally` (what the evaluation keeps, draw by draw) against the two-pass formulas over the whole [K, N]
    table, on random sums with a heavy tail; a different table gives a different estimate (control)."""
    import torch

    from megatron_csbp.tools.evaluation import estimate

    generator = torch.Generator().manual_seed(0)
    sums = torch.rand(7, 11, generator=generator, dtype=torch.float64).pow(-0.5) * 40
    counts = torch.full((7, 11), 64.0, dtype=torch.float64)
    result = estimate(sums, counts)
    nelbo = sums.sum() / counts.sum()
    residual = (sums.sum(0) - nelbo * counts.sum(0)) / counts.sum(0).mean()
    assert result.nelbo == pytest.approx(nelbo.item(), rel=1e-12)
    assert result.stderr == pytest.approx((residual.std() / math.sqrt(11)).item(), rel=1e-12)
    assert result.noise_stderr == pytest.approx((sums.var(dim=0).sum() / 7).sqrt().item() / counts[0].sum().item(),
                                                rel=1e-12)
    assert result.per_draw == pytest.approx((sums.sum(1) / counts.sum(1)).tolist(), rel=1e-12)
    assert estimate(sums.flip(0) * 1.01, counts).nelbo != pytest.approx(result.nelbo, rel=1e-6)


def test_a_different_seed_changes_the_estimate(evaluations):
    """The negative control: agreement between layouts must not come from noise that ignores the seed."""
    seven, eight = evaluations["1 rank"][1], evaluations["seed 8"][1]
    assert seven["sequences"] == eight["sequences"]
    assert all(_relative(a, b) > 1e-4 for a, b in zip(eight["nelbo_per_draw"], seven["nelbo_per_draw"]))
    assert _relative(eight["nelbo"], seven["nelbo"]) > 1e-4
    # ... and both estimate the same NELBO of the same sequences, within their noise.
    combined = math.hypot(seven["noise_stderr"], eight["noise_stderr"])
    assert abs(eight["nelbo"] - seven["nelbo"]) <= 5 * combined, (seven["nelbo"], eight["nelbo"], combined)


def test_the_estimate_by_hand():
    """Two draws of three sequences of 4 tokens: the NELBO is the weighted CE sum over the tokens; the error
    over sequences is the spread of their 2-draw NELBOs (1.5, 2, 2) over sqrt(3); the noise's is the draws'
    variance per sequence (8, 0, 32), summed, over K, rooted, over the 12 tokens of one draw."""
    from megatron_csbp.tools.evaluation import draw_seed, estimate

    result = estimate([[4.0, 8.0, 12.0], [8.0, 8.0, 4.0]], [[4.0] * 3, [4.0] * 3])
    assert result.nelbo == pytest.approx(44 / 24, rel=1e-12)
    assert result.stderr == pytest.approx(statistics.stdev([1.5, 2.0, 2.0]) / math.sqrt(3), rel=1e-12)
    assert result.noise_stderr == pytest.approx(math.sqrt(40 / 2) / 12, rel=1e-12)
    assert result.per_draw == pytest.approx((2.0, 20 / 12), rel=1e-12)
    one = estimate([[4.0, 8.0]], [[4.0, 4.0]])
    assert one.noise_stderr is None and one.stderr is not None  # one draw: no noise error to estimate
    assert draw_seed(7, 0) == draw_seed(7, 0) != draw_seed(7, 1) != draw_seed(8, 1) and draw_seed(7, 3) >= 0


@on_cpu_backend
def _with_the_trainers_noise(rank, world, argv, seed, group):
    """The evaluator's NELBO with the trainer's objective: its seed, stratified over each global batch."""
    from dataclasses import replace

    from megatron_csbp.mcore import parallel_state
    from megatron_csbp.tools import evaluation

    evaluator = evaluation.Evaluator(evaluation.prepare(argv, world),
                                     lambda objective, draw: replace(objective, seed=seed, antithetic_group=group))
    try:
        return evaluator.evaluate()["nelbo"]
    finally:
        evaluator.close()
        parallel_state.destroy_model_parallel()


def test_given_the_trainers_noise_it_reproduces_the_trainers_validation(training, corpus):
    """The evaluator and Trainer.evaluate compute the same thing: on the trainer's validation sequences (the
    first 8 of the split) with the trainer's noise (seed, stratified per global batch of 4), the same NELBO."""
    from megatron_csbp.training.launch import run_ranks

    root, trained_run = training
    logged = trained_run.validation[TRAIN_ITERS]
    argv = ["--load", str(root / "run"), "--data-path", corpus, "--eval-sequences", "8", "--log-interval", "1000"]
    (nelbo,) = run_ranks(_with_the_trainers_noise, 1, argv, TINY["seed"], TINY["global_batch_size"])
    print(f"trainer's validation {logged:.6E}, evaluator with the trainer's noise {nelbo:.6E}")
    assert nelbo == pytest.approx(logged, rel=2e-6)  # the trainer prints 7 significant digits
