#!/usr/bin/env python3
"""The ZeRO-3 engine's gather pipeline with its shards on NVMe, between gloo
ranks, beside each of its two stages measured alone in the same run.

    torchrun --nproc-per-node 2 bench/python/zero_gather.py --nvme-dir DIR [--params 16]
        [--numel 4194304] [--host-memory BYTES] [--iterations 5] [--json FILE]

Each rank stores ``--params`` bf16 parameters of ``--numel`` elements, its
shard of each homed on NVMe, through ``--host-memory`` bytes of host memory
(default: a quarter of a rank's shards), so that every iteration reads every
shard from NVMe again. Timed, each the slowest rank's, median of
``--iterations`` after one that records the order:

* **NVMe read alone**: each shard leased into host memory and released, in
  order, through the store's prefetch scheduler (what the pipeline reads, as
  fast as the store reads it);
* **all-gather alone**: each parameter all-gathered in place from host
  memory already holding the shard, every gather issued at once on
  tierflow's Gloo communicator (as fast as it gathers);
* **the pipeline**: each parameter fetched and released as a forward does —
  its shard read from NVMe straight into its slot of the gather buffer,
  gathered in place once the read is done, the next ones ahead; with
  tierflow's communicator, and with torch.distributed's gloo group running
  the same pipeline's collectives.

Bandwidths are the gathered parameters' bytes per second. Rank 0 prints
them and the pipeline's over the lesser of the two stages alone (the target
is at least 0.8: the pipeline overlaps them).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys

import torch
import torch.distributed as dist

from fsdp2_step import slowest_rank_seconds as slowest  # (this directory: the script's)


def build(args, collectives: str):
    """A store with this rank's shards of the parameters, and its partitions."""
    import tierflow
    from tierflow.zero.comm import Group
    from tierflow.zero.partition import ParamStore
    from tierflow.zero.plan import make_plan

    world = dist.get_world_size()
    model = torch.nn.Module()
    for i in range(args.params):  # a module each, frozen: no gradient blocks beside the shards
        layer = torch.nn.Module()
        layer.register_parameter("weight", torch.nn.Parameter(
            torch.full((args.numel,), float(i), dtype=torch.bfloat16), requires_grad=False))
        model.add_module(f"layer{i}", layer)
    shard_bytes = -(-args.numel // world) * 2
    host = args.host_memory or max(4 * shard_bytes, args.params * shard_bytes // 4)
    config = tierflow.config.from_deepspeed({
        "train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": args.nvme_dir},
                              "offload_optimizer": {"device": "cpu"}, "stage3_param_persistence_threshold": 0},
        # the parameter in use and the gathers ahead, whole
        "tierflow": {"device_memory": (2 + 4) * args.numel * 2, "collectives": collectives},
    }, world_size=world)
    # The planner sizes the host tier for gradients of every parameter, these
    # frozen ones' too: the budget is set on the plan instead.
    plan = dataclasses.replace(make_plan(model, config, world_size=world), host_budget=host)
    store = ParamStore(plan, group=Group.from_options(config.tierflow))
    parts = [store.adopt(p, name, persistent=False) for name, p in model.named_parameters()]
    return store, parts, host


def iterations(args, one) -> list[float]:
    """``one()`` timed ``--iterations`` times after a first that records the order."""
    times = [slowest(one) for _ in range(1 + args.iterations)]
    return times[1:]


def read_alone(args, store, parts) -> list[float]:
    def one():
        store.begin_iteration()
        for part in parts:
            store._unlease(store._lease(part.block, "host", "read"), dirty=False)
        store.end_iteration()
    return iterations(args, one)


def gather_alone(args, store, parts) -> list[float]:
    world = dist.get_world_size()
    fulls = [torch.empty(part.shard_numel * world, dtype=part.dtype) for part in parts]
    for full in fulls:
        store.group.slot(full).fill_(1.0)

    def one():
        for pending in [store.group.gather_in_place(full) for full in fulls]:
            pending.wait()
    return iterations(args, one)


