"""lm-evaluation-harness on our checkpoints, through lm-eval's real command line (`python -m megatron_csbp.harness`)
with local tasks (JSON files written here, nothing downloaded): a model trained briefly on the sequences corpus
(`scripts/prepare_data.py --corpus sequences`) picks the next word of a run of months, weekdays, planets or
colours among four far above chance, the same model untrained (one step at learning rate 0: the initial weights)
at chance; `generate_until` answers what `scripts/generate_bdlm.py` prints for the same greedy settings; the two
NELBO estimators agree (and a biased one does not), and a continuation's score does not depend on the padding
or the batch it ran in. Under tensor parallelism (2 ranks through `python -m megatron_csbp.torchrun -m
megatron_csbp.harness`) the same tasks give the 1-rank answers, and only rank 0 writes them. Every bad input
(model_args, lm-eval's options, a task or its data, --output_path, a model call larger than the memory) is one
line with exit status 2 before the model loads, and a save that fails on a full disk saves nothing.
"""

import ast
import dataclasses
import json
import os
import random
import subprocess
import sys
import time

import pytest

from megatron_csbp.tools import prepare_data
from pretrain_runs import REPO, SCRIPT, environment
from spawn import run_ranks

GENERATE = os.path.join(REPO, "scripts", "generate_bdlm.py")
CHOICES = 4  # the right next word and three other words of the same run: chance is 1/4
CHANCE_BAND = 0.15  # untrained accuracy within 0.25 +- 0.15 (about 3 standard errors over 80 questions)
# The demo's config on one rank, smaller and at L = 64 so that ~300 steps (~30 s) learn the runs.
SMALL = ["context-block-parallel=1", "num-layers=2", "hidden-size=64", "ffn-hidden-size=192", "seq-length=64",
         "eval-interval=1000", "log-interval=50", "lr=5e-3"]
GEN_PROMPTS = ["january february march", "monday tuesday", "mercury venus earth", "red orange"]
GEN_STOPS = ["\n", "y", "nn"]  # byte-level: "y" and "nn" cut some of the samples short
GEN_TOKENS = 24


