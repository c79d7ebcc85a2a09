"""The BD3-LM objective on top of the model: noise, the batch of `[x_t ; x_0]` rows, the loss, the forward
step, and its exact FLOPs. Imports `core` and `mcore`.
"""

from megatron_csbp.bdlm.forward_step import BDLMForwardStep, batch_on_this_rank, checked_loss_func  # noqa: F401
from megatron_csbp.bdlm.objective import BDLMObjective, loss_func  # noqa: F401
