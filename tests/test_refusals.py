"""Bad input never reaches a traceback: every numeric flag out of range, every unusable directory and a
--save too small for a checkpoint are one line naming the flag, exit status 2, before any work."""

import os
import subprocess
import sys

import pytest

from megatron_csbp.core.rules import ConfigError
from megatron_csbp.training.arguments import checkpoint_bytes, validate, validate_args
from megatron_csbp.training.flags import build_parser
from megatron_csbp.training.layer_pattern import HINT as PATTERN_HINT
from spawn import on_cpu_backend

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
        "--micro-batch-size", "1", "--train-iters", "10", "--lr", "1e-3", "--bdlm-block-size", "8",
        "--eval-iters", "0", "--attention-dropout", "0"]

GDN = ["--experimental-attention-variant", "gated_delta_net", "--linear-attention-freq", "2"]
# (extra flags, the refusal's exact text). `{prefix}`, `{file}` and `{tmp}` are filled in per test.
REFUSALS = [
    (["--kv-channels", "0"], "--kv-channels must be >= 1; got 0"),
    (["--ffn-hidden-size", "-1"], "--ffn-hidden-size must be >= 1; got -1"),
    (["--lr", "-1"], "--lr must be >= 0; got -1.0"),
    (["--lr", "nan"], "--lr must be >= 0; got nan"),
    (["--min-lr=-1e-4"], "--min-lr must be >= 0; got -0.0001"),
    (["--lr", "1e-4", "--min-lr", "1e-3"], "--lr 0.0001 is below --min-lr 0.001: the schedule decays from --lr "
                                           "down to --min-lr; raise --lr or lower --min-lr"),
    (["--weight-decay", "-0.1"], "--weight-decay must be >= 0; got -0.1"),
    (["--adam-beta1", "1.5"], "--adam-beta1 must be in [0, 1); got 1.5"),
    (["--adam-beta1", "-0.1"], "--adam-beta1 must be in [0, 1); got -0.1"),
    (["--adam-beta2", "1"], "--adam-beta2 must be in [0, 1); got 1.0"),
    (["--adam-eps", "0"], "--adam-eps must be > 0; got 0.0"),
    (["--clip-grad", "-1"], "--clip-grad must be >= 0 (0: no clipping); got -1.0"),
    (["--attention-dropout", "1"], "--attention-dropout must be in [0, 1); got 1.0"),
    (["--hidden-dropout", "-0.1"], "--hidden-dropout must be in [0, 1); got -0.1"),
    (["--hidden-dropout", "1.5"], "--hidden-dropout must be in [0, 1); got 1.5"),
    (["--init-method-std", "-0.02"], "--init-method-std must be >= 0; got -0.02"),
    (["--norm-epsilon", "0"], "--norm-epsilon must be > 0; got 0.0"),
    (["--rotary-percent", "0"], "--rotary-percent must be in (0, 1]; got 0.0"),
    (["--rotary-base", "0"], "--rotary-base must be >= 1; got 0"),
    (["--seed", "-1"], "--seed must be in [0, 2**32); got -1"),
    (["--seed", str(2 ** 32)], f"--seed must be in [0, 2**32); got {2 ** 32}"),
    (["--make-vocab-size-divisible-by", "0"], "--make-vocab-size-divisible-by must be >= 1; got 0"),
    (["--vocab-size", "0"], "--vocab-size must be >= 1; got 0"),
    (["--global-batch-size", "0"], "--global-batch-size must be >= 1; got 0"),
    (["--global-batch-size", "-4"], "--global-batch-size must be >= 1; got -4"),
    (["--lr-warmup-iters", "-1"], "--lr-warmup-iters must be >= 0; got -1"),
    (["--lr-decay-iters", "0"], "--lr-decay-iters must be >= 1; got 0"),
    (["--lr-decay-style", "WSD"], "--lr-decay-style WSD needs --lr-wsd-decay-iters N (the final iterations over "
                                  "which the lr anneals; --lr-wsd-decay-style picks its shape)"),
    (["--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "20"],
     "--lr-wsd-decay-iters 20 exceeds --lr-decay-iters 10 (default: --train-iters); shorten the anneal"),
    (["--save-interval", "-1"], "--save-interval must be >= 1; got -1"),
    (["--save-interval", "0"], "--save-interval must be >= 1; got 0"),
    (["--exit-interval", "-5"], "--exit-interval must be >= 1; got -5"),
    (["--exit-duration-in-mins", "-1"], "--exit-duration-in-mins must be >= 0; got -1"),
    (["--num-workers", "-1"], "--num-workers must be >= 0; got -1"),
    (["--recompute-num-layers", "0"], "--recompute-num-layers must be >= 1; got 0"),
    (["--split", "100,0,0", "--eval-iters", "2"],
     "--split '100,0,0' gives validation no share, but --eval-iters 2 asks for it: give it a share (e.g. --split "
     "98,2,0) or set --eval-iters 0"),
    (["--data-path", "nan", "{prefix}", "1", "{prefix}"],
     "--data-path: weights must be finite, >= 0 and not all 0; got [nan, 1.0]"),
    (["--save", "{file}"], "--save {file} is a file, not a directory; give a directory (it is created when missing)"),
    (["--load", "{file}"], "--load {file} is a file, not a directory; give the --save directory of a run"),
    (["--tensorboard-dir", "{file}"],
     "--tensorboard-dir {file} is a file, not a directory; give a directory (it is created when missing)"),
    (["--data-cache-path", "{file}"],
     "--data-cache-path {file} is a file, not a directory; give a directory (it is created when missing)"),
    (["--save", "{file}/checkpoints"],
     "--save {file}/checkpoints: {file} is a file, so {file}/checkpoints cannot be created; give another directory"),
    # sizes, counts and the other numbers the model, the experts and the run read
    (["--num-layers", "1000000"], "--num-layers must be <= 10000; got 1000000"),
    (["--num-experts", "4", "--moe-ffn-hidden-size", "0"], "--moe-ffn-hidden-size must be >= 1; got 0"),
    (["--num-experts", "4", "--moe-ffn-hidden-size", "-64"], "--moe-ffn-hidden-size must be >= 1; got -64"),
    (["--num-experts", "4", "--moe-shared-expert-intermediate-size", "0"],
     "--moe-shared-expert-intermediate-size must be >= 1 (leave it unset for no shared expert); got 0"),
    (["--num-experts", "-1"], "--num-experts must be >= 0 (0: no experts); got -1"),
    (["--num-experts", "4", "--moe-router-topk", "0"], "--moe-router-topk must be >= 1; got 0"),
    (["--num-experts", "4", "--moe-aux-loss-coeff", "0.01", "-1"], "--moe-aux-loss-coeff must be >= 0; got -1.0"),
    (["--num-experts", "4", "--moe-aux-loss-coeff", "nan"], "--moe-aux-loss-coeff must be >= 0; got nan"),
    (["--num-experts", "4", "--moe-aux-loss-coeff", "inf"],
     "--moe-aux-loss-coeff must be a finite number >= 0; got inf"),
    (["--num-experts", "4", "--expert-model-parallel-size", "0"], "--expert-model-parallel-size must be >= 1; got 0"),
    (["--num-experts", "4", "--expert-tensor-parallel-size", "0"], "--expert-tensor-parallel-size must be >= 1; got 0"),
    (["--rope-scaling-factor", "0"], "--rope-scaling-factor must be > 0; got 0.0"),
    (["--rope-scaling-factor", "nan"], "--rope-scaling-factor must be > 0; got nan"),
    (["--context-block-parallel", "0"], "--context-block-parallel must be >= 1; got 0"),
    (["--context-block-parallel-clean-shards", "-2"], "--context-block-parallel-clean-shards must be >= 1; got -2"),
    (["--bdlm-mask-token-id", "-1"], "--bdlm-mask-token-id must be >= 0; got -1"),
    (["--link-gbps", "-1"], "--link-gbps must be > 0; got -1.0"),
    (["--link-gbps", "1", "--link-latency-us", "inf"], "--link-latency-us must be a finite number >= 0; got inf"),
    (["--distributed-timeout-minutes", "0"], "--distributed-timeout-minutes must be in [1, 527040]; got 0"),
    (["--distributed-timeout-minutes", str(10 ** 10)],
     f"--distributed-timeout-minutes must be in [1, 527040]; got {10 ** 10}"),
    (["--lr", "inf"], "--lr must be a finite number >= 0; got inf"),
    (["--norm-epsilon", "inf"], "--norm-epsilon must be a finite number > 0; got inf"),
    (["--init-method-std", "inf"], "--init-method-std must be a finite number >= 0; got inf"),
    (["--weight-decay", "inf"], "--weight-decay must be a finite number >= 0; got inf"),
    (["--adam-eps", "inf"], "--adam-eps must be a finite number > 0; got inf"),
    (["--clip-grad", "inf"], "--clip-grad must be a finite number >= 0 (0: no clipping); got inf"),
    # --moe-layer-freq: read, never run, before any parser's type sees it
    (["--num-experts", "4", "--moe-layer-freq", "[1,0"],
     f"--moe-layer-freq '[1,0': the '[' at character 1 is not closed: the end where ']' should be; {PATTERN_HINT}"),
    (["--num-experts", "4", "--moe-layer-freq", "[1]*10**12"],
     f"--moe-layer-freq '[1]*10**12': it builds the number 1000000000000, more than 10000; {PATTERN_HINT}"),
    (["--num-experts", "4", "--moe-layer-freq=[1]*9999*9999"],
     f"--moe-layer-freq '[1]*9999*9999': it builds a list of 99980001 layers, more than 10000; {PATTERN_HINT}"),
    (["--num-experts", "4", "--moe-layer-freq", "[1,2]"],
     f"--moe-layer-freq '[1,2]': layer 1 is 2; each layer is 0 (dense) or 1 (MoE); {PATTERN_HINT}"),
    (["--num-experts", "4", "--moe-layer-freq", "[1,0,1]"],
     "--moe-layer-freq [1, 0, 1] names 3 layers, but --num-layers is 2: give one 0 (dense) or 1 (MoE) per layer, or "
     "an int N (every N-th layer MoE)"),
    (["--num-experts", "4", "--moe-layer-freq", "0"], "--moe-layer-freq must be >= 1; got 0"),
    # Gated DeltaNet hybrids: the shapes the layer cannot take, and what it cannot do yet
    (["--linear-attention-freq", "2"], "--linear-attention-freq picks the Gated DeltaNet layers, but there is no "
     "--experimental-attention-variant: give --experimental-attention-variant gated_delta_net or drop "
     "--linear-attention-freq"),
    (["--experimental-attention-variant", "gated_delta_net"], "--experimental-attention-variant gated_delta_net "
     "needs --linear-attention-freq: N (every N-th layer full attention, e.g. 4 for Qwen3.5) or one 1 (Gated "
     "DeltaNet) or 0 per layer"),
    (GDN + ["--linear-attention-freq", "[1,0,1]"], "--linear-attention-freq names 3 layers, but --num-layers is 2: "
     "give one 1 (Gated DeltaNet) or 0 (full attention) per layer, or an int N"),
    (GDN + ["--linear-attention-freq", "[1,2]"], "--linear-attention-freq '[1,2]': layer 1 is 2; each layer is 1 "
     f"(Gated DeltaNet) or 0 (full attention); {PATTERN_HINT}"),
    (GDN + ["--linear-num-key-heads", "3", "--linear-num-value-heads", "4"], "--linear-num-value-heads 4 is not a "
     "multiple of --linear-num-key-heads 3: each key head serves the same number of value heads"),
    (GDN + ["--linear-key-head-dim", "0"], "--linear-key-head-dim must be >= 1; got 0"),
    (GDN + ["--linear-conv-kernel-dim", "10"], "--bdlm-block-size 8 is shorter than the convolution's history "
     "(--linear-conv-kernel-dim 10 reads 9 earlier tokens): use a block of at least 9"),
    (GDN + ["--reset-attention-mask"], "--reset-attention-mask: Gated DeltaNet layers carry their state across a "
     "packed sample's documents (it is not reset per document yet); drop --reset-attention-mask, or train without "
     "--experimental-attention-variant"),
    (["--apply-layernorm-1p"], "--apply-layernorm-1p is taken with --normalization RMSNorm only (the zero-centred "
     "RMSNorm of Qwen3.5): give --normalization RMSNorm, or drop --apply-layernorm-1p"),
]


@pytest.fixture
def places(tmp_path):
    prefix = tmp_path / "corpus"
    for suffix in (".bin", ".idx"):
        (prefix.parent / (prefix.name + suffix)).write_bytes(b"")  # only their presence is checked up front
    file = tmp_path / "a_file"
    file.write_text("not a directory")
    return {"prefix": str(prefix), "file": str(file), "tmp": str(tmp_path)}


def _fill(values, places):
    return [value.format(**places) for value in values]


def test_every_out_of_range_flag_is_one_line_naming_it_exit_2(places, capsys):
    from megatron_csbp.training import pretrain

    for extra, message in REFUSALS:
        # Our loop, in this process: importing Megatron-LM's (where present) enables faulthandler on stderr,
        # which pytest's capture cannot give a file descriptor; tests/test_flag_table_megatron_lm.py runs its refusals.
        argv = BASE + ["--training-loop", "megatron-core", "--data-path", places["prefix"]] + _fill(extra, places)
        assert pretrain.main(argv) == 2, extra
        captured = capsys.readouterr()
        assert captured.err.strip().splitlines() == [f"pretrain_bdlm.py: error: {message.format(**places)}"], extra
        assert captured.out == "", extra
    # Negative control: the same base with no bad flag passes every check (and fills the batch size).
    args = validate_args(build_parser().parse_args(BASE + ["--data-path", places["prefix"]]), 1, on_accelerator=False)
    assert args.global_batch_size == 1


def test_a_refusal_is_exit_2_from_the_command_line_too(places):
    done = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "pretrain_bdlm.py"), *BASE,
                           "--data-path", places["prefix"], "--adam-beta1", "1.5"],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1] == "pretrain_bdlm.py: error: --adam-beta1 must be in [0, 1); got 1.5"


