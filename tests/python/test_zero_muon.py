"""The engine with ``optimizer.type: "Muon"`` (DeepSpeed's MuonWithAuxAdam:
Muon for the hidden matrices, AdamW for the rest) against a plain torch loop
over the same split: tierflow's two optimizers as MuonConfig.build makes
them (the same kernels: losses to fp32 rounding), and torch.optim.Muon with
torch.optim.AdamW (a measured tolerance: torch's Newton–Schulz rounds to
bf16 at other points than the kernel's, see test_muon.py). Stages 2 and 3,
the state in host memory and on NVMe, a checkpoint resume, and the cases
the engine refuses."""

import json

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tierflow
from tierflow.config import from_deepspeed
from tierflow.torch.optim import muon_param_groups
from tierflow.zero.runtime import check_optimizer

from zero_models import Block

STEPS = 4
GAS = 2
MUON = {"type": "Muon", "params": {"muon_lr": 0.02, "adam_lr": 3e-3, "momentum": 0.95, "weight_decay": 0.01}}


class SmallLM(nn.Module):
    """An embedding tied to the LM head (AdamW's), two blocks whose Linears' weights are Muon's."""

    def __init__(self, vocab=32, d=32, layers=2):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight
        nn.init.normal_(self.emb.weight, std=0.1)

    def forward(self, x, y):
        h = self.emb(x)
        for b in self.blocks:
            h = b(h)
        logits = self.head(self.ln(h))
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))


def batches(n, seed=3, vocab=32, batch=4, seq=8):
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randint(0, vocab, (batch, seq), generator=g) for _ in range(n)]
    return [(x, (3 * x + 1) % vocab) for x in xs]


def config(tmp_path, stage, state, clip=1.0, **extra):
    """A DeepSpeed config with the Muon section; ``state``: where
    offload_optimizer puts the state ("cpu" or "nvme")."""
    z = {"stage": stage, "offload_optimizer": {"device": state}}
    if state == "nvme":
        z["offload_optimizer"]["nvme_path"] = str(tmp_path / "nvme")
    if stage == 3:
        z["offload_param"] = {"device": "cpu"}
        z["stage3_param_persistence_threshold"] = 0
    c = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": GAS, "gradient_clipping": clip,
         "optimizer": MUON, "zero_optimization": z}
    c.update(extra)
    return c


def engine_losses(engine, steps=STEPS, first=0, data=None):
    data = data or batches((first + steps) * GAS)
    losses = []
    for step in range(first, first + steps):
        for micro in range(GAS):
            x, y = data[step * GAS + micro]
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    return losses


def plain_losses(make_optimizers, clip=1.0, steps=STEPS):
    """The same training in a plain loop, ``make_optimizers(model)`` giving the optimizers."""
    torch.manual_seed(0)
    model = SmallLM()
    optimizers = make_optimizers(model)
    data = batches(steps * GAS)
    losses = []
    for step in range(steps):
        for micro in range(GAS):
            x, y = data[step * GAS + micro]
            loss = model(x, y)
            (loss / GAS).backward()
            losses.append(loss.item())
        if clip > 0:
            clip_as_deepspeed(model.parameters(), clip)
        for opt in optimizers:
            opt.step()
            opt.zero_grad()
    return losses


def clip_as_deepspeed(params, clip):
    """DeepSpeed's clipping (the engine's): the global norm in fp64, the
    gradients times clip / (norm + 1e-6) when it exceeds ``clip``. Muon's
    bf16 Newton–Schulz turns a last-bit difference in a gradient (torch's
    clip_grad_norm_ sums its norm in fp32) into a visible one, so the
    reference clips as the engine does."""
    grads = [p.grad for p in params if p.grad is not None]
    norm = sum(float(torch.linalg.vector_norm(g, dtype=torch.float64)) ** 2 for g in grads) ** 0.5
    if norm > clip:
        for g in grads:
            g.mul_(clip / (norm + 1e-6))


def tierflow_pair(model):
    """MuonConfig.build's two optimizers (tierflow's Muon and AdamW)."""
    section = from_deepspeed({"train_micro_batch_size_per_gpu": 4, "optimizer": MUON}).optimizer
    return [o for o in section.build(model) if o is not None]


def torch_pair(model):
    """torch.optim.Muon and torch.optim.AdamW over the same split, with the section's values."""
    hidden, rest = muon_param_groups(model)
    p = MUON["params"]
    return [torch.optim.Muon(hidden, lr=p["muon_lr"], momentum=p["momentum"], weight_decay=p["weight_decay"],
                             nesterov=True, ns_steps=5),
            torch.optim.AdamW(rest, lr=p["adam_lr"], betas=(0.9, 0.95), eps=1e-10, weight_decay=p["weight_decay"])]


def make_engine(cfg):
    torch.manual_seed(0)
    engine, *_ = tierflow.initialize(model=SmallLM(), config=cfg)
    return engine


CASES = [(2, "cpu", 0.0), (2, "nvme", 0.0), (3, "cpu", 0.0), (3, "nvme", 0.0), (2, "cpu", 1.0), (3, "nvme", 1.0)]


@pytest.mark.parametrize("stage,state,clip", CASES,
                         ids=[f"stage{s}-{where}-{'clip' if c else 'overlapped'}" for s, where, c in CASES])
def test_the_engine_steps_muon_as_a_plain_loop_over_muon_config_build(tmp_path, stage, state, clip):
    reference = plain_losses(tierflow_pair, clip=clip)
    engine = make_engine(config(tmp_path, stage, state, clip=clip))
    try:
        opt = engine.optimizer
        assert isinstance(opt, torch.optim.Optimizer) and opt.offload == state
        assert [g["use_muon"] for g in opt.param_groups] == [True, False]
        assert [len(g["params"]) for g in opt.param_groups] == [4, 11]  # 2 blocks x (up, down); the embedding, norms, biases
        losses = engine_losses(engine)
        if stage == 3 and not clip:  # nothing global to know first: every parameter stepped in the backward
            assert engine.runtime._overlap.overlapped > 0
    finally:
        engine.close()
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference), rtol=1e-5, atol=1e-6)


def test_the_engine_tracks_torch_optim_muon_and_adamw_within_bf16_newton_schulz(tmp_path):
    # Measured over these 8 micro-batches: losses within 3e-4 relative of torch's (bf16 Newton–Schulz noise).
    reference = plain_losses(torch_pair)
    engine = make_engine(config(tmp_path, 2, "cpu"))
    try:
        losses = engine_losses(engine)
    finally:
        engine.close()
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference), rtol=2e-3, atol=0)
