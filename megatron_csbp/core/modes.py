"""The parallel modes — CSBP, conventional CP over `[x_t ; x_0]`, pure BP — as objects that state their facts.

Every fact that differs between the modes lives on its mode: how many clean shards it takes, which geometry
its layout needs, how many rows and attention pairs a rank holds, how many tokens' K/V its ring gathers,
and which layout describes a rank. The trainer's checks (`rules`), the layouts, the FLOP and byte counts
(`flops`), the planner and the bench ask the mode (`parallel_mode(name)`) instead of testing its name, so
a new mode is one class here (docs/algorithm.md §4–§5 for the layouts).

Standard library only (the planner runs without torch): `layout()` imports the torch layouts when called.
"""

import dataclasses


@dataclasses.dataclass(frozen=True)
class ParallelMode:
    """One way to split `[x_t ; x_0]` over `P` block-parallel ranks with `C` clean shards (base: CSBP's)."""

    name: str
    summary: str
    # Copies of the sequence whose K/V the ring carries: CSBP the clean copy, CP both, BP none.
    transported_copies: int
    is_baseline: bool = False  # what the field runs; the others are compared with it

    def clean_shard_choices(self, parallel_size: int) -> list[int]:
        """The `C` worth planning at `P` ranks: CSBP with `C = 1` is pure BP, and at `P = 1` all modes are
        the same run (the baseline stands for it)."""
        return [c for c in range(2, parallel_size + 1) if parallel_size % c == 0]

    def traits(self, parallel_size: int, clean_shards: int) -> list[str]:
        """What sets a layout of this mode apart, in a few words (the planner's reasons)."""
        if parallel_size > clean_shards:
            return [f"clean rows replicated {parallel_size // clean_shards}x"]
        return []

    @property
    def compared_with_baseline(self) -> bool:
        """Whether its traffic is worth setting beside the baseline's (it has a ring and is not the baseline)."""
        return self.transported_copies > 0 and not self.is_baseline

    def clean_shards(self, parallel_size: int, given: int | None = None) -> int:
        """`C`: the clean-shards flag, or `P` when it is unset."""
        return parallel_size if given is None else given

    def clean_shards_problem(self, parallel_size: int, given: int | None, flags) -> str | None:
        """What this mode refuses of the clean-shards flag (`given`, None when unset)."""
        return None

    def geometry_problem(self, seq_length: int, block_size: int, parallel_size: int, clean_shards: int,
                         clean_layout: str, flags) -> str | None:
        """This mode's cut of the sequence, past the rules every mode shares (whole blocks, a block per rank)."""
        chunks = 2 * clean_shards if clean_layout == "zigzag" else clean_shards
        if seq_length % chunks == 0:
            return None
        return (f"{flags.seq_length} {seq_length} cannot be cut into {chunks} equal clean chunks ({flags.clean_layout} "
                f"{clean_layout}, {flags.clean_shards} {clean_shards}); use a multiple of {chunks}")

    def rows(self, seq_length: int, parallel_size: int, clean_shards: int) -> tuple[int, int]:
        """(noisy, clean) rows of one rank: whole blocks of the `L/P` noisy rows, a `1/C` shard of the clean."""
        return seq_length // parallel_size, seq_length // clean_shards

    def attention_pairs(self, parts: dict, parallel_size: int, clean_shards: int) -> tuple[float, float]:
        """(all, local) query-key pairs of one rank, from the whole mask's parts (`flops.bdlm_attention_pair_
        parts`): local pairs need no key from another rank, so they can hide the ring's traffic."""
        P, C = parallel_size, clean_shards
        return ((parts["noisy_noisy"] + parts["noisy_clean"]) / P + parts["clean_clean"] / C,
                parts["noisy_noisy"] / P)

    def gathered_tokens(self, seq_length: int, clean_shards: int) -> int:
        """Tokens whose K/V one layer's ring gathers on every rank (none without a ring)."""
        return self.transported_copies * seq_length if clean_shards > 1 else 0

    def layout(self, seq_length: int, block_size: int, parallel_size: int, clean_shards: int | None = None,
               rank: int = 0, **options):
        """The rows rank `rank` holds (`core.layout`; `options`: the schedule and clean layout)."""
        from megatron_csbp.core.layout import CSBPLayout

        return CSBPLayout(seq_length, block_size, parallel_size, self.clean_shards(parallel_size, clean_shards),
                          rank, **options)


