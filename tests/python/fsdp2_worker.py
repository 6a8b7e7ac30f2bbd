"""One rank of a model sharded with FSDP2's ``fully_shard`` over a gloo mesh
on the CPU (``torchrun --nproc-per-node 2 fsdp2_worker.py OUT NVME CASE``):
the same 30 steps with torch.optim.AdamW and with tierflow's AdamW over the
same DTensor shards, then tierflow's again stopped at step 15, saved and
loaded with torch.distributed.checkpoint into a fresh model and optimizer,
and run to the end. ``CASE``: "plain" (fully_shard as it is),
"cpu_offload" (``CPUOffloadPolicy(pin_memory=False)``: pinning needs a GPU
driver), "nvme" (tierflow's optimizer state on NVMe files in NVME/rank<r>),
"offload" (as "nvme", and every parameter shard homed on NVMe by
``tierflow.torch.fsdp.offload`` within 64 KiB of host memory, so the step
runs a few shards at a time), "offload_torch" (the shards and their
gradients so homed within 1 MiB, stepped by torch.optim.AdamW, at once) or "offload_grads" (as
"offload", their gradients homed on NVMe too, and every step of every run
two micro-batches accumulated, torch's own clip_grad_norm_, and
zero_grad(set_to_none=False) up to step 20);
"muon" and "muon_nvme" run :func:`muon_main` instead, "clip" and
"clip_cpu_offload" :func:`clip_main`, "offload_full" :func:`full_main`.
Writes OUT.rank<r>: the losses of each run (each step's global mean) and
what the state_dict holds."""

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor

import tierflow.torch.fsdp
import tierflow.torch.optim

STEPS, STOP = 30, 15
HYPER = {"lr": 3e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.01}


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


def model(case: str) -> nn.Module:
    """Three blocks of width 24 (odd shards: 96 rows of up.weight over 2 ranks, 24 of down's), each
    fully_shard'ed, and the root."""
    torch.manual_seed(0)
    m = nn.Sequential(*(Block(24) for _ in range(3)), nn.Linear(24, 5))
    policy = {"offload_policy": CPUOffloadPolicy(pin_memory=False)} if case == "cpu_offload" else {}
    for block in m[:3]:
        fully_shard(block, **policy)
    fully_shard(m, **policy)
    return m


def homed(m: nn.Module, case: str, nvme: str):
    """tierflow.torch.fsdp.offload's handle on ``m`` for the "offload" cases (None for the others)."""
    if not case.startswith("offload"):
        return None
    budget = 1 << 20 if case == "offload_torch" else 64 << 10
    gradients = "host" if case == "offload" else "nvme"
    return tierflow.torch.fsdp.offload(m, tierflow.torch.fsdp.OffloadPolicy(nvme_dir=nvme, host_memory=budget,
                                                                             gradients=gradients))


def optimizer(kind: str, m: nn.Module, case: str, nvme: str, rank: int):
    if kind == "torch" or case == "offload_torch":
        return torch.optim.AdamW(m.parameters(), **HYPER)
    where = {"offload": "nvme", "nvme_dir": os.path.join(nvme, f"rank{rank}")} \
        if case in ("nvme", "offload", "offload_grads") else {}
    if where:
        os.makedirs(where["nvme_dir"], exist_ok=True)
    return tierflow.torch.optim.AdamW(m.parameters(), **HYPER, **where)


def batches(rank: int):
    g = torch.Generator().manual_seed(100 + rank)  # each rank its own data, as data parallelism has it
    return [(torch.randn(8, 24, generator=g), torch.randn(8, 5, generator=g)) for _ in range(STEPS)]


