"""A run: arguments and YAML config, the providers both loops share, our megatron-core loop and Megatron-LM's
`pretrain()`, checkpoints, progress, and the torchrun launcher that validates a run before its ranks start.
"""
