"""torch optimizers whose steps run in tierflow's C++ kernels.

:class:`Adam`, :class:`AdamW` and :class:`Muon` are drop-in replacements for
torch.optim's, for parameters on the CPU, and for Adam/AdamW also on a CUDA
device, stepped on the CPU (see their docstrings for what tierflow adds);
:func:`muon_param_groups` splits a model's parameters between Muon (hidden
matrices) and AdamW (the rest) by the C++ engine's rule;
:class:`ZenFlow` is AdamW with ZenFlow's split of the update between the
device and the host, in the C++ ZenFlow engine.
"""

from tierflow.torch.optim.adam import MASTER_KEY, Adam, AdamW, adam
from tierflow.torch.optim.muon import Muon, MuonParamGroups, muon, muon_param_groups
from tierflow.torch.optim.zenflow import ZenFlow

__all__ = ["Adam", "AdamW", "adam", "Muon", "muon", "muon_param_groups", "MuonParamGroups", "MASTER_KEY",
           "ZenFlow"]
