"""Export formats: the Hugging Face directory `scripts/convert_hf.py export --format NAME` writes, per serving engine.

`hf` (the default) is the plain export: the source family's own architecture (`LlamaForCausalLM`,
`Qwen2ForCausalLM`, `Qwen3ForCausalLM`) and our decoding keys (`hf.bdlm_config`). The other formats make
the same weights (byte for byte) loadable by an engine that decodes block diffusion LMs, under the
architecture, `model_type` and config keys that engine reads. Each format states its own facts, all read
from the engines' sources (the README's "Exports for serving engines" names the files):

* `sdar`: SDAR (JetAstra/SDAR) is Qwen3 with the BD3-LM decoding: SGLang's `DllmConfig` recognises it by
  `architectures[0] == "SDARForCausalLM"`, lmdeploy's `SDARModelConfigBuilder` by `model_type == "sdar"`
  (and its model by the architecture), and both hard-code MASK id 151669 (Qwen3's first id past its tokenizer) and a default block of 4
  (SGLang's `--dllm-algorithm-config` YAML `block_size`, lmdeploy's `--dllm-block-length` change it).
  SDAR decodes in place (`generate.py` writes the token sampled at row p to position p): our `bd3lm`.
  SDAR's own `modeling_sdar.py` (which the user adds; `auto_map` names it) imports our `configuration_sdar.py`
  and reads `fuse_cross_entropy`, `block_size`, `mask_token_id` and `rope_theta` (through transformers' RoPE).
* `fast-dllm-v2`: Fast-dLLM v2 is Qwen2.5 (QKV bias) with shifted labels (its `generate` reads position
  p's token from row p-1): our `fast-dllm-v2`. Its model code reads `bd_size` (the training mask's block)
  and `layer_types` from `config.json` and takes MASK id 151665 (Qwen2.5's first id past its tokenizer)
  and block 32 as defaults of `generate`.

Neither engine has an architecture for a Gated DeltaNet hybrid (Qwen3.5): Fast-dLLM v2's release (NVlabs/Fast-dLLM
`v2/`, the hub's Fast_dLLM_v2_1.5B / 7B) is `Fast_dLLM_QwenForCausalLM` alone, and SDAR is Qwen3. Turbo-dLLM 0.1.6
names one, `Qwen3_5FastDLLMForCausalLM`, in its Qwen3.8 export's config, with no model code for it. Such a
checkpoint exports with `--format hf` only.

Why refuse or only warn: an engine that hard-codes the MASK id would feed the model an id it never
learned as MASK, and an engine decoding the other label shift would read every token one position off:
those exports are refused before anything is written. The block size is a flag of each engine, so a block
other than the engine's default is exported with a note that says which flag to give.
"""

from dataclasses import dataclass, field
from typing import Callable

from megatron_csbp.core import objectives
from megatron_csbp.core.clean_attention import BLOCK_CAUSAL, CLEAN_ATTENTIONS
from megatron_csbp.core.rules import ConfigError
from megatron_csbp.tools.hf import FAMILIES, QWEN2, QWEN3

# Our own config class for model_type "sdar": transformers has none, so SGLang's get_config (AutoConfig, with
# --trust-remote-code) needs one named by auto_map, and SDAR's modeling_sdar.py imports it as `.configuration_sdar`.
# It is Qwen3's config under SDAR's name (SDAR is Qwen3), with `rope_theta` an attribute under transformers 5 too.
SDAR_CONFIGURATION = '''"""SDAR's config: Qwen3's fields under model_type "sdar" (written by megatron_csbp's `convert_hf.py export
--format sdar`, so that `AutoConfig.from_pretrained(DIR, trust_remote_code=True)` knows the model type)."""

from transformers import Qwen3Config


class SDARConfig(Qwen3Config):
    model_type = "sdar"

    def __post_init__(self, **kwargs):
        """transformers 5 (the only version that calls this) folds `rope_theta` into `rope_parameters`; SGLang's and
        SDAR's model code read `config.rope_theta` (transformers 4's Qwen3Config keeps it as an attribute itself)."""
        super().__post_init__(**kwargs)
        self.rope_theta = self.rope_parameters["rope_theta"]
'''

def _rope_keys(config: dict) -> dict:
    """RoPE in the v4 spelling the engines read (`rope_theta`, `rope_scaling`) beside transformers 5's
    `rope_parameters`: SGLang's SDAR model and Fast-dLLM v2's config fall back to theta 10000 without it."""
    rope = config.get("rope_parameters") or {}
    scaling = None if rope.get("rope_type", "default") == "default" else \
        {key: value for key, value in rope.items() if key != "rope_theta"}
    return {"rope_theta": rope.get("rope_theta", 10000.0), "rope_scaling": scaling}