def pipeline(args, store, parts) -> list[float]:
    def one():
        store.begin_iteration()
        for part in parts:
            store.fetch(part)
            store.release(part)
        store.end_iteration()
    return iterations(args, one)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nvme-dir", required=True)
    p.add_argument("--params", type=int, default=16)
    p.add_argument("--numel", type=int, default=4 << 20)
    p.add_argument("--host-memory", type=int)
    p.add_argument("--iterations", type=int, default=5)
    p.add_argument("--json")
    args = p.parse_args(argv)
    for name in ("params", "numel", "iterations"):
        if getattr(args, name) < 1:
            p.error(f"--{name}: {getattr(args, name)} is not positive")
    if not os.path.isdir(args.nvme_dir):
        p.error(f"--nvme-dir: {args.nvme_dir} is not a directory")
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    gathered = args.params * args.numel * 2  # bytes of full parameters an iteration makes

    from tierflow.zero.plan import links_of

    store, parts, host = build(args, "tierflow")
    read_bytes = lambda: links_of(store.telemetry()).get("nvme->host", 0)  # noqa: E731
    try:
        before = read_bytes()
        read = read_alone(args, store, parts)
        read_per = (read_bytes() - before) / (1 + args.iterations)
        gather = gather_alone(args, store, parts)
    finally:
        store.close()
    store, parts, _ = build(args, "tierflow")  # (a store of its own: no schedule recorded by the read alone)
    read_bytes = lambda: links_of(store.telemetry()).get("nvme->host", 0)  # noqa: E731
    try:
        before = read_bytes()
        ours = pipeline(args, store, parts)
        pipeline_per = (read_bytes() - before) / (1 + args.iterations)
        ahead, dropped, direct = store.gathered_ahead, store.gathers_dropped, store.shards_read_into_slots
    finally:
        store.close()
    store, parts, _ = build(args, "torch")
    try:
        theirs = pipeline(args, store, parts)
    finally:
        store.close()

    if rank == 0:
        mib = 1 << 20
        med = {k: statistics.median(v) for k, v in
               (("read", read), ("gather", gather), ("pipeline", ours), ("pipeline_torch", theirs))}
        bw = {k: gathered / v for k, v in med.items()}
        bound = min(bw["read"], bw["gather"])
        ratio = bw["pipeline"] / bound
        print(f"{args.params} bf16 parameters of {args.numel} elements over {world} gloo ranks "
              f"({gathered / mib:.0f} MiB gathered an iteration, {gathered / world / mib:.0f} MiB of shards a rank "
              f"on NVMe, through {host / mib:.0f} MiB of host memory); median of {args.iterations}")
        rows = (("NVMe read alone", "read"), ("all-gather alone (tierflow's Gloo)", "gather"),
                ("pipeline on tierflow's Gloo", "pipeline"), ("pipeline on torch.distributed's gloo", "pipeline_torch"))
        for label, key in rows:
            print(f"  {label:<38}{med[key] * 1e3:9.1f} ms  {bw[key] / mib:8.1f} MiB/s")
        print(f"pipeline over min(read, all-gather): {ratio:.2f} "
              f"({'meets' if ratio >= 0.8 else 'misses'} the target ≥ 0.8); "
              f"over torch.distributed's: {med['pipeline_torch'] / med['pipeline']:.2f}× faster; "
              f"{ahead} gathers issued ahead, {dropped} dropped, {direct} shards read straight into their slot; read from NVMe a rank per iteration: "
              f"{read_per / mib:.0f} MiB alone, {pipeline_per / mib:.0f} MiB in the pipeline")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"world": world, "params": args.params, "numel": args.numel, "host_memory": host,
                           "seconds": {"read": read, "gather": gather, "pipeline": ours, "pipeline_torch": theirs},
                           "median_bytes_per_second": bw, "pipeline_over_bound": ratio,
                           "gathered_ahead": ahead, "ahead_dropped": dropped, "shards_read_into_slots": direct,
                           "nvme_read_bytes_per_iteration": {"read": read_per, "pipeline": pipeline_per}}, f, indent=1)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
