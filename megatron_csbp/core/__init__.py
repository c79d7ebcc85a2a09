"""The op and what it stands on: layouts, kernels, collectives, groups, the device, the rules. torch only.

Nothing here imports Megatron: the layers above (`mcore`, `bdlm`, `training`, `tools`) import it, never the
reverse (`tests/test_suite_rules.py` checks).
"""
