"""Installs `megatron_csbp`; the version ranges are the ones our CI tests (torch 2.13, megatron-core 0.16.1)."""

from setuptools import find_packages, setup

setup(
    name="megatron-csbp",
    version="0.1.0",
    description="Context-sharded block parallelism (CSBP) for block diffusion language models on Megatron-Core",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["megatron_csbp", "megatron_csbp.*"]),
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.6,<2.15",
        "megatron-core>=0.16.1,<0.17",
        "numpy>=1.26,<3",
        "PyYAML>=6.0,<7",
        # megatron-core's checkpoint writer processes import psutil without declaring it.
        "psutil>=5.9",
        "tensorboard>=2.15,<3",
        "matplotlib>=3.8,<4",
    ],
    extras_require={
        "test": ["pytest>=8,<10", "pytest-timeout>=2.3,<3"],
        # scripts/convert_hf.py (Hugging Face import/export) and, in tests, the reference models.
        "hf": ["transformers>=5.0,<6", "safetensors>=0.4", "tokenizers>=0.21"],
        "gpu": ["transformer-engine[pytorch]"],
        # Gated DeltaNet layers' delta rule on GPUs (core.kernels.gated_delta; the torch chunked rule elsewhere).
        "fla": ["flash-linear-attention>=0.5"],
        # What Megatron-LM's `megatron.training` imports beyond megatron-core (Megatron-LM itself is not on
        # PyPI: see the README). triton is not listed: on GPUs it comes with torch, on CPUs it is not needed.
        "megatron-lm": ["six>=1.16", "regex>=2023", "pydantic>=2,<3"],
        # python -m megatron_csbp.harness (lm-evaluation-harness benchmarks); lm-eval's base install pulls no torch.
        "eval": ["lm-eval>=0.4.13,<0.5"],
    },
)
