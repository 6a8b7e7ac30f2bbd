"""torch optimizers whose steps run in tierflow's C++ kernels.

:class:`Adam`, :class:`AdamW` and :class:`Muon` are drop-in replacements for
torch.optim's, for parameters on the CPU (see their docstrings for what
tierflow adds).
"""

from tierflow.torch.optim.adam import MASTER_KEY, Adam, AdamW, adam
from tierflow.torch.optim.muon import Muon, muon

__all__ = ["Adam", "AdamW", "adam", "Muon", "muon", "MASTER_KEY"]
