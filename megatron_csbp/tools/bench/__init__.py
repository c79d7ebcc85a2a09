"""The side-by-side benchmark of the parallel modes (`python -m megatron_csbp.bench`; its flags and what it
measures: `cli`), one idea a module:

* `cli`: the command line and its checks (every run it makes is the trainer's `RunConfig`);
* `records`: the typed records the tables, the plots and the JSON are made from;
* `mode_run`: one mode's model and timed steps in spawned ranks, and what each rank measures;
* `memory`: saved activations, peak memory and exact peak tensor bytes, each transport's peaks, a step's with the
  LM head's logits whole and tiled;
* `interleaved`: every mode of a length in the same ranks, steps alternating;
* `calibration`: the machine's rates timed in the ranks, and the planner's prediction beside each step;
* `experts`: the mixture of experts: routing, parameters, optimizer state, the planner's figures;
* `kernel_check`: the CPU kernel against a dense matmul, every rank's kernels on its own plan;
* `document_balance`: the per-rank balance of random packings of documents;
* `report` and `plots`: the tables and the figures;
* `command`: `main`, which runs what the command line asks and writes the JSON.
"""
