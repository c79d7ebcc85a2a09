"""`megatron_csbp.layout`, kept for users' imports: the row layouts live in `megatron_csbp.core.layout`."""

from megatron_csbp.core.layout import CPLayout, CSBPLayout, block_cost, layout_for  # noqa: F401
