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
or from its `--config` YAML. Refused in one line (`ConfigError`, exit 2): a launch whose world size is not
`tensor_parallel_size`, `--use_cache` under TP (a rank answering from its cache would skip a collective the
others enter), loglikelihood on a `fast-dllm-v2` checkpoint (its shifted labels give no BD3-LM bound;
`config=` a YAML with `bdlm-objective: bd3lm` to score it as one), unknown or bad model_args.
"""

import atexit
import difflib
import hashlib
import os
import re
import sys
from contextlib import contextmanager

import torch
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from tqdm import tqdm

from megatron_csbp.core import objectives
from megatron_csbp.core.run_config import RunConfig
from megatron_csbp.core.rules import ConfigError
from megatron_csbp.tools.sampling import DEFAULT_STRATEGY

COMMAND = "python -m megatron_csbp.harness"  # as its refusals name it
NAME = "megatron_csbp"
ESTIMATORS = ("inverse-t", "count")


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def _flag(value) -> bool:
    """A model_args switch: lm-eval turns `true`/`false` into bools already; accept 1/0/yes/no too."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    _require(text in ("1", "0", "true", "false", "yes", "no"), f"model_args: {value!r} is not true or false")
    return text in ("1", "true", "yes")


def check_world_size(tensor_parallel_size) -> int:
    """`tensor_parallel_size` as an int, refused unless the launch has exactly that many ranks: the ranks hold
    one model replica's TP shards and all answer every request (the harness does no data parallelism)."""
    text = str(tensor_parallel_size).strip()
    _require(text.isdigit() and int(text) >= 1, f"model_args: tensor_parallel_size={tensor_parallel_size} must be "
                                                 f"an integer >= 1")
    size, world = int(text), int(os.environ.get("WORLD_SIZE", "1"))
    _require(size == world, f"model_args: tensor_parallel_size={size} but this launch has {world} "
                            f"rank{'s' if world != 1 else ''}: launch exactly tensor_parallel_size ranks "
                            f"(python -m megatron_csbp.torchrun --standalone --nproc-per-node {size} "
                            f"-m megatron_csbp.harness ...)")
    return size


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

    model_args (lm-eval's `key=value,...`): `load` (a `--save` directory or an `iter_XXXXXXX` one, required),
    `config` (a training YAML overriding what the checkpoint recorded), `mc_samples` (noise draws per
    request, 32), `estimator` (`inverse-t` | `count`), `seed` (0), `greedy_check` (true), `strategy`
    (confidence), `steps_per_block` (the block size), `threshold` (0.9), `temperature` (0), `top_k` (0),
    `top_p` (1), `max_gen_toks` (default for gen_kwargs, 128), `tensor_parallel_size` (1: the launch's world
    size must equal it); lm-eval's `--batch_size` is the requests per model call ("auto": 8).
    """

    ARGUMENTS = ("load", "config", "mc_samples", "estimator", "seed", "greedy_check", "strategy", "steps_per_block",
                 "threshold", "temperature", "top_k", "top_p", "max_gen_toks", "tensor_parallel_size", "batch_size",
                 "max_batch_size", "device")

    def __init__(self, load=None, config=None, mc_samples=32, estimator="inverse-t", seed=0, greedy_check=True,
                 strategy=DEFAULT_STRATEGY, steps_per_block=None, threshold=0.9, temperature=0.0, top_k=0, top_p=1.0,
                 max_gen_toks=128, tensor_parallel_size=1, batch_size=None, max_batch_size=None, device=None,
                 **unknown):
        super().__init__()
        for name in unknown:
            close = difflib.get_close_matches(name, self.ARGUMENTS, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise ConfigError(f"model_args: unknown argument {name!r}{hint}; known: {', '.join(self.ARGUMENTS)}")
        _require(load is not None and str(load) != "", "model_args: give load=DIR, a --save directory of a training "
                                                       "run or one of its iter_XXXXXXX directories")
        self.tensor_parallel_size = check_world_size(tensor_parallel_size)
        # Every rank answers every request (a model call is a collective of the TP ranks): to lm-eval this LM is
        # rank 0 of 1 on each of them (LM's defaults, stated here because TP depends on them).
        self._rank, self._world_size = 0, 1
        self._shard_rank = int(os.environ.get("RANK", "0"))  # only rank 0 shows progress bars and warnings
        _require(estimator in ESTIMATORS, f"model_args: estimator={estimator!r}: choose one of {', '.join(ESTIMATORS)}")
        _require(int(mc_samples) >= 1, f"model_args: mc_samples={mc_samples} must be >= 1")
        _require(int(seed) >= 0, f"model_args: seed={seed} must be >= 0")
        _require(int(max_gen_toks) >= 1, f"model_args: max_gen_toks={max_gen_toks} must be >= 1")
        if batch_size in (None, "", "auto") or str(batch_size).startswith("auto"):
            batch_size = 8
        _require(str(batch_size).isdigit() and int(batch_size) >= 1, f"--batch_size {batch_size} must be an integer >= 1")
        self.batch_size = int(batch_size)
        self.mc_samples, self.estimator, self.seed = int(mc_samples), estimator, int(seed)
        self.greedy_check, self.default_max_gen_toks = _flag(greedy_check), int(max_gen_toks)
        self.sampling = dict(strategy=strategy, steps_per_block=None if steps_per_block is None else int(steps_per_block),
                             threshold=float(threshold), temperature=float(temperature), top_k=int(top_k),
                             top_p=float(top_p))
        self._warned = set()
        self._load(str(load), None if config is None else str(config))

    # ------------------------------------------------------------------------------------------ set-up
    def _load(self, load: str, config: str | None) -> None:
        """Arguments and tokenizer from the checkpoint, then both models over `tensor_parallel_size` ranks, this
        rank's shard (as generate_bdlm.py: the process group, then megatron-core's TP groups)."""
        from megatron_csbp.tools import inference

        directory = inference.checkpoint_directory(load)
        args = inference.model_args(directory, config, self.tensor_parallel_size)
        self.args, self.directory, self.tokenizer = args, directory, args.tokenizer
        self.seq_length, self.block_size = args.seq_length, args.bdlm_block_size
        self.mask_token_id, self.eod = args.mask_token_id, args.tokenizer.eod
        # the objective and weighting it trained
        self.run_config = RunConfig.from_args(args, world_size=self.tensor_parallel_size)
        self.settings(temperature=self.sampling["temperature"])  # refuse bad decoding model_args before any work

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
        from megatron_csbp.mcore.model import model_provider
        from megatron_csbp.training import providers
        from megatron_csbp.training.megatron_config import transformer_config_from_args

        self.layout = self.run_config.layout(0)
        vocab_ids = getattr(args, "vocab_ids", None) or max(args.tokenizer.vocab_size, args.mask_token_id + 1)
        model = model_provider(config=providers.for_bdlm(transformer_config_from_args(args)),
                               vocab_size=args.padded_vocab_size, layout=self.layout,
                               mask_token_id=args.mask_token_id, vocab_ids=vocab_ids,
                               group=parallel_state.get_block_parallel_groups(),
                               logits_tile_rows=self.run_config.logits_tile_rows, **providers.gpt_model_kwargs(args))
        model.load_state_dict(self.sampler.state_dict(), strict=True, assign=True)  # shares the tensors
        return model.to(default_device())

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
        _require(self.run_config.objective.label_shift == 0,  # the rows below predict in place
                 f"checkpoint {self.directory} was trained with --bdlm-objective {self.run_config.objective.name} "
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
        from megatron_csbp.tools.sampling import SamplingSettings

        options = self.sampling
        steps = options["steps_per_block"]
        try:
            return SamplingSettings(
                block_size=self.block_size, mask_token_id=self.mask_token_id,
                steps_per_block=self.block_size if steps is None else steps, strategy=options["strategy"],
                threshold=options["threshold"], temperature=temperature, top_p=options["top_p"],
                top_k=options["top_k"], seed=self.seed, eos_token_id=self.eod if eos else None,
                stop_sequences=stops, start_token_id=self.eod, context_window=context_window,
                shifted_labels=bool(self.run_config.objective.label_shift), vocab_size=self.tokenizer.vocab_size)
        except ConfigError as error:  # the sampler names script flags: name the model_args
            named = re.sub(r"--([a-z][a-z-]*)", lambda flag: flag.group(1).replace("-", "_"), str(error))
            raise ConfigError(f"model_args: {named}") from None

    def _generation_options(self, gen_kwargs: dict) -> tuple:
        kwargs = dict(gen_kwargs or {})
        until = kwargs.pop("until", None)
        until = [until] if isinstance(until, str) else list(until or [])
        max_gen = int(kwargs.pop("max_gen_toks", self.default_max_gen_toks))
        _require(max_gen >= 1, f"gen_kwargs: max_gen_toks={max_gen} must be >= 1")
        temperature = float(kwargs.pop("temperature", self.sampling["temperature"]))
        if kwargs.pop("do_sample", None) is False:
            temperature = 0.0
        return tuple(text for text in until if text), max_gen, temperature

    def generate_until(self, requests, disable_tqdm: bool = False) -> list:
        from megatron_csbp.tools.sampling import generate

        results = [None] * len(requests)
        groups = {}
        for index, request in enumerate(requests):
            context, gen_kwargs = request.args
            groups.setdefault(self._generation_options(gen_kwargs), []).append(index)
        progress = tqdm(total=len(requests), disable=disable_tqdm or self._shard_rank != 0,
                        desc="generate_until (BDLM sampler)")
        L, B = self.seq_length, self.block_size
        for (until, max_gen, temperature), indices in groups.items():
            stops = tuple(tuple(self.tok_encode(text)) for text in until)
            window = None
            if max_gen + B > L:  # the sample needs positions past the trained length: BD3-LM's sliding window
                window = max(2 * B, L // B * B)
                self._warn_once("window", f"max_gen_toks {max_gen} reaches past the trained length {L}: decoding "
                                          f"with a context window of {window} positions")
            keep = max(L - max_gen, B)
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


@contextmanager
def _lockstep(rank: int, world: int):
    """lm-eval's configuration (`EvaluatorConfig.from_cli`, which merges the command line and its `--config`
    YAML) checked and, on rank != 0, silenced, before lm-eval indexes its tasks or builds the model.

    Every launch: `--model megatron_csbp`'s `tensor_parallel_size` must equal the world size (refused at once,
    not after the task index). Under TP, `--use_cache` is refused, and on rank != 0 the `SILENT` fields are
    dropped, so whichever way the user asked for output only rank 0 writes it. lm-eval's own CLI runs
    unchanged around this one hook (its config class is the one place both flag sources meet)."""
    from lm_eval.config.evaluate_config import EvaluatorConfig

    original = EvaluatorConfig.__dict__["from_cli"]

    def from_cli(cls, namespace):
        config = original.__func__(cls, namespace)
        if config.model == NAME:
            check_world_size((config.model_args or {}).get("tensor_parallel_size", 1))
        if world > 1:
            _require(not config.use_cache, f"--use_cache {config.use_cache}: not under tensor_parallel_size > 1 (a "
                                           f"rank answering from its cache would leave the others waiting); drop it")
            if rank != 0:
                for name, value in SILENT.items():
                    setattr(config, name, value)
        return config

    EvaluatorConfig.from_cli = classmethod(from_cli)
    try:
        yield
    finally:
        EvaluatorConfig.from_cli = original


def _silence_stdout() -> None:
    """This process's stdout (Python's and the file descriptor's, so lm-eval's prints and any library's) to
    /dev/null: a rank other than 0 under TP, whose output would repeat rank 0's."""
    sys.stdout.flush()
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.close(devnull)