def _run(command, timeout=300):
    done = subprocess.run(command, cwd=REPO, env=environment({"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}),
                          timeout=timeout, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return done


def _ok(command, timeout=300):
    done = _run(command, timeout)
    assert done.returncode == 0, f"exit status {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    return done


def _questions(count: int, seed: int = 0) -> list:
    """Three consecutive words of a run, the next word among `CHOICES` words of that run (order shuffled)."""
    runs = prepare_data.SEQUENCES
    generator = random.Random(seed)
    questions = []
    for index in range(count):
        words = runs[sorted(runs)[index % len(runs)]].split()
        start = generator.randrange(len(words))
        right = words[(start + 3) % len(words)]
        choices = generator.sample([word for word in words if word != right], CHOICES - 1) + [right]
        generator.shuffle(choices)
        questions.append({"context": " ".join(words[(start + k) % len(words)] for k in range(3)),
                          "choices": choices, "answer": choices.index(right)})
    return questions


def _write_tasks(folder) -> None:
    """Three local tasks: multiple choice (loglikelihood), perplexity (loglikelihood_rolling), generation."""
    folder.mkdir()
    (folder / "next_word.json").write_text(json.dumps(_questions(80)))
    runs = prepare_data.sequence_documents(count=6, seed=7)
    (folder / "texts.json").write_text(json.dumps([{"text": text} for text in runs]))
    (folder / "prompts.json").write_text(json.dumps([{"context": prompt} for prompt in GEN_PROMPTS]))
    common = "dataset_path: json\ntest_split: test\ndataset_kwargs:\n  data_files:\n    test: {file}\n"
    (folder / "next_word.yaml").write_text(
        "task: csbp_next_word\n" + common.format(file=folder / "next_word.json")
        + "output_type: multiple_choice\ndoc_to_text: \"{{context}}\"\ndoc_to_choice: \"{{choices}}\"\n"
          "doc_to_target: answer\nmetric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n")
    (folder / "texts.yaml").write_text(
        "task: csbp_texts\n" + common.format(file=folder / "texts.json")
        + "output_type: loglikelihood_rolling\ndoc_to_text: \"\"\ndoc_to_target: \"{{text}}\"\n"
          "metric_list:\n  - metric: bits_per_byte\n    aggregation: bits_per_byte\n    higher_is_better: false\n")
    (folder / "prompts.yaml").write_text(
        "task: csbp_prompts\n" + common.format(file=folder / "prompts.json")
        + "output_type: generate_until\ndoc_to_text: \"{{context}}\"\ndoc_to_target: \"\"\n"
          f"generation_kwargs:\n  until: {json.dumps(GEN_STOPS)}\n  max_gen_toks: {GEN_TOKENS}\n  do_sample: false\n"
          "metric_list:\n  - metric: exact_match\n    aggregation: mean\n    higher_is_better: true\n")


def _config(root) -> list:
    return ["--config", os.path.join(REPO, "configs", "demo_sequences.yaml"), f"data-path={root / 'sequences'}",
            f"tensorboard-dir={root / 'tensorboard'}", *SMALL]


@pytest.fixture(scope="module")
def harness_root(tmp_path_factory):
    """The sequences corpus, the local tasks, and the model untrained: the demo's config and seed, one step at
    learning rate 0 (the weights stay the initial ones; pretrain_bdlm.py refuses train-iters=0)."""
    root = tmp_path_factory.mktemp("harness")
    assert prepare_data.main(["--corpus", "sequences", "--output-prefix", str(root / "sequences")]) == 0
    _ok([sys.executable, SCRIPT, *_config(root), f"save={root / 'untrained'}", f"load={root / 'untrained'}",
         "train-iters=1", "save-interval=1", "lr=0", "min-lr=0"])
    _write_tasks(root / "tasks")
    return root


@pytest.fixture(scope="module")
def harness_runs(harness_root):
    """`harness_root` and the same model trained 300 steps on the corpus."""
    root = harness_root
    _ok([sys.executable, SCRIPT, *_config(root), f"save={root / 'trained'}", f"load={root / 'trained'}",
         "train-iters=300", "save-interval=300"])
    return root


def _harness(root, load, tasks, *model_args, output=None):
    command = [sys.executable, "-m", "megatron_csbp.harness", "--model", "megatron_csbp", "--model_args",
               ",".join([f"load={load}", *model_args]), "--tasks", tasks, "--include_path", str(root / "tasks"),
               "--batch_size", "16"]
    if output is not None:
        command += ["--output_path", str(output), "--log_samples"]
    return command


def _results(output) -> dict:
    files = [os.path.join(folder, name) for folder, _, names in os.walk(output) for name in names
             if name.startswith("results") and name.endswith(".json")]
    assert len(files) == 1, files
    with open(files[0]) as handle:
        return json.load(handle)["results"]


def _samples(output, task) -> list:
    files = [os.path.join(folder, name) for folder, _, names in os.walk(output) for name in names
             if name.startswith(f"samples_{task}") and name.endswith(".jsonl")]
    assert len(files) == 1, files
    with open(files[0]) as handle:
        return [json.loads(line) for line in handle]


@pytest.fixture(scope="module")
def evaluations(harness_runs):
    """lm-eval's command line on both models, `--log_samples` kept: the trained one on the three tasks (with the
    greedy check), the untrained one on the two scored ones. Each start indexes lm-eval's own tasks (~10-30 s)."""
    outputs = {}
    for name, tasks, greedy in (("trained", "csbp_next_word,csbp_texts,csbp_prompts", "true"),
                                ("untrained", "csbp_next_word,csbp_texts", "false")):
        outputs[name] = harness_runs / f"results_{name}"
        started = time.time()
        done = _ok(_harness(harness_runs, harness_runs / name, tasks, "mc_samples=8", f"greedy_check={greedy}",
                            output=outputs[name]))
        assert "loglikelihood (BDLM NELBO)" in done.stderr  # the progress bar
        print(f"lm-eval on the {name} model ({tasks}): {time.time() - started:.0f} s")
    return outputs


def test_multiple_choice_far_above_chance_when_trained_and_at_chance_untrained(evaluations):
    scores = {}
    for name, output in evaluations.items():
        results = _results(output)
        scores[name] = (results["csbp_next_word"]["acc,none"], results["csbp_texts"]["bits_per_byte,none"])
    print(f"next word among {CHOICES} (chance {1 / CHOICES:.2f}): trained acc {scores['trained'][0]:.3f}, "
          f"untrained acc {scores['untrained'][0]:.3f}; NELBO bits per byte: trained {scores['trained'][1]:.3f}, "
          f"untrained {scores['untrained'][1]:.3f}")
    assert scores["trained"][0] >= 0.8, scores
    assert abs(scores["untrained"][0] - 1 / CHOICES) <= CHANCE_BAND, scores
    assert scores["trained"][1] < scores["untrained"][1] - 1, scores  # the bound of the texts, per byte
    # is_greedy: the sampler's greedy decode is at most one of the choices, and mostly the right one.
    rows = _samples(evaluations["trained"], "csbp_next_word")
    greedy = [[str(response[0][1]) == "True" for response in row["resps"]] for row in rows]
    right = sum(flags[int(row["target"])] for flags, row in zip(greedy, rows))
    print(f"is_greedy: the right choice in {right} of {len(rows)} questions")
    assert all(sum(flags) <= 1 for flags in greedy) and right >= len(rows) // 2, greedy


def test_generate_until_answers_what_the_generate_script_prints(harness_runs, evaluations):
    answers = {row["doc"]["context"]: row["resps"][0][0] for row in _samples(evaluations["trained"], "csbp_prompts")}
    prompts = [flag for prompt in GEN_PROMPTS for flag in ("--prompt", prompt)]
    stops = [flag for stop in GEN_STOPS for flag in ("--stop", stop)]
    printed = _ok([sys.executable, GENERATE, "--load", str(harness_runs / "trained"), *prompts, *stops,
                   "--max-new-tokens", str(GEN_TOKENS), "--temperature", "0"]).stdout
    samples = [ast.literal_eval(line.split(": ", 1)[1]) for line in printed.splitlines() if line.startswith("sample ")]
    print("\n".join(f"{prompt!r} -> {answers[prompt]!r}" for prompt in GEN_PROMPTS))
    assert [answers[prompt] for prompt in GEN_PROMPTS] == samples
    assert any(sample.strip() for sample in samples) and not any(stop in sample for sample in samples
                                                                 for stop in GEN_STOPS)


def _in_process(rank, world_size, load):
    """The model from Python (as `lm_eval.simple_evaluate` makes it): estimator agreement, padding, refusals."""
    import torch

    from megatron_csbp.tools.harness import MegatronCSBPLM
    from megatron_csbp.core.rules import ConfigError

    refusals = {}
    for arguments in ({"tensor_parallel_size": 2}, {"estimator": "median"}, {"mc_sample": 4}, {"strategy": "best"}):
        try:
            MegatronCSBPLM(load=load, **arguments)
        except ConfigError as error:
            refusals[str(arguments)] = str(error)
    lm = MegatronCSBPLM(load=load, batch_size=3)
    pairs = [lm.encode_pair("january february march", " april"), lm.encode_pair("mercury venus", " earth mars"),
             lm.encode_pair("red orange yellow green blue indigo violet red", " orange yellow green blue indigo")]
    draws = 512
    estimates = {name: lm.nelbo_samples(pairs, estimator=name, samples=draws) for name in ("inverse-t", "count")}
    trained = lm.run_config
    lm.run_config = dataclasses.replace(trained, loss_weighting="unit")  # negative control: the masked tokens' CE
    estimates["unweighted"] = lm.nelbo_samples(pairs, estimator="inverse-t", samples=draws)  # without 1/t: no NELBO
    lm.run_config = trained
    summary = {name: [(float(e.mean()), float(e.std() / draws ** 0.5)) for e in values]
               for name, values in estimates.items()}
    # Padding and batching: alone, in batches of other lengths, and with the padding after the last block the
    # letter 'x' instead of MASK, a request scores the same.
    lone = [lm.nelbo_samples([pair], samples=16)[0] for pair in pairs]
    batched = lm.nelbo_samples(pairs[::-1] + [lm.encode_pair("a", " b")], samples=16)[:3][::-1]
    padded = lm.nelbo_samples(pairs, samples=16, padding_id=ord("x"))
    longer = lm.nelbo_samples([lm.encode_pair("january february march april", " april")], samples=16)[0]
    padding = max(float((a - b).abs().max() / a.abs().max()) for a, b in zip(lone, batched + padded))
    control = float((longer - lone[0]).abs().max() / lone[0].abs().max())
    # The rows are the objective's: BDLMObjective.rows with the same noise lays out the same ids, labels, weights.
    from megatron_csbp.bdlm.objective import BDLMObjective, Noise

    generator = torch.Generator().manual_seed(3)
    L, B = lm.seq_length, lm.block_size
    tokens = torch.randint(0, 256, (L,), generator=generator)
    t = torch.rand(1, L // B, generator=generator, dtype=torch.float64).clamp(min=0.05)
    masked = torch.rand(1, L, generator=generator, dtype=torch.float64) < t.repeat_interleave(B, dim=1)

    class GivenNoise(BDLMObjective):
        def noise(self, sample_index, seq_length):
            return Noise(t, masked)

    expected = GivenNoise(block_size=B, mask_token_id=lm.mask_token_id).rows(tokens.unsqueeze(0), [0], lm.layout)
    weight = torch.where(masked, 1.0 / t.repeat_interleave(B, dim=1), 0.0)
    got = lm.request_rows(tokens.tolist(), 0, masked, weight)
    same_rows = (torch.equal(got[0], expected.input_ids.cpu()) and torch.equal(got[1], expected.labels.cpu())
                 and torch.allclose(got[2].float(), expected.loss_weights.cpu()))
    lm.run_config = dataclasses.replace(lm.run_config, objective="fast-dllm-v2", loss_weighting=None)
    try:
        lm.nelbo_samples(pairs[:1])
    except ConfigError as error:
        refusals["fast-dllm-v2"] = str(error)
    assert torch.isfinite(torch.stack(lone)).all()
    # The loss as a tiled linear cross-entropy (config= a YAML turning it on) scores the same (a second model: the
    # first one's parallel state is replaced, so this comes last).
    tiled_config = os.path.join(os.path.dirname(load), "tiled_cross_entropy.yaml")
    with open(tiled_config, "w", encoding="utf-8") as handle:
        handle.write("cross-entropy-loss-fusion: true\ncross-entropy-tile-rows: 7\n")
    tiled_lm = MegatronCSBPLM(load=load, batch_size=3, config=tiled_config)
    tiled = (tiled_lm.model.logits_tile_rows,
             max(float((score - tiled_lm.nelbo_samples([pair], samples=16)[0]).abs().max() / score.abs().max())
                 for score, pair in zip(lone, pairs)))
    # A final-logit softcap reaches the scoring model (`RunConfig.model_ends`, as training builds it): one far
    # above every logit scores as none, a tight one does not.
    capped = {}
    for cap in (1e6, 1.0):
        cap_config = os.path.join(os.path.dirname(load), f"softcap_{cap:g}.yaml")
        with open(cap_config, "w", encoding="utf-8") as handle:
            handle.write(f"final-logit-softcapping: {cap}\n")
        capped_lm = MegatronCSBPLM(load=load, batch_size=3, config=cap_config)
        capped[cap] = max(float((score - capped_lm.nelbo_samples([pair], samples=16)[0]).abs().max()
                                / score.abs().max()) for score, pair in zip(lone, pairs))
    return summary, padding, control, refusals, same_rows, tiled, capped


def test_estimators_agree_scores_do_not_depend_on_padding_and_rows_are_the_objectives(harness_runs):
    summary, padding, control, refusals, same_rows, tiled, capped = run_ranks(
        _in_process, 1, str(harness_runs / "trained"), timeout=300)[0]
    for index in range(3):
        (a, sa), (b, sb), (u, su) = (summary[name][index] for name in ("inverse-t", "count", "unweighted"))
        gap, unweighted = abs(a - b) / (sa ** 2 + sb ** 2) ** 0.5, abs(a - u) / (sa ** 2 + su ** 2) ** 0.5
        print(f"request {index}: NELBO inverse-t {a:.3f} +- {sa:.3f}, count {b:.3f} +- {sb:.3f} ({gap:.1f} s.e. apart);"
              f" unweighted (biased control) {u:.3f} ({unweighted:.1f} s.e. away)")
        assert gap <= 4, summary
        assert unweighted > 4, summary
    print(f"padding/batching: largest relative difference {padding:.1e}; a different context: {control:.1e}; the "
          f"tiled cross-entropy (tiles of {tiled[0]} rows): {tiled[1]:.1e}")
    assert padding <= 1e-5 and control > 1e-2
    assert tiled[0] == 7 and tiled[1] <= 1e-5
    print(f"softcap 1e6: {capped[1e6]:.1e} from the uncapped scores; softcap 1 (control): {capped[1.0]:.1e}")
    assert capped[1e6] <= 1e-5 and capped[1.0] > 1e-2
    assert same_rows, "the harness's [x_t ; x_0] rows differ from BDLMObjective.rows under the same noise"
    messages = {"{'tensor_parallel_size': 2}": "this launch has 1 rank:", "{'estimator': 'median'}": "inverse-t, count",
                "{'mc_sample': 4}": "did you mean mc_samples", "{'strategy': 'best'}": "strategy",
                "fast-dllm-v2": "bdlm-objective: bd3lm"}
    for case, message in messages.items():
        assert case in refusals and message in refusals[case] and "\n" not in refusals[case], (case, refusals)


def _write_bad_tasks(folder) -> None:
    """Local tasks lm-eval cannot load: data that is not JSON, a missing data file, no documents, documents
    without the field the task reads, a group over the first, a dataset on the Hub (offline here)."""
    folder.mkdir()
    (folder / "not_json.json").write_text("this is not JSON {\n")
    (folder / "empty.json").write_text("[]\n")
    (folder / "no_field.json").write_text(json.dumps([{"context": "red orange"}]))
    task = ("task: {name}\n{data}test_split: test\noutput_type: multiple_choice\ndoc_to_text: \"{{{{context}}}}\"\n"
            "doc_to_choice: \"{{{{choices}}}}\"\ndoc_to_target: 0\nmetric_list:\n  - metric: acc\n")
    local = "dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {file}\n"
    for name, file in (("not_json", "not_json.json"), ("missing", "missing.json"), ("empty", "empty.json"),
                       ("no_field", "no_field.json")):
        (folder / f"{name}.yaml").write_text(task.format(name=f"csbp_{name}",
                                                         data=local.format(file=folder / file)))
    (folder / "hub.yaml").write_text(task.format(name="csbp_hub", data="dataset_path: no_such_org/no_such_data\n"))
    (folder / "group.yaml").write_text("group: csbp_bad_group\ntask:\n  - csbp_not_json\n")


HARNESS = "python -m megatron_csbp.harness"


def _refusal(status: int, stderr: str) -> str:
    """The refusal's line, checked to be the only error line, after no traceback, with exit status 2."""
    assert status == 2 and "Traceback" not in stderr, f"exit {status}:\n{stderr[-3000:]}"
    lines = stderr.strip().splitlines()
    errors = [line for line in lines if line.startswith(f"{HARNESS}: error: ")]
    assert len(errors) == 1 and lines[-1] == errors[0], lines[-5:]
    return errors[0][len(f"{HARNESS}: error: "):]


def test_bad_input_is_one_line_before_the_model_loads(harness_root, tmp_path, monkeypatch, capsys):
    """lm-eval's command line with one bad input each: exit status 2, one line naming what is wrong, no
    traceback, nothing written. Those found in lm-eval's configuration come before the checkpoint is even read
    (no `verified` line), the tasks are loaded (and refused) before it too, and the model call's size once the
    checkpoint's arguments are read, before the model is built. Some run as users run them (a process each),
    the rest through the same `main(argv)` in this process, where building the model would raise."""
    import lm_eval.utils

    from megatron_csbp.tools import harness
    from megatron_csbp.training import loops

    load, root = harness_root / "untrained", harness_root
    _write_bad_tasks(tmp_path / "bad_tasks")
    file = tmp_path / "a_file"
    file.write_text("keep me")
    include = ["--include_path", str(tmp_path / "bad_tasks")]
    cases = {  # name: (command, the refusal (exact, or its start when it ends with '...'), checkpoint read, spawn)
        "model_args": (_harness(root, load, "csbp_next_word", "mc_samples=abc"),
                       "model_args: mc_samples=abc: expected an integer >= 1", False, True),
        "data not JSON": (_harness(root, load, "csbp_not_json")[:-4] + include + ["--output_path", str(tmp_path)],
                          f"--tasks csbp_not_json (task file {tmp_path}/bad_tasks/not_json.yaml; data {tmp_path}/"
                          f"bad_tasks/not_json.json): lm-eval cannot load it: DatasetGenerationError: ...", False,
                          True),
        "Hub dataset offline": (_harness(root, load, "csbp_hub")[:-4] + include,
                                f"--tasks csbp_hub (task file {tmp_path}/bad_tasks/hub.yaml; dataset "
                                f"no_such_org/no_such_data): lm-eval cannot load it: ...", False, True),
        "model call": (_harness(root, load, "csbp_next_word", f"mc_samples={10 ** 9}"),
                       f"model_args: mc_samples={10 ** 9} with --batch_size 16: a model call scores "
                       f"16,000,000,000 rows of 128 positions, about ...", True, True),
        "tensor_parallel_size": (_harness(root, load, "csbp_next_word", "tensor_parallel_size=2"),
                                 "model_args: tensor_parallel_size=2 but this launch has 1 rank: ...", False, False),
        "no checkpoint": (_harness(root, tmp_path / "no_run", "csbp_next_word"),
                          f"model_args: load={tmp_path / 'no_run'}: no such directory; give the --save directory "
                          f"of a training run", False, False),
        "lm-eval's options": (_harness(root, load, "csbp_next_word") + ["--log_samples"],
                              "lm-eval's options: ValueError: Specify --output_path if providing --log_samples or "
                              "--predict_only", False, False),
        "output file": (_harness(root, load, "csbp_next_word") + ["--output_path", str(file)],
                        f"--output_path {file} is a file; give a directory (lm-eval writes its results under it) "
                        f"or a name ending .json (written beside it as NAME_<date>.json)", False, False),
        "no config file": (_harness(root, load, "csbp_next_word", f"config={tmp_path / 'no.yaml'}"),
                           f"model_args: config={tmp_path / 'no.yaml'}: no such file; give a training YAML", False,
                           False),
        "negative limit": (_harness(root, load, "csbp_next_word") + ["--limit", "-5"],  # lm-eval: after the model
                           "--limit -5.0: give a number of documents >= 1, or a fraction of them in (0, 1)", False,
                           False),
        "no include path": (_harness(root, load, "csbp_next_word")[:-4] + ["--include_path", str(tmp_path / "no")],
                            f"--include_path {tmp_path / 'no'}: no such file or directory; give the folder of your "
                            f"task YAMLs", False, False),
        "unknown task": (_harness(root, load, "csbp_no_such_task"),
                         f"--tasks csbp_no_such_task: ValueError: Tasks not found: csbp_no_such_task; lm-eval's "
                         f"tasks: {HARNESS} ls tasks (with --include_path DIR for tasks of your own)", False, False),
        "gen_kwargs": (_harness(root, load, "csbp_prompts") + ["--gen_kwargs", "max_gen_toks=abc"],
                       "gen_kwargs of --tasks csbp_prompts: max_gen_toks=abc: expected an integer >= 1", False, False),
    }

    def building(*args, **kwargs):
        raise AssertionError("the model is being built")

    monkeypatch.setattr(loops, "init_distributed", building)
    monkeypatch.setattr(lm_eval.utils, "_LOGGING_CONFIGURED", True)  # its logs to pytest's, not to a handler here
    monkeypatch.setattr(sys, "argv", list(sys.argv))  # main() sets lm-eval's
    for name, (command, expected, read, spawn) in cases.items():
        started = time.time()
        if spawn:
            done = _run(command)
            status, stderr, stdout = done.returncode, done.stderr, done.stdout
        else:
            status = harness.main(command[3:])
            captured = capsys.readouterr()
            stderr, stdout = captured.err, captured.out
        line = _refusal(status, stderr)
        print(f"{name}: {time.time() - started:.0f} s: {line}")
        assert line == expected or expected.endswith("...") and line.startswith(expected[:-3]), (name, line)
        assert (" verified " in stdout) == read, (name, stdout[-2000:])  # the checkpoint was read
    assert sorted(os.listdir(tmp_path)) == ["a_file", "bad_tasks"] and file.read_text() == "keep me"


@pytest.fixture
def small_disk(tmp_path):
    """A 1200 KiB tmpfs: room for a results file (the 1 MiB bound), not for samples of long documents. Needs
    root (mount); tests/test_refusals.py covers the same paths with a patched disk and files."""
    mount = tmp_path / "small_disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1200k", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here ({done.stderr.decode().strip()})")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def test_a_save_that_fails_on_a_full_disk_is_one_line_and_saves_nothing(harness_root, small_disk, tmp_path):
    """lm-eval logs a failed write as a warning and exits 0; here its samples (30 documents of ~15 kB, each in
    the samples four times) fill the disk after the results fit: one line, exit status 2, nothing left there."""
    words = prepare_data.SEQUENCES["months"].split()
    folder = tmp_path / "long_task"
    folder.mkdir()
    documents = [{"context": " ".join(words[(i + k) % len(words)] for k in range(2000)),
                  "choices": ["a", "b", "c", "d"], "answer": 0} for i in range(30)]
    (folder / "long.json").write_text(json.dumps(documents))
    (folder / "long.yaml").write_text(
        f"task: csbp_long\ndataset_path: json\ntest_split: test\ndataset_kwargs:\n  data_files:\n    test: "
        f"{folder / 'long.json'}\noutput_type: multiple_choice\ndoc_to_text: \"{{{{context}}}}\"\ndoc_to_choice: "
        f"\"{{{{choices}}}}\"\ndoc_to_target: answer\nmetric_list:\n  - metric: acc\n")
    output = small_disk / "results"
    command = _harness(harness_root, harness_root / "untrained", "csbp_long", "mc_samples=2", "greedy_check=false")
    done = _run(command[:-4] + ["--include_path", str(folder), "--output_path", str(output), "--log_samples"])
    assert _refusal(done.returncode, done.stderr) == (
        f"--output_path {output}: lm-eval could not write its output (the samples of csbp_long are missing or "
        f"incomplete; its warning above says why); nothing was saved there")
    assert "Could not save sample results" in done.stderr and "csbp_long" in done.stdout  # it ran, then failed
    assert os.listdir(small_disk) == []


def test_task_and_data_errors_name_the_task_and_its_files(harness_root, tmp_path):
    """lm-eval's and `datasets`' own errors while loading a task become one line naming the task, its YAML and
    its data files (a group's failing member, not the group); good tasks load into the objects lm-eval runs."""
    from lm_eval.api.task import Task
    from lm_eval.tasks import TaskManager

    from megatron_csbp.core.rules import ConfigError
    from megatron_csbp.tools.lm_eval_inputs import load_tasks

    folder = tmp_path / "bad_tasks"
    _write_bad_tasks(folder)
    manager = TaskManager(include_path=[str(harness_root / "tasks"), str(folder)], include_defaults=False)
    cases = {"csbp_not_json": ("csbp_not_json", "not_json.json", "JSON parse error"),
             "csbp_missing": ("csbp_missing", "missing.json", f"FileNotFoundError: Unable to find '{folder}/missing"),
             "csbp_empty": ("csbp_empty", "empty.json", "corresponds to no data"),
             "csbp_no_field": ("csbp_no_field", "no_field.json", "UndefinedError: 'choices' is undefined"),
             "csbp_bad_group": ("csbp_not_json", "not_json.json", "JSON parse error")}
    for asked, (named, data, why) in cases.items():
        with pytest.raises(ConfigError) as caught:
            load_tasks(manager, ["csbp_next_word", asked])
        message = str(caught.value)
        print(message)
        assert message.startswith(f"--tasks {named} (task file {folder}/{named[5:]}.yaml; data {folder}/{data}): "
                                  f"lm-eval cannot load it: ") and "\n" not in message, message
        assert why in message and message.endswith("; fix the task or its data, or leave it out"), message
    items = load_tasks(manager, ["csbp_next_word", "csbp_texts"])  # control
    assert [item.task_name for item in items] == ["csbp_next_word", "csbp_texts"]
    assert all(isinstance(item, Task) for item in items) and len(items[0].eval_docs) == 80


def test_resource_bounds_refuse_before_the_model_is_built(harness_root, monkeypatch):
    """A model call's rows (`--batch_size x mc_samples`) and decoding to `max_gen_toks` are bounded by the
    device's memory once the checkpoint's arguments are read, before the process group and the model exist;
    the defaults fit (control: the build then starts)."""
    from megatron_csbp.core.rules import ConfigError
    from megatron_csbp.tools import harness
    from megatron_csbp.training import loops

    class Building(Exception):
        pass

    def building(*args, **kwargs):
        raise Building()

    monkeypatch.setattr(loops, "init_distributed", building)  # the first step of building the model
    monkeypatch.setenv("WORLD_SIZE", "1")
    load = str(harness_root / "untrained")
    for arguments, start in (({"mc_samples": 10 ** 9}, f"model_args: mc_samples={10 ** 9} with --batch_size 8: "
                                                       f"a model call scores 8,000,000,000 rows of 128 positions, "
                                                       f"about "),
                             ({"max_gen_toks": 10 ** 12}, f"model_args: max_gen_toks={10 ** 12}: decoding 8 prompts "
                                                          f"to 1,000,000,000,008 positions needs ")):
        with pytest.raises(ConfigError) as caught:
            harness.MegatronCSBPLM(load=load, **arguments)
        assert str(caught.value).startswith(start) and "GiB this device has; lower " in str(caught.value), caught.value
    with pytest.raises(Building):
        harness.MegatronCSBPLM(load=load, batch_size=16, mc_samples=8)


LAUNCHER = [sys.executable, "-m", "megatron_csbp.torchrun", "--standalone", "--nproc-per-node", "2"]


def test_two_tensor_parallel_ranks_answer_as_one_rank(harness_runs, evaluations):
    """TP2 (each rank a shard of both models, lm-eval in lockstep on both) against the 1-rank run of `evaluations`
    with the same model_args: the same accuracy, the same is_greedy flags, loglikelihoods within 1e-5 relative
    (the shards sum their partial products in another order), identical generated text; one results file and
    one printed table (rank 0's)."""
    output = harness_runs / "results_tp2"
    command = _harness(harness_runs, harness_runs / "trained", "csbp_next_word,csbp_prompts", "mc_samples=8",
                       "greedy_check=true", "tensor_parallel_size=2", output=output)
    started = time.time()
    done = _ok(LAUNCHER + command[1:], timeout=900)
    print(f"lm-eval under TP2 (csbp_next_word,csbp_prompts): {time.time() - started:.0f} s")
    assert done.stdout.count("megatron_csbp (") == 1 and done.stderr.count("loglikelihood (BDLM NELBO)") >= 1
    one, two = _results(evaluations["trained"]), _results(output)
    print(f"accuracy: 1 rank {one['csbp_next_word']['acc,none']:.4f}, TP2 {two['csbp_next_word']['acc,none']:.4f}")
    assert two["csbp_next_word"]["acc,none"] == one["csbp_next_word"]["acc,none"]
    rows = {name: {row["doc_id"]: row for row in _samples(folder, "csbp_next_word")}
            for name, folder in (("one", evaluations["trained"]), ("two", output))}
    assert rows["one"].keys() == rows["two"].keys() and rows["one"]
    gaps = []
    for doc, row in rows["one"].items():
        answers = zip((r[0] for r in row["resps"]), (r[0] for r in rows["two"][doc]["resps"]), strict=True)
        for (a, greedy_a), (b, greedy_b) in answers:
            gaps.append(abs(float(a) - float(b)) / abs(float(a)))
            assert str(greedy_a) == str(greedy_b), (doc, row["resps"], rows["two"][doc]["resps"])
    print(f"loglikelihood: {len(gaps)} values, largest relative difference TP2 vs 1 rank {max(gaps):.1e}")
    assert max(gaps) <= 1e-5
    texts = [{row["doc"]["context"]: row["resps"][0][0] for row in _samples(folder, "csbp_prompts")}
             for folder in (evaluations["trained"], output)]
    print("\n".join(f"{prompt!r} -> 1 rank {texts[0][prompt]!r}, TP2 {texts[1][prompt]!r}" for prompt in GEN_PROMPTS))
    assert texts[0] == texts[1] and len(texts[0]) == len(GEN_PROMPTS)


def test_a_world_size_other_than_tensor_parallel_size_is_refused_in_one_line(harness_root):
    done = _run(LAUNCHER + _harness(harness_root, harness_root / "untrained", "csbp_next_word")[1:])
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert lines[-1] == ("python -m megatron_csbp.harness: error: model_args: tensor_parallel_size=1 but this launch "
                         "has 2 ranks: launch exactly tensor_parallel_size ranks (python -m megatron_csbp.torchrun "
                         "--standalone --nproc-per-node 1 -m megatron_csbp.harness ...)"), lines[-3:]
    assert sum("error:" in line for line in lines) == 1, lines  # rank 0's line only
