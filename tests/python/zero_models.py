"""The model pieces the ZeRO-3 tests share (test_zero.py, and
zero_dp_worker.py, which torchrun runs as a script)."""

import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    """A pre-norm MLP block with a residual: a LayerNorm and two Linears."""

    def __init__(self, d):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.ln(x))))
