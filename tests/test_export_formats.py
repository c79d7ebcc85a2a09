"""Exports for serving engines: `scripts/convert_hf.py export --format sdar / fast-dllm-v2`
(`megatron_csbp/tools/hf_formats.py`), checked against the fields the engines' sources read.

The engines hard-code the MASK id, so the models here are tokenizer-sized like the real ones: a local
word-level tokenizer with exactly Qwen3's 151669 ids (SDAR) or Qwen2.5's 151665 ids (Fast-dLLM v2) and
Qwen's 151936 embedding rows, on a tiny random Qwen3 / Qwen2 body (nothing is downloaded). Imported as
they are, the new MASK lands on 151669 / 151665, the ids the engines hard-code.
* each format's config.json holds every field the engine reads, with the engine's values (the file read is
  named beside each assertion); it loads with transformers' own Qwen3Config / Qwen2Config, and with a config
  class of the engine's kind: the SDAR one with AutoConfig (the `configuration_sdar.py` the export writes, which
  SGLang's get_config and SDAR's modeling_sdar.py load), the Fast-dLLM v2 one with a class built as its
  release's `Fast_dLLM_QwenConfig` is; every attribute the engines' model code reads is checked on both;
* the tokenizer_config.json names a class transformers 4.5x (the engines' pin) knows, as well as 5.x;
* its weights are those of the plain export of the same checkpoint, byte for byte;
* what a format cannot honour (another family, the other label shift, another MASK id) is one line, exit
  2, and nothing is written; a block size other than the engine's default is a note naming its flag;
* negative control: the plain export (`--format hf`, the default) has none of the engines' fields.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from megatron_csbp.tools import convert_hf, tiny_hf_model
from spawn import run_command, run_ranks
from test_hf import _safetensors

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QWEN_ROWS = 151936            # the embedding rows of Qwen2.5 and Qwen3 (ids past the tokenizer's are unused)
TOKENIZER_IDS = {"qwen3": 151669, "qwen2": 151665}  # Qwen3's and Qwen2.5's tokenizers: 151643 BPE ids + specials
DIVISIBLE_BY = 64             # QWEN_ROWS is a multiple: no padding rows
BLOCK = 16                    # the import's block size (configs/ar_to_bdlm_fast_dllm_v2.yaml's too)
QWEN_ROPE = {"rope_type": "default", "rope_theta": 1000000.0}  # Qwen2.5's and Qwen3's (engines fall back to 10000)
TINY = dict(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16, intermediate_size=48)

# The config attributes each engine's model code reads. SDAR's own modeling_sdar.py (JetAstra/SDAR c2041a8
# training/model/SDAR-4B-Chat/; rope_theta through transformers 4's default RoPE init, which it calls):
SDAR_MODELING_READS = ("hidden_size", "intermediate_size", "hidden_act", "num_attention_heads", "num_key_value_heads",
                       "head_dim", "attention_bias", "attention_dropout", "rms_norm_eps", "sliding_window",
                       "use_sliding_window", "max_window_layers", "rope_scaling", "rope_theta",
                       "max_position_embeddings", "vocab_size", "pad_token_id", "initializer_range", "use_cache",
                       "num_hidden_layers", "block_size", "mask_token_id", "fuse_cross_entropy", "tie_word_embeddings")
# SGLang's python/sglang/srt/models/sdar.py (sgl-project/sglang 0b142c7):
SGLANG_SDAR_READS = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "attention_bias",
                     "rms_norm_eps", "rope_theta", "rope_scaling", "max_position_embeddings", "intermediate_size",
                     "num_hidden_layers", "vocab_size", "tie_word_embeddings")
# Fast-dLLM v2's release modeling.py (a copy: Satgoy152/DualDiffusion 189fa7a
# FastDLLM-inferencing/Fast_dLLM_v2_7B/modeling.py; rope_theta through transformers 4's default RoPE init):
FAST_DLLM_V2_READS = ("hidden_size", "intermediate_size", "hidden_act", "num_attention_heads", "num_key_value_heads",
                      "head_dim", "attention_dropout", "rms_norm_eps", "layer_types", "sliding_window", "rope_scaling",
                      "rope_theta", "max_position_embeddings", "vocab_size", "pad_token_id", "bd_size",
                      "num_hidden_layers", "initializer_range", "tie_word_embeddings")
# Fast_dLLM_QwenConfig's arguments and their defaults (its release's configuration.py, read in the same copy):
# a key config.json lacked would take these, rope_theta 10000 and bd_size 32 among them
FAST_DLLM_V2_DEFAULTS = dict(vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32,
                             num_attention_heads=32, num_key_value_heads=32, hidden_act="silu",
                             max_position_embeddings=32768, initializer_range=0.02, rms_norm_eps=1e-6, use_cache=True,
                             rope_theta=10000.0, rope_scaling=None, use_sliding_window=False, sliding_window=4096,
                             max_window_layers=28, layer_types=None, attention_dropout=0.0, bd_size=32)
MISSING = "<missing>"


def _word_level_tokenizer(num_ids: int):
    """A fast tokenizer of exactly `num_ids` ids (id 0 `<|endoftext|>`), built locally in a second."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<|endoftext|>": 0, **{f"w{i}": i for i in range(1, num_ids)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>")


def _qwen_sized_model(family: str, out: str) -> str:
    """A tiny random `family` model with Qwen's embedding rows and the real tokenizer's id count."""
    tiny_hf_model.make_model(family, out, tokenizer_ids=300, model_rows=QWEN_ROWS, tied=family == "qwen2",
                             rope_parameters=QWEN_ROPE, **TINY)
    for name in os.listdir(out):
        if name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            os.remove(os.path.join(out, name))
    tokenizer = _word_level_tokenizer(TOKENIZER_IDS[family])
    assert len(tokenizer) == TOKENIZER_IDS[family]
    tokenizer.save_pretrained(out)
    return out


def _conversions(rank, world, jobs):
    """On one spawned rank: `convert_hf` calls in order; returns each call's log lines."""
    logs = []
    for function, kwargs in jobs:
        lines = []
        getattr(convert_hf, function)(**kwargs, log=lambda *parts: lines.append(" ".join(map(str, parts))))
        logs.append(lines)
    return logs


def _pretrain(config, *overrides):
    done = run_command([sys.executable, os.path.join(REPO, "scripts", "pretrain_bdlm.py"), "--config", config,
                        *overrides], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    assert done.returncode == 0, done.stdout[-6000:]


def _convert(*argv):
    done = run_command([sys.executable, os.path.join(REPO, "scripts", "convert_hf.py"), *argv], cwd=REPO,
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=300,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    return done.returncode, done.stdout, done.stderr


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """root/<name>/{hf,ckpt}: Qwen3- and Qwen2.5-sized imports and a tiny Qwen3 (300 ids, MASK 300); the
    Qwen2 import fine-tuned one step at lr 0 with the Fast-dLLM v2 recipe (root/qwen2/finetuned); and the
    exports root/exports/<name>, with the log lines of each."""
    from megatron_csbp.data.datasets import write_indexed_dataset

    root = str(tmp_path_factory.mktemp("formats"))
    _qwen_sized_model("qwen3", os.path.join(root, "qwen3", "hf"))
    _qwen_sized_model("qwen2", os.path.join(root, "qwen2", "hf"))
    tiny_hf_model.make_model("qwen3", os.path.join(root, "tiny_qwen3", "hf"), tokenizer_ids=300, model_rows=384,
                             **TINY)
    run_ranks(_conversions, 1, [("import_checkpoint", dict(hf_dir=os.path.join(root, name, "hf"),
                                                            save=os.path.join(root, name, "ckpt"),
                                                            make_vocab_size_divisible_by=DIVISIBLE_BY))
                                for name in ("qwen3", "qwen2", "tiny_qwen3")], timeout=600)

    generator = torch.Generator().manual_seed(3)
    documents = [torch.randint(1, TOKENIZER_IDS["qwen2"], (int(n),), generator=generator).tolist()
                 for n in torch.randint(40, 80, (8,), generator=generator)]
    data = os.path.join(root, "qwen2_data")
    write_indexed_dataset(documents, data, TOKENIZER_IDS["qwen2"] + 1)
    config = os.path.join(root, "finetune.yaml")
    with open(config, "w", encoding="utf-8") as handle:
        for part in (os.path.join(root, "qwen2", "ckpt", "model.yaml"),
                     os.path.join(REPO, "configs", "ar_to_bdlm_fast_dllm_v2.yaml")):
            handle.write(open(part, encoding="utf-8").read())
    finetuned = os.path.join(root, "qwen2", "finetuned")
    _pretrain(config, f"data-path={data}", "seq-length=32", "train-iters=1", "lr=0", "min-lr=0",
              "lr-warmup-iters=0", "eval-iters=0", "split=100,0,0", f"save={finetuned}", "save-interval=1", "micro-batch-size=1",
              "global-batch-size=1", f"data-cache-path={os.path.join(root, 'cache')}")

    qwen3 = os.path.join(root, "qwen3", "ckpt")
    jobs = [("qwen3_hf", qwen3, "hf", False), ("qwen3_sdar", qwen3, "sdar", False),
            ("qwen2_hf", finetuned, "hf", False), ("qwen2_fast_dllm_v2", finetuned, "fast-dllm-v2", False),
            ("replaced", qwen3, "sdar", False), ("replaced", qwen3, "hf", True)]  # an SDAR export, then hf over it
    logs = run_ranks(_conversions, 1, [("export_checkpoint", dict(load=load, out=os.path.join(root, "exports", name),
                                                                  export_format=fmt, overwrite=overwrite))
                                       for name, load, fmt, overwrite in jobs], timeout=600)[0]
    return root, {name: lines for (name, *_), lines in zip(jobs, logs)}  # "replaced": the last export's


def _config(root, name):
    with open(os.path.join(root, "exports", name, "config.json"), encoding="utf-8") as handle:
        return json.load(handle)


def _assert_same_weights(root, name, plain):
    ours, theirs = _safetensors(os.path.join(root, "exports", name)), _safetensors(os.path.join(root, "exports", plain))
    assert sorted(ours) == sorted(theirs)
    for key, tensor in theirs.items():
        assert ours[key].dtype == tensor.dtype and torch.equal(ours[key], tensor), key


def _fast_dllm_v2_kind_config():
    """A config class of Fast-dLLM v2's kind, built as its release's `Fast_dLLM_QwenConfig` is: a `PretrainedConfig`
    that takes `FAST_DLLM_V2_DEFAULTS` as arguments and keeps each as a plain attribute (`sliding_window` only with
    `use_sliding_window`, `layer_types` full attention when absent) before the base class takes the rest; it knows
    no `rope_parameters`. Built on call, as transformers may be absent (the module skips then)."""
    from transformers import PretrainedConfig

    class FastDLLMV2KindConfig(PretrainedConfig):
        model_type = "Fast_dLLM_Qwen"

        def __init__(self, tie_word_embeddings=False, **kwargs):
            for key, default in FAST_DLLM_V2_DEFAULTS.items():
                setattr(self, key, kwargs.pop(key, default))
            self.sliding_window = self.sliding_window if self.use_sliding_window else None
            self.layer_types = self.layer_types or ["full_attention"] * self.num_hidden_layers
            super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)

    return FastDLLMV2KindConfig


def _assert_reads(read: dict, config: dict, fields) -> None:
    """Each of `fields` (the attributes an engine's code reads) is an attribute of the loaded config (`read`: name ->
    value) and a key of config.json, with config.json's value (no engine default applies), and the RoPE is Qwen's:
    theta 1e6, default type (transformers 5 answers `rope_scaling` with its `rope_parameters`)."""
    assert not [name for name in fields if read[name] == MISSING or name not in config], read
    assert read["rope_theta"] == 1000000.0 and read["rope_scaling"] in (None, QWEN_ROPE), read
    assert {name: read[name] for name in fields if name != "rope_scaling"} == \
        {name: config[name] for name in fields if name != "rope_scaling"}


def _assert_tokenizer_config_for_transformers_4(directory: str, tokenizer_class: str) -> None:
    """A class transformers 4.5x resolves (its AutoTokenizer takes `Qwen2Tokenizer` as Qwen2TokenizerFast): transformers
    5 saves the generic fast tokenizer of an import as `TokenizersBackend`, which 4.x does not have, and the export
    names `PreTrainedTokenizerFast` (both load tokenizer.json as it is); a Qwen2 model's comes back `Qwen2Tokenizer`."""
    with open(os.path.join(directory, "tokenizer_config.json"), encoding="utf-8") as handle:
        tokenizer_config = json.load(handle)
    assert tokenizer_config["tokenizer_class"] == tokenizer_class, tokenizer_config
    assert not isinstance(tokenizer_config.get("extra_special_tokens"), list), tokenizer_config
    assert not {"local_files_only", "is_local"} & set(tokenizer_config), tokenizer_config  # how we loaded it


def test_imported_mask_lands_on_the_ids_the_engines_hard_code(exports):
    """Import puts a new MASK right after the tokenizer's ids: Qwen3's 151669 ids -> 151669 (SDAR's, in SGLang and
    lmdeploy), Qwen2.5's 151665 -> 151665 (Fast-dLLM v2's), with no new row (Qwen's unused rows make room)."""
    import yaml

    from megatron_csbp.tools import hf_formats

    root, _ = exports
    for family, fmt in (("qwen3", hf_formats.SDAR), ("qwen2", hf_formats.FAST_DLLM_V2)):
        with open(os.path.join(root, family, "ckpt", "model.yaml"), encoding="utf-8") as handle:
            fragment = yaml.safe_load(handle)
        assert fragment["bdlm-mask-token-id"] == TOKENIZER_IDS[family] == fmt.mask_token_id, family
    assert (hf_formats.SDAR.mask_token_id, hf_formats.FAST_DLLM_V2.mask_token_id) == (151669, 151665)


def test_sdar_export_has_the_fields_sglang_and_lmdeploy_read(exports, tmp_path):
    from transformers import AutoTokenizer, Qwen3Config

    root, logs = exports
    config = _config(root, "qwen3_sdar")
    # SGLang python/sglang/srt/dllm/config.py: DLLM_PARAMS keyed by architectures[0] ("SDARForCausalLM": block 4,
    # MASK 151669); lmdeploy lmdeploy/pytorch/configurations/sdar.py: model_type in ["sdar", "sdar_moe"], MASK 151669;
    # lmdeploy lmdeploy/pytorch/models/module_map.py: "SDARForCausalLM" -> its SDAR model.
    assert config["architectures"] == ["SDARForCausalLM"] and config["model_type"] == "sdar"
    assert config["mask_token_id"] == 151669 and config["block_size"] == BLOCK
    assert (config["bdlm_objective"], config["bdlm_label_shift"]) == ("bd3lm", 0) and "bd_size" not in config
    # SGLang python/sglang/srt/models/sdar.py: getattr(config, "rope_theta", 10000.0), rope_scaling, attention_bias,
    # head_dim, rms_norm_eps, tie_word_embeddings, num_key_value_heads.
    assert config["rope_theta"] == 1000000.0 and config["rope_scaling"] is None and config["attention_bias"] is False
    assert (config["head_dim"], config["num_key_value_heads"], config["tie_word_embeddings"]) == (16, 1, False)
    # lmdeploy lmdeploy/pytorch/models/sdar.py reads config.sliding_window; lmdeploy/pytorch/configurations/default.py
    # takes use_sliding_window as true when absent.
    assert config["sliding_window"] is None and config["use_sliding_window"] is False
    assert config["layer_types"] == ["full_attention"] * 2
    assert config["torch_dtype"] == config["dtype"] == "float32"  # transformers 4's name, which the engines pin
    assert config["vocab_size"] == QWEN_ROWS  # every row of the import (its fragment keeps Qwen's unused rows)
    # SGLang's get_config is AutoConfig.from_pretrained(trust_remote_code=...): model_type "sdar" needs auto_map;
    # SDAR's generate.py loads AutoModelForCausalLM (trust_remote_code) from the modeling_sdar.py the user adds, and
    # SDARForCausalLM.forward reads config.fuse_cross_entropy (JetAstra/SDAR c2041a8
    # training/model/SDAR-4B-Chat/modeling_sdar.py).
    assert config["auto_map"] == {"AutoConfig": "configuration_sdar.SDARConfig", "AutoModel": "modeling_sdar.SDARModel",
                                  "AutoModelForCausalLM": "modeling_sdar.SDARForCausalLM"}
    assert config["fuse_cross_entropy"] is False
    directory = os.path.join(root, "exports", "qwen3_sdar")
    assert not {"modeling_sdar.py", "fused_linear_diffusion_cross_entropy.py"} & set(os.listdir(directory))
    assert os.path.isfile(os.path.join(directory, "configuration_sdar.py"))

    loaded = Qwen3Config.from_pretrained(directory)
    assert (loaded.mask_token_id, loaded.block_size, loaded.num_hidden_layers) == (151669, BLOCK, 2)
    assert loaded.rope_parameters["rope_theta"] == 1000000.0
    fields = json.dumps(sorted(set(SDAR_MODELING_READS) | set(SGLANG_SDAR_READS)))
    probe = ("from transformers import AutoConfig; import json, sys; c = AutoConfig.from_pretrained(sys.argv[1], "
             "trust_remote_code=True, local_files_only=True); "
             "print(json.dumps([type(c).__name__, c.model_type, c.architectures[0], "
             "{f: getattr(c, f, '<missing>') for f in json.loads(sys.argv[2])}]))")
    done = subprocess.run([sys.executable, "-c", probe, directory, fields], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules"),
                                                       "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    name, model_type, architecture, read = json.loads(done.stdout.strip().splitlines()[-1])
    assert (name, model_type, architecture) == ("SDARConfig", "sdar", "SDARForCausalLM")
    _assert_reads(read, config, set(SDAR_MODELING_READS) | set(SGLANG_SDAR_READS))
    tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True,
                                              trust_remote_code=False)  # auto_map names no tokenizer: no prompt
    assert tokenizer.mask_token_id == 151669  # SDAR's generate.py takes the MASK id from the tokenizer
    _assert_tokenizer_config_for_transformers_4(directory, "PreTrainedTokenizerFast")
    _assert_same_weights(root, "qwen3_sdar", "qwen3_hf")
    notes = [line for line in logs["qwen3_sdar"] if "note:" in line]
    assert len(notes) == 2 and f"blocks of {BLOCK}, the default of SGLang and lmdeploy is 4" in notes[0], notes
    assert f"block_size: {BLOCK} in SGLang's --dllm-algorithm-config" in notes[0]
    assert f"--dllm-block-length {BLOCK}" in notes[0]
    assert "copy modeling_sdar.py and fused_linear_diffusion_cross_entropy.py" in notes[1]


def test_transformers_5s_own_qwen3_config_has_no_rope_theta_attribute(exports):
    """Negative control of the SDAR config class: transformers 5 folds `rope_theta` into `rope_parameters`, so
    without our `SDARConfig` SGLang's `getattr(config, "rope_theta", 10000.0)` would read 10000."""
    import transformers
    from transformers import Qwen3Config

    if int(transformers.__version__.split(".")[0]) < 5:
        pytest.skip("transformers 4 keeps rope_theta as an attribute of Qwen3Config")
    root, _ = exports
    loaded = Qwen3Config.from_pretrained(os.path.join(root, "exports", "qwen3_sdar"))
    assert getattr(loaded, "rope_theta", 10000.0) == 10000.0 and loaded.rope_parameters["rope_theta"] == 1000000.0


def test_fast_dllm_v2_export_has_the_fields_its_code_reads(exports):
    from transformers import AutoTokenizer, Qwen2Config

    root, logs = exports
    config = _config(root, "qwen2_fast_dllm_v2")
    # Fast-dLLM v2's modeling.py (its Hub release, Fast_dLLM_v2_7B/modeling.py): Fast_dLLM_QwenModel reads
    # config.bd_size (the training mask's block), Fast_dLLM_QwenAttention config.layer_types[layer] and
    # config.sliding_window; forward/generate default mask_id=151665, generate block_size=32.
    assert config["architectures"] == ["Fast_dLLM_QwenForCausalLM"] and config["model_type"] == "Fast_dLLM_Qwen"
    assert config["bd_size"] == BLOCK and config["block_size"] == BLOCK and config["mask_token_id"] == 151665
    assert (config["bdlm_objective"], config["bdlm_label_shift"]) == ("fast-dllm-v2", 1)
    assert config["layer_types"] == ["full_attention"] * 2 and config["sliding_window"] is None
    assert config["use_sliding_window"] is False
    # its config class takes rope_theta (default 10000) and its rotary embedding reads rope_scaling.
    assert config["rope_theta"] == 1000000.0 and config["rope_scaling"] is None
    assert config["tie_word_embeddings"] is True and config["vocab_size"] == QWEN_ROWS  # the trained run's vocabulary
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling.Fast_dLLM_QwenForCausalLM"
    assert config["auto_map"]["AutoConfig"] == "configuration.Fast_dLLM_QwenConfig"
    assert not {"configuration.py", "modeling.py"} & set(os.listdir(os.path.join(root, "exports", "qwen2_fast_dllm_v2")))

    directory = os.path.join(root, "exports", "qwen2_fast_dllm_v2")
    loaded = Qwen2Config.from_pretrained(directory)
    assert (loaded.bd_size, loaded.mask_token_id, loaded.layer_types) == (BLOCK, 151665, ["full_attention"] * 2)
    assert loaded.rope_parameters["rope_theta"] == 1000000.0
    assert set(FAST_DLLM_V2_DEFAULTS) <= set(config)  # none of its config class's defaults applies
    engine_kind = _fast_dllm_v2_kind_config().from_pretrained(directory)
    _assert_reads({name: getattr(engine_kind, name, MISSING) for name in FAST_DLLM_V2_READS}, config,
                  FAST_DLLM_V2_READS)
    tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True,
                                              trust_remote_code=False)  # auto_map names no tokenizer: no prompt
    assert tokenizer.mask_token_id == 151665
    _assert_tokenizer_config_for_transformers_4(directory, "Qwen2Tokenizer")
    _assert_same_weights(root, "qwen2_fast_dllm_v2", "qwen2_hf")
    notes = [line for line in logs["qwen2_fast_dllm_v2"] if "note:" in line]
    assert len(notes) == 2 and f"generate(..., block_size={BLOCK})" in notes[0], notes
    assert "configuration.py and modeling.py" in notes[1]


def test_the_plain_export_has_none_of_the_engines_fields(exports):
    """Negative control: `--format hf` (the default) keeps the source architecture and writes no engine keys."""
    root, logs = exports
    for name, family, architecture in (("qwen3_hf", "qwen3", "Qwen3ForCausalLM"), ("qwen2_hf", "qwen2", "Qwen2ForCausalLM")):
        config = _config(root, name)
        assert config["architectures"] == [architecture] and config["model_type"] == family, name
        assert not {"auto_map", "torch_dtype", "rope_theta"} & set(config), name
        assert "configuration_sdar.py" not in os.listdir(os.path.join(root, "exports", name))
        assert not [line for line in logs[name] if "note:" in line]
    assert "bd_size" not in _config(root, "qwen3_hf") and _config(root, "qwen2_hf")["bd_size"] == BLOCK
    # --overwrite replaces an SDAR export whole: the plain export over it keeps no SDAR file or key
    assert sorted(os.listdir(os.path.join(root, "exports", "replaced"))) == \
        sorted(os.listdir(os.path.join(root, "exports", "qwen3_hf")))
    assert _config(root, "replaced") == _config(root, "qwen3_hf")


@pytest.mark.parametrize("name, fmt, message", [
    ("qwen2/ckpt", "sdar", "--format sdar: SDARForCausalLM (SGLang and lmdeploy) is a Qwen3 (QK-norm) model and "
                           "this checkpoint is a Qwen2 / Qwen2.5 (QKV bias) model; export it with --format hf"),
    ("qwen3/ckpt", "fast-dllm-v2", "--format fast-dllm-v2: Fast_dLLM_QwenForCausalLM (Fast-dLLM v2's model code) is a "
                                   "Qwen2 / Qwen2.5 (QKV bias) model and this checkpoint is a Qwen3"),
    ("qwen2/ckpt", "fast-dllm-v2", "this checkpoint records --bdlm-objective bd3lm (noisy row p predicts token p; an "
                                   "import not yet fine-tuned records bd3lm); fine-tune it with --bdlm-objective "
                                   "fast-dllm-v2"),
    ("tiny_qwen3/ckpt", "sdar", "--format sdar: this checkpoint's MASK id is 300 but the MASK id of SGLang and "
                                "lmdeploy is hard-coded to 151669"),
], ids=["sdar of qwen2", "fast-dllm-v2 of qwen3", "fast-dllm-v2 of a bd3lm checkpoint", "sdar with MASK 300"])
def test_what_a_format_cannot_honour_is_one_line_exit_2_and_nothing_written(exports, tmp_path, capsys, name, fmt,
                                                                          message):
    """Refused before anything is written: no --hf-dir, no private directory beside it. (`main` is what the
    script exits with; the first case runs the script itself, for its exit status.)"""
    root, _ = exports
    argv = ["export", "--load", os.path.join(root, name), "--hf-dir", str(tmp_path / "export"), "--format", fmt]
    if fmt == "sdar" and name == "qwen2/ckpt":
        code, stdout, stderr = _convert(*argv)
    else:
        code = convert_hf.main(argv)
        stdout, stderr = capsys.readouterr()
    assert code == 2 and len(stderr.strip().splitlines()) == 1 and message in stderr, stderr
    assert stderr.startswith("convert_hf.py: error: --format ") and "Traceback" not in stdout + stderr
    assert os.listdir(tmp_path) == [], os.listdir(tmp_path)


def test_each_format_states_its_engines_facts():
    """The facts each format refuses or notes by, without a checkpoint: SDAR wants a BD3-LM Qwen3 at MASK 151669,
    Fast-dLLM v2 a shifted-label Qwen2 at 151665; the plain export takes anything."""
    from megatron_csbp.tools import hf_formats
    from megatron_csbp.core.rules import ConfigError

    sdar, fast, plain = hf_formats.SDAR, hf_formats.FAST_DLLM_V2, hf_formats.HF
    assert sdar.problem("qwen3", "bd3lm", 151669) is None and fast.problem("qwen2", "fast-dllm-v2", 151665) is None
    assert "records --bdlm-objective fast-dllm-v2 (noisy row p predicts token p+1" in \
        sdar.problem("qwen3", "fast-dllm-v2", 151669)
    assert "is a Llama model" in sdar.problem("llama", "bd3lm", 151669)
    assert "hard-coded to 151665" in fast.problem("qwen2", "fast-dllm-v2", 151669)
    assert all(plain.problem(family, objective, 7, clean) is None for family in ("llama", "qwen2", "qwen3")
               for objective in ("bd3lm", "fast-dllm-v2") for clean in ("block-causal", "token-causal"))
    for engine, family, objective, mask in ((sdar, "qwen3", "bd3lm", 151669), (fast, "qwen2", "fast-dllm-v2", 151665)):
        assert "trained with --bdlm-clean-attention token-causal" in engine.problem(family, objective, mask,
                                                                                     "token-causal")
    assert sdar.notes(4) == [sdar.notes(16)[1]] and fast.notes(32) == [fast.notes(16)[1]] and plain.notes(16) == []
    with pytest.raises(ConfigError, match="--format gguf: not an export format; choose one of hf, sdar, fast-dllm-v2"):
        hf_formats.export_format("gguf")


def test_the_tokenizer_config_names_what_transformers_4_loads():
    """`portable_tokenizer_config` on what transformers 5 writes: its generic `TokenizersBackend` becomes
    `PreTrainedTokenizerFast`, a list of `extra_special_tokens` becomes 4.x's `additional_special_tokens`, the keys
    of how it was loaded (`local_files_only`) go; a family's own class, 4.x's dict of named tokens and every other
    key stay as they are."""
    written = {"tokenizer_class": "TokenizersBackend", "backend": "tokenizers", "mask_token": "<|mask|>",
               "extra_special_tokens": ["<|im_start|>", "<|im_end|>"], "local_files_only": True, "is_local": True}
    assert convert_hf.portable_tokenizer_config(written) == {
        "tokenizer_class": "PreTrainedTokenizerFast", "backend": "tokenizers", "mask_token": "<|mask|>",
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"]}
    assert written["tokenizer_class"] == "TokenizersBackend"  # the argument is not changed
    family = {"tokenizer_class": "Qwen2Tokenizer", "extra_special_tokens": {"image_token": "<|image_pad|>"}}
    assert convert_hf.portable_tokenizer_config(family) == family
    assert convert_hf.portable_tokenizer_config({"eos_token": "<|endoftext|>"}) == {"eos_token": "<|endoftext|>"}