def _full_attention_keys(config: dict) -> dict:
    """Full attention in every layer, said explicitly: lmdeploy's default builder takes `use_sliding_window`
    as true when absent, its SDAR attention reads `config.sliding_window`, Fast-dLLM v2 indexes `layer_types`."""
    return {"use_sliding_window": False, "sliding_window": None,
            "layer_types": ["full_attention"] * config["num_hidden_layers"]}


def _sdar_keys(config: dict, block_size: int) -> dict:
    """`fuse_cross_entropy`: SDAR's `SDARForCausalLM.forward` reads it (false: plain logits, no fused loss)."""
    return {**_rope_keys(config), **_full_attention_keys(config), "attention_bias": False, "fuse_cross_entropy": False,
            "torch_dtype": config["dtype"],
            "auto_map": {"AutoConfig": "configuration_sdar.SDARConfig", "AutoModel": "modeling_sdar.SDARModel",
                         "AutoModelForCausalLM": "modeling_sdar.SDARForCausalLM"}}


def _fast_dllm_v2_keys(config: dict, block_size: int) -> dict:
    return {**_rope_keys(config), **_full_attention_keys(config), "bd_size": block_size,
            "torch_dtype": config["dtype"],
            "auto_map": {"AutoConfig": "configuration.Fast_dLLM_QwenConfig", "AutoModel": "modeling.Fast_dLLM_QwenModel",
                         "AutoModelForCausalLM": "modeling.Fast_dLLM_QwenForCausalLM"}}


@dataclass(frozen=True)
class ExportFormat:
    """One export format and the facts of the engine it is for (None: the plain export does not constrain it).

    `families`: the source families it accepts; `architecture` / `model_type`: what `config.json` names;
    `objective`: the `--bdlm-objective` whose label shift the engine decodes; `mask_token_id` /
    `block_size`: the ids the engine hard-codes (`mask_source` says where), `block_size_flag` how the
    engine is given another block; `keys(config, block_size)`: the config keys it adds; `files`: files
    written beside `config.json` (name -> text); `needs`: what the user adds before the engine loads it."""

    name: str
    engines: str = ""
    families: tuple | None = None  # hf.Family objects
    architecture: str | None = None
    model_type: str | None = None
    objective: objectives.ObjectiveKind | None = None
    clean_attention: object = None  # the clean-attention rule the engine decodes committed blocks with
    mask_token_id: int | None = None
    mask_source: str = ""
    block_size: int | None = None
    block_size_flag: str = ""
    keys: Callable[[dict, int], dict] = lambda config, block_size: {}
    files: dict = field(default_factory=dict)
    needs: str = ""

    def problem(self, family: str, objective: str, mask_token_id: int,
                clean_attention: str = BLOCK_CAUSAL.name) -> str | None:
        """One line naming `--format` and the fix, or None: what this format cannot honour for a checkpoint
        (`family`, `objective`, `clean_attention`: the names it records)."""
        flag = f"--format {self.name}"
        if self.families is not None and family in FAMILIES and FAMILIES[family].hybrid:
            return (f"{flag}: {self.engines} has no architecture for {FAMILIES[family].display} models: its "
                    f"{self.architecture} has attention layers only, none of Gated DeltaNet; export it with --format "
                    f"{HF.name}")
        if self.families is not None and FAMILIES.get(family) not in self.families:
            wanted = " or ".join(accepted.display for accepted in self.families)
            return (f"{flag}: {self.architecture} ({self.engines}) is a {wanted} model and this checkpoint is a "
                    f"{FAMILIES[family].display if family in FAMILIES else family} model; export it with --format "
                    f"hf, or fine-tune an import of a {wanted} model")
        objective = objectives.objective_kind(objective)
        if self.objective is not None and objective is not self.objective:
            other = [fmt.name for fmt in FORMATS.values() if fmt.objective is objective]
            return (f"{flag}: the decoding of {self.engines} is --bdlm-objective {self.objective}'s "
                    f"({self.objective.target}) but this checkpoint records --bdlm-objective {objective} "
                    f"({objective.target}; an import not yet fine-tuned records {objectives.BD3LM}); fine-tune it "
                    f"with --bdlm-objective {self.objective}, or export it with --format {' / '.join(other + [HF.name])}")
        if self.clean_attention is not None and CLEAN_ATTENTIONS(clean_attention) is not self.clean_attention:
            return (f"{flag}: {self.engines} decode committed blocks with {self.clean_attention} clean attention, "
                    f"and this checkpoint was trained with --bdlm-clean-attention {clean_attention}: the engine "
                    f"would compute other keys than the model learned; export it with --format {HF.name}")
        if self.mask_token_id is not None and mask_token_id != self.mask_token_id:
            return (f"{flag}: this checkpoint's MASK id is {mask_token_id} but the MASK id of {self.engines} is "
                    f"hard-coded to {self.mask_token_id} ({self.mask_source}); "
                    f"import the model with its own tokenizer ({self.mask_token_id} ids: the new MASK lands on "
                    f"id {self.mask_token_id}) or with --mask-token naming its token at id {self.mask_token_id}, "
                    f"and fine-tune from that import")
        return None

    def notes(self, block_size: int) -> list[str]:
        """What the user must tell the engine or add to the directory (printed by the export, not refusals)."""
        notes = []
        if self.block_size is not None and block_size != self.block_size:
            notes.append(f"note: --format {self.name}: this model decodes blocks of {block_size}, the default of "
                         f"{self.engines} is {self.block_size}: "
                         f"{self.block_size_flag.format(block_size=block_size)}")
        if self.needs:
            notes.append(f"note: --format {self.name}: {self.needs}")
        return notes

    def config(self, config: dict, family: str, objective: str, block_size: int, mask_token_id: int,
               clean_attention: str = BLOCK_CAUSAL.name) -> dict:
        """`config` (the plain export's config.json) as this format writes it; refuses (ConfigError) first."""
        problem = self.problem(family, objective, mask_token_id, clean_attention)
        if problem:
            raise ConfigError(problem)
        config = dict(config)
        if self.architecture:
            config.update(architectures=[self.architecture], model_type=self.model_type)
        config.update(self.keys(config, block_size))
        return config


