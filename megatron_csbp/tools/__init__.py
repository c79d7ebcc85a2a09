"""What a user runs beside training: the side-by-side benchmark, the topology planner, the sampler."""