def test_save_needs_room_for_a_checkpoint(places, monkeypatch, capsys):
    from collections import namedtuple

    import megatron_csbp.training.arguments as arguments

    save = os.path.join(places["tmp"], "checkpoints")
    parsed = build_parser().parse_args(BASE + ["--data-path", places["prefix"], "--save", save])
    need, parameters, per_parameter = checkpoint_bytes(validate(parsed, 1, on_accelerator=False), parsed)
    assert per_parameter == 4 + 8  # fp32 weights and Adam's two moments
    usage = namedtuple("usage", "total used free")
    for free, refused, warned in ((need - 1, True, False), (need + 1, False, True), (3 * need, False, False)):
        monkeypatch.setattr(arguments.shutil, "disk_usage", lambda path, free=free: usage(10 * need, 0, free))
        parsed = build_parser().parse_args(BASE + ["--data-path", places["prefix"], "--save", save])
        sizes = (f"{free / 2**30:.2f} GiB free there; one checkpoint of this model takes about {need / 2**30:.2f} GiB "
                 f"({parameters:,} parameters x 12 bytes: weights and optimizer state)")
        if refused:
            with pytest.raises(ConfigError) as caught:
                validate_args(parsed, 1, on_accelerator=False)
            assert str(caught.value) == f"--save {save}: {sizes}; free space or give another --save"
            continue
        validate_args(parsed, 1, on_accelerator=False)
        err = capsys.readouterr().err
        assert (f"WARNING: --save {save}: {sizes}: room for one checkpoint only" in err) == warned, err


