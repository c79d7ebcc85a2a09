"""The BD3-LM objective on top of the model: noise, the batch of `[x_t ; x_0]` rows, the loss, the forward
step, and its exact FLOPs. Imports `core` and `mcore`.
"""

from megatron_csbp.bdlm.objective import (BDLMForwardStep, BDLMObjective, batch_on_this_rank,  # noqa: E402,F401
                                          checked_loss_func, loss_func)
