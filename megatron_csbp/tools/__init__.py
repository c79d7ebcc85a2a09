"""What a user runs beside training: the side-by-side benchmark, the topology planner, the sampler, and the
commands behind scripts/ (generation, HF conversion, data preparation, the GPU check, Slurm submission)."""
