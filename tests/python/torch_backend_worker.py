"""One rank of torch.distributed and FSDP2 on tierflow's communicators
(``torchrun --nproc-per-node N torch_backend_worker.py OUT MODE``).

MODE ``tierflow``: the process group is the ``"tierflow"`` backend; every
collective torch's API has for it is checked exactly (small integers, exact
in every dtype), with ``async_op`` and with errors for what it refuses; then
FSDP2 (``fully_shard`` over the group's mesh) trains 30 steps with
torch.optim.AdamW and torch's ``clip_grad_norm_``. MODE ``gloo``: the same
training on torch's gloo backend. MODE ``custom``: on gloo, with FSDP2's
all-gathers and reduce-scatters given to tierflow's through
``set_custom_all_gather`` / ``set_custom_reduce_scatter`` (counted).
Writes OUT.rank<r>: the failures, the losses, the counts.
"""

import json
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import tierflow.torch.distributed as tfd

from fsdp2_worker import HYPER, STEPS, Block, batches


def value(rank: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    return ((rank + 1) * 10 + torch.arange(n) % 7).to(dtype)


def check_collectives(failures: list[str]) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()

    def check(what, got, expected):
        if not torch.equal(got, expected):
            failures.append(f"{what}: {got.tolist()} != {expected.tolist()}")

    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        t = value(rank, 11, dtype)
        dist.all_reduce(t)
        check(f"all_reduce {dtype}", t, sum(value(r, 11, torch.float64) for r in range(world)).to(dtype))
        t = value(rank, 11, dtype)
        work = dist.all_reduce(t, op=dist.ReduceOp.MAX, async_op=True)
        work.wait()
        check(f"all_reduce max {dtype}", t, value(world - 1, 11, dtype))
        t = torch.full((6,), float(rank + 1), dtype=dtype)
        dist.all_reduce(t, op=dist.ReduceOp.AVG)
        check(f"all_reduce avg {dtype}", t, torch.full((6,), (world + 1) / 2, dtype=dtype))

        out = torch.empty(5 * world, dtype=dtype)
        dist.all_gather_into_tensor(out, value(rank, 5, dtype))
        check(f"all_gather_into_tensor {dtype}", out, torch.cat([value(r, 5, dtype) for r in range(world)]))
        pieces = [torch.empty(3, dtype=dtype) for _ in range(world)]
        dist.all_gather(pieces, value(rank, 3, dtype))
        check(f"all_gather {dtype}", torch.cat(pieces), torch.cat([value(r, 3, dtype) for r in range(world)]))

        shard = torch.empty(4, dtype=dtype)
        dist.reduce_scatter_tensor(shard, value(rank, 4 * world, dtype))
        whole = sum(value(r, 4 * world, torch.float64) for r in range(world))
        check(f"reduce_scatter_tensor {dtype}", shard, whole[rank * 4:(rank + 1) * 4].to(dtype))

        b = value(rank, 9, dtype)
        dist.broadcast(b, src=world - 1)
        check(f"broadcast {dtype}", b, value(world - 1, 9, dtype))
    work = dist.all_reduce(torch.ones(3), async_op=True)
    future = work.get_future()
    got = future.wait()[0]
    check("get_future", got, torch.full((3,), float(world)))
    dist.barrier()
    for what, call in (("an int64 tensor", lambda: dist.all_reduce(torch.ones(2, dtype=torch.int64))),
                       ("PREMUL_SUM", lambda: dist.reduce_scatter_tensor(
                           torch.empty(1), torch.ones(world), op=dist.ReduceOp.PREMUL_SUM(0.5)))):
        try:
            call()
            failures.append(f"{what} was taken")
        except (NotImplementedError, RuntimeError) as e:
            if "tierflow backend" not in str(e):
                failures.append(f"{what}: {e}")


def train(mesh, custom: bool) -> tuple[list[float], dict]:
    torch.manual_seed(0)
    m = nn.Sequential(*(Block(24) for _ in range(3)), nn.Linear(24, 5))
    for block in m[:3]:
        fully_shard(block, mesh=mesh)
    fully_shard(m, mesh=mesh)
    calls = {"all_gather": 0, "reduce_scatter": 0}
    if custom:
        class Counted:
            def __init__(self, inner, name):
                self.inner, self.name = inner, name

            def allocate(self, *a, **k):
                return self.inner.allocate(*a, **k)

            def __call__(self, *a, **k):
                calls[self.name] += 1
                return self.inner(*a, **k)

        for module in (*m[:3], m):
            module.set_custom_all_gather(Counted(tfd.AllGather(), "all_gather"))
            module.set_custom_reduce_scatter(Counted(tfd.ReduceScatter(), "reduce_scatter"))
    opt = torch.optim.AdamW(m.parameters(), **HYPER)
    data = batches(dist.get_rank())
    losses = []
    for step in range(STEPS):
        x, y = data[step]
        loss = torch.nn.functional.mse_loss(m(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / dist.get_world_size())
    return losses, calls


def main() -> None:
    out, mode = sys.argv[1:3]
    dist.init_process_group(tfd.BACKEND if mode == "tierflow" else "gloo")
    failures: list[str] = []
    if mode == "tierflow":
        if dist.get_backend() != tfd.BACKEND:
            failures.append(f"the backend is {dist.get_backend()}")
        check_collectives(failures)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    losses, calls = train(mesh, custom=mode == "custom")
    with open(f"{out}.rank{dist.get_rank()}", "w") as f:
        json.dump({"failures": failures, "losses": losses, "calls": calls}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
