"""megatron_csbp: context-sharded block parallelism (CSBP) for block diffusion LMs on Megatron-Core.

The op and layout (`layout`, `kernels`, `comm`, `ops`) depend on torch alone; the Megatron glue
(`parallel_state`, `spec`, `model`, `bdlm`, training) imports them, never the reverse.
"""

__version__ = "0.1.0"
