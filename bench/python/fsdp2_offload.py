#!/usr/bin/env python3
"""Training iterations of a model sharded with FSDP2 over gloo ranks on the
CPU, its parameter shards in host memory (where FSDP2's CPUOffloadPolicy
keeps them) beside the same model with every shard homed on NVMe by
``tierflow.torch.fsdp.offload``, and with their gradients homed on NVMe too
(``gradients="nvme"``), in the same run.

    torchrun --nproc-per-node 2 bench/python/fsdp2_offload.py --nvme-dir DIR [--layers 8]
        [--width 1024] [--tokens 1024] [--iterations 5] [--warmup 2] [--host-memory BYTES]
        [--threads N] [--json FILE]

The model is ``--layers`` blocks (LayerNorm, Linear(width, 4·width), GELU,
Linear(4·width, width)), each ``fully_shard``-ed, and the root, stepped by
tierflow's AdamW (its state in host memory in both runs). An iteration is a
forward and backward over ``--tokens`` rows of each rank's batch and the
step; each is timed between barriers, the time the slowest rank's. The NVMe
run's shards pass through ``--host-memory`` bytes of tierflow's host memory
(default: the policy's, a quarter of a rank's shards and at least twice
one block's), read ahead of each all-gather and
step in the order the first iteration used them. Rank 0 prints the medians,
each NVMe run's ratio to the host run's (the target is ≤ 1.2×), the bytes read and written a rank per
iteration and the time the iterations waited on those reads (the
prefetcher's stalls), the first iteration's included in none of them: it
records the order."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch
import torch.distributed as dist

from fsdp2_step import HYPER, build, slowest_rank_seconds  # (this directory: the script's)


def link_bytes(telemetry: dict, name: str) -> int:
    return next(link["bytes"] for link in telemetry["store"]["links"] if link["name"] == name)


def run(args, threads: int, on_nvme: bool, gradients: str = "host") -> dict:
    import tierflow.torch.fsdp
    import tierflow.torch.optim

    model = build(args.layers, args.width)
    shard_bytes = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    handle = None
    if on_nvme:
        policy = tierflow.torch.fsdp.OffloadPolicy(nvme_dir=args.nvme_dir, host_memory=args.host_memory,
                                                   gradients=gradients)
        handle = tierflow.torch.fsdp.offload(model, policy)
    opt = tierflow.torch.optim.AdamW(model.parameters(), threads=threads, **HYPER)
    g = torch.Generator().manual_seed(dist.get_rank())
    x = torch.randn(args.tokens, args.width, generator=g)
    times, before = [], None

    def iteration() -> None:
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()

    try:
        for i in range(args.warmup + args.iterations):
            if i == args.warmup and handle is not None:
                before = handle.telemetry()
            elapsed = slowest_rank_seconds(iteration)
            if i >= args.warmup:
                times.append(elapsed)
        out = {"median_s": statistics.median(times), "shard_bytes": shard_bytes}
        if handle is not None:
            after = handle.telemetry()
            n = args.iterations
            out.update(
                host_memory=handle.host_memory,
                read_bytes_per_iteration=(link_bytes(after, "nvme->host") - link_bytes(before, "nvme->host")) / n,
                written_bytes_per_iteration=(link_bytes(after, "host->nvme") - link_bytes(before, "host->nvme")) / n,
                stall_s_per_iteration=(after["prefetch"]["stall_seconds"] - before["prefetch"]["stall_seconds"]) / n,
                rerecords=after["prefetch"]["rerecords"])
        return out
    finally:
        opt.close()
        if handle is not None:
            handle.close()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nvme-dir", required=True)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--iterations", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--host-memory", type=int)
    p.add_argument("--threads", type=int)
    p.add_argument("--json")
    args = p.parse_args(argv)
    for name in ("layers", "width", "tokens", "iterations", "warmup"):
        if getattr(args, name) < (0 if name == "warmup" else 1):
            p.error(f"--{name}: {getattr(args, name)} is too small")
    if args.warmup < 1:
        p.error("--warmup: at least 1 (the first iteration records the order)")
    if not os.path.isdir(args.nvme_dir):
        p.error(f"--nvme-dir: {args.nvme_dir} is not a directory")
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    threads = args.threads or max(1, len(os.sched_getaffinity(0)) // world)
    torch.set_num_threads(threads)
    host = run(args, threads, on_nvme=False)
    nvme = run(args, threads, on_nvme=True)
    grads = run(args, threads, on_nvme=True, gradients="nvme")
    if rank == 0:
        ratio, grads_ratio = nvme["median_s"] / host["median_s"], grads["median_s"] / host["median_s"]
        mb = 1 << 20
        print(f"fully_shard over {world} gloo ranks: {args.layers} blocks of width {args.width}, "
              f"{host['shard_bytes'] / mb:.0f} MiB of shards a rank, {args.tokens} tokens a rank, "
              f"{threads} threads a rank; median of {args.iterations} iterations")
        print(f"  shards in host memory      {host['median_s'] * 1e3:9.1f} ms")
        for label, r in (("shards homed on NVMe", nvme), ("  and their gradients", grads)):
            print(f"  {label:<27}{r['median_s'] * 1e3:9.1f} ms  "
                  f"(through {r['host_memory'] / mb:.0f} MiB; {r['read_bytes_per_iteration'] / mb:.0f} MiB read, "
                  f"{r['written_bytes_per_iteration'] / mb:.0f} MiB written, "
                  f"{r['stall_s_per_iteration'] * 1e3:.1f} ms waited a rank per iteration)")
        for label, x in (("shards on NVMe", ratio), ("shards and gradients on NVMe", grads_ratio)):
            print(f"{label} over host memory: {x:.2f}× ({'meets' if x <= 1.2 else 'misses'} the target ≤ 1.2×)")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"world": world, "threads": threads, "tokens": args.tokens, "host": host, "nvme": nvme,
                           "nvme_gradients": grads, "nvme_over_host": ratio,
                           "nvme_gradients_over_host": grads_ratio}, f, indent=1)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