def test_a_cpu_run_bigger_than_the_machine_is_refused_before_any_work(places, monkeypatch, capsys):
    """Model sizes and micro-batches no CPU rank can hold (which used to die allocating, after the process group
    and the data were set up, or be killed by the kernel): one line naming the sizes and the machine's memory."""
    from collections import namedtuple

    import psutil

    from megatron_csbp.training import pretrain

    memory = namedtuple("memory", "total")
    monkeypatch.setattr(psutil, "virtual_memory", lambda: memory(8 << 30))
    monkeypatch.setattr(psutil, "swap_memory", lambda: memory(2 << 30))
    argv = BASE + ["--training-loop", "megatron-core", "--data-path", places["prefix"]]
    fix = ("more than this machine's 10.0 GiB of memory and swap; shrink the model (--num-layers, --hidden-size, "
           "--ffn-hidden-size, --num-experts, the vocabulary) or --micro-batch-size, or split it over more ranks")
    for extra, need in (
            (["--hidden-size", "4000000000"], "over 1,430,511,482,656.0 GiB per rank (384,000,001,648,000,000,000 "
                                              "fp32 parameters over 1 model-parallel ranks, and a layer's input: "
                                              "--micro-batch-size 1 x 128 rows x --hidden-size 4000000000)"),
            (["--num-experts", "100000000", "--moe-ffn-hidden-size", "64"],
             "over 6,247.3 GiB per rank (1,677,000,058,496 fp32 parameters over 1 model-parallel ranks, and a "
             "layer's input: --micro-batch-size 1 x 128 rows x --hidden-size 64)"),
            (["--make-vocab-size-divisible-by", "1000000000"],
             "over 238.4 GiB per rank (64,000,100,096 fp32 parameters over 1 model-parallel ranks, and a layer's "
             "input: --micro-batch-size 1 x 128 rows x --hidden-size 64)"),
            (["--micro-batch-size", "1000000000"],
             "over 30,517.6 GiB per rank (124,672 fp32 parameters over 1 model-parallel ranks, and a layer's input: "
             "--micro-batch-size 1000000000 x 128 rows x --hidden-size 64)"),
            (["--seq-length", "6400000000", "--max-position-embeddings", "6400000000"],
             "over 3,051.8 GiB per rank (124,672 fp32 parameters over 1 model-parallel ranks, and a layer's input: "
             "--micro-batch-size 1 x 12800000000 rows x --hidden-size 64)")):
        assert pretrain.main(argv + extra) == 2, extra
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [f"pretrain_bdlm.py: error: this model and micro-batch need {need}, {fix}"], err
    # Negative controls: the same base fits; a GPU run's memory is its devices', not counted here.
    validate_args(build_parser().parse_args(argv), 1, on_accelerator=False)
    validate_args(build_parser().parse_args(argv + ["--hidden-size", "4000000000"]), 1, on_accelerator=True)


