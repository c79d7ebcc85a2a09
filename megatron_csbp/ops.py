"""`megatron_csbp.ops`, kept for users' imports: the CSBP op lives in `megatron_csbp.core.ops`."""

from megatron_csbp.core.ops import (RingPlan, collective_backward, collective_forward,  # noqa: F401
                                    context_sharded_block_attention, ring_plan, streaming_backward,
                                    streaming_forward)
