"""The BDLM objective against the BD3-LM NELBO written out independently, on one process.

Block-parallel ranks are simulated by building every rank's rows and summing what Megatron would sum
over dp×cp (loss sums, token counts, gradients).
"""

import itertools
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from megatron_csbp.bdlm.forward_step import BDLMForwardStep
from megatron_csbp.bdlm.objective import BDLMObjective, loss_func
from megatron_csbp.core.layout import CPLayout, CSBPLayout, layout_for

VOCAB = 5  # real ids 0..4
MASK = VOCAB  # the extra id; the model's vocabulary is VOCAB + 1


class TableModel(torch.nn.Module):
    """A stand-in for the BDLM GPT model whose logits are known: `token_table[input id] + position_table[pos]`.

    Like the real model it scores noisy rows only, excludes the MASK logit and returns per-token CE.
    """

    def __init__(self, seq_length, pre_process=True, post_process=True, per_token_loss=True):
        super().__init__()
        gen = torch.Generator().manual_seed(7)
        self.token_table = torch.nn.Parameter(torch.randn(VOCAB + 1, VOCAB + 1, generator=gen))
        self.position_table = torch.nn.Parameter(torch.randn(seq_length, VOCAB + 1, generator=gen))
        self.config = SimpleNamespace(calculate_per_token_loss=per_token_loss)
        self.pre_process, self.post_process = pre_process, post_process
        self.calls = []

    def set_input_tensor(self, input_tensor):
        """Megatron's pipeline hook; one stage holds the whole stand-in."""

    def logits(self, input_id, position):
        return (self.token_table[input_id] + self.position_table[position])[..., :VOCAB]

    def forward(self, input_ids, position_ids, attention_mask=None, labels=None):
        self.calls.append((input_ids, position_ids, labels))
        if labels is None or input_ids is None:  # a pipeline stage without the embedding or the head
            return position_ids.float()
        n_noisy = labels.shape[1]
        logits = self.logits(input_ids[:, :n_noisy], position_ids[:, :n_noisy])
        return F.cross_entropy(logits.transpose(1, 2), labels, reduction="none")


def reference_nelbo(model, x0, noise, block_size, inverse_t=True):
    """BD3-LM NELBO per token: sum over masked tokens of w_b * -log p(x0 | x_t), over all b*L tokens."""
    total = torch.zeros(())
    batch, seq_length = x0.shape
    for k, p in itertools.product(range(batch), range(seq_length)):
        if noise.masked[k, p]:
            weight = 1.0 / noise.t[k, p // block_size].item() if inverse_t else 1.0
            log_probs = torch.log_softmax(model.logits(torch.tensor(MASK), torch.tensor(p)), dim=-1)
            total = total - weight * log_probs[x0[k, p]]
    return total / (batch * seq_length)


def sharded_loss(model, objective, x0, sample_index, layouts, loss_mask=None):
    """What Megatron computes: per-rank loss sums and counts, summed over the block-parallel ranks; and
    two wrong normalisations for negative controls (a mean of per-rank means, a mean over masked tokens)."""
    loss_sum, num_tokens, mean_of_means, num_masked = 0.0, 0, 0.0, 0
    for layout in layouts:
        rows = objective.rows(x0, sample_index, layout, loss_mask)
        ce = model(rows.input_ids, rows.position_ids, labels=rows.labels)
        rank_sum, rank_tokens, report = loss_func(rows.loss_weights, rows.num_tokens, ce)
        assert torch.equal(report["lm loss"], torch.stack([rank_sum.detach(), rank_tokens.float()]))
        assert rank_tokens.dtype == torch.int
        loss_sum, num_tokens = loss_sum + rank_sum, num_tokens + int(rank_tokens)
        mean_of_means = mean_of_means + rank_sum / rank_tokens / len(layouts)
        num_masked += int((rows.loss_weights > 0).sum())
    return loss_sum / num_tokens, num_tokens, SimpleNamespace(mean_of_means=mean_of_means,
                                                              masked_mean=loss_sum / num_masked)


def all_ranks(layout):
    return [layout.for_rank(r) for r in range(layout.block_parallel_size)]


def relative_error(a, b):
    return (torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b)).item()


