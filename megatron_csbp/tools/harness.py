"""lm-evaluation-harness model for our block diffusion checkpoints: `--model megatron_csbp`.

    python -m megatron_csbp.harness --model megatron_csbp --model_args load=runs/demo_sequences,mc_samples=32 \\
        --tasks my_task --include_path my_tasks/ --batch_size 4

lm-eval finds models through its registry (no plugin entry point), so `megatron_csbp.harness` registers
`MegatronCSBPLM` and runs lm-eval's own command line unchanged; `import megatron_csbp.tools.harness` does the
same for `lm_eval.simple_evaluate(model="megatron_csbp", ...)`.

What each request type means for a BDLM (a model that gives no left-to-right token probabilities):

* `loglikelihood(context, continuation)` is minus a Monte-Carlo estimate of the BD3-LM NELBO of the
  continuation given the context, a lower bound on log p(continuation | context). The training forward runs
  (the `BDLMGPTModel` over `[x_t ; x_0]` rows of a one-rank CSBP layout at the trained length `L`): context
  tokens are never masked; the continuation tokens of each block are masked with that block's noise and
  scored by the cross-entropy of the noisy row, weighted as the objective weights them. Two estimators,
  both unbiased for the same bound (per block, `sum_k g(k)/k` with `g(k)` the expected CE sum when `k` of
  its `n` continuation tokens are masked): `inverse-t` (the training objective's: `t ~ U(0, 1]`, each token
  masked with probability `t`, weight `1/t`) and `count` (LLaDA's: `k` uniform in `1..n`, `k` tokens masked
  uniformly, weight `n/k`). The `mc_samples` draws per block are stratified (`(u + j/M) mod 1`, each draw
  still uniform), and they depend on `(seed, the request's tokens)` only, so a score does not depend on the
  batch it ran in. Every request is padded to `L` with MASK: the padding inside its last block is MASK
  in the noisy copy (the model is not told where the text ends), later blocks are never seen by its
  blocks (the block mask). A request longer than `L` keeps its last `L` tokens (warned once); the dropped
  continuation tokens are not scored.
* `is_greedy` is True when the sampler (`megatron_csbp.tools.sampling.generate`, the model_args' strategy at
  temperature 0, EOS ignored) decodes exactly the continuation's tokens after the context. It costs one
  decode per request; `greedy_check=false` skips it and reports False.
* `loglikelihood_rolling(text)` is minus the NELBO of the whole text: every token noised, after an
  end-of-document token; texts longer than `L` are scored in windows of `L - L/2` new tokens, each after the
  `L/2` tokens before it.
* `generate_until(context, gen_kwargs)` decodes with the sampler (`strategy`, `steps_per_block`,
  `threshold`, `temperature`, `top_k`, `top_p`, `seed` model_args; gen_kwargs' `until`, `max_gen_toks`,
  `temperature`/`do_sample` honoured): a sample ends at EOS or a stop string, cut before it.

Checkpoints load on one rank, or over `tensor_parallel_size` ranks (`megatron_csbp.tools.inference`, as
`scripts/generate_bdlm.py` samples under TP):

    python -m megatron_csbp.torchrun --standalone --nproc-per-node 2 -m megatron_csbp.harness \
        --model megatron_csbp --model_args load=runs/demo_sequences,tensor_parallel_size=2 --tasks my_task ...

Every rank runs lm-eval's whole command line in lockstep: each builds its TP shard of both models and sees
every request in the same order (the LM tells lm-eval it is rank 0 of 1, so lm-eval splits no requests for
data parallelism), because each model call is a collective of all the ranks. Only rank 0 prints and writes:
on the other ranks stdout goes to /dev/null, lm-eval logs errors only, and the output flags (`--output_path`,
`--log_samples`, `--predict_only`, the W&B/Trackio/Hub loggers, `--show_config`, `--write_out`,
`--cache_requests`) are dropped from the configuration lm-eval builds, whether they came from the command line
or from its `--config` YAML.

Every input is checked before the model loads, and refused in one line (`ConfigError`, exit 2): model_args
(and lm-eval's `--batch_size`) by one typed parser (`model_arguments`: an unknown key, a value not of its
key's type or range), lm-eval's own option errors, a launch whose world size is not `tensor_parallel_size`,
`--use_cache` under TP (a rank answering from its cache would skip a collective the others enter), a task or
its data lm-eval cannot load, gen_kwargs of the wrong type, an `--output_path` lm-eval cannot write
(`lm_eval_inputs`, which also publishes lm-eval's files whole), a model call (`--batch_size x mc_samples`
rows) or a decode (`max_gen_toks`) larger than the device's memory; and, when its requests come,
loglikelihood on a `fast-dllm-v2` checkpoint (its shifted labels give no BD3-LM bound; `config=` a YAML with
`bdlm-objective: bd3lm` to score it as one) or on a uniform-state `diffusion-gemma` one (no MASK to score under:
its generate_until tasks run, with the sampler's `diffusion-gemma` strategy).

Both models are built as training builds them (`RunConfig.model_ends`, Gemma 4's shape config): a checkpoint with
Gemma 4's layers, a softcap or scaled embeddings is scored and decoded as it trained.
"""

import atexit
import difflib
import hashlib
import math
import os
import re
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable

import torch
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from tqdm import tqdm

from megatron_csbp.core import objectives
from megatron_csbp.core.run_config import RunConfig
from megatron_csbp.core.rules import ConfigError