def main(argv: list | None = None) -> int:
    """lm-eval's command line, unchanged, with `--model megatron_csbp` registered; refusals are one line, exit 2
    (printed by rank 0 under TP: every rank refuses alike, and all leave at once). Under a launcher
    (`WORLD_SIZE` > 1) each rank runs it in lockstep and only rank 0 prints or writes (see the module doc)."""
    from lm_eval.__main__ import cli_evaluate

    from megatron_csbp.training import quiet

    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    quiet.quiet_start_up()
    sys.argv = [COMMAND, *(sys.argv[1:] if argv is None else argv)]
    if rank != 0:
        _silence_stdout()
        os.environ["LMEVAL_LOG_LEVEL"] = "ERROR"  # lm-eval's setup_logging reads it: rank 0 logs for all
    try:
        with _lockstep(rank, world):
            cli_evaluate()
    except ConfigError as error:
        if rank == 0:
            print(f"{COMMAND}: error: {error}", file=sys.stderr, flush=True)
        from megatron_csbp.training.entry import leave_together

        leave_together(world)  # under torchrun: every rank at once, or the launcher reports the late ones killed
        return 2
    except KeyboardInterrupt:
        print(f"{COMMAND}: interrupted", file=sys.stderr, flush=True)
        return 130
    return 0
