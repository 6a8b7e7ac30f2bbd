"""torch optimizers whose steps run in tierflow's C++ kernels.

:class:`Adam` and :class:`AdamW` are drop-in replacements for torch.optim's,
for parameters on the CPU (see their docstrings for what tierflow adds).
"""

from tierflow.torch.optim.adam import MASTER_KEY, Adam, AdamW, adam

__all__ = ["Adam", "AdamW", "adam", "MASTER_KEY"]