def sample_batch(batch=2, seq_length=8, seed=3):
    return torch.randint(0, VOCAB, (batch, seq_length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("weighting", ["inverse-t", "unit"])
@pytest.mark.parametrize("layout", [CSBPLayout(8, 4, 2, 2), CSBPLayout(8, 4, 1, 1), CPLayout(8, 4, 2)],
                         ids=["csbp-P2", "single", "cp-C2"])
def test_loss_and_grads_equal_independent_nelbo(weighting, layout):
    x0, sample_index = sample_batch(), torch.tensor([10, 11])
    objective = BDLMObjective(block_size=4, mask_token_id=MASK, loss_weighting=weighting, seed=5)
    model = TableModel(8)
    noise = objective.noise(sample_index, 8)
    assert noise.masked.any() and (~noise.masked).any()  # the batch exercises both kinds of position

    loss, num_tokens, wrong = sharded_loss(model, objective, x0, sample_index, all_ranks(layout))
    grads = torch.autograd.grad(loss, list(model.parameters()))
    expected = reference_nelbo(model, x0, noise, 4, inverse_t=weighting == "inverse-t")
    expected_grads = torch.autograd.grad(expected, list(model.parameters()))

    assert num_tokens == 2 * 8
    assert relative_error(loss, expected) < 1e-6
    for grad, expected_grad in zip(grads, expected_grads):
        assert relative_error(grad, expected_grad) < 1e-6
    assert relative_error(wrong.masked_mean, expected) > 1e-2  # negative control: not a mean over masked tokens


def test_loss_mask_sets_supervised_tokens_and_normaliser():
    x0, sample_index = sample_batch(), torch.tensor([0, 1])
    loss_mask = torch.ones(2, 8)
    loss_mask[0, 5:] = 0
    objective = BDLMObjective(block_size=4, mask_token_id=MASK, noise_range=(0.6, 1.0), seed=2)
    model = TableModel(8)
    loss, num_tokens, wrong = sharded_loss(model, objective, x0, sample_index, all_ranks(CSBPLayout(8, 4, 2, 2)),
                                           loss_mask)
    noise = objective.noise(sample_index, 8)
    assert (noise.masked[0, 5:]).any()  # an unsupervised masked token that must not count
    supervised_noise = noise._replace(masked=noise.masked & loss_mask.bool())
    expected = reference_nelbo(model, x0, supervised_noise, 4) * (2 * 8) / 13
    assert num_tokens == 13
    assert relative_error(loss, expected) < 1e-6
    assert relative_error(wrong.mean_of_means, expected) > 1e-2  # negative control: uneven per-rank counts


@pytest.mark.parametrize("layout", [CSBPLayout(16, 2, 2, 2), CSBPLayout(16, 2, 4, 2), CSBPLayout(16, 2, 4, 1),
                                    CSBPLayout(16, 2, 4, 4, schedule="contiguous", clean_layout="contiguous"),
                                    CPLayout(16, 2, 2)],
                         ids=["P2C2", "P4C2", "P4C1", "P4C4-contiguous", "cp-C2"])
def test_rank_rows_reconstruct_the_sample(layout):
    x0, sample_index = sample_batch(batch=3, seq_length=16), torch.tensor([4, 8, 15])
    objective = BDLMObjective(block_size=2, mask_token_id=MASK, seed=9)
    noise = objective.noise(sample_index, 16)
    x_t = torch.where(noise.masked, MASK, x0)
    seen_noisy, seen_clean = torch.full_like(x0, -1), {}
    total_tokens = 0
    for rank_layout in all_ranks(layout):
        rows = objective.rows(x0, sample_index, rank_layout)
        n_noisy = rank_layout.num_noisy_rows
        assert rows.input_ids.shape == rows.position_ids.shape == (3, rank_layout.num_rows)
        assert torch.equal(rows.position_ids[0], rank_layout.row_positions)
        noisy_at = rank_layout.noisy_positions
        assert (seen_noisy[:, noisy_at] == -1).all()  # every noisy position on exactly one rank
        seen_noisy[:, noisy_at] = rows.input_ids[:, :n_noisy]
        assert torch.equal(rows.labels, x0[:, noisy_at])
        ring = seen_clean.setdefault(rank_layout.ring_index, torch.full_like(x0, -1))
        ring[:, rank_layout.clean_positions] = rows.input_ids[:, n_noisy:]
        total_tokens += int(rows.num_tokens)
    assert torch.equal(seen_noisy, x_t)
    assert len(seen_clean) == layout.num_rings and all(torch.equal(ring, x0) for ring in seen_clean.values())
    assert total_tokens == 3 * 16


def test_noise_depends_on_seed_and_sample_index_only():
    objective = BDLMObjective(block_size=4, mask_token_id=MASK, antithetic_group=4, seed=11)
    together = objective.noise(torch.tensor([8, 9, 10, 11]), 32)
    alone = objective.noise(torch.tensor([10]), 32)
    reordered = objective.noise(torch.tensor([11, 8]), 32)
    assert torch.equal(alone.t[0], together.t[2]) and torch.equal(alone.masked[0], together.masked[2])
    assert torch.equal(reordered.t, together.t[[3, 0]]) and torch.equal(reordered.masked, together.masked[[3, 0]])
    twin = BDLMObjective(block_size=4, mask_token_id=MASK, antithetic_group=4, seed=11)
    assert torch.equal(twin.noise(torch.tensor([9]), 32).masked, together.masked[1:2])
    torch.manual_seed(0)  # the global RNG stream plays no part
    again = objective.noise(torch.tensor([8, 9, 10, 11]), 32)
    assert torch.equal(again.t, together.t) and torch.equal(again.masked, together.masked)
    other_seed = BDLMObjective(block_size=4, mask_token_id=MASK, antithetic_group=4, seed=12)
    assert not torch.equal(other_seed.noise(torch.tensor([8]), 32).masked, together.masked[:1])
    assert len({tuple(m.tolist()) for m in together.masked}) == 4  # different samples, different masks


@pytest.mark.parametrize("noise_range", [(1e-3, 1.0), (0.2, 0.7)])
def test_antithetic_times_are_stratified_within_the_range(noise_range):
    group, num_blocks = 8, 4
    objective = BDLMObjective(block_size=2, mask_token_id=MASK, antithetic_group=group, noise_range=noise_range)
    t_min, t_max = noise_range
    for first in (0, 8, 24):
        t = objective.noise(torch.arange(first, first + group), 2 * num_blocks).t
        assert ((t >= t_min) & (t <= t_max)).all()
        unit = (t - t_min) / (t_max - t_min)
        strata = torch.floor(unit.reshape(-1) * group * num_blocks + 1e-9) % (group * num_blocks)
        # one time per stratum of width 1/N, and all at the same offset u inside its stratum
        assert sorted(strata.long().tolist()) == list(range(group * num_blocks))
        offsets = unit.reshape(-1) * group * num_blocks - strata
        assert torch.allclose(offsets % 1, (offsets % 1)[0].expand_as(offsets), atol=1e-9)
    iid = BDLMObjective(block_size=2, mask_token_id=MASK, antithetic=False, noise_range=noise_range)
    t = iid.noise(torch.arange(group), 2 * num_blocks).t
    assert ((t >= t_min) & (t <= t_max)).all()
    strata = torch.floor((t - t_min) / (t_max - t_min) * group * num_blocks).long()
    assert len(set(strata.reshape(-1).tolist())) < group * num_blocks  # i.i.d. times are not stratified


def test_masking_probability_is_the_block_time():
    objective = BDLMObjective(block_size=256, mask_token_id=MASK, noise_range=(0.3, 0.3))
    masked = objective.noise(torch.arange(20), 512).masked
    assert abs(masked.float().mean().item() - 0.3) < 0.01
    full = BDLMObjective(block_size=4, mask_token_id=MASK, noise_range=(1.0, 1.0))
    assert full.noise(torch.arange(3), 8).masked.all()


def test_fast_dllm_v2_complementary_views_and_shifted_labels():
    x0, sample_index = sample_batch(batch=2, seq_length=16), torch.tensor([3, 4])
    objective = BDLMObjective(block_size=4, mask_token_id=MASK, objective="fast-dllm-v2", seed=1)
    assert objective.loss_weighting == "unit" and objective.views_per_sample == 2
    noise = objective.noise(sample_index, 16)
    model = TableModel(16)
    layouts = all_ranks(CSBPLayout(16, 4, 2, 2))
    x_t = torch.full((4, 16), -1)
    weights = torch.zeros(4, 16)
    loss_sum, num_tokens = 0.0, 0
    for layout in layouts:
        rows = objective.rows(x0, sample_index, layout)
        noisy_at = layout.noisy_positions
        assert rows.input_ids.shape[0] == 4  # the micro-batch doubles: [views m ; views 1-m]
        x_t[:, noisy_at] = rows.input_ids[:, :layout.num_noisy_rows]
        weights[:, noisy_at] = rows.loss_weights
        shifted = torch.where(noisy_at < 15, noisy_at + 1, noisy_at)
        assert torch.equal(rows.labels, x0.repeat(2, 1)[:, shifted])
        assert torch.equal(rows.input_ids[:, layout.num_noisy_rows:], x0.repeat(2, 1)[:, layout.clean_positions])
        ce = model(rows.input_ids, rows.position_ids, labels=rows.labels)
        rank_sum, rank_tokens, _ = loss_func(rows.loss_weights, rows.num_tokens, ce)
        loss_sum, num_tokens = loss_sum + rank_sum, num_tokens + int(rank_tokens)
    first, second = x_t[:2] == MASK, x_t[2:] == MASK
    assert torch.equal(first, noise.masked) and torch.equal(first ^ second, torch.ones_like(first))
    assert torch.equal(torch.where(first, x0, x_t[:2]), x0) and torch.equal(torch.where(second, x0, x_t[2:]), x0)
    # row p is weighted (unit) iff token p+1 is masked in its view: each target 1..L-1 exactly once per pair
    assert set(weights.unique().tolist()) <= {0.0, 1.0}
    assert torch.equal(weights[:2, :15] + weights[2:, :15], torch.ones(2, 15))
    assert (weights[:, 15] == 0).all()
    assert torch.equal(weights[:, :15].bool(), torch.cat([first, second])[:, 1:])
    assert num_tokens == 2 * 15
    # with pair-complementary masks the loss is the mean shifted CE over every target, like AR
    expected = 0.0
    for k, p in itertools.product(range(2), range(15)):
        view = x_t[k] if first[k, p + 1] else x_t[2 + k]
        log_probs = torch.log_softmax(model.logits(view[p], torch.tensor(p)), dim=-1)
        expected = expected - log_probs[x0[k, p + 1]]
    assert relative_error(loss_sum / num_tokens, expected / 30) < 1e-6


def test_forward_step_feeds_the_model_per_pipeline_stage():
    x0, sample_index = sample_batch(), torch.tensor([6, 7])
    objective = BDLMObjective(block_size=4, mask_token_id=MASK, seed=4)
    layout = CSBPLayout(8, 4, 2, 2, rank=1)
    step = BDLMForwardStep(objective, layout)
    expected = objective.rows(x0, sample_index, layout)

    whole = TableModel(8)
    output, loss = step(iter([{"tokens": x0, "sample_index": sample_index}]), whole)
    input_ids, position_ids, labels = whole.calls[-1]
    assert torch.equal(input_ids, expected.input_ids) and torch.equal(labels, expected.labels)
    assert torch.equal(position_ids, expected.position_ids)
    loss_sum, num_tokens, report = loss(output)
    assert torch.equal(loss_sum, (output * expected.loss_weights).sum())
    assert int(num_tokens) == int(expected.num_tokens) and report["lm loss"].shape == (2,)

    first = TableModel(8, post_process=False)
    step(iter([{"tokens": x0, "sample_index": sample_index}]), first)
    assert first.calls[-1][2] is None and torch.equal(first.calls[-1][0], expected.input_ids)
    last = TableModel(8, pre_process=False)
    step(iter([{"tokens": x0, "sample_index": sample_index}]), last)
    assert last.calls[-1][0] is None and torch.equal(last.calls[-1][2], expected.labels)
    middle = TableModel(8, pre_process=False, post_process=False)
    step(None, middle)  # middle stages read no data
    assert middle.calls[-1][0] is None and torch.equal(middle.calls[-1][1][0], layout.row_positions)


def test_forward_step_refusals_name_the_flag():
    x0 = sample_batch()
    objective = BDLMObjective(block_size=4, mask_token_id=MASK)
    step = BDLMForwardStep(objective, CSBPLayout(8, 4, 2, 2))
    with pytest.raises(ValueError, match="--calculate-per-token-loss"):
        step(iter([{"tokens": x0, "sample_index": torch.tensor([0, 1])}]), TableModel(8, per_token_loss=False))
    with pytest.raises(ValueError, match="sample_index"):
        step(iter([{"tokens": x0}]), TableModel(8))
    with pytest.raises(ValueError, match="--bdlm-block-size"):
        BDLMForwardStep(objective, CSBPLayout(8, 2, 2, 2))
    wrong_mask = TableModel(8)
    wrong_mask.mask_token_id = None  # a model that would keep the MASK logit
    with pytest.raises(ValueError, match="--bdlm-mask-token-id=5"):
        step(iter([{"tokens": x0, "sample_index": torch.tensor([0, 1])}]), wrong_mask)
    wrong_layout = TableModel(8)
    wrong_layout.layout = CSBPLayout(8, 4, 2, 2, rank=1)
    with pytest.raises(ValueError, match="same layout"):
        step(iter([{"tokens": x0, "sample_index": torch.tensor([0, 1])}]), SimpleNamespace(module=wrong_layout))  # unwrapped like DDP
    with pytest.raises(ValueError, match="--bdlm-mask-token-id=5"):
        objective.rows(torch.full((2, 8), MASK), torch.tensor([0, 1]), CSBPLayout(8, 4, 2, 2))
    with pytest.raises(ValueError, match="--seq-length=8"):
        objective.rows(sample_batch(seq_length=16), torch.tensor([0, 1]), CSBPLayout(8, 4, 2, 2))
    with pytest.raises(ValueError, match="sample_index has 1 entries"):
        objective.rows(x0, torch.tensor([0]), CSBPLayout(8, 4, 2, 2))
    with pytest.raises(ValueError, match="per-token cross-entropy"):
        loss_func(torch.ones(2, 4), torch.tensor(8), torch.ones(2, 8))


@pytest.mark.parametrize("kwargs, flag", [
    (dict(block_size=0), "--bdlm-block-size"),
    (dict(mask_token_id=-1), "--bdlm-mask-token-id"),
    (dict(objective="mdlm"), "--bdlm-objective"),
    (dict(loss_weighting="elbo"), "--bdlm-loss-weighting"),
    (dict(objective="fast-dllm-v2", loss_weighting="inverse-t"), "--bdlm-loss-weighting"),
    (dict(noise_range=(0.0, 1.0)), "--bdlm-noise-range"),
    (dict(noise_range=(0.5, 0.2)), "--bdlm-noise-range"),
    (dict(noise_range=(0.5, 1.5)), "--bdlm-noise-range"),
    (dict(noise_range=(0.5,)), "--bdlm-noise-range"),
    (dict(antithetic_group=0), "--global-batch-size"),
    (dict(seed=-3), "--seed"),
])
def test_objective_refusals_name_the_flag(kwargs, flag):
    with pytest.raises(ValueError, match=flag):
        BDLMObjective(**{"block_size": 4, "mask_token_id": MASK, **kwargs})


def test_noise_refuses_a_length_that_is_not_whole_blocks():
    with pytest.raises(ValueError, match="--bdlm-block-size 4"):
        BDLMObjective(block_size=4, mask_token_id=MASK).noise(torch.tensor([0]), 10)


def test_layout_for_modes_share_the_objective():
    x0, sample_index = sample_batch(seq_length=16), torch.tensor([1, 2])
    objective = BDLMObjective(block_size=2, mask_token_id=MASK, seed=8)
    model = TableModel(16)
    losses = [sharded_loss(model, objective, x0, sample_index, all_ranks(layout_for(mode, 16, 2, 2, rank=0)))[0]
              for mode in ("csbp", "cp", "cp-traffic", "bp")]
    assert all(relative_error(loss, losses[0]) < 1e-6 for loss in losses[1:])
