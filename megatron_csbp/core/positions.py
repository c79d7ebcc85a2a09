"""The model's RoPE beyond Megatron's base and percent: YaRN's frequencies and Llama 4's query scaling.

A token's noisy and clean copy share its position (the layout's `row_positions`; under --reset-position-ids
its position within its document), so both copies take the same YaRN angles and the same query scale, and
the sampler, whose position is the row index, takes them at the same positions.

* YaRN (Peng et al., 2023; `YaRN`) interpolates the low RoPE frequencies by `factor`, keeps the high ones, and
  ramps between them over the channels that turn between `beta_slow` and `beta_fast` times in the original
  context `original_max_position_embeddings`; cos and sin are multiplied by the attention (concentration)
  factor. megatron-core computes it (`YarnRotaryEmbedding`, and the attention's concentration factor), reading
  its `TransformerConfig.yarn_*` fields; Megatron-LM's parser (tag core_v0.16.1) has no flags for them, so the
  plugin's `--yarn-*` flags are those fields' names. transformers' `rope_type: yarn` is the same model.
* Llama 4's query scaling (`QueryScaling`; transformers' Ministral 3 `llama_4_scaling_beta`, Megatron-Bridge's
  Nemotron-Labs-Diffusion): after RoPE each query is multiplied by `1 + beta * log(1 + floor(p / L0))`, `p` the
  row's RoPE position (the one RoPE turns it by, as transformers takes it from `position_ids`) and `L0` YaRN's
  original length: queries past the original context sharpen their attention, logarithmically.

`RotaryPositions.from_args` reads these flags: a run's, once, into its `RunConfig`; a checkpoint's record, for
the sampler and the export. Each refusal is one line naming the flag. Standard library only (`QueryScaling.scales` takes torch tensors).
"""

import dataclasses
import math

from megatron_csbp.core.rules import ConfigError, refuse

YARN = "yarn"  # --position-embedding-type of YaRN (megatron-core's name); plain RoPE is "rope"
ROPE = "rope"
# Each YaRN flag (its `args` attribute: megatron-core's `TransformerConfig` field) and the `YaRN` field it sets.
YARN_FLAGS = {"yarn_rotary_scaling_factor": "factor",
              "yarn_original_max_position_embeddings": "original_max_position_embeddings",
              "yarn_beta_fast": "beta_fast", "yarn_beta_slow": "beta_slow", "yarn_mscale": "mscale",
              "yarn_mscale_all_dim": "mscale_all_dim"}
ROUNDING = "yarn_correction_range_round_to_int"  # megatron-core's field; its flag turns it off
NO_ROUNDING = "--no-yarn-correction-range-round-to-int"


def position_embedding_type(args) -> str:
    """The position type Megatron-LM resolves: `--use-rotary-position-embeddings` (its older spelling) makes it rope
    whatever `--position-embedding-type` says."""
    return ROPE if getattr(args, "use_rotary_position_embeddings", False) else args.position_embedding_type


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def yarn_mscale(factor: float, mscale: float) -> float:
    """YaRN's `0.1 * mscale * ln(factor) + 1` (1 when the factor does not extend the context)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@dataclasses.dataclass(frozen=True)
class YaRN:
    """YaRN's RoPE (megatron-core's `yarn_*` fields, without the prefix; `factor` is `yarn_rotary_scaling_factor`)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    correction_range_round_to_int: bool = True  # transformers' `truncate`

    def __post_init__(self):
        refuse(self.problem(), ConfigError)

    def problem(self) -> str | None:
        """The first value YaRN cannot take (one line naming the flag), or None."""
        for name, value, minimum, strict in (("yarn_rotary_scaling_factor", self.factor, 1, False),
                                             ("yarn_beta_fast", self.beta_fast, 0, True),
                                             ("yarn_beta_slow", self.beta_slow, 0, True),
                                             ("yarn_mscale", self.mscale, 0, False),
                                             ("yarn_mscale_all_dim", self.mscale_all_dim, 0, False)):
            if not _finite(value) or value < minimum or (strict and value == minimum):
                return (f"{_flag(name)} must be a finite number {'>' if strict else '>='} {minimum}; got {value}"
                        + (" (how many times the original context the model extends to)" if minimum == 1 else ""))
        length = self.original_max_position_embeddings
        if type(length) is not int or length < 1:
            return f"--yarn-original-max-position-embeddings must be an integer >= 1; got {length}"
        if self.beta_fast < self.beta_slow:
            return (f"--yarn-beta-fast {self.beta_fast} is below --yarn-beta-slow {self.beta_slow}: the ramp runs from "
                    f"the channels turning beta_fast times in the original context to those turning beta_slow times; "
                    f"swap them")
        return None

    @property
    def attention_factor(self) -> float:
        """What cos and sin are multiplied by (megatron-core's concentration factor)."""
        return yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim)

    def config_fields(self) -> dict:
        """megatron-core's `TransformerConfig` fields of this YaRN (its GPTModel and attention read them)."""
        fields = {name: getattr(self, field) if field == "original_max_position_embeddings" else
                  float(getattr(self, field)) for name, field in YARN_FLAGS.items()}
        return {**fields, ROUNDING: self.correction_range_round_to_int}