COMMAND = "python -m megatron_csbp.harness"  # as its refusals name it
NAME = "megatron_csbp"
ESTIMATORS = ("inverse-t", "count")
AUTO_BATCH = 8  # the requests per model call of lm-eval's `--batch_size auto`
LM_EVAL_FLAGS = ("batch_size", "max_batch_size", "device")  # lm-eval's own flags, passed to the model beside model_args


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


# ------------------------------------------------------------------------------------ typed arguments
@dataclass(frozen=True)
class Option:
    """One key of model_args (or gen_kwargs): `read` turns the value lm-eval hands over (`key=value` text it
    already turned into a str, int, float, bool or None, or whatever a Python caller gave) into its type, or
    None when it is not of that type; `holds` is its range; `expected` says both in a refusal."""

    read: Callable
    holds: Callable
    expected: str
    default: object = None


def _integer(value):
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return int(value) if isinstance(value, str) and re.fullmatch(r"\s*[+-]?\d+\s*", value) else None


def _number(value):
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        return None
    try:
        number = float(value)
    except (ValueError, OverflowError):
        return None
    return number if math.isfinite(number) else None


def _switch(value):
    if isinstance(value, bool) or isinstance(value, int) and value in (0, 1):
        return bool(value)
    return {"true": True, "yes": True, "1": True, "false": False, "no": False, "0": False}.get(
        value.strip().lower()) if isinstance(value, str) else None


def _text(value):
    return value if isinstance(value, str) and value.strip() else None


def _batch(value):
    return AUTO_BATCH if isinstance(value, str) and re.fullmatch(r"auto(:\d+)?", value.strip()) else _integer(value)


def _stops(value):
    stops = [value] if isinstance(value, str) else value
    return list(stops) if isinstance(stops, (list, tuple)) and all(isinstance(s, str) for s in stops) else None


def _integer_from(low: int, default, below: tuple | None = None) -> Option:
    """An integer >= `low` (and below `below`, a (value, how to write it) pair)."""
    expected = f"an integer >= {low}" if below is None else f"an integer in [{low}, {below[1]})"
    return Option(_integer, lambda v: v >= low and (below is None or v < below[0]), expected, default)


def _choice(choices, default) -> Option:
    return Option(_text, lambda v: v in choices, f"one of {', '.join(choices)}", default)


def _path(what: str) -> Option:
    return Option(_text, lambda v: True, f"a path: {what}")


SWITCH = Option(_switch, lambda v: True, "true or false")
MAX_GEN_TOKS = _integer_from(1, 128)
TEMPERATURE = Option(_number, lambda v: v >= 0, "a number >= 0 (0: greedy)", 0.0)
GEN_OPTIONS = {"max_gen_toks": MAX_GEN_TOKS, "temperature": TEMPERATURE, "do_sample": SWITCH,
               "until": Option(_stops, lambda v: True, "a string or a list of strings")}


def model_options() -> dict:
    """Every model_args key, with lm-eval's flags the model also receives (`LM_EVAL_FLAGS`)."""
    from megatron_csbp.tools.sampling import STRATEGIES

    return {
        "load": _path("a --save directory of a training run, or one of its iter_XXXXXXX directories"),
        "config": _path("a training YAML whose settings override those the checkpoint recorded"),
        "mc_samples": _integer_from(1, 32),
        "estimator": _choice(ESTIMATORS, "inverse-t"),
        "seed": _integer_from(0, 0, below=(2 ** 64, "2**64")),
        "greedy_check": Option(_switch, lambda v: True, "true or false", True),
        "strategy": _choice(STRATEGIES, None),  # None: the checkpoint's (`sampling.strategy_for`)
        "steps_per_block": _integer_from(1, None),
        "threshold": Option(_number, lambda v: 0 <= v <= 1, "a probability in [0, 1]", 0.9),
        "temperature": TEMPERATURE,
        "top_k": _integer_from(0, 0),
        "top_p": Option(_number, lambda v: 0 < v <= 1, "a number in (0, 1]", 1.0),
        "max_gen_toks": MAX_GEN_TOKS,
        "tensor_parallel_size": _integer_from(1, 1),
        "batch_size": Option(_batch, lambda v: v >= 1, "an integer >= 1, or auto", AUTO_BATCH),
        "max_batch_size": _integer_from(1, None),
        "device": Option(_text, lambda v: True, "a device name (unused: the model runs on the accelerator if any)"),
    }


def _named(where: str, key: str, value) -> str:
    return f"--{key} {value}" if key in LM_EVAL_FLAGS else f"{where}: {key}={value}"


