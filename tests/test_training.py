"""The pretraining entry point end to end: the loss falls, every parallel layout logs the same losses,
checkpoints reload into another block-parallel size, the log lines and TensorBoard scalars are right,
and the Megatron-LM path hands over our providers and flags."""

import math
import os
import re
import sys
import types

import pytest

from pretrain_runs import K, REPO, base, copy_checkpoint, run, significant, validated_args
from spawn import on_cpu_backend

pytest_plugins = ["pretrain_runs"]  # fixtures shared with the other training tests: corpus, reference_runs
LINE = re.compile(r" \[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\] iteration +(\d+)/ +(\d+) \| consumed samples: +(\d+) \| "
                  r"elapsed time per iteration \(ms\): ([\d.]+) \| tokens/s: ([\d.]+) \| TFLOP/s per rank: ([\d.e+-]+) \| "
                  r"learning rate: (\d\.\d{6}E[-+]\d\d) \| global batch size: +(\d+) \| lm loss: (\d\.\d{6}E[-+]\d\d) \| "
                  r"grad norm: ([\d.]+) \| number of skipped iterations: +(\d+) \| number of nan iterations: +(\d+) \|")


@pytest.fixture(scope="module")
def layout_runs(corpus, reference_runs):
    """The same config on 1 rank and on 2 block-parallel ranks in each mode (csbp, cp, cp-traffic, bp)."""
    runs = dict(reference_runs)
    for mode in ("cp", "cp-traffic", "bp"):
        runs[mode] = run(2, base(corpus, context_block_parallel=2, bdlm_parallel_mode=mode))
    return runs


def test_loss_falls_clearly(layout_runs):
    csbp = layout_runs["csbp"]
    losses, validation = csbp.losses, csbp.validation
    assert sorted(losses) == list(range(1, 2 * K + 1)) and sorted(validation) == [K, 2 * K], csbp.output
    start = sum(losses[i] for i in (1, 2, 3)) / 3
    print(f"first losses {start:.3f}, validation NELBO {validation[K]:.3f} -> {validation[2 * K]:.3f}")
    assert validation[2 * K] < validation[K] < start
    assert validation[2 * K] < start - 1.0, (start, validation)


def test_every_layout_logs_the_same_losses(layout_runs):
    reference = layout_runs["1 rank"]
    expected = {i: significant(v) for i, v in reference.losses.items()}
    assert sorted(expected) == list(range(1, 2 * K + 1))
    for name in ("csbp", "cp", "cp-traffic", "bp"):
        got = {i: significant(v) for i, v in layout_runs[name].losses.items()}
        assert got == expected, f"{name}: {got} != {expected}"
        got_validation = {i: significant(v) for i, v in layout_runs[name].validation.items()}
        assert got_validation == {i: significant(v) for i, v in reference.validation.items()}, name


def test_log_lines_memory_and_tensorboard(layout_runs):
    from megatron_csbp.bdlm.flops import ModelShape, bdlm_step_flops

    csbp = layout_runs["csbp"]
    lines = [m for m in (LINE.fullmatch(line) for line in csbp.output.splitlines()) if m]
    assert [int(m.group(1)) for m in lines] == list(range(1, 2 * K + 1)), csbp.output
    step_flops = bdlm_step_flops(ModelShape(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128,
                                            num_query_groups=2, swiglu=True),
                                 padded_vocab_size=384, seq_length=64, block_size=8, batch_size=4)
    for match in lines:
        iteration, milliseconds = int(match.group(1)), float(match.group(4))
        assert int(match.group(3)) == 4 * iteration and int(match.group(8)) == 4
        # The time is printed to 0.1 ms, tokens/s to 0.1, TFLOP/s to 4 significant digits: each figure must
        # lie within what the printed time allows, however fast the machine.
        slowest, fastest = (milliseconds + 0.05) / 1e3, (milliseconds - 0.05) / 1e3
        assert 4 * 64 / slowest - 0.05 <= float(match.group(5)) <= 4 * 64 / fastest + 0.05, match.group(0)
        flops_per_rank = step_flops / 2 / 1e12
        assert flops_per_rank / slowest * (1 - 5e-4) <= float(match.group(6)) <= flops_per_rank / fastest * (1 + 5e-4)
        assert match.group(11) == match.group(12) == "0"
    assert csbp.output.count(" memory (MB) | rss: ") == 2 * K
    assert re.search(r"lm loss PPL \(upper bound\): (\S+) \|", csbp.output)
    for iteration, nelbo in csbp.validation.items():
        ppl = float(re.search(rf"at iteration {iteration} \|.*PPL \(upper bound\): (\S+) \|", csbp.output).group(1))
        assert ppl == pytest.approx(math.exp(nelbo), rel=1e-5)

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(layout_runs["root"] / "tb"))
    events.Reload()
    scalars = set(events.Tags()["scalars"])
    assert {"lm loss", "learning-rate", "grad-norm", "tokens-per-second", "lm loss validation",
            "lm loss validation ppl bound", "memory/rss (MB)"} <= scalars, scalars
    logged = {e.step: e.value for e in events.Scalars("lm loss")}
    assert {i: significant(v) for i, v in logged.items()} == {i: significant(v) for i, v in csbp.losses.items()}


