"""megatron_csbp: context-sharded block parallelism (CSBP) for block diffusion LMs on Megatron-Core.

Layers, each importing only the ones before it (`tests/test_suite_rules.py` checks):
`core` (layouts, the op, kernels, collectives, groups, device, rules: torch only) -> `mcore` (megatron-core
glue: parallel state, spec, model, CPU backend) -> `bdlm` (objective, forward step, FLOPs) -> `training`
(arguments, config, data, providers, both loops, checkpoints) -> `tools` (bench, plan, sampler).
`megatron_csbp.layout` and `megatron_csbp.ops` stay importable; `python -m megatron_csbp.bench`, `.plan`
and `.torchrun` stay the commands.
"""

__version__ = "0.1.0"
