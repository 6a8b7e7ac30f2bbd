"""A decoder-only transformer in plain torch, GPT-2's architecture.

Token and position embeddings, pre-LayerNorm blocks of causal self-attention
(``F.scaled_dot_product_attention``) and a GELU MLP, a final LayerNorm, and an
LM head tied to the token embedding. ``GPT(cfg)(idx, targets)`` returns the
mean cross-entropy of predicting each next token.

Every weight is initialised inside the constructor of the leaf module that
owns it (``reset_parameters`` of :class:`_Linear` and :class:`_Embedding`),
never by a pass over the finished model: a ZeRO-3 ``Init`` context moves each
module's parameters into its store as that module's constructor returns, so
an initialisation applied afterwards would reach empty placeholders. Under the
same seed, the model is the same whether or not it is built in such a context.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["GPTConfig", "GPT", "PRESETS"]


@dataclass(frozen=True)
class GPTConfig:
    """A model's shape: layers, heads, width, context (tokens) and vocabulary."""

    n_layer: int
    n_head: int
    n_embd: int
    context: int
    vocab_size: int = 256  # bytes

    def __post_init__(self) -> None:
        for name in ("n_layer", "n_head", "n_embd", "context", "vocab_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: {getattr(self, name)} is not ≥ 1")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd: {self.n_embd} is not a multiple of n_head {self.n_head}")

    @property
    def parameters(self) -> int:
        """The parameter count, the tied LM head counted once."""
        d, v, t = self.n_embd, self.vocab_size, self.context
        block = 2 * 2 * d + (3 * d * d + 3 * d) + (d * d + d) + (4 * d * d + 4 * d) + (4 * d * d + d)
        return v * d + t * d + self.n_layer * block + 2 * d


# The presets: a tiny default for a CPU, GPT-2's and GPT-3's shapes for a GPU
# (a byte vocabulary makes their embeddings smaller than the originals': GPT-2
# small's 124M parameters are 85M here).
PRESETS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(n_layer=4, n_head=4, n_embd=256, context=128),
    "gpt2-small": GPTConfig(n_layer=12, n_head=12, n_embd=768, context=1024),
    "gpt2-medium": GPTConfig(n_layer=24, n_head=16, n_embd=1024, context=1024),
    "gpt2-large": GPTConfig(n_layer=36, n_head=20, n_embd=1280, context=1024),
    "1.3b": GPTConfig(n_layer=24, n_head=16, n_embd=2048, context=2048),
    "2.7b": GPTConfig(n_layer=32, n_head=32, n_embd=2560, context=2048),
    "6.7b": GPTConfig(n_layer=32, n_head=32, n_embd=4096, context=2048),
}


class _Linear(nn.Linear):
    """nn.Linear initialised as GPT-2's: weight ~ N(0, std²), bias 0."""

    def __init__(self, fan_in: int, fan_out: int, *, std: float) -> None:
        self.std = std  # read by reset_parameters(), which nn.Linear.__init__ calls
        super().__init__(fan_in, fan_out)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=self.std)
        nn.init.zeros_(self.bias)


class _Embedding(nn.Embedding):
    """nn.Embedding initialised as GPT-2's: N(0, 0.02²) rather than torch's N(0, 1),
    which through the tied LM head would start the logits far from uniform."""

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=0.02)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = _Linear(cfg.n_embd, 3 * cfg.n_embd, std=0.02)
        # GPT-2 scales the residual projections by 1/sqrt(2·n_layer): each block adds two.
        self.proj = _Linear(cfg.n_embd, cfg.n_embd, std=0.02 / math.sqrt(2 * cfg.n_layer))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = _Linear(cfg.n_embd, 4 * cfg.n_embd, std=0.02)
        self.proj = _Linear(4 * cfg.n_embd, cfg.n_embd, std=0.02 / math.sqrt(2 * cfg.n_layer))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """The model; ``forward(idx, targets)`` → the mean next-token loss.

    ``idx`` and ``targets`` are ``(batch, time)`` int64 token ids with
    ``time <= cfg.context``; ``targets[:, i]`` is the token after ``idx[:, i]``.
    """

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = _Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos_emb = _Embedding(cfg.context, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        # Tied: the head reads logits off the token embedding (GPT-2's choice,
        # and one matrix fewer to keep in every tier).
        self.lm_head.weight = self.tok_emb.weight

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.cfg.context:
            raise ValueError(f"idx: {t} tokens is longer than the model's context {self.cfg.context}")
        pos = torch.arange(t, device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]).float(), targets.reshape(-1))