HF = ExportFormat("hf")
SDAR = ExportFormat(
    "sdar", engines="SGLang and lmdeploy", families=(QWEN3,), architecture="SDARForCausalLM", model_type="sdar",
    objective=objectives.BD3LM, clean_attention=BLOCK_CAUSAL, mask_token_id=151669,
    mask_source="SGLang's DLLM_PARAMS in python/sglang/srt/dllm/config.py, lmdeploy's "
                "lmdeploy/pytorch/configurations/sdar.py",
    block_size=4,
    block_size_flag="serve it with block_size: {block_size} in SGLang's --dllm-algorithm-config YAML, or lmdeploy's "
                    "--dllm-block-length {block_size}",
    keys=_sdar_keys, files={"configuration_sdar.py": SDAR_CONFIGURATION},
    needs="SGLang and lmdeploy run their own SDAR code; SDAR's own (its generate.py loads AutoModelForCausalLM with "
          "trust_remote_code=True) is not included: copy modeling_sdar.py and fused_linear_diffusion_cross_entropy.py "
          "from SDAR's release (JetAstra/SDAR training/model/SDAR-4B-Chat, or a JetLM/SDAR-*-Chat model) into the "
          "directory; they need flash-attn, triton and the transformers SDAR pins (4.52.4)")
FAST_DLLM_V2 = ExportFormat(
    "fast-dllm-v2", engines="Fast-dLLM v2's model code", families=(QWEN2,),
    architecture="Fast_dLLM_QwenForCausalLM", model_type="Fast_dLLM_Qwen", objective=objectives.FAST_DLLM_V2,
    clean_attention=BLOCK_CAUSAL,
    mask_token_id=151665,
    mask_source="the mask_id=151665 default of Fast_dLLM_QwenForCausalLM.forward and .generate in its modeling.py",
    block_size=32,
    block_size_flag="call its generate(..., block_size={block_size}) (bd_size in config.json only sets its training "
                    "mask)",
    keys=_fast_dllm_v2_keys,
    needs="Fast-dLLM v2's own configuration.py and modeling.py (its release's code, which config.json's auto_map "
          "names) are not included: copy them from the Fast_dLLM_v2 release (e.g. Efficient-Large-Model/"
          "Fast_dLLM_v2_1.5B) into the directory to load it with trust_remote_code=True")

FORMATS = {fmt.name: fmt for fmt in (HF, SDAR, FAST_DLLM_V2)}


def export_format(name: str) -> ExportFormat:
    """The format `--format name` names; refuses an unknown one in one line."""
    if name not in FORMATS:
        raise ConfigError(f"--format {name}: not an export format; choose one of {', '.join(FORMATS)}")
    return FORMATS[name]