def train(m, opt, data, steps, world, case):
    losses = []
    for step in steps:
        x, y = data[step]
        if case == "offload_grads":
            loss = 0
            for half in (slice(0, 4), slice(4, 8)):
                part = torch.nn.functional.mse_loss(m(x[half]), y[half]) / 2
                part.backward()
                loss = loss + part.detach()
            torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)
            opt.step()
            opt.zero_grad(set_to_none=step >= 20)
        else:
            loss = torch.nn.functional.mse_loss(m(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
    return losses


def main() -> None:
    out, nvme, case = sys.argv[1:4]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    data = batches(rank)
    result = {}
    for kind in ("torch", "tierflow"):
        m = model(case)
        shards = homed(m, case, nvme) if kind == "tierflow" else None
        opt = optimizer(kind, m, case, nvme, rank)
        result[kind] = train(m, opt, data, range(STEPS), world, case)
        # Read as a user would: every parameter whole (the homed shards read from NVMe).
        result[f"{kind}_sums"] = [p.full_tensor().double().sum().item() for p in m.parameters()]
        if case == "offload_grads":  # one more backward: its gradients homed, then close() brings them back
            x, y = data[0]
            torch.nn.functional.mse_loss(m(x), y).backward()
            result[f"{kind}_grads"] = [type(p.grad._local_tensor).__name__ for p in m.parameters()]
        if shards is not None:
            prefetch = shards.telemetry()["prefetch"]
            result["prefetch"] = {"iterations": prefetch["iterations"], "rerecords": prefetch["rerecords"]}
            host = next(t for t in shards.telemetry()["store"]["tiers"] if t["kind"] == "host")
            result["host"] = [host["high_water_bytes"], host["budget_bytes"]]
            shards.close()
        if case == "offload_grads":
            result[f"{kind}_grads_closed"] = [type(p.grad._local_tensor).__name__ for p in m.parameters()]
            result[f"{kind}_grad_sums"] = [p.grad.full_tensor().double().sum().item() for p in m.parameters()]
        if kind == "tierflow":
            sd = opt.state_dict()
            first = next(iter(sd["state"].values()))
            p = next(iter(m.parameters()))
            result["state"] = {"exp_avg": type(first["exp_avg"]).__name__,
                               "placements": str(first["exp_avg"].placements) if isinstance(first["exp_avg"], DTensor)
                               else None, "param_placements": str(p.placements),
                               "step": type(first["step"]).__name__}
        if hasattr(opt, "close"):
            opt.close()
    # Stopped, saved with torch.distributed.checkpoint, loaded into new ones.
    m = model(case)
    shards = homed(m, case, nvme)
    opt = optimizer("tierflow", m, case, nvme, rank)
    resumed = train(m, opt, data, range(STOP), world, case)
    model_sd, optim_sd = get_state_dict(m, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=os.path.join(nvme, "dcp"))
    if hasattr(opt, "close"):
        opt.close()
    if shards is not None:
        shards.close()
    m = model(case)
    torch.manual_seed(1)
    for p in m.parameters():  # other values: the checkpoint gives them back
        p.data.add_(torch.randn_like(p))
    shards = homed(m, case, nvme)
    opt = optimizer("tierflow", m, case, nvme, rank)
    model_sd, optim_sd = get_state_dict(m, opt)
    loaded = {"model": model_sd, "optim": optim_sd}
    dcp.load(loaded, checkpoint_id=os.path.join(nvme, "dcp"))
    set_state_dict(m, opt, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])
    resumed += train(m, opt, data, range(STOP, STEPS), world, case)
    if hasattr(opt, "close"):
        opt.close()
    if shards is not None:
        shards.close()
    result["resumed"] = resumed
    with open(f"{out}.rank{rank}", "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


MUON = {"lr": 0.02, "momentum": 0.95, "weight_decay": 0.01, "nesterov": True, "ns_steps": 5}
AUX = {"lr": 3e-3, "betas": (0.9, 0.95), "eps": 1e-10, "weight_decay": 0.01}


def muon_main(out: str, nvme: str, case: str) -> None:
    """Muon (hidden matrices, muon_param_groups' rule) and AdamW (the rest):
    the unsharded model on the whole batch with torch.optim.Muon + AdamW and
    with tierflow's, against the model sharded with fully_shard, each rank on
    its half of the batch, with tierflow's (state on NVMe with "muon_nvme"),
    20 steps, and a resume through torch.distributed.checkpoint at step 10."""
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(7)
    data = [(torch.randn(8, 24, generator=g), torch.randn(8, 5, generator=g)) for _ in range(20)]
    rows = slice(rank * 8 // world, (rank + 1) * 8 // world)

    def unsharded():
        torch.manual_seed(0)
        return nn.Sequential(*(Block(24) for _ in range(3)), nn.Linear(24, 5))

    def sharded():
        m = unsharded()
        for block in m[:3]:
            fully_shard(block)
        fully_shard(m)
        return m

    def optimizers(m, kind):
        hidden, rest = tierflow.torch.optim.muon_param_groups(m)
        if kind == "torch":
            return [torch.optim.Muon(hidden, **MUON), torch.optim.AdamW(rest, **AUX)]
        where = {}
        if case == "muon_nvme" and kind == "sharded":
            where = {"offload": "nvme", "nvme_dir": os.path.join(nvme, f"rank{rank}")}
            os.makedirs(where["nvme_dir"], exist_ok=True)
        return [tierflow.torch.optim.Muon(hidden, **MUON, **where), tierflow.torch.optim.AdamW(rest, **AUX, **where)]

    def train(m, opts, steps, on_rows):
        losses = []
        for step in steps:
            x, y = data[step]
            if on_rows:
                x, y = x[rows], y[rows]
            loss = torch.nn.functional.mse_loss(m(x), y)
            loss.backward()
            for o in opts:
                o.step()
                o.zero_grad()
            mean = loss.detach().clone()
            if on_rows:
                dist.all_reduce(mean)
                mean /= world
            losses.append(mean.item())
        return losses

    result = {}
    for kind in ("torch", "tierflow"):
        m = unsharded()
        result[kind] = train(m, optimizers(m, kind), range(20), on_rows=False)
    m = sharded()
    opts = optimizers(m, "sharded")
    result["sharded"] = train(m, opts, range(20), on_rows=True)
    buffer = next(iter(opts[0].state_dict()["state"].values()))["momentum_buffer"]
    result["buffer"] = type(buffer).__name__
    for o in opts:
        o.close()
    m = sharded()
    opts = optimizers(m, "sharded")
    resumed = train(m, opts, range(10), on_rows=True)
    sd = {f"o{i}": get_state_dict(m, o)[1] for i, o in enumerate(opts)}
    sd["model"] = get_state_dict(m, opts[0])[0]
    dcp.save(sd, checkpoint_id=os.path.join(nvme, "dcp"))
    for o in opts:
        o.close()
    m = sharded()
    opts = optimizers(m, "sharded")
    loaded = {f"o{i}": get_state_dict(m, o)[1] for i, o in enumerate(opts)}
    loaded["model"] = get_state_dict(m, opts[0])[0]
    dcp.load(loaded, checkpoint_id=os.path.join(nvme, "dcp"))
    for i, o in enumerate(opts):
        set_state_dict(m, o, model_state_dict=loaded["model"], optim_state_dict=loaded[f"o{i}"])
    resumed += train(m, opts, range(10, 20), on_rows=True)
    for o in opts:
        o.close()
    result["resumed"] = resumed
    with open(f"{out}.rank{rank}", "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


def clip_main(out: str, case: str) -> None:
    """tierflow.torch.fsdp.clip_grad_norm_ against torch.nn.utils.clip_grad_norm_
    over the same gradients of a fully_shard model (``case`` "clip" or
    "clip_cpu_offload"), for norms 2, 1 and inf: each total norm and the
    largest difference between the clipped gradients' shards."""
    import math

    from tierflow.torch.fsdp import clip_grad_norm_

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    result = {}
    for norm_type in (2.0, 1.0, math.inf):
        runs = []
        for clip in (torch.nn.utils.clip_grad_norm_, clip_grad_norm_):
            m = model("cpu_offload" if case == "clip_cpu_offload" else "plain")
            g = torch.Generator().manual_seed(3 + rank)
            x, y = torch.randn(8, 24, generator=g), torch.randn(8, 5, generator=g)
            torch.nn.functional.mse_loss(m(x), y).backward()
            norm = clip(m.parameters(), 0.05, norm_type=norm_type)
            norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
            runs.append((float(norm), [p.grad.to_local().clone() for p in m.parameters()]))
        (theirs, g_theirs), (ours, g_ours) = runs
        result[str(norm_type)] = {"torch": theirs, "tierflow": ours,
                                  "grads": max((a - b).abs().max().item() for a, b in zip(g_theirs, g_ours))}
    with open(f"{out}.rank{rank}", "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


def full_main(out: str, nvme: str) -> None:
    """Every shard and gradient homed on a disk (``nvme``, a small tmpfs)
    with room for the shards alone: the first backward's write of a gradient
    fails. Writes what it raised, whether the model's values after close()
    are those before, and whether close() left any file."""
    import errno

    dist.init_process_group("gloo")
    m = model("plain")
    shards = tierflow.torch.fsdp.offload(m, tierflow.torch.fsdp.OffloadPolicy(
        nvme_dir=nvme, host_memory=64 << 10, gradients="nvme"))
    before = {k: v.full_tensor().clone() for k, v in m.state_dict().items()}
    x, y = batches(0)[0]
    result = {}
    try:
        torch.nn.functional.mse_loss(m(x), y).backward()
    except OSError as e:
        result = {"errno": errno.errorcode.get(e.errno), "message": str(e)}
    shards.close()
    after = {k: v.full_tensor() for k, v in m.state_dict().items()}
    result["intact"] = all(torch.equal(before[k], after[k]) for k in before)
    result["files_left"] = os.path.exists(os.path.join(nvme, "tierflow-fsdp"))
    with open(f"{out}.rank0", "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    if sys.argv[3].startswith("muon"):
        muon_main(*sys.argv[1:4])
    elif sys.argv[3] == "offload_full":
        full_main(*sys.argv[1:3])
    elif sys.argv[3].startswith("clip"):
        clip_main(sys.argv[1], sys.argv[3])
    else:
        main()
