"""One rank of tierflow's GlooCommunicator beside torch.distributed's gloo
group (``torchrun --nproc-per-node N collectives_worker.py OUT``): the ranks
meet through torchrun's own store (``torch.distributed.rendezvous("env://")``);
every collective in every dtype, with uneven and empty shards, is checked
exactly against the values each rank put in (small integers, exact in
float32, bfloat16 and float16), and all_reduce against torch.distributed's
on the same tensors. Writes OUT.rank<r>: the failures (none when it passes)."""

import json
import sys

import torch
import torch.distributed as dist

from tierflow._core import GlooCommunicator


def value(rank: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    return ((rank + 1) * 10 + torch.arange(n) % 7).to(dtype)


def main() -> None:
    out = sys.argv[1]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    store, _, _ = next(dist.rendezvous("env://"))
    comm = GlooCommunicator(rank, world, store=store, prefix="tierflow-test", timeout=30.0)
    failures = []

    def check(what, got, expected):
        if not torch.equal(got, expected):
            failures.append(f"{what}: {got.tolist()} != {expected.tolist()}")

    counts = [0 if r == 1 else 3 + 2 * r for r in range(world)]  # rank 1's shard is empty
    total, offset = sum(counts), sum(counts[:rank])
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        mine = value(rank, counts[rank], dtype)
        gathered = torch.empty(total, dtype=dtype)
        comm.all_gather(mine, gathered, counts).wait()
        check(f"all_gather {dtype}", gathered, torch.cat([value(r, counts[r], dtype) for r in range(world)]))
        in_place = torch.zeros(total, dtype=dtype)  # this rank's slot holds its shard already
        in_place[offset:offset + counts[rank]] = mine
        comm.all_gather(in_place[offset:offset + counts[rank]], in_place, counts).wait()
        check(f"all_gather in place {dtype}", in_place, gathered)

        whole = value(rank, total, dtype)
        reduced = torch.empty(counts[rank], dtype=dtype)
        comm.reduce_scatter(whole, reduced, counts, op="sum").wait()
        expected = sum(value(r, total, torch.float64) for r in range(world))[offset:offset + counts[rank]]
        check(f"reduce_scatter {dtype}", reduced, expected.to(dtype))

        ours, theirs = value(rank, 1000, dtype), value(rank, 1000, dtype)
        work = comm.all_reduce(ours, op="max")
        dist.all_reduce(theirs, op=dist.ReduceOp.MAX)
        work.wait()
        check(f"all_reduce max {dtype} (torch.distributed's)", ours, theirs)

        # A chunk of each rank's shard of 10 (elements 4 to 7) gathered into its place; the rest untouched.
        shard = 10
        strided = torch.full((world * shard,), -1.0, dtype=dtype)
        strided[rank * shard:][:shard] = value(rank, shard, dtype)
        comm.all_gather_strided(strided[rank * shard + 4:][:3], strided[4:], shard).wait()
        want = torch.full((world * shard,), -1.0, dtype=dtype)
        for r in range(world):
            want[r * shard + 4:][:3] = value(r, shard, dtype)[4:7]
        want[rank * shard:][:shard] = value(rank, shard, dtype)
        check(f"all_gather_strided {dtype}", strided, want)

        b = value(rank, 257, dtype)
        comm.broadcast(b, world - 1).wait()
        check(f"broadcast {dtype}", b, value(world - 1, 257, dtype))

    try:
        comm.all_gather(torch.zeros(1), torch.zeros(1), [1] * world)
        failures.append("an output of the wrong size was taken")
    except ValueError as e:
        if "the counts add up to" not in str(e):
            failures.append(f"wrong-size output: {e}")
    try:
        comm.all_gather_strided(torch.zeros(3), torch.zeros(3 * world), 2)
        failures.append("overlapping pieces were taken")
    except ValueError as e:
        if "3 elements a rank overlap at a stride of 2" not in str(e):
            failures.append(f"overlapping pieces: {e}")
    comm.close()
    with open(f"{out}.rank{rank}", "w") as f:
        json.dump(failures, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
