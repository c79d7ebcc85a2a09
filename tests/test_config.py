"""`--config FILE.yaml`: keys and sections, overrides and their precedence, bad files, and the shipped recipes."""

import argparse
import os
import re

import pytest

from megatron_csbp.core.rules import ConfigError
from megatron_csbp.training.arguments import validate_args
from megatron_csbp.training.flags import add_csbp_args
from megatron_csbp.training.megatron_config import lr_schedule_steps
from megatron_csbp.training.config import expand_argv, load_config, parse_args

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

GOOD = """
num-layers: 2
hidden_size: 64
num-attention-heads: 4
seq-length: 64
micro-batch-size: 1
train-iters: 10
lr: 1e-3
bf16: true
data-path: [0.25, data/a, 0.75, data/b]
save: runs/x
bdlm:
  block-size: 8
  noise-range: [0.01, 1.0]
  bdlm-objective: fast-dllm-v2
csbp:
  context-block-parallel: 2
  transport: streaming
  clean-shards: 1
"""


def write(tmp_path, text, name="run.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_yaml_keys_sections_and_types(tmp_path):
    args = parse_args(["--config", write(tmp_path, GOOD)])
    assert (args.num_layers, args.hidden_size, args.seq_length, args.lr) == (2, 64, 64, 1e-3)
    assert args.bf16 is True and args.data_path == ["0.25", "data/a", "0.75", "data/b"]
    assert (args.bdlm_block_size, args.bdlm_noise_range, args.bdlm_objective) == (8, [0.01, 1.0], "fast-dllm-v2")
    assert (args.context_block_parallel, args.context_parallel_size, args.csbp_transport) == (2, 2, "streaming")
    assert args.context_block_parallel_clean_shards == 1 and args.config.endswith("run.yaml")
    assert args.config_overridden == []


def test_precedence_yaml_then_overrides_then_flags(tmp_path):
    path = write(tmp_path, GOOD)
    args = parse_args(["--config", path, "seq-length=128", "bf16=false", "save=null", "bdlm-noise-range=0.1 0.5",
                       "--lr", "5e-4", "lr=7e-4", "--context-block-parallel", "4"])
    assert args.seq_length == 128 and args.bf16 is False and args.save is None
    assert args.bdlm_noise_range == [0.1, 0.5]
    assert args.lr == 5e-4  # an ordinary flag beats a key=value override of the same key
    assert (args.context_block_parallel, args.context_parallel_size) == (4, 4)
    assert args.config_overridden == ["bdlm-noise-range", "bf16", "context-block-parallel", "lr", "save",
                                      "seq-length"]
    # A YAML value contradicting a flag given on the command line: the command line wins, whatever the order.
    assert parse_args(["--seq-length", "256", "--config", path]).seq_length == 256
    assert parse_args(["--config=" + path, "--seq-length=32"]).seq_length == 32
    # A CLI override can turn on what the YAML leaves off; without a config, key=value still works.
    assert parse_args(["num-layers=3", "--swiglu"]).num_layers == 3


def test_overrides_are_not_confused_with_flag_values(tmp_path):
    argv = expand_argv(["--save", "runs/a=b", "--data-path", "0.5", "x", "0.5", "y", "seq-length=32"])
    assert argv == ["--seq-length", "32", "--save", "runs/a=b", "--data-path", "0.5", "x", "0.5", "y"]


@pytest.mark.parametrize("text, needles", [
    ("seq-lenght: 64\n", ["unknown key 'seq-lenght'", "did you mean 'seq-length'"]),
    ("bdlm:\n  blok-size: 8\n", ["unknown key 'bdlm.blok-size'", "did you mean 'bdlm-block-size'"]),
    ("zzzzzz: 1\n", ["unknown key 'zzzzzz'", "--help"]),
    ("- num-layers: 2\n", ["expected a mapping of flag names", "got a list"]),
    ("just a string\n", ["expected a mapping", "got a str"]),
    ("num-layers: [2, 4]\n", ["'num-layers' expects a number (int), got list"]),
    ("num-layers: two\n", ["'num-layers' expects int, got 'two'"]),
    ("num-layers: true\n", ["'num-layers' expects a number (int), got bool"]),
    ("lr: {a: 1}\n", ["'lr' expects a number (float), got dict"]),
    ("bdlm-noise-range: [0.1, 0.2, 0.3]\n", ["'bdlm-noise-range' expects a list of 2 values"]),
    ("bf16: yes please\n", ["'bf16' is a switch; give true or false"]),
    ("calculate-per-token-loss: false\n", ["always on"]),
    ("bdlm-objective: bd4lm\n", ["'bdlm-objective' is 'bd4lm'; choose one of bd3lm, fast-dllm-v2"]),
    ("seq-length: 64\nseq_length: 128\n", ["'seq-length' is given twice"]),
    ("num-layers: [2\n", ["not valid YAML"]),
])
def test_bad_yaml_is_refused_with_the_file_name(tmp_path, text, needles):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as caught:
        parse_args(["--config", path])
    message = str(caught.value)
    assert message.startswith(path) and "\n" not in message
    for needle in needles:
        assert needle in message


def test_bad_config_flag_and_override(tmp_path):
    with pytest.raises(ConfigError, match="--config .*missing.yaml: no such file"):
        parse_args(["--config", str(tmp_path / "missing.yaml")])
    path = write(tmp_path, "num-layers: 2\n")
    with pytest.raises(ConfigError, match="given 2 times"):
        parse_args(["--config", path, "--config", path])
    with pytest.raises(ConfigError, match="unknown key 'seq-lenth' .*did you mean 'seq-length'"):
        parse_args(["--config", path, "seq-lenth=64"])
    with pytest.raises(ConfigError, match="'num-layers' expects int, got 'x'"):
        parse_args(["num-layers=x"])
    assert parse_args(["--config", write(tmp_path, "", "empty.yaml")]).num_layers is None


def test_expand_argv_with_a_megatron_lm_style_parser(tmp_path):
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq-length", type=int)
    parser.add_argument("--context-parallel-size", type=int, default=1)
    parser.add_argument("--distributed-timeout-minutes", type=int, default=10)
    add_csbp_args(parser)
    path = write(tmp_path, "seq-length: 64\ncsbp:\n  context-block-parallel: 2\n")
    args = parser.parse_args(expand_argv(["--config", path, "seq-length=128"], parser))
    assert (args.seq_length, args.context_parallel_size, args.config) == (128, 2, path)
    with pytest.raises(ConfigError, match="unknown key 'num-layers'"):
        expand_argv(["--config", write(tmp_path, "num-layers: 2\n", "other.yaml")], parser)


@pytest.mark.parametrize("text, value", [
    ("moe-layer-freq: 2\n", 2),
    ("moe-layer-freq: '2'\n", 2),
    ("moe-layer-freq: [1, 0, 1, 1]\n", [1, 0, 1, 1]),
    ("moe-layer-freq: '[1,0,1,1]'\n", [1, 0, 1, 1]),
    ("moe-layer-freq: ([0]+[1]*3)*2\n", [0, 1, 1, 1, 0, 1, 1, 1]),
    ("moe_layer_freq: '[0]*2 + [1]*2'\n", [0, 0, 1, 1]),
])
def test_moe_layer_freq_in_a_yaml_as_a_list_a_string_or_an_int(tmp_path, value, text):
    path = write(tmp_path, text)
    assert parse_args(["--config", path]).moe_layer_freq == value
    assert parse_args([f"moe-layer-freq={text.split(': ', 1)[1].strip()}"]).moe_layer_freq == value  # as an override


@pytest.mark.parametrize("text, why", [
    ("moe-layer-freq: '[1,0'\n", "the '[' at character 1 is not closed: the end where ']' should be"),
    ("moe-layer-freq: '[1]*10**12'\n", "it builds the number 1000000000000, more than 10000"),
    ("moe-layer-freq: [1, 2]\n", "layer 1 is 2; each layer is 0 (dense) or 1 (MoE)"),
    ("moe-layer-freq: [[1], [0]]\n", "the list at character 1 holds a list; it holds one 0 or 1 per layer"),
    ("moe-layer-freq: [1, 0.5]\n", "'.' at character 6 is not part of a pattern (digits , [ ] ( ) + *)"),
    ("moe-layer-freq: true\n", "not an integer, and no list"),
    ("moe-layer-freq: {a: 1}\n", "not an integer, and no list"),
    ("moe-layer-freq: 1.5\n", "not an integer, and no list"),
])
def test_a_bad_moe_layer_freq_in_a_yaml_is_one_line_naming_the_file(tmp_path, text, why):
    from megatron_csbp.training.layer_pattern import HINT

    path = write(tmp_path, text)
    for argv in (["--config", path], ["--config", path, "--num-layers", "2"]):
        with pytest.raises(ConfigError) as caught:
            parse_args(argv)
        assert re.fullmatch(rf"{re.escape(path)}: 'moe-layer-freq' .*: {re.escape(why)}; {re.escape(HINT)}",
                            str(caught.value)), str(caught.value)


def test_a_pattern_flag_is_read_before_a_megatron_lm_style_type_sees_it(tmp_path):
    """Megatron-LM's `moe_freq_type` evaluates its text: `expand_argv` reads the value first (from the command line,
    either spelling, a YAML or an override) and hands the parser only the plain list, or refuses in one line."""
    seen = []

    def moe_freq_type(text):  # Megatron-LM's type's name, recording what it is given
        seen.append(text)
        return text

    parser = argparse.ArgumentParser()
    parser.add_argument("--moe-layer-freq", type=moe_freq_type, default=1)
    parser.add_argument("--num-layers", type=int)
    add_csbp_args(parser)
    for argv in (["--moe-layer-freq", "([1]*1+[0])*2"], ["--moe-layer-freq=[1, 0]*2", "--num-layers", "4"],
                 ["--config", write(tmp_path, "moe-layer-freq: ([1]+[0])*2\n")], ["moe-layer-freq=[1,0]+[1,0]"]):
        assert parser.parse_args(expand_argv(argv, parser)).moe_layer_freq == "[1,0,1,0]", argv
    assert set(seen) == {"[1,0,1,0]"}  # only ever the plain list (a YAML value is also type-checked on loading)
    seen.clear()
    for argv in (["--moe-layer-freq", "[1]*10**12"], ["--moe-layer-freq=[1,0"], ["moe-layer-freq=[1]*10**12"]):
        with pytest.raises(ConfigError, match="moe-layer-freq"):
            expand_argv(argv, parser)
    assert seen == []  # the type never saw the refused texts
    assert expand_argv(["--moe-layer-freq"], parser) == ["--moe-layer-freq"]  # a missing value: argparse says so


@pytest.mark.parametrize("name, world, gpu", [("tiny_cpu", 2, False), ("demo_sequences", 2, False),
                                              ("nemotron_labs_diffusion_3b_256k", 16, True),
                                              ("nemotron_labs_diffusion_8b_256k", 16, True),
                                              ("nemotron_labs_diffusion_14b_256k", 16, True),
                                              ("qwen3_8_27b_fast_dllm_v2_256k", 16, True),
                                              ("diffusion_gemma_26b_a4b_256k", 16, True)])
def test_shipped_configs_parse_and_validate(name, world, gpu):
    path = os.path.join(REPO, "configs", f"{name}.yaml")
    assert load_config(path)
    args = validate_args(parse_args(["--config", path]), world, on_accelerator=gpu, check_paths=False)
    assert args.context_block_parallel >= 2 and args.bdlm_parallel_mode == "csbp"
    corpus = "sequences" if name == "demo_sequences" else "stdlib"  # prepare_data.py --corpus
    assert args.data_path == [f"data/{corpus}_bytes_text_document"]
    if gpu:
        assert args.bf16 and args.recompute_granularity == "full" and args.use_distributed_optimizer
        with pytest.raises(ConfigError, match="--bf16 needs a GPU"):
            validate_args(parse_args(["--config", path]), world, on_accelerator=False, check_paths=False)
    else:
        assert args.num_layers * 12 * args.hidden_size ** 2 < 10_000_000  # a few million parameters
    with pytest.raises(ConfigError, match="does not divide the world size"):
        validate_args(parse_args(["--config", path]), world + 1, on_accelerator=gpu, check_paths=False)
    # A short run of any shipped config keeps a valid schedule: its warmup is a fraction of the decay length.
    short = validate_args(parse_args(["--config", path, "train-iters=3"]), world, on_accelerator=gpu,
                          check_paths=False)
    warmup, decay = lr_schedule_steps(short)
    assert decay == 3 * short.global_batch_size and 0 < warmup < decay


def test_the_qwen_recipe_is_turbo_dllms_qwen3_8_run():
    """Turbo-dLLM's qwen3-8-27b-fast-dllm-v2-256k recipe on the public Qwen3.5/3.6-27B shape: 64 layers, every 4th
    gated full attention (24 heads / 4 KV of 256, rotary on a quarter), the others Gated DeltaNet (16 QK / 48 V
    heads of 128), Fast-dLLM v2 with block 256 at 256K, TP2 x CSBP8 on 16 GPUs, our loop (Gated DeltaNet beside
    block parallelism is refused under Megatron-LM's)."""
    from megatron_csbp.core.run_config import RunConfig

    path = os.path.join(REPO, "configs", "qwen3_8_27b_fast_dllm_v2_256k.yaml")
    args = validate_args(parse_args(["--config", path]), 16, on_accelerator=True, check_paths=False)
    assert (args.num_layers, args.hidden_size, args.ffn_hidden_size, args.seq_length) == (64, 5120, 17408, 262144)
    assert (args.bdlm_objective, args.bdlm_block_size, args.tensor_model_parallel_size,
            args.context_block_parallel, args.training_loop) == ("fast-dllm-v2", 256, 2, 8, "megatron-core")
    assert args.attention_output_gate and args.apply_layernorm_1p and args.rotary_percent == 0.25
    linear = RunConfig.from_args(args, 16).shape.linear
    assert (linear.num_linear_layers, linear.num_value_heads, linear.num_key_heads) == (48, 48, 16)
    assert linear.pattern[:4] == (1, 1, 1, 0)


def test_the_diffusion_gemma_recipe_is_the_released_26b_a4b():
    """Turbo-dLLM's diffusiongemma-26b-sft-256k recipe on google/diffusiongemma-26B-A4B-it's shape: 30 layers of 2816,
    16 query heads; sliding layers (window 1024 keys: 1023 before) 8 K/V heads of 256, every 6th layer global with 2
    K/V heads of 512; Gemma 4's MoE (128 experts of 704, top 8, a dense 2112 beside) with EP2; DiffusionGemma's
    objective (self-conditioning 0.5, AR co-loss 1.0, token-causal clean stream), CSBP8 on 16 GPUs."""
    from megatron_csbp.core.run_config import RunConfig
    from megatron_csbp.core.windows import GLOBAL, Sliding

    path = os.path.join(REPO, "configs", "diffusion_gemma_26b_a4b_256k.yaml")
    args = validate_args(parse_args(["--config", path, "expert-model-parallel-size=2"]), 16, on_accelerator=True,
                         check_paths=False)  # EP2, the paper's, given at launch as the config says
    run = RunConfig.from_args(args, 16)
    shape = run.shape
    assert (shape.num_layers, shape.hidden_size, shape.num_attention_heads, shape.num_query_groups,
            shape.kv_channels) == (30, 2816, 16, 8, 256)
    assert (shape.gemma4_attention.global_kv_channels, shape.gemma4_attention.global_query_groups) == (512, 2)
    assert run.layer_windows == ((Sliding(1023),) * 5 + (GLOBAL,)) * 5
    assert (shape.moe.num_experts, shape.moe.topk, shape.moe.ffn_hidden_size, shape.moe.shared_expert_ffn_hidden_size,
            shape.moe.num_moe_layers, shape.moe.gemma4) == (128, 8, 704, 2112, 30, True)
    assert (run.objective.name, run.block_size, run.self_conditioning_probability, run.ar_loss_weight,
            run.final_logit_softcapping, run.scale_embeddings) == ("diffusion-gemma", 256, 0.5, 1.0, 30.0, True)
    assert (run.block_parallel_size, run.expert_parallel_size, run.data_parallel_size, run.global_batch_size,
            run.logits_tile_rows is not None) == (8, 2, 2, 2, True)


def test_warmup_is_iterations_or_a_fraction_as_in_megatron_lm():
    def steps(*argv):
        args = validate_args(parse_args(["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                                         "--seq-length", "64", "--micro-batch-size", "2", "--global-batch-size", "4",
                                         "--lr", "1e-3", "--train-iters", "10", "--data-path", "x", *argv]), 1,
                             check_paths=False)
        return lr_schedule_steps(args)

    assert steps("--lr-warmup-iters", "3") == (12, 40)
    assert steps("--lr-warmup-fraction", "0.25") == (10.0, 40)  # not rounded to iterations, as Megatron-LM
    assert steps("--lr-warmup-fraction", "0.1", "--lr-decay-iters", "20") == (8.0, 80)
    for argv, message in [(("--lr-warmup-fraction", "0.1", "--lr-warmup-iters", "2"), "are exclusive"),
                          (("--lr-warmup-fraction", "1.0"), "must be in [0, 1)"),
                          (("--lr-warmup-iters", "10"), "shorten the warmup or give it as --lr-warmup-fraction")]:
        with pytest.raises(ConfigError, match=re.escape(message)):
            steps(*argv)


def test_the_paper_recipes_are_nemotron_labs_diffusion():
    """Megatron-Bridge's Nemotron-Labs-Diffusion: a token-causal clean stream with the AR co-loss (weights 1.0 and
    0.3, block 64), YaRN x16 from 16K with Llama 4 query scaling, at the paper's 256K layouts."""
    for size, layers, P in (("3b", 26, 4), ("8b", 34, 4), ("14b", 40, 8)):
        args = parse_args(["--config", os.path.join(REPO, "configs", f"nemotron_labs_diffusion_{size}_256k.yaml")])
        assert (args.num_layers, args.seq_length, args.context_block_parallel, args.bdlm_block_size) == \
            (layers, 262144, P, 64), size
        assert (args.bdlm_clean_attention, args.bdlm_ar_loss_weight, args.bdlm_diffusion_loss_weight) == \
            ("token-causal", 1.0, 0.3), size
        assert (args.position_embedding_type, args.yarn_rotary_scaling_factor, args.llama_4_scaling_beta) == \
            ("yarn", 16, 0.1), size