# Wrongly typed config.json fields: (family, change, the field's refusal). Each family's tiny config is written
# without weights: a config the schema passes is refused next for having no *.safetensors (the control).
HF_CONFIG_FIELDS = [
    ("qwen3_moe", {"mlp_only_layers": 1}, 'mlp_only_layers is 1, expected a list of layer numbers'),
    ("qwen3_moe", {"mlp_only_layers": ["1"]}, 'mlp_only_layers is ["1"], expected a list of layer numbers'),
    ("llama", {"rms_norm_eps": "tiny"}, 'rms_norm_eps is "tiny", expected a number > 0'),
    ("qwen3", {"rms_norm_eps": 0}, "rms_norm_eps is 0, expected a number > 0"),
    ("qwen3_moe", {"router_aux_loss_coef": "abc"}, 'router_aux_loss_coef is "abc", expected a number >= 0'),
    ("llama", {"num_hidden_layers": "2"}, 'num_hidden_layers is "2", expected an integer in [1, 10000]'),
    ("llama", {"num_hidden_layers": True}, "num_hidden_layers is true, expected an integer in [1, 10000]"),
    ("llama", {"num_hidden_layers": 10 ** 9}, "num_hidden_layers is 1000000000, expected an integer in [1, 10000]"),
    ("llama", {"num_hidden_layers": None}, "num_hidden_layers is null, expected an integer in [1, 10000]"),
    ("qwen2", {"hidden_size": 1.5}, "hidden_size is 1.5, expected a positive integer"),
    ("mistral", {"num_attention_heads": [4]}, "num_attention_heads is [4], expected a positive integer"),
    ("qwen3", {"intermediate_size": 0}, "intermediate_size is 0, expected a positive integer"),
    ("llama", {"rope_theta": None}, "rope_theta is null, expected a number > 0"),
    ("llama", {"rope_parameters": {"rope_type": "default", "rope_theta": None}},
     "rope_parameters.rope_theta is null, expected a number > 0"),
    ("llama", {"rope_parameters": {"rope_type": "default", "rope_theta": float("inf")}},
     "rope_parameters.rope_theta is Infinity, expected a number > 0"),
    ("llama", {"rope_parameters": "default"}, 'rope_parameters is "default", expected an object (the RoPE settings)'),
    ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": "8"}}, 'rope_scaling.factor is "8", expected a '
                                                                         'number > 0'),
    ("llama", {"rope_parameters": {"rope_type": 3}}, "rope_parameters.rope_type is 3, expected a string"),
    ("llama", {"tie_word_embeddings": "false"}, 'tie_word_embeddings is "false", expected true or false'),
    ("llama", {"architectures": "LlamaForCausalLM"}, 'architectures is "LlamaForCausalLM", expected a list of class '
                                                     'names'),
    ("llama", {"architectures": [5]}, "architectures is [5], expected a list of class names"),
    ("llama", {"layer_types": 3}, "layer_types is 3, expected a list of strings"),
    ("llama", {"num_key_value_heads": 0}, "num_key_value_heads is 0, expected a positive integer"),
    ("qwen3", {"head_dim": "16"}, 'head_dim is "16", expected a positive integer'),
    ("llama", {"max_position_embeddings": -1}, "max_position_embeddings is -1, expected a positive integer"),
    ("llama", {"partial_rotary_factor": "1"}, 'partial_rotary_factor is "1", expected a number in (0, 1]'),
    ("llama", {"hidden_act": 1}, "hidden_act is 1, expected a string"),
    ("llama", {"mlp_bias": "no"}, 'mlp_bias is "no", expected true or false'),
    ("qwen2", {"sliding_window": "4096"}, 'sliding_window is "4096", expected a non-negative integer'),
    ("qwen3_moe", {"num_experts": "4"}, 'num_experts is "4", expected a non-negative integer'),
    ("qwen3_moe", {"num_experts_per_tok": 2.0}, "num_experts_per_tok is 2.0, expected a positive integer"),
    ("qwen3_moe", {"moe_intermediate_size": [32]}, "moe_intermediate_size is [32], expected a positive integer"),
    ("qwen3_moe", {"decoder_sparse_step": None}, "decoder_sparse_step is null, expected a positive integer"),
    ("qwen3_moe", {"norm_topk_prob": 1}, "norm_topk_prob is 1, expected true or false"),
    ("qwen3_moe", {"router_aux_loss_coef": -0.5}, "router_aux_loss_coef is -0.5, expected a number >= 0"),
]