class _PureBlockParallel(ParallelMode):
    """Every rank keeps the whole clean sequence: nothing travels, the clean prefix is computed `P` times."""

    def clean_shard_choices(self, parallel_size):
        return [1] if parallel_size > 1 else []

    def traits(self, parallel_size, clean_shards):
        return ["no attention traffic, every rank recomputes the clean prefix"]

    def clean_shards(self, parallel_size, given=None):
        return 1

    def clean_shards_problem(self, parallel_size, given, flags):
        if given in (None, 1):
            return None
        return (f"{flags.mode} bp replicates the clean sequence (one clean shard); drop {flags.clean_shards} {given} "
                f"or use {flags.mode} csbp")


class _ContextParallel(ParallelMode):
    """Megatron's context parallelism applied to the `2L` rows: `2P` zigzag chunks of `[x_t ; x_0]`, whose
    K/V all travel."""

    def clean_shard_choices(self, parallel_size):
        return [parallel_size]

    def traits(self, parallel_size, clean_shards):
        if clean_shards > 1:
            return ["gathers K/V of all 2L rows behind the same local noisy attention"]
        return ["no sequence sharding"]

    def clean_shards(self, parallel_size, given=None):
        return parallel_size

    def clean_shards_problem(self, parallel_size, given, flags):
        if given in (None, parallel_size):
            return None
        return f"{flags.mode} cp shards both copies over all {parallel_size} ranks; drop {flags.clean_shards} {given}"

    def geometry_problem(self, seq_length, block_size, parallel_size, clean_shards, clean_layout, flags):
        L, B, P = seq_length, block_size, parallel_size
        if L % (P * B) == 0:
            return None
        return (f"{flags.mode} cp cuts [x_t ; x_0] into {2 * P} chunks of whole blocks: {flags.seq_length} {L} "
                f"must be a multiple of {P * B} ({flags.parallel_size} x {flags.block_size})")

    def rows(self, seq_length, parallel_size, clean_shards):
        return seq_length // clean_shards, seq_length // clean_shards

    def attention_pairs(self, parts, parallel_size, clean_shards):
        return sum(parts.values()) / clean_shards, parts["noisy_noisy"] / clean_shards

    def layout(self, seq_length, block_size, parallel_size, clean_shards=None, rank=0, **options):
        """Chunks by position: CSBP's schedule and clean layout do not apply."""
        from megatron_csbp.core.layout import CPLayout

        return CPLayout(seq_length, block_size, parallel_size, rank)


CSBP = ParallelMode("csbp", "CSBP: whole noisy blocks per rank (dual-end), a zigzag shard of the clean copy; "
                            "only clean K/V travel", transported_copies=1)
CP = _ContextParallel("cp", "conventional context parallelism over [x_t ; x_0] (the baseline): K/V of both "
                            "copies travel", transported_copies=2, is_baseline=True)
BP = _PureBlockParallel("bp", "pure block parallelism: the clean copy replicated on every rank, nothing travels",
                        transported_copies=0)

PARALLEL_MODES = {mode.name: mode for mode in (CSBP, CP, BP)}  # the flag's choices, in its order


def parallel_mode(name: str) -> ParallelMode:
    """The mode called `name` (a `--bdlm-parallel-mode` value); `ValueError` naming the choices otherwise."""
    if name not in PARALLEL_MODES:
        raise ValueError(f"--bdlm-parallel-mode {name!r}: choose one of {', '.join(PARALLEL_MODES)}")
    return PARALLEL_MODES[name]
