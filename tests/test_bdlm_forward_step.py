"""The BDLM forward step through megatron-core's schedule, DDP and `finalize_model_grads` on 2 block ranks.

The model is `test_bdlm.TableModel` (known logits), so what is checked is the objective's plumbing in
Megatron: rows per block rank, integer token counts summed over dp×cp, gradients divided by the global
count, the "lm loss" report. Reference: the BD3-LM NELBO of the whole global batch on one process.
Negative control: every rank building rank 0's rows (a layout that ignores the block rank) must miss.
"""

import torch

from spawn import on_cpu_backend, run_ranks
from test_bdlm import MASK, TableModel, reference_nelbo, relative_error, sample_batch

SEQ, BLOCK, MICRO_BATCH, NUM_MICRO = 16, 2, 2, 3


def _global_batch():
    tokens = sample_batch(batch=MICRO_BATCH * NUM_MICRO, seq_length=SEQ, seed=21)
    return tokens, torch.arange(tokens.shape[0]) + 40


@on_cpu_backend
def _megatron_step(rank, world_size, layout_rank):
    from megatron.core import parallel_state
    from megatron.core.enums import ModelType
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer import TransformerConfig

    from megatron_csbp.bdlm.forward_step import BDLMForwardStep
    from megatron_csbp.bdlm.objective import BDLMObjective
    from megatron_csbp.core.layout import CSBPLayout

    parallel_state.initialize_model_parallel(context_parallel_size=world_size)
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, use_cpu_initialization=True,
                               calculate_per_token_loss=True, context_parallel_size=world_size)
    model = TableModel(SEQ)
    model.config, model.model_type = config, ModelType.encoder_or_decoder
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(), model)
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = ddp.no_sync

    tokens, sample_index = _global_batch()
    batches = [{"tokens": tokens[m * MICRO_BATCH:(m + 1) * MICRO_BATCH],
                "sample_index": sample_index[m * MICRO_BATCH:(m + 1) * MICRO_BATCH]} for m in range(NUM_MICRO)]
    objective = BDLMObjective(block_size=BLOCK, mask_token_id=MASK, seed=99)
    layout = CSBPLayout(SEQ, BLOCK, world_size, world_size, rank=layout_rank(parallel_state.get_context_parallel_rank()))
    ddp.zero_grad_buffer()
    reports = get_forward_backward_func()(
        forward_step_func=BDLMForwardStep(objective, layout), data_iterator=iter(batches), model=[ddp],
        num_microbatches=NUM_MICRO, seq_length=2 * SEQ, micro_batch_size=MICRO_BATCH, forward_only=False)
    report = torch.stack([r["lm loss"] for r in reports]).sum(0)
    torch.distributed.all_reduce(report, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
    grads = [p.main_grad.clone() for p in model.parameters()]
    parallel_state.destroy_model_parallel()
    return report, grads


def _run(rank, world_size):
    return {"right": _megatron_step(rank, world_size, lambda cp_rank: cp_rank),
            "wrong": _megatron_step(rank, world_size, lambda cp_rank: 0)}


def test_forward_step_through_megatron_schedule_equals_nelbo():
    results = run_ranks(_run, 2, timeout=240)

    from megatron_csbp.bdlm.objective import BDLMObjective

    tokens, sample_index = _global_batch()
    model = TableModel(SEQ)
    noise = BDLMObjective(block_size=BLOCK, mask_token_id=MASK, seed=99).noise(sample_index, SEQ)
    expected = reference_nelbo(model, tokens, noise, BLOCK)
    expected_grads = torch.autograd.grad(expected, list(model.parameters()))

    for rank_result in results:
        report, grads = rank_result["right"]
        assert int(report[1]) == tokens.numel()
        assert relative_error(report[0] / report[1], expected) < 1e-6
        for grad, expected_grad in zip(grads, expected_grads):
            assert relative_error(grad, expected_grad) < 1e-5
    wrong_report, wrong_grads = results[0]["wrong"]
    assert relative_error(wrong_report[0] / wrong_report[1], expected) > 1e-2
    assert max(relative_error(g, e) for g, e in zip(wrong_grads, expected_grads)) > 1e-2