def _config_only(directory, family, change):
    """A directory holding only the tiny `family` model's config.json, with `change` applied."""
    import json

    from megatron_csbp.tools import tiny_hf_model

    config = tiny_hf_model.make_config(family, mlp_only_layers=(1,) if family == "qwen3_moe" else ()).to_dict()
    config.update(change)
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config))
    return str(directory)


@pytest.mark.parametrize("family, change, message", HF_CONFIG_FIELDS)
def test_a_wrongly_typed_hf_config_field_is_one_line_before_any_weights(tmp_path, capsys, family, change, message):
    pytest.importorskip("transformers")
    from megatron_csbp.tools import convert_hf

    hf_dir = _config_only(tmp_path / "model", family, change)
    code = convert_hf.main(["import", "--hf-dir", hf_dir, "--save", str(tmp_path / "ckpt")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err == [f"convert_hf.py: error: --hf-dir {hf_dir}: {hf_dir}/config.json: {message}; restore "
                                 f"the model's config.json"], err
    assert sorted(os.listdir(tmp_path)) == ["model"] and os.listdir(hf_dir) == ["config.json"]


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3", "qwen3_moe"])
def test_every_familys_config_passes_the_schema(tmp_path, capsys, family):
    """The control: each family's config as transformers writes it is read past the schema, to the weights."""
    pytest.importorskip("transformers")
    from megatron_csbp.tools import convert_hf
    from megatron_csbp.tools import hf

    assert family in hf.FAMILIES
    hf_dir = _config_only(tmp_path / "model", family, {})
    assert convert_hf.main(["import", "--hf-dir", hf_dir, "--save", str(tmp_path / "ckpt")]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"convert_hf.py: error: --hf-dir {hf_dir}: no *.safetensors files (convert .bin weights to safetensors "
        f"first; pickled weights are not read)"]
    missing = _config_only(tmp_path / "lacking", family, {})
    config = hf.read_config(missing)
    del config["hidden_size"]
    with pytest.raises(ConfigError, match=r"config.json lacks hidden_size \(a positive integer\); restore"):
        hf.model_flags(config, missing)


def test_checkpoint_size_estimate_matches_a_real_checkpoint(tmp_path):
    """The estimate behind the free-space check, against the bytes a saved checkpoint really takes."""
    sys.path.insert(0, os.path.join(REPO, "tests"))
    from pretrain_runs import TINY, flags
    from spawn import run_ranks

    from megatron_csbp.training.config import parse_args

    args = parse_args(flags({**TINY, "data_path": "unused", "train_iters": 4}))
    estimate = checkpoint_bytes(validate(args, 1, on_accelerator=False, check_paths=False), args)[0]
    actual = run_ranks(_save_once, 1, args, str(tmp_path / "save"), timeout=300)[0]
    assert 0.9 * actual <= estimate <= 1.1 * actual, (estimate, actual)


@on_cpu_backend
def _save_once(rank, world, args, save):
    """Builds the tiny model and optimizer, steps once, saves one checkpoint; returns its .distcp bytes."""
    from megatron_csbp.training import checkpointing, providers, loop as training
    from megatron_csbp.mcore import parallel_state

    args.vocab_size, args.tokenizer_type = 256, "ByteLevelTokenizer"
    parallel_state.initialize_model_parallel(1, 1, context_block_parallel_size=1)
    try:
        trainer = training.Trainer(providers.RunProviders(args))
        trainer.optimizer.step()  # Adam's moments exist from the first step on (zero gradients suffice)
        directory = checkpointing.save_checkpoint(save, trainer.state, trainer.model, trainer.optimizer,
                                                  trainer.scheduler, args, log=lambda line: None)
    finally:
        parallel_state.destroy_model_parallel()
    return sum(os.path.getsize(os.path.join(directory, name)) for name in os.listdir(directory)
               if name.endswith(".distcp"))


def test_prepare_data_on_empty_input_is_one_line(tmp_path):
    empty, skipped = tmp_path / "empty.jsonl", tmp_path / "bad.jsonl"
    empty.write_text("")
    skipped.write_text('{"other": 1}\nnot json\n')
    script = os.path.join(REPO, "scripts", "prepare_data.py")
    for source, why, extra in ((empty, "the input is empty", []),
                               (skipped, "all 2 non-empty line(s) were skipped", ["--on-bad-line", "skip"])):
        done = subprocess.run([sys.executable, script, "--input", str(source), "--output-prefix",
                               str(tmp_path / "out"), *extra], capture_output=True, text=True, timeout=120)
        assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
        assert done.stderr.strip().splitlines()[-1] == (
            f"prepare_data: {source}: no documents to write ({why}); give input with text in it")
        assert not list(tmp_path.glob("out*")), list(tmp_path.glob("out*"))


def prepare_data_command(*argv):
    """`scripts/prepare_data.py ARGV` in a fresh interpreter: (exit status, stderr)."""
    done = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "prepare_data.py"), *map(str, argv)],
                          capture_output=True, text=True, timeout=300)
    return done.returncode, done.stderr