def read_options(given: dict, options: dict, where: str) -> dict:
    """`given` read by `options`: every key of `options` in the result (its default where not given); an
    unknown key (with the closest known one), or a value not of its key's type and range, is one line."""
    values = {}
    for key, value in given.items():
        if key not in options:
            close = difflib.get_close_matches(key, options, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            known = ", ".join(name for name in options if name not in LM_EVAL_FLAGS)
            raise ConfigError(f"{where}: unknown argument {key!r}{hint}; known: {known}")
        option = options[key]
        typed = None if value is None else option.read(value)
        if typed is None and not (value is None and option.default is None) or \
                typed is not None and not option.holds(typed):
            raise ConfigError(f"{_named(where, key, value)}: expected {option.expected}")
        values[key] = typed
    return {key: values.get(key, option.default) for key, option in options.items()}


def model_arguments(given: dict) -> dict:
    """model_args (and lm-eval's `--batch_size`, `--max_batch_size`, `--device`) typed and checked, before
    anything is read or built: the one parser of the model's arguments, whichever way lm-eval passes them."""
    values = read_options(given, model_options(), "model_args")
    _require(values["load"] is not None, "model_args: give load=DIR, a --save directory of a training run or one of "
                                         "its iter_XXXXXXX directories")
    check_world_size(values["tensor_parallel_size"])
    return values


def check_world_size(size: int) -> None:
    """Refused unless the launch has exactly `tensor_parallel_size` ranks: the ranks hold one model replica's
    TP shards and all answer every request (the harness does no data parallelism)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    _require(size == world, f"model_args: tensor_parallel_size={size} but this launch has {world} "
                            f"rank{'s' if world != 1 else ''}: launch exactly tensor_parallel_size ranks "
                            f"(python -m megatron_csbp.torchrun --standalone --nproc-per-node {size} "
                            f"-m megatron_csbp.harness ...)")


def checkpoint_of(load: str):
    """The checkpoint model_args `load` names (`inference.read_checkpoint`, its refusal naming the model
    argument)."""
    from megatron_csbp.tools import inference

    try:
        return inference.read_checkpoint(load)
    except ConfigError as error:
        raise ConfigError(f"model_args: {str(error).replace(f'--load {load}', f'load={load}', 1)}") from None


def call_bytes(args, rows: int) -> int:
    """About what one forward of the training model over `rows` `[x_t ; x_0]` rows allocates beyond its weights
    (float32): per position of the `2L`, the logits, a row of attention scores per head, the MLP's and a layer's
    activations (the tests' model measured ~0.8x of it)."""
    positions, hidden = 2 * args.seq_length, args.hidden_size
    sharded = args.padded_vocab_size + positions * args.num_attention_heads + 2 * (args.ffn_hidden_size or 4 * hidden)
    return 4 * rows * positions * (sharded // args.tensor_model_parallel_size + 4 * hidden)


def _uniforms(seed: int, key: str, count: int) -> torch.Tensor:
    """`count` uniforms in [0, 1) from a generator that depends on `(seed, key)` only (float64, on the CPU)."""
    digest = hashlib.blake2b(f"{seed}/{key}".encode(), digest_size=8).digest()
    return torch.rand(count, generator=torch.Generator().manual_seed(int.from_bytes(digest, "little")),
                      dtype=torch.float64)


def noise_draws(estimator: str, seed: int, tokens: list, block_positions: list, samples: int):
    """Per Monte-Carlo sample `j` and continuation position: (masked [M, n] bool, weight [M, n] float64).

    `block_positions`: per block, the indices (into the continuation) of its continuation tokens. A block's
    `M` draws are stratified: `v_j = (u + j/M) mod 1` with one uniform `u` per block, so each `v_j` is uniform.
    `inverse-t`: `t = 1 - v_j` in (0, 1], each token masked when its own uniform is below `t`, weight `1/t`.
    `count`: `k = 1 + floor(v_j n_b)` of the block's `n_b` tokens, the `k` with the smallest uniforms, weight
    `n_b/k`. The draws come from `(seed, tokens)`: the same request gets the same noise in any batch.
    """
    key = ",".join(map(str, tokens))
    n = sum(len(positions) for positions in block_positions)
    masked = torch.zeros(samples, n, dtype=torch.bool)
    weight = torch.zeros(samples, n, dtype=torch.float64)
    strata = torch.arange(samples, dtype=torch.float64) / samples
    for block, positions in enumerate(block_positions):
        index = torch.as_tensor(positions, dtype=torch.long)
        draws = _uniforms(seed, f"{key}/block{block}", 1 + samples * len(positions))
        v = (draws[0] + strata) % 1.0
        per_token = draws[1:].view(samples, len(positions))
        if estimator == "inverse-t":
            t = 1.0 - v
            chosen = per_token < t.unsqueeze(1)
            scale = 1.0 / t
        else:
            k = (1 + (v * len(positions)).floor()).clamp(max=len(positions)).long()
            order = per_token.argsort(dim=1).argsort(dim=1)  # rank of each token's uniform in its row
            chosen = order < k.unsqueeze(1)
            scale = len(positions) / k.double()
        masked[:, index] = chosen
        weight[:, index] = torch.where(chosen, scale.unsqueeze(1), 0.0)
    return masked, weight


class MegatronCSBPLM(LM):
    """An lm-eval `LM` over one of our checkpoints (see the module doc for what each request type returns).

    model_args (lm-eval's `key=value,...`, read by `model_arguments`): `load` (a `--save` directory or an
    `iter_XXXXXXX` one, required), `config` (a training YAML overriding what the checkpoint recorded),
    `mc_samples` (noise draws per request, 32), `estimator` (`inverse-t` | `count`), `seed` (0), `greedy_check`
    (true), `strategy` (the checkpoint's: confidence, or diffusion-gemma for a uniform-state one),
    `steps_per_block` (the strategy's default: the block size, or diffusion-gemma's 48), `threshold` (0.9),
    `temperature` (0), `top_k` (0), `top_p` (1), `max_gen_toks` (default for gen_kwargs, 128),
    `tensor_parallel_size` (1: the launch's world size must equal it); lm-eval's `--batch_size` is the requests
    per model call ("auto": 8).
    One model call holds `batch_size x mc_samples` rows: refused when they cannot fit in the device's memory.
    """

    def __init__(self, **model_args):
        super().__init__()
        options = model_arguments(model_args)
        self.tensor_parallel_size = options["tensor_parallel_size"]
        # Every rank answers every request (a model call is a collective of the TP ranks): to lm-eval this LM is
        # rank 0 of 1 on each of them (LM's defaults, stated here because TP depends on them).
        self._rank, self._world_size = 0, 1
        self._shard_rank = int(os.environ.get("RANK", "0"))  # only rank 0 shows progress bars and warnings
        self.batch_size, self.mc_samples = options["batch_size"], options["mc_samples"]
        self.estimator, self.seed = options["estimator"], options["seed"]
        self.greedy_check, self.default_max_gen_toks = options["greedy_check"], options["max_gen_toks"]
        self.sampling = {key: options[key] for key in ("strategy", "steps_per_block", "threshold", "temperature",
                                                       "top_k", "top_p")}
        self._warned = set()
        self._load(options["load"], options["config"])

    # ------------------------------------------------------------------------------------------ set-up
    def _load(self, load: str, config: str | None) -> None:
        """Arguments and tokenizer from the checkpoint, then both models over `tensor_parallel_size` ranks, this
        rank's shard (as generate_bdlm.py: the process group, then megatron-core's TP groups)."""
        from megatron_csbp.tools import inference

        checkpoint = checkpoint_of(load)
        directory = checkpoint.directory
        args = inference.model_args(checkpoint, config, self.tensor_parallel_size)
        self.args, self.directory, self.tokenizer = args, directory, args.tokenizer
        self.seq_length, self.block_size = args.seq_length, args.bdlm_block_size
        self.mask_token_id, self.eod = args.mask_token_id, args.tokenizer.eod
        # the objective and weighting it trained
        self.run_config = RunConfig.from_args(args, world_size=self.tensor_parallel_size)
        self.settings(temperature=self.sampling["temperature"])  # refuse bad decoding model_args before any work
        self._check_memory()

        import torch.distributed as dist

        from megatron_csbp.training.loops import init_distributed

        if not dist.is_initialized():
            init_distributed(args.distributed_timeout_minutes)
            atexit.register(_shut_down)
        from megatron_csbp.mcore import parallel_state

        if parallel_state.is_initialized():  # a second model in one process (simple_evaluate called again)
            parallel_state.destroy_model_parallel()
        with self._backend():
            self.sampler = inference.build_model(args, directory)
            self.model = self._training_model(args)
        self.sampler.eval()
        self.model.eval()
        self._device = next(self.model.parameters()).device

    def _training_model(self, args):
        """The training forward's model (one-rank CSBP layout at the trained length) sharing the sampler's
        weights (the same parameter names: `sampling_model` is built to load our checkpoints)."""
        from megatron_csbp.core.device import default_device
        from megatron_csbp.mcore import parallel_state
        from megatron_csbp.mcore.model import model_provider, set_shape_config
        from megatron_csbp.training import providers
        from megatron_csbp.training.megatron_config import transformer_config_from_args

        run = self.run_config
        self.layout = run.layout(0)
        vocab_ids = getattr(args, "vocab_ids", None) or max(args.tokenizer.vocab_size, args.mask_token_id + 1)
        config = providers.for_bdlm(transformer_config_from_args(args))
        set_shape_config(config, run.shape)  # as training's (Gemma 4's layers)
        model = model_provider(config=config, vocab_size=args.padded_vocab_size, layout=self.layout,
                               mask_token_id=args.mask_token_id, vocab_ids=vocab_ids,
                               group=parallel_state.get_block_parallel_groups(),
                               logits_tile_rows=run.logits_tile_rows, **run.model_ends,
                               **providers.gpt_model_kwargs(args))
        model.load_state_dict(self.sampler.state_dict(), strict=True, assign=True)  # shares the tensors
        return model.to(default_device())

    def _check_memory(self) -> None:
        """What a model call allocates, bounded by the device before the model is built: `batch_size x
        mc_samples` NELBO rows, and decoding `batch_size` prompts to `max_gen_toks` (gen_kwargs' are checked
        as their requests come, `_check_decoding`)."""
        from megatron_csbp.tools.generate import available_memory

        rows, have = self.batch_size * self.mc_samples, available_memory()
        needed = call_bytes(self.args, rows)
        _require(needed <= have, f"model_args: mc_samples={self.mc_samples} with --batch_size {self.batch_size}: a "
                                 f"model call scores {rows:,} rows of {2 * self.seq_length} positions, about "
                                 f"{needed / 2**30:,.1f} GiB (logits, attention scores, activations), more than the "
                                 f"{have / 2**30:,.1f} GiB this device has; lower mc_samples or --batch_size (at most "
                                 f"{have // call_bytes(self.args, 1):,} rows a call)")
        self._check_decoding(self.default_max_gen_toks, "model_args: max_gen_toks")

    def _decoding(self, max_gen: int) -> tuple:
        """(context window or None, the most prompt tokens kept) of decoding `max_gen` tokens: past the trained
        length `L` the sampler slides BD3-LM's window, and a prompt keeps its last `L - max_gen` tokens."""
        L, B = self.seq_length, self.block_size
        window = max(2 * B, L // B * B) if max_gen + B > L else None
        return window, max(L - max_gen, B)

    def _check_decoding(self, max_gen: int, named: str) -> None:
        """Decoding `batch_size` prompts to `max_gen` tokens fits in the device (`generate.decoding_bytes`)."""
        from megatron_csbp.tools.generate import available_memory, decoding_bytes
        from megatron_csbp.tools.sampling import positions_seen

        window, keep = self._decoding(max_gen)
        total = -(-(keep + max_gen) // self.block_size) * self.block_size
        seen = positions_seen([keep], max_gen, self.settings(0.0, context_window=window))
        needed, have = decoding_bytes(self.args, self.batch_size, total, seen), available_memory()
        _require(needed <= have, f"{named}={max_gen}: decoding {self.batch_size} prompts to {total:,} positions "
                                 f"needs {needed / 2**30:,.1f} GiB (sequence and K/V cache), more than the "
                                 f"{have / 2**30:,.1f} GiB this device has; lower it")

    @contextmanager
    def _backend(self):
        from megatron_csbp.mcore import cpu_backend

        with cpu_backend.active(), torch.no_grad():
            yield

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned and self._shard_rank == 0:
            self._warned.add(key)
            print(f"{NAME}: warning: {message}", file=sys.stderr, flush=True)

    # ---------------------------------------------------------------------------------------- tokens
    @property
    def eot_token_id(self) -> int:
        return self.eod

    @property
    def tokenizer_name(self) -> str:
        return type(self.tokenizer).__name__

    def tok_encode(self, text: str) -> list:
        return list(self.tokenizer.tokenize(text)) if text else []

    def tok_decode(self, tokens) -> str:
        return self.tokenizer.detokenize(list(tokens))

    def encode_pair(self, context: str, continuation: str) -> tuple[list, list]:
        """Context and continuation ids, the context's trailing spaces moved to the continuation; the
        continuation is the tail of the whole text's ids (a tokenizer may merge across the boundary). An empty
        context is the end-of-document token."""
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        if not context:
            return [self.eod], self.tok_encode(continuation)
        whole, head = self.tok_encode(context + continuation), self.tok_encode(context)
        return head, whole[len(head):]

    # ---------------------------------------------------------------------------------- the NELBO
    def _fit(self, context: list, continuation: list) -> tuple[list, list]:
        """At most `L` tokens: the last ones (the continuation's tail when it alone is longer)."""
        L = self.seq_length
        if len(context) + len(continuation) <= L:
            return context, continuation
        self._warn_once("long", f"a request of {len(context) + len(continuation)} tokens is longer than the trained "
                                f"length {L} (--seq-length): its last {L} tokens are kept (context first dropped)")
        if len(continuation) >= L:
            return continuation[-L:][:1], continuation[-L:][1:]
        return context[len(context) + len(continuation) - L:], continuation

    def _blocks(self, start: int, end: int) -> list:
        """Per block that holds positions `[start, end)`: those positions, as indices from `start`."""
        B = self.block_size
        if end <= start:
            return []
        return [list(range(max(start, b * B) - start, min(end, (b + 1) * B) - start))
                for b in range(start // B, (end - 1) // B + 1)]

    def _check_objective(self) -> None:
        objective = self.run_config.objective
        _require(objective.corruption == objectives.MASK_STATE,  # the rows below mask with MASK
                 f"checkpoint {self.directory} was trained with --bdlm-objective {objective.name} "
                 f"({objective.corruption}-state corruption: no MASK, unit weights): it has no BD3-LM bound to score; "
                 f"run generate_until tasks only")
        _require(objective.label_shift == 0,  # the rows below predict in place
                 f"checkpoint {self.directory} was trained with --bdlm-objective {objective.name} "
                 f"(shifted labels, unit weights): it has no BD3-LM bound to score; give model_args config=FILE.yaml "
                 f"with 'bdlm-objective: bd3lm' to score it as one, or run generate_until tasks only")

    def request_rows(self, tokens: list, start: int, masked, weight, padding_id: int | None = None):
        """One request's model rows for its `M` noise draws, as `BDLMObjective.rows` lays them out (tested
        equal): input ids `[M, 2L]` (`[x_t at the layout's noisy positions ; x0 at its clean positions]`), labels
        and loss weights `[M, L]` at the noisy positions. `tokens[start:]` is the continuation, `masked` and
        `weight` `[M, len(tokens) - start]` its noise; the context is clean in both copies. Past the tokens:
        MASK in the rest of the last block's noisy copy, `padding_id` (default MASK) everywhere else."""
        L, layout, samples = self.seq_length, self.layout, masked.shape[0]
        end = len(tokens)
        padding_id = self.mask_token_id if padding_id is None else padding_id
        row = torch.full((L,), padding_id, dtype=torch.long)
        row[:end] = torch.tensor(tokens, dtype=torch.long)
        x_t = row.repeat(samples, 1)
        x_t[:, end:-(-end // self.block_size) * self.block_size] = self.mask_token_id  # the unknown rest of the block
        x_t[:, start:end] = torch.where(masked, self.mask_token_id, x_t[:, start:end])
        full_weight = torch.zeros(samples, L, dtype=torch.float64)
        full_weight[:, start:end] = weight
        labels = torch.where(row == self.mask_token_id, 0, row).repeat(samples, 1)  # padding: weight 0, any label
        inputs = torch.cat([x_t[:, layout.noisy_positions], row.repeat(samples, 1)[:, layout.clean_positions]], dim=1)
        return inputs, labels[:, layout.noisy_positions], full_weight[:, layout.noisy_positions]

    def nelbo_samples(self, pairs: list, estimator: str | None = None, samples: int | None = None,
                      padding_id: int | None = None, disable_tqdm: bool = True) -> list:
        """Per `(context ids, continuation ids)`: the [M] NELBO estimates of the continuation (nats, summed over
        its tokens); their mean is minus the loglikelihood. `padding_id`: the token of the clean copy and of the
        noisy blocks after the request's last one (MASK by default; the score must not depend on it)."""
        self._check_objective()
        estimator, samples = estimator or self.estimator, samples or self.mc_samples
        padding_id = self.mask_token_id if padding_id is None else padding_id
        layout = self.layout
        unit = self.run_config.loss_weighting == objectives.UNIT
        results = [None] * len(pairs)
        order = sorted(range(len(pairs)), key=lambda i: -sum(map(len, pairs[i])))
        progress = tqdm(total=len(pairs), disable=disable_tqdm or self._shard_rank != 0,
                        desc="loglikelihood (BDLM NELBO)")
        with self._backend():
            for first in range(0, len(order), self.batch_size):
                chunk = order[first:first + self.batch_size]
                inputs, labels, weights = [], [], []
                for i in chunk:
                    context, continuation = self._fit(*pairs[i])
                    tokens = context + continuation
                    start, end = len(context), len(tokens)
                    masked, weight = noise_draws(estimator, self.seed, tokens, self._blocks(start, end), samples)
                    rows = self.request_rows(tokens, start, masked, masked.double() if unit else weight, padding_id)
                    for into, part in zip((inputs, labels, weights), rows):
                        into.append(part)
                inputs = torch.cat(inputs)
                positions = layout.row_positions.expand(inputs.shape[0], -1).contiguous()
                target = torch.cat(labels)
                ce = self.model(inputs.to(self._device), positions.to(self._device), attention_mask=None,
                                labels=target.to(self._device)).double().cpu()
                scored = ce * torch.cat(weights)
                for k, i in enumerate(chunk):
                    results[i] = scored[k * samples:(k + 1) * samples].sum(1)
                progress.update(len(chunk))
        progress.close()
        return results

    def _greedy(self, pairs: list) -> list:
        """Whether the sampler at temperature 0 decodes each continuation exactly (see the module doc)."""
        from megatron_csbp.tools.sampling import generate

        if not self.greedy_check:
            return [False] * len(pairs)
        settings = self.settings(temperature=0.0, eos=False)
        answers = [False] * len(pairs)
        with self._backend():
            for first in range(0, len(pairs), self.batch_size):
                chunk = [(i, self._fit(*pairs[i])) for i in range(first, min(len(pairs), first + self.batch_size))]
                chunk = [(i, context, continuation) for i, (context, continuation) in chunk if continuation]
                if not chunk:
                    continue
                longest = max(len(continuation) for _, _, continuation in chunk)
                decoded = generate(self.sampler, [context for _, context, _ in chunk], longest, settings).tokens
                for (i, _, continuation), tokens in zip(chunk, decoded):
                    answers[i] = list(tokens[:len(continuation)]) == list(continuation)
        return answers

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list:
        pairs = [self.encode_pair(*request.args) for request in requests]
        estimates = self.nelbo_samples(pairs, disable_tqdm=disable_tqdm)
        greedy = self._greedy(pairs)
        results = []
        for request, estimate, is_greedy in zip(requests, estimates, greedy):
            answer = (-float(estimate.mean()), bool(is_greedy))
            self.cache_hook.add_partial("loglikelihood", request.args, answer)
            results.append(answer)
        return results

    def rolling_windows(self, tokens: list) -> list:
        """`(context, continuation)` windows covering `tokens`: the first after EOD, the next ones `L - L/2`
        new tokens each after the `L/2` tokens before them."""
        L, keep = self.seq_length, self.seq_length // 2
        windows, done = [([self.eod], tokens[:L - 1])], L - 1
        while done < len(tokens):
            windows.append((tokens[done - keep:done], tokens[done:done + L - keep]))
            done += L - keep
        return [window for window in windows if window[1]]

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list:
        windows, owner = [], []
        for index, request in enumerate(requests):
            for window in self.rolling_windows(self.tok_encode(request.args[0])):
                windows.append(window)
                owner.append(index)
        estimates = self.nelbo_samples(windows, disable_tqdm=disable_tqdm)
        totals = [0.0] * len(requests)
        for index, estimate in zip(owner, estimates):
            totals[index] -= float(estimate.mean())
        for request, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    # ------------------------------------------------------------------------------------- generation
    def settings(self, temperature: float, eos: bool = True, stops: tuple = (), context_window=None):
        from megatron_csbp.tools.sampling import SamplingSettings, strategy_for

        options = self.sampling
        strategy = strategy_for(self.run_config.objective.corruption, options["strategy"])
        try:
            return SamplingSettings(
                block_size=self.block_size, mask_token_id=self.mask_token_id,
                steps_per_block=strategy.steps(self.block_size, options["steps_per_block"]), strategy=strategy.name,
                threshold=options["threshold"], temperature=temperature, top_p=options["top_p"],
                top_k=options["top_k"], seed=self.seed, eos_token_id=self.eod if eos else None,
                stop_sequences=stops, start_token_id=self.eod, context_window=context_window,
                shifted_labels=bool(self.run_config.objective.label_shift), vocab_size=self.tokenizer.vocab_size,
                corruption=self.run_config.objective.corruption)
        except ConfigError as error:  # the sampler names script flags: name the model_args
            named = re.sub(r"--([a-z][a-z-]*)", lambda flag: flag.group(1).replace("-", "_"), str(error))
            raise ConfigError(f"model_args: {named}") from None

    def _generation_options(self, gen_kwargs: dict) -> tuple:
        """(stop strings, max_gen_toks, temperature) of a request's gen_kwargs, typed as model_args are (the keys
        this model does not use, e.g. top_p, are left to the model_args)."""
        given = {key: value for key, value in (gen_kwargs or {}).items() if key in GEN_OPTIONS}
        options = read_options({"max_gen_toks": self.default_max_gen_toks, "temperature": self.sampling["temperature"],
                                **given}, GEN_OPTIONS, "gen_kwargs")
        temperature = 0.0 if options["do_sample"] is False else options["temperature"]
        return tuple(text for text in options["until"] or () if text), options["max_gen_toks"], temperature

    def generate_until(self, requests, disable_tqdm: bool = False) -> list:
        from megatron_csbp.tools.sampling import generate

        results = [None] * len(requests)
        groups = {}
        for index, request in enumerate(requests):
            context, gen_kwargs = request.args
            groups.setdefault(self._generation_options(gen_kwargs), []).append(index)
        for _, max_gen, _ in groups:  # every group's memory, before any decoding
            self._check_decoding(max_gen, "gen_kwargs: max_gen_toks")
        progress = tqdm(total=len(requests), disable=disable_tqdm or self._shard_rank != 0,
                        desc="generate_until (BDLM sampler)")
        L = self.seq_length
        for (until, max_gen, temperature), indices in groups.items():
            stops = tuple(tuple(self.tok_encode(text)) for text in until)
            window, keep = self._decoding(max_gen)
            if window is not None:  # the sample needs positions past the trained length: BD3-LM's sliding window
                self._warn_once("window", f"max_gen_toks {max_gen} reaches past the trained length {L}: decoding "
                                          f"with a context window of {window} positions")
            settings = self.settings(temperature, stops=stops, context_window=window)
            for first in range(0, len(indices), self.batch_size):
                chunk = indices[first:first + self.batch_size]
                prompts = []
                for index in chunk:
                    ids = self.tok_encode(requests[index].args[0])
                    if len(ids) > keep:
                        self._warn_once("prompt", f"a context of {len(ids)} tokens leaves no room for max_gen_toks "
                                                  f"{max_gen} within the trained length {L}: its last {keep} tokens "
                                                  f"are kept")
                        ids = ids[-keep:]
                    prompts.append(ids)
                with self._backend():
                    decoded = generate(self.sampler, prompts, max_gen, settings).tokens
                for index, tokens in zip(chunk, decoded):
                    text = self.tok_decode(tokens)
                    for stop in until:  # a stop string the tokens did not show (merged across tokens)
                        text = text.split(stop, 1)[0]
                    results[index] = text
                    self.cache_hook.add_partial("generate_until", requests[index].args, text)
                progress.update(len(chunk))
        progress.close()
        return results


def _shut_down() -> None:
    """Megatron's groups, then the default process group, at exit (as generate_bdlm.py ends)."""
    import torch.distributed as dist

    from megatron_csbp.mcore import parallel_state

    if parallel_state.is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


register_model(NAME)(MegatronCSBPLM)


# What rank != 0 must not do under TP: write, log or print lm-eval's output (rank 0 does), as configuration
# fields of lm-eval's `EvaluatorConfig` and the value each gets there.
SILENT = {"output_path": None, "log_samples": False, "predict_only": False, "wandb_args": {}, "trackio_args": {},
          "hf_hub_log_args": {}, "show_config": False, "write_out": False, "cache_requests": {}}


def _check_model_configuration(config) -> None:
    """`--model megatron_csbp`'s model_args and lm-eval's flags it receives, typed; `load` and `config` there."""
    given = dict(config.model_args or {})
    for flag in LM_EVAL_FLAGS:
        _require(flag not in given, f"model_args: {flag} is lm-eval's own flag; give it as --{flag}")
    flags = {flag: getattr(config, flag) for flag in LM_EVAL_FLAGS if getattr(config, flag) is not None}
    arguments = model_arguments({**given, **flags})
    load, config_file = arguments["load"], arguments["config"]
    _require(os.path.isdir(load), f"model_args: load={load}: no such directory; give the --save directory of a "
                                  f"training run")  # the checkpoint itself is verified as the model loads
    _require(config_file is None or os.path.isfile(config_file), f"model_args: config={config_file}: no such file; "
                                                                 f"give a training YAML")


def _check_run_options(config) -> None:
    """lm-eval's own options it would take and fail on (or misread) only once the model is built."""
    limit, shots = _number(config.limit), _integer(config.num_fewshot)
    _require(config.limit is None or limit is not None and limit > 0,
             f"--limit {config.limit}: give a number of documents >= 1, or a fraction of them in (0, 1)")
    _require(config.num_fewshot is None or shots is not None and shots >= 0,
             f"--num_fewshot {config.num_fewshot} must be an integer >= 0")
    included = config.include_path if isinstance(config.include_path, (list, tuple)) else [config.include_path]
    for folder in filter(None, included):  # lm-eval would skip it and report its tasks not found
        _require(os.path.exists(folder), f"--include_path {folder}: no such file or directory; give the folder "
                                         f"of your task YAMLs")


def _check_generation_kwargs(config, items) -> None:
    """Every generate_until task's gen_kwargs (its YAML's, under the command line's), typed as the model reads
    them."""
    from lm_eval.api.group import Group

    for item in items:
        for task in item.get_all_tasks() if isinstance(item, Group) else [item]:
            if task.get_config("output_type") == "generate_until":
                given = {**(task.get_config("generation_kwargs") or {}), **(config.gen_kwargs or {})}
                read_options({key: value for key, value in given.items() if key in GEN_OPTIONS}, GEN_OPTIONS,
                             f"gen_kwargs of --tasks {task.task_name}")


@contextmanager
def _checked_cli(rank: int, world: int):
    """lm-eval's command line with its inputs checked before the model loads, on every rank alike; yields the
    list that will hold the `StagedOutput` (rank 0's) for `main` to publish.

    Two hooks of lm-eval's config class (where its command line and its `--config` YAML meet):
    `EvaluatorConfig.from_cli` (before lm-eval indexes its tasks) checks the model_args
    (`model_arguments`, `load` and `config` there), `--limit`, `--num_fewshot`, `--include_path`,
    `--output_path`, `--use_cache` under TP, silences rank != 0
    (`SILENT`), and stages the output (`lm_eval_inputs.StagedOutput`); `EvaluatorConfig.process_tasks` loads
    the tasks and their data (`lm_eval_inputs.load_tasks`) and types their gen_kwargs. lm-eval's own errors in
    both are its input refused, in one line."""
    from lm_eval.config.evaluate_config import EvaluatorConfig

    from megatron_csbp.tools import lm_eval_inputs

    originals = {name: EvaluatorConfig.__dict__[name] for name in ("from_cli", "process_tasks")}
    staged = []

    def from_cli(cls, namespace):
        try:
            config = originals["from_cli"].__func__(cls, namespace)
        except (ValueError, TypeError, OSError) as error:
            raise ConfigError(f"lm-eval's options: {lm_eval_inputs.reasons(error)}") from None
        if config.model == NAME:
            _check_model_configuration(config)
        _check_run_options(config)
        if config.output_path:
            lm_eval_inputs.check_output_path(config.output_path)
        if world > 1:
            _require(not config.use_cache, f"--use_cache {config.use_cache}: not under tensor_parallel_size > 1 (a "
                                           f"rank answering from its cache would leave the others waiting); drop it")
            if rank != 0:
                for name, value in SILENT.items():
                    setattr(config, name, value)
        if config.output_path:
            samples = bool(config.log_samples or config.predict_only)
            staged.append(lm_eval_inputs.StagedOutput(config.output_path, samples))
            config.output_path = staged[-1].staged
        return config

    def process_tasks(self, metadata=None):
        asked = self.tasks if isinstance(self.tasks, str) else ",".join(map(str, self.tasks or []))
        try:
            manager = originals["process_tasks"](self, metadata)
        except Exception as error:  # noqa: BLE001 - lm-eval resolving the names, paths and folders given
            raise ConfigError(f"--tasks {asked}: {lm_eval_inputs.reasons(error)}; lm-eval's tasks: {COMMAND} ls tasks "
                              f"(with --include_path DIR for tasks of your own)") from None
        _require(self.tasks, f"--tasks: no task given; name one (lm-eval's tasks: {COMMAND} ls tasks)")
        items = lm_eval_inputs.load_tasks(manager, self.tasks)
        if self.model == NAME:
            _check_generation_kwargs(self, items)
        if not self.check_integrity:  # lm-eval's task tests take names
            self.tasks = items
        return manager

    EvaluatorConfig.from_cli = classmethod(from_cli)
    EvaluatorConfig.process_tasks = process_tasks
    try:
        yield staged
    finally:
        for name, original in originals.items():
            setattr(EvaluatorConfig, name, original)
        for output in staged:
            output.discard()


def _silence_stdout() -> None:
    """This process's stdout (Python's and the file descriptor's, so lm-eval's prints and any library's) to
    /dev/null: a rank other than 0 under TP, whose output would repeat rank 0's."""
    sys.stdout.flush()
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.close(devnull)


def _run_lm_eval() -> None:
    """lm-eval's `cli_evaluate`, its own parse errors (e.g. `--model_args` that is not JSON) one line."""
    from lm_eval._cli import HarnessCLI
    from lm_eval.utils import setup_logging

    setup_logging()
    parser = HarnessCLI()
    try:
        arguments = parser.parse_args()
    except ValueError as error:
        raise ConfigError(f"lm-eval's options: {error}") from None
    parser.execute(arguments)


def main(argv: list | None = None) -> int:
    """lm-eval's command line, unchanged, with `--model megatron_csbp` registered; refusals are one line, exit 2
    (printed by rank 0 under TP: every rank refuses alike, and all leave at once). Under a launcher
    (`WORLD_SIZE` > 1) each rank runs it in lockstep and only rank 0 prints or writes (see the module doc)."""
    from megatron_csbp.runtime import quiet

    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    quiet.quiet_start_up()
    sys.argv = [COMMAND, *(sys.argv[1:] if argv is None else argv)]
    if rank != 0:
        _silence_stdout()
        os.environ["LMEVAL_LOG_LEVEL"] = "ERROR"  # lm-eval's setup_logging reads it: rank 0 logs for all
    try:
        with _checked_cli(rank, world) as staged:
            _run_lm_eval()
            for output in staged:
                output.publish()
    except ConfigError as error:
        if rank == 0:
            print(f"{COMMAND}: error: {error}", file=sys.stderr, flush=True)
        from megatron_csbp.runtime.entry import leave_together

        leave_together(world)  # under torchrun: every rank at once, or the launcher reports the late ones killed
        return 2
    except KeyboardInterrupt:
        print(f"{COMMAND}: interrupted", file=sys.stderr, flush=True)
        return 130
    return 0
