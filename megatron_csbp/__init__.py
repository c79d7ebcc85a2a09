"""megatron_csbp: context-sharded block parallelism (CSBP) for block diffusion LMs on Megatron-Core.

Layers, each importing only the ones before it (`tests/test_suite_rules.py` checks):
`core` (layouts, the op, kernels, collectives, groups, device, rules: torch only) -> `runtime` (one-line
refusals, launching ranks, publishing files whole, safe loading) -> `data` (indexed datasets, loss masks,
tokenizers) -> `mcore` (megatron-core glue: parallel state, spec, model, CPU backend) -> `bdlm` (objective,
forward step, FLOPs) -> `training` (arguments, config, providers, both loops, checkpoints) -> `tools` (bench,
plan, sampler, Hugging Face import and export, the scripts' commands).
Each module has one import path, in its layer (`megatron_csbp.core.layout`, `megatron_csbp.core.ops`, ...);
the top-level `bench`, `plan` and `torchrun` are only the commands `python -m megatron_csbp.bench`, `.plan`
and `.torchrun`.
"""

__version__ = "0.1.0"