@dataclasses.dataclass(frozen=True)
class QueryScaling:
    """Llama 4's query scaling: the query at RoPE position `p` times `1 + beta * log(1 + floor(p / L0))`."""

    beta: float
    original_max_position_embeddings: int  # L0: YaRN's original length

    def __post_init__(self):
        refuse(None if _finite(self.beta) and self.beta >= 0 else
               f"--llama-4-scaling-beta must be a finite number >= 0; got {self.beta}", ConfigError)

    def scales(self, positions):
        """Each position's query scale (float32 tensor, the shape of the integer tensor `positions`), computed as
        transformers computes it (so an imported model's logits are transformers' to the last bits)."""
        whole = positions.div(self.original_max_position_embeddings, rounding_mode="floor")
        return 1 + self.beta * (whole + 1).float().log()


@dataclasses.dataclass(frozen=True)
class RotaryPositions:
    """The model's RoPE variant beyond its base and percent: YaRN (None: plain RoPE) and the query scaling (None:
    none; it needs YaRN, whose original length it takes)."""

    yarn: YaRN | None = None
    query_scaling: QueryScaling | None = None

    @property
    def embedding_type(self) -> str:
        """megatron-core's `position_embedding_type` of the model."""
        return YARN if self.yarn is not None else ROPE

    @classmethod
    def from_args(cls, args) -> "RotaryPositions":
        """The RoPE of parsed arguments (either loop's, or a checkpoint's record: one saved before these flags
        existed records none of them, and is plain RoPE); `ConfigError` (one line naming the flag) where the flags
        do not make one."""
        kind = position_embedding_type(args)
        given = {field: getattr(args, dest) for dest, field in YARN_FLAGS.items()
                 if getattr(args, dest, None) is not None}
        rounded = getattr(args, ROUNDING, True)
        beta = getattr(args, "llama_4_scaling_beta", None)
        if kind != YARN:
            stray = [_flag(dest) for dest, field in YARN_FLAGS.items() if field in given]
            stray += [NO_ROUNDING] * (not rounded)
            refuse(stray and f"{stray[0]} is a YaRN setting, but --position-embedding-type is {kind}: give "
                             f"--position-embedding-type yarn, or drop {stray[0]}", ConfigError)
            refuse(beta is not None and f"--llama-4-scaling-beta scales the queries past YaRN's original length "
                                        f"(--yarn-original-max-position-embeddings), but --position-embedding-type is "
                                        f"{kind}: give --position-embedding-type yarn, or drop --llama-4-scaling-beta",
                   ConfigError)
            return cls()
        refuse("factor" not in given and "--position-embedding-type yarn needs --yarn-rotary-scaling-factor F (how "
                                         "many times its original context the model extends to, e.g. 4)", ConfigError)
        refuse("original_max_position_embeddings" not in given and
               "--position-embedding-type yarn needs --yarn-original-max-position-embeddings N (the context the "
               "model was trained at before YaRN)", ConfigError)
        refuse(bool(getattr(args, "use_rope_scaling", False)) and
               "--use-rope-scaling (Llama 3's frequency scaling) and --position-embedding-type yarn would scale the "
               "same frequencies twice; keep one", ConfigError)
        percent = getattr(args, "rotary_percent", 1.0)
        refuse(percent != 1.0 and f"--rotary-percent {percent} with --position-embedding-type yarn: megatron-core's "
                                  f"YaRN turns every channel of a head; use --rotary-percent 1", ConfigError)
        yarn = YaRN(**given, correction_range_round_to_int=bool(rounded))
        scaling = None if beta is None else QueryScaling(beta, yarn.original_max_position_embeddings)
        return cls(yarn, scaling)

    def flags(self) -> dict:
        """These positions as training flags (YAML keys), every YaRN setting explicit."""
        if self.yarn is None:
            return {"position-embedding-type": ROPE}
        fields = self.yarn.config_fields()
        flags = {"position-embedding-type": YARN,
                 **{dest.replace("_", "-"): fields[dest] for dest in YARN_FLAGS}}
        if not self.yarn.correction_range_round_to_int:
            flags[NO_ROUNDING[2:]] = True
        if self.query_scaling is not None:
            flags["llama-4-scaling-beta"] = float(self.query_scaling.beta)
        return flags
