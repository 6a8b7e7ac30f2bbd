"""One rank of the ZeRO-3 engine's device collectives on tierflow's NCCL
(``torchrun --nproc-per-node N nccl_group_worker.py OUT``, one GPU a rank):
every collective and dtype against the values each rank computes for all;
then torch.distributed's API on a "tierflow" group, CUDA tensors on its NCCL.
Writes OUT.rank<r> (JSON)."""

import json
import os
import sys

import torch
import torch.distributed as dist

from tierflow.zero.comm import Group

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def values(rank: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(n, generator=g).to(dtype)


def main() -> None:
    out = sys.argv[1]
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    group = Group(collectives="tierflow")
    result = {"device_collectives": group._device_collectives, "mismatches": []}
    for dtype in DTYPES:
        shard = 1000
        mine = values(rank, shard, dtype).cuda()
        full = group.gather(mine)
        want = torch.cat([values(r, shard, dtype) for r in range(world)])
        if not torch.equal(full.cpu(), want):
            result["mismatches"].append(f"gather {dtype}")
        flat = values(rank, shard * world - 7, dtype).cuda()  # padded to world × shard
        got = group.reduce_scatter_mean(flat, shard).wait().cpu()
        every = torch.stack([torch.cat([values(r, shard * world - 7, dtype).float(), torch.zeros(7)])
                             for r in range(world)])
        mean = (every.sum(0) / world)[rank * shard:(rank + 1) * shard]
        if not torch.allclose(got, mean, rtol=1e-6, atol=1e-6):
            result["mismatches"].append(f"reduce_scatter_mean {dtype}: {(got - mean).abs().max().item()}")
        root = values(world - 1, 333, dtype).cuda() if rank == world - 1 else torch.zeros(333, dtype=dtype).cuda()
        group.broadcast(root, src=world - 1)
        if not torch.equal(root.cpu(), values(world - 1, 333, dtype)):
            result["mismatches"].append(f"broadcast {dtype}")
    result["counts"] = group.counts
    group.close()
    # torch.distributed's API on the "tierflow" backend, CUDA tensors on its NCCL
    import tierflow.torch.distributed  # noqa: F401 - registers the backend

    ours = dist.new_group(backend="tierflow")
    x = torch.full((10,), float(rank + 1), device="cuda")
    dist.all_reduce(x, group=ours)
    if not torch.equal(x.cpu(), torch.full((10,), float(world * (world + 1) // 2))):
        result["mismatches"].append(f"the tierflow backend's all_reduce: {x.cpu().tolist()}")
    gathered = torch.empty(world * 10, device="cuda")
    dist.all_gather_into_tensor(gathered, torch.full((10,), float(rank), device="cuda"), group=ours)
    if not torch.equal(gathered.cpu(), torch.arange(world).repeat_interleave(10).float()):
        result["mismatches"].append("the tierflow backend's all_gather_into_tensor")
    with open(f"{out}.rank{rank}", "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
