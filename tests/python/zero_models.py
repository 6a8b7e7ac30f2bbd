"""The model pieces the ZeRO-3 tests share (test_zero.py, test_zero_muon.py,
and zero_dp_worker.py, which torchrun runs as a script)."""

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


class TiedLM(nn.Module):
    """An embedding tied to the LM head, ``layers`` blocks and a LayerNorm;
    ``forward(x, y)`` is the cross entropy of the next tokens ``y``. The
    embedding starts at std 0.1. :meth:`trunk` runs the blocks (a subclass
    may run them otherwise)."""

    def __init__(self, vocab, d, layers):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight
        nn.init.normal_(self.emb.weight, std=0.1)

    def trunk(self, h):
        for b in self.blocks:
            h = b(h)
        return h

    def forward(self, x, y):
        logits = self.head(self.ln(self.trunk(self.emb(x))))
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