def test_checkpoints_reload_into_another_parallel_layout(layout_runs, tmp_path, corpus):
    """CSBP over 2 ranks -> 1 rank, 1 rank -> CSBP over 2 ranks and -> TP 2: the resumed losses are the
    uninterrupted run's (torch_dist reshards the model and optimizer). Under TP 2 the vocabulary padding
    must be asked to stay 384 (Megatron pads to a multiple of 128 x TP by default)."""
    root = layout_runs["root"]
    targets = ((1, "csbp", "csbp", {}), (2, "one", "1 rank", {"context_block_parallel": 2}),
               (2, "one", "1 rank", {"tensor_model_parallel_size": 2, "make_vocab_size_divisible_by": 64}))
    for index, (nproc, source, reference, parallel) in enumerate(targets):
        load = copy_checkpoint(str(root / source), K, str(tmp_path / f"load{index}"))
        resumed = run(nproc, base(corpus, load=load, **parallel))
        assert f"loaded checkpoint from {load} at iteration {K}" in resumed.output
        expected = {i: significant(v) for i, v in layout_runs[reference].losses.items() if i > K}
        assert {i: significant(v) for i, v in resumed.losses.items()} == expected, (source, parallel, resumed.output)
        assert significant(resumed.validation[2 * K]) == significant(layout_runs[reference].validation[2 * K])


# ------------------------------------------------------------------------------------ in-process checks
def test_providers_read_megatron_lm_globals_when_given_no_args(monkeypatch, corpus):
    """Under `pretrain()` the providers get no `args`: they read Megatron-LM's global args and tokenizer (a
    stand-in `megatron.training` here; tests/test_megatron_lm.py runs the real one)."""
    from megatron_csbp.training import providers
    from megatron_csbp.training.tokenizers import NullTokenizer

    megatron_args = validated_args(corpus, 2, context_block_parallel=2, bdlm_parallel_mode="csbp")
    fake = types.ModuleType("megatron.training")
    fake.get_args = lambda: megatron_args
    tokenizers = []
    fake.get_tokenizer = lambda: tokenizers.append(NullTokenizer(256)) or tokenizers[-1]
    monkeypatch.setitem(sys.modules, "megatron.training", fake)
    monkeypatch.setattr(providers, "is_dataset_built_on_rank", lambda vp_stage=None: True)
    run_providers = providers.RunProviders()
    run_providers.train_valid_test_datasets_provider([16, 8, 0])
    train, valid, test = run_providers.train_valid_test_datasets_provider([16, 8, 0])
    assert len(tokenizers) == 1  # the vocabulary is worked out once per run
    assert test is None and len(train) >= 16 and len(valid) >= 1
    sample = train[5]
    assert sample["tokens"].shape == (64,) and int(sample["sample_index"]) == 5
    assert isinstance(run_providers.vocabulary.tokenizer, NullTokenizer)  # Megatron-LM's, not one of ours
    assert int(sample["tokens"].max()) < run_providers.vocabulary.mask_token_id == 257
    objective = providers.objective_for(run_providers.settings, run_providers.vocabulary.mask_token_id)
    assert (objective.block_size, objective.mask_token_id, objective.antithetic_group) == (8, 257, 4)
    # Megatron-LM's args are what its checkpoints save: they record the model's vocabulary.
    assert (megatron_args.mask_token_id, megatron_args.padded_vocab_size) == (257, 384)