def test_prepare_data_refuses_input_that_is_not_utf8_in_one_line(tmp_path):
    """A text file or a JSONL line in Latin-1: one line naming the file, line and byte and the fix, exit 2, and
    nothing written; the same JSONL with --on-bad-line skip builds the dataset from its good line (control)."""
    good, text, jsonl = tmp_path / "good.txt", tmp_path / "notes.txt", tmp_path / "lines.jsonl"
    good.write_text("read first, never written\n")
    text.write_bytes(b"plain line\n" + "caf\u00e9 au lait\n".encode("latin-1"))  # 0xe9: line 2, byte 14
    jsonl.write_bytes(b'{"text": "ok"}\n' + '{"text": "caf\u00e9"}\n'.encode("latin-1"))  # line 2, byte 28
    fix = "convert the file to UTF-8 (e.g. iconv -f LATIN1 -t UTF-8), or skip such lines with --on-bad-line skip"
    for source, byte in ((text, 14), (jsonl, 28)):
        code, err = prepare_data_command("--input", good, source, "--output-prefix", tmp_path / "out")
        assert code == 2 and err.strip().splitlines() == [
            f"prepare_data: {source}:2: not UTF-8 text (byte 0xe9 at byte {byte} of the file); {fix}"], err
        assert sorted(os.listdir(tmp_path)) == ["good.txt", "lines.jsonl", "notes.txt"]  # no dataset, no temporary
    code, err = prepare_data_command("--input", jsonl, "--output-prefix", tmp_path / "out", "--on-bad-line", "skip")
    assert code == 0 and err.strip().splitlines() == [
        f"skipped {jsonl}:2: not UTF-8 text (byte 0xe9 at byte 28 of the file)"], err
    assert sorted(os.listdir(tmp_path)) == ["good.txt", "lines.jsonl", "notes.txt", "out.bin", "out.idx",
                                            "out.stats.json"]


def test_submit_refuses_a_non_positive_cpus_per_task():
    submit = os.path.join(REPO, "scripts", "slurm", "submit.py")
    for cpus, refused in (("-1", True), ("0", True), ("2", False)):
        done = subprocess.run([sys.executable, submit, "--config", os.path.join(REPO, "configs", "tiny_cpu.yaml"),
                               "--nodes", "1", "--gpus-per-node", "0", "--ntasks-per-node", "2", "--cpus-per-task",
                               cpus, "--dry-run"], capture_output=True, text=True, timeout=120, cwd=REPO)
        if refused:
            assert done.returncode == 2 and done.stderr.strip().splitlines() == [
                f"submit.py: refused: --cpus-per-task {cpus}: must be >= 1 (or drop it for Slurm's default)"]
        else:  # negative control: a valid count is written into the batch script
            assert done.returncode == 0 and "--cpus-per-task=2" in done.stdout, done.stderr



# ------------------------------------------------------------------------ the lm-eval model and the evaluator
# (model_args as lm-eval hands them over, the refusal's exact text): lm-eval's `key=value` parsing has already
# turned numbers into int/float and true/false/none into bool/None; a Python caller gives anything.
MODEL_ARGS_REFUSALS = [
    ({"mc_samples": "abc"}, "model_args: mc_samples=abc: expected an integer >= 1"),
    ({"mc_samples": 0}, "model_args: mc_samples=0: expected an integer >= 1"),
    ({"mc_samples": 1.5}, "model_args: mc_samples=1.5: expected an integer >= 1"),
    ({"mc_samples": ""}, "model_args: mc_samples=: expected an integer >= 1"),  # `mc_samples` without `=`
    ({"mc_samples": True}, "model_args: mc_samples=True: expected an integer >= 1"),
    ({"mc_samples": [1, 2]}, "model_args: mc_samples=[1, 2]: expected an integer >= 1"),  # JSON model_args
    ({"mc_samples": None}, "model_args: mc_samples=None: expected an integer >= 1"),
    ({"seed": -1}, "model_args: seed=-1: expected an integer in [0, 2**64)"),
    ({"seed": 2 ** 64}, f"model_args: seed={2 ** 64}: expected an integer in [0, 2**64)"),
    ({"max_gen_toks": 0}, "model_args: max_gen_toks=0: expected an integer >= 1"),
    ({"top_k": -1}, "model_args: top_k=-1: expected an integer >= 0"),
    ({"steps_per_block": 0}, "model_args: steps_per_block=0: expected an integer >= 1"),
    ({"tensor_parallel_size": 0}, "model_args: tensor_parallel_size=0: expected an integer >= 1"),
    ({"threshold": 1.5}, "model_args: threshold=1.5: expected a probability in [0, 1]"),
    ({"threshold": float("nan")}, "model_args: threshold=nan: expected a probability in [0, 1]"),
    ({"temperature": -0.5}, "model_args: temperature=-0.5: expected a number >= 0 (0: greedy)"),
    ({"temperature": float("inf")}, "model_args: temperature=inf: expected a number >= 0 (0: greedy)"),
    ({"temperature": "hot"}, "model_args: temperature=hot: expected a number >= 0 (0: greedy)"),
    ({"top_p": 0}, "model_args: top_p=0: expected a number in (0, 1]"),
    ({"greedy_check": "maybe"}, "model_args: greedy_check=maybe: expected true or false"),
    ({"greedy_check": 2}, "model_args: greedy_check=2: expected true or false"),
    ({"estimator": "median"}, "model_args: estimator=median: expected one of inverse-t, count"),
    ({"strategy": 3}, "model_args: strategy=3: expected one of confidence, fast-dllm-v2, top-k, posterior, "
                      "first-hitting, diffusion-gemma"),
    ({"config": ""}, "model_args: config=: expected a path: a training YAML whose settings override those the "
                     "checkpoint recorded"),
    ({"load": 7}, "model_args: load=7: expected a path: a --save directory of a training run, or one of its "
                  "iter_XXXXXXX directories"),
    ({"batch_size": 0}, "--batch_size 0: expected an integer >= 1, or auto"),
    ({"batch_size": "-1"}, "--batch_size -1: expected an integer >= 1, or auto"),
    ({"batch_size": "big"}, "--batch_size big: expected an integer >= 1, or auto"),
    ({"max_batch_size": 0}, "--max_batch_size 0: expected an integer >= 1"),
    ({"tensor_parallel_size": 2}, "model_args: tensor_parallel_size=2 but this launch has 1 rank: launch exactly "
                                  "tensor_parallel_size ranks (python -m megatron_csbp.torchrun --standalone "
                                  "--nproc-per-node 2 -m megatron_csbp.harness ...)"),
]


