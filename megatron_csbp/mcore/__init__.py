"""megatron-core glue: the block-parallel dimension in its CP slot, the layer spec whose core attention is
CSBP, the BDLM GPT model, and the CPU backend that neutralises its CUDA assumptions. Imports `core`.
"""