@on_cpu_backend
def _count_assembly(rank, world, args):
    """Trains `args` on this rank, counting how often the run's parts are built, checked and used."""
    from collections import Counter

    from megatron_csbp.bdlm import forward_step as bdlm
    from megatron_csbp.core.run_config import RunConfig
    from megatron_csbp.training import providers, tokenizers, loop as training

    counts = Counter()

    def counted(name, function):
        def wrapper(*arguments, **keywords):
            counts[name] += 1
            return function(*arguments, **keywords)
        return wrapper

    providers.build_run = counted("run", providers.build_run)
    RunConfig.layout = counted("layout", RunConfig.layout)
    tokenizers.build_tokenizer = counted("tokenizer", tokenizers.build_tokenizer)
    bdlm._check_model_matches = counted("model check", bdlm._check_model_matches)
    bdlm.BDLMForwardStep.__call__ = counted("micro-batch", bdlm.BDLMForwardStep.__call__)
    training.train(args)
    return dict(counts)


def test_the_run_is_built_once_per_run(corpus):
    """Our loop: one tokenizer, one layout, one run and one model check for all micro-batches of all
    iterations, training and validation alike (the providers share the run; nothing is rebuilt per step)."""
    from spawn import run_ranks

    args = validated_args(corpus, 1, train_iters=3, eval_interval=2, eval_iters=1)
    counts = run_ranks(_count_assembly, 1, args, timeout=300)[0]
    micro_batches = (3 + 1) * args.global_batch_size // args.micro_batch_size  # 3 training, 1 validation batch
    assert counts == {"tokenizer": 1, "layout": 1, "run": 1, "model check": 1, "micro-batch": micro_batches}, counts


def _spans(*ranges):
    return [p for start, stop in ranges for p in range(start, stop)]


# L=64, B=8, P=2, worked out by hand from docs/algorithm.md §4: dual-end pairs (0,7),(1,6) | (2,5),(3,4);
# zigzag clean chunks of 16 (C=2): r0 [0,16)+[48,64), r1 [16,48); CP: zigzag over [x_t ; x_0] in 4 chunks of 32.
EXPECTED_ROWS = {
    "csbp": [_spans((0, 8), (56, 64), (8, 16), (48, 56), (0, 16), (48, 64)),
             _spans((16, 24), (40, 48), (24, 32), (32, 40), (16, 48))],
    "cp": [_spans((0, 32), (32, 64)), _spans((32, 64), (0, 32))],
    "cp-traffic": [_spans((0, 32), (32, 64)), _spans((32, 64), (0, 32))],  # cp's rows, CSBP's kernels
    "bp": [_spans((0, 8), (56, 64), (8, 16), (48, 56), (0, 64)), _spans((16, 24), (40, 48), (24, 32), (32, 40), (0, 64))],
}


@pytest.mark.parametrize("mode,clean_shards", [("csbp", 2), ("cp", 2), ("cp-traffic", 2), ("bp", 1)])
def test_the_run_configs_layouts(corpus, mode, clean_shards):
    from megatron_csbp.core.run_config import RunConfig

    settings = RunConfig.from_args(validated_args(corpus, 2, context_block_parallel=2, bdlm_parallel_mode=mode))
    assert settings.clean_shards == clean_shards
    for rank in (0, 1):
        layout = settings.layout(rank)
        assert layout.row_positions.tolist() == EXPECTED_ROWS[mode][rank], (mode, rank)
        assert layout.masked_attention == (mode == "cp"), mode  # the field's CP: one masked call per rank


def test_the_demo_config_learns(corpus, tmp_path):
    """`make demo`'s own config (configs/tiny_cpu.yaml, CSBP over 2 ranks), on fewer iterations and shorter
    sequences: the loss falls clearly and the run ends with a checkpoint."""
    import subprocess

    from pretrain_runs import REPO, SCRIPT, TORCHRUN, Run, environment

    overrides = [f"data-path={corpus}", f"save={tmp_path}", f"load={tmp_path}", f"tensorboard-dir={tmp_path / 'tb'}",
                 "seq-length=128", "split=80,20,0", "train-iters=24", "log-interval=1", "eval-interval=12"]
    done = subprocess.run([TORCHRUN, "--standalone", "--nproc-per-node", "2", SCRIPT, "--config",
                           os.path.join(REPO, "configs", "tiny_cpu.yaml"), *overrides], cwd=REPO, env=environment(),
                          timeout=600, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert done.returncode == 0, done.stdout[-6000:]
    run = Run(done.returncode, done.stdout, 0.0)
    losses = run.losses
    assert sorted(losses) == list(range(1, 25)), done.stdout[-3000:]
    start, end = sum(losses[i] for i in (1, 2, 3)) / 3, sum(losses[i] for i in (22, 23, 24)) / 3
    print(f"demo config: lm loss {start:.3f} -> {end:.3f}, validation {run.validation}")
    assert end < start - 1.0, (start, end)
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text().strip() == "24"