def test_model_args_are_read_by_one_typed_parser(monkeypatch):
    """Every model_args key is typed and ranged in one table; a bad value is one line naming the key, the value
    and what it must be; an unknown key names the closest known one; lm-eval's own values parse (control)."""
    pytest.importorskip("lm_eval")
    from megatron_csbp.tools.harness import model_arguments

    monkeypatch.setenv("WORLD_SIZE", "1")
    for given, message in MODEL_ARGS_REFUSALS:
        with pytest.raises(ConfigError) as caught:
            model_arguments({"load": "runs/x", **given})
        assert str(caught.value) == message, given
    for given, hint in (({"mc_sample": 4}, " (did you mean mc_samples?)"), ({"pretrained": "gpt2"}, "")):
        with pytest.raises(ConfigError) as caught:
            model_arguments({"load": "runs/x", **given})
        assert str(caught.value).startswith(f"model_args: unknown argument {next(iter(given))!r}{hint}; known: load, "
                                            "config, mc_samples,"), caught.value
        assert "batch_size" not in str(caught.value)  # lm-eval's flags are not model_args
    with pytest.raises(ConfigError) as caught:
        model_arguments({"mc_samples": 4})
    assert str(caught.value).startswith("model_args: give load=DIR")
    # Control: what lm-eval hands over for good values reads as the types the model uses.
    values = model_arguments({"load": "runs/x", "mc_samples": "16", "seed": 1e3, "greedy_check": "no",
                              "temperature": 1, "top_p": "0.5", "steps_per_block": None, "batch_size": "auto:4",
                              "device": "cuda:0"})
    assert (values["mc_samples"], values["seed"], values["greedy_check"], values["temperature"], values["top_p"],
            values["steps_per_block"], values["batch_size"]) == (16, 1000, False, 1.0, 0.5, None, 8)
    assert isinstance(values["mc_samples"], int) and isinstance(values["temperature"], float)
    assert model_arguments({"load": "runs/x"})["mc_samples"] == 32 and model_arguments(
        {"load": "runs/x", "batch_size": 3})["batch_size"] == 3


def test_gen_kwargs_are_typed_like_model_args():
    pytest.importorskip("lm_eval")
    from megatron_csbp.tools.harness import GEN_OPTIONS, read_options

    for given, message in (({"max_gen_toks": "abc"}, "gen_kwargs: max_gen_toks=abc: expected an integer >= 1"),
                           ({"max_gen_toks": -3}, "gen_kwargs: max_gen_toks=-3: expected an integer >= 1"),
                           ({"temperature": -1}, "gen_kwargs: temperature=-1: expected a number >= 0 (0: greedy)"),
                           ({"do_sample": "sometimes"}, "gen_kwargs: do_sample=sometimes: expected true or false"),
                           ({"until": ["\n", 3]}, "gen_kwargs: until=['\\n', 3]: expected a string or a list of "
                                                  "strings")):
        with pytest.raises(ConfigError) as caught:
            read_options(given, GEN_OPTIONS, "gen_kwargs")
        assert str(caught.value) == message
    values = read_options({"max_gen_toks": 16, "until": "\n\n", "do_sample": False}, GEN_OPTIONS, "gen_kwargs")
    assert (values["max_gen_toks"], values["until"], values["do_sample"]) == (16, ["\n\n"], False)


def _usage(free):
    from collections import namedtuple

    return namedtuple("usage", "total used free")(10 * 2 ** 30, 0, free)


