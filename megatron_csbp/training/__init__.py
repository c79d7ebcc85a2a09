"""A run: arguments and YAML config, data, the providers both loops share, our megatron-core loop and
Megatron-LM's `pretrain()`, checkpoints, progress, launching and supervising ranks, Hugging Face weights.
"""