def test_output_path_is_checked_as_lm_eval_reads_it(tmp_path, monkeypatch):
    """lm-eval 0.4's --output_path: a name ending .json is a pattern for files beside it, anything else a
    directory. A file where the directory must be, no write access or no room for a results file is refused;
    nothing is created by the check."""
    pytest.importorskip("lm_eval")
    from megatron_csbp.tools import lm_eval_inputs
    from megatron_csbp.runtime import publish

    file = tmp_path / "a_file"
    file.write_text("keep me")
    refused = {
        str(file): f"--output_path {file} is a file; give a directory (lm-eval writes its results under it) or a "
                   f"name ending .json (written beside it as NAME_<date>.json)",
        str(file / "sub"): f"--output_path {file}/sub: {file} is a file, not a directory; give a path in a directory",
        str(file / "r.json"): f"--output_path {file}/r.json: {file} is a file, not a directory; give a path in a "
                              f"directory",
    }
    for path, message in refused.items():
        with pytest.raises(ConfigError) as caught:
            lm_eval_inputs.check_output_path(path)
        assert str(caught.value) == message
    # Accepted as lm-eval defines them: a missing directory, an existing .json file (results go beside it).
    assert lm_eval_inputs.check_output_path(str(tmp_path / "new" / "dir")) == str(tmp_path / "new" / "dir")
    assert lm_eval_inputs.check_output_path(str(file) + ".json") == str(tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["a_file"] and file.read_text() == "keep me"
    monkeypatch.setattr(publish.shutil, "disk_usage", lambda path: _usage(lm_eval_inputs.RESULTS_BYTES - 1))
    with pytest.raises(ConfigError) as caught:
        lm_eval_inputs.check_output_path(str(tmp_path / "results"))
    assert str(caught.value).startswith(f"--output_path {tmp_path}/results: 1.0 MiB are to be written but only")
    monkeypatch.setattr(lm_eval_inputs.os, "access", lambda path, mode: False)
    with pytest.raises(ConfigError) as caught:
        lm_eval_inputs.check_output_path(str(tmp_path / "results"))
    assert str(caught.value) == (f"--output_path {tmp_path}/results: {tmp_path} cannot be written (permissions or a "
                                 f"read-only file system); give another path")


def _lm_eval_writes(staged: str, samples_lines: int, results: bool = True) -> None:
    """What lm-eval's tracker writes for a directory --output_path: results and one task's samples."""
    import json

    folder = os.path.join(staged, "model")
    os.makedirs(folder)
    if results:
        with open(os.path.join(folder, "results_2026-01-01T00-00-00.0.json"), "w") as handle:
            json.dump({"results": {}, "n-samples": {"my_task": {"original": 5, "effective": 3}}}, handle)
    with open(os.path.join(folder, "samples_my_task_2026-01-01T00-00-00.0.jsonl"), "w") as handle:
        handle.write('{"doc_id": 0}\n' * samples_lines + ('{"doc_' if samples_lines < 3 else ""))


def test_lm_eval_output_is_published_whole_or_not_at_all(tmp_path):
    """lm-eval writes into a private directory; its files are published when all are complete (the results
    parse, each task's samples are all there), else the run says so in one line and nothing is published."""
    pytest.importorskip("lm_eval")
    from megatron_csbp.tools.lm_eval_inputs import StagedOutput

    for lines, results, why in ((2, True, "the samples of my_task are missing or incomplete"),
                                (3, False, "no results file")):
        output = StagedOutput(str(tmp_path / "out"), samples=True)
        _lm_eval_writes(output.staged, lines, results)
        with pytest.raises(ConfigError) as caught:
            output.publish()
        assert str(caught.value) == (f"--output_path {tmp_path}/out: lm-eval could not write its output ({why}; its "
                                     f"warning above says why); nothing was saved there")
        output.discard()
        assert os.listdir(tmp_path) == []  # the directory made for the run is gone with what lm-eval wrote
    output = StagedOutput(str(tmp_path / "out"), samples=True)
    _lm_eval_writes(output.staged, 3)
    published = output.publish()
    output.discard()  # after publishing: nothing to discard
    assert sorted(os.path.relpath(path, tmp_path) for path in published) == [
        "out/model/results_2026-01-01T00-00-00.0.json", "out/model/samples_my_task_2026-01-01T00-00-00.0.jsonl"]
    assert sorted(os.listdir(tmp_path / "out")) == ["model"]  # no private directory left


def test_evaluation_bounds_noise_samples_and_its_json_before_any_work(tmp_path, places, monkeypatch):
    """--noise-samples against the machine's memory (each draw's NELBO is kept for the record; the sums are
    streamed), --distributed-timeout-minutes against what a timeout can hold, and the --output-json record
    against the free space, before the checkpoint is read."""
    from collections import namedtuple

    import psutil

    from megatron_csbp.tools import evaluation
    from megatron_csbp.runtime import publish

    memory = namedtuple("memory", "available")
    monkeypatch.setattr(psutil, "virtual_memory", lambda: memory(2 ** 30))
    base = ["--load", str(tmp_path / "no_run"), "--data-path", places["prefix"]]
    with pytest.raises(ConfigError) as caught:
        evaluation.prepare(base + ["--noise-samples", str(10 ** 10)], 1)
    assert str(caught.value) == ("--noise-samples 10000000000: the evaluation keeps each draw's NELBO for the "
                                 "record, 596.0 GiB, more than the 1.0 GiB of memory available; lower it (at most "
                                 "16,777,216)")
    with pytest.raises(ConfigError) as caught:  # the process group's timeout: a timedelta, ~2.7 million years
        evaluation.prepare(base + ["--distributed-timeout-minutes", str(10 ** 13)], 1)
    assert str(caught.value) == "--distributed-timeout-minutes 10000000000000 must be in [1, 1439999999999]"
    target = tmp_path / "numbers.json"
    need = evaluation.record_bytes(10 ** 6)  # 16 KiB + 32 bytes a draw
    assert need == 16 * 2 ** 10 + 32 * 10 ** 6
    monkeypatch.setattr(publish.shutil, "disk_usage", lambda path: _usage(2 ** 20))
    with pytest.raises(ConfigError) as caught:
        evaluation.prepare(base + ["--noise-samples", str(10 ** 6), "--output-json", str(target)], 1)
    assert str(caught.value) == (f"--output-json {target}: 30.5 MiB are to be written but only 1.0 MiB are free "
                                 f"there; free space or give another --output-json")
    # Control: with room, the options pass and the next check (the checkpoint) is the one that refuses.
    monkeypatch.setattr(publish.shutil, "disk_usage", lambda path: _usage(need))
    with pytest.raises(ConfigError) as caught:
        evaluation.prepare(base + ["--noise-samples", str(10 ** 6), "--output-json", str(target)], 1)
    assert str(caught.value).startswith(f"--load {tmp_path}/no_run: no such directory")
    assert not target.exists()


def test_a_failed_json_write_is_one_line_and_leaves_nothing(tmp_path, monkeypatch):
    """The disk filling (or any write error) while the record is written: one line naming the file; no file
    there, no private temporary beside it."""
    import errno
    import json

    from megatron_csbp.tools import evaluation

    def full_disk(record, handle, **kwargs):
        handle.write('{"nelbo": ')
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(json, "dump", full_disk)
    target = tmp_path / "numbers.json"
    with pytest.raises(ConfigError) as caught:
        evaluation.write_json(str(target), {"nelbo": 1.0}, overwrite=False)
    assert str(caught.value) == (f"--output-json {target}: cannot write it (No space left on device); nothing was "
                                 f"written: free space there or give another file")
    assert os.listdir(tmp_path) == []
