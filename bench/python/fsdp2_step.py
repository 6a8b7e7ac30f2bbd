#!/usr/bin/env python3
"""The optimizer step of a model sharded with FSDP2 over gloo ranks on the
CPU: tierflow's AdamW over the DTensor shards beside torch.optim.AdamW over
the same shards, in each of its implementations that runs on them (the
default for-loop, ``foreach=True``, ``fused=True``), in the same run.

    torchrun --nproc-per-node 2 bench/python/fsdp2_step.py [--layers 8] [--width 1024]
        [--steps 10] [--warmup 3] [--threads N] [--nvme-dir DIR] [--json FILE]

The model is ``--layers`` blocks (LayerNorm, Linear(width, 4·width), GELU,
Linear(4·width, width)), each ``fully_shard``-ed, and the root; one
forward and backward makes the gradients, then each contender's
``step()`` is timed ``--steps`` times after ``--warmup`` (the gradients
kept, so every step does the same work), with a barrier before and after
each, the time the slowest rank's. Rank 0 prints each contender's median
step, the parameters stepped per second and tierflow's speed-up over each
torch implementation and over the fastest of them (the target is ≥ 2×).
``--threads``: torch's and tierflow's CPU threads per rank (default: this
process's CPUs over the ranks). ``--nvme-dir``: also tierflow's AdamW with
its state on NVMe files there (``offload="nvme"``, a directory per rank),
and that step over the one in host memory."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard

HYPER = {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.01}


def build(layers: int, width: int) -> nn.Module:
    torch.manual_seed(0)
    blocks = []
    for _ in range(layers):
        blocks.append(nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.GELU(),
                                    nn.Linear(4 * width, width)))
    model = nn.Sequential(*blocks)
    for block in model:
        fully_shard(block)
    fully_shard(model)
    return model


def contenders(threads: int, nvme_dir: str | None, rank: int):
    import tierflow.torch.optim

    out = {"tierflow AdamW": lambda ps: tierflow.torch.optim.AdamW(ps, threads=threads, **HYPER)}
    if nvme_dir is not None:
        where = os.path.join(nvme_dir, f"rank{rank}")
        os.makedirs(where, exist_ok=True)
        out["tierflow AdamW, state on NVMe"] = lambda ps: tierflow.torch.optim.AdamW(
            ps, threads=threads, offload="nvme", nvme_dir=where, **HYPER)
    return {
        **out,
        "torch AdamW (for-loop)": lambda ps: torch.optim.AdamW(ps, foreach=False, **HYPER),
        "torch AdamW (foreach=True)": lambda ps: torch.optim.AdamW(ps, foreach=True, **HYPER),
        "torch AdamW (fused=True)": lambda ps: torch.optim.AdamW(ps, fused=True, **HYPER),
    }


def slowest_rank_seconds(work) -> float:
    """The seconds ``work()`` took on the slowest rank, timed between barriers."""
    dist.barrier()
    t0 = time.perf_counter()
    work()
    elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item()


def time_steps(opt, steps: int, warmup: int) -> list[float]:
    times = [slowest_rank_seconds(opt.step) for _ in range(warmup + steps)]
    return times[warmup:]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int)
    p.add_argument("--nvme-dir", type=str)
    p.add_argument("--json", type=str)
    args = p.parse_args(argv)
    for name in ("layers", "width", "steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name}: {getattr(args, name)} is not ≥ 1")
    if args.warmup < 0:
        p.error(f"--warmup: {args.warmup} is not ≥ 0")
    if args.nvme_dir is not None and not os.path.isdir(args.nvme_dir):
        p.error(f"--nvme-dir: {args.nvme_dir} is not a directory")
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    threads = args.threads or max(1, len(os.sched_getaffinity(0)) // world)
    torch.set_num_threads(threads)
    model = build(args.layers, args.width)
    params = list(model.parameters())
    numel = sum(p.numel() for p in params)
    x = torch.randn(8, args.width)
    model(x).square().mean().backward()
    results, errors = {}, {}
    for name, make in contenders(threads, args.nvme_dir, rank).items():
        try:
            opt = make(params)
            results[name] = statistics.median(time_steps(opt, args.steps, args.warmup))
        except Exception as e:  # an implementation torch does not offer for DTensor shards on the CPU
            errors[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
        finally:
            if "opt" in locals() and hasattr(opt, "close"):
                opt.close()
    if rank == 0:
        print(f"fully_shard over {world} gloo ranks: {args.layers} blocks of width {args.width}, "
              f"{numel / 1e6:.1f}M parameters, {threads} threads a rank; median of {args.steps} steps")
        for name, seconds in results.items():
            print(f"  {name:<28} {seconds * 1e3:9.1f} ms  {numel / seconds / 1e6:8.1f}M parameters/s")
        for name, error in errors.items():
            print(f"  {name:<28} does not run: {error}")
        ours = results.get("tierflow AdamW")
        on_nvme = results.get("tierflow AdamW, state on NVMe")
        if ours and on_nvme:
            # Each step reads and writes a rank's moments: 16 bytes a parameter of its shards.
            streamed = 16 * numel / world / on_nvme
            print(f"  tierflow with its state on NVMe over in host memory: {on_nvme / ours:.2f}× "
                  f"(the moments streamed at {streamed / 1e9:.2f} GB/s a rank, read and written)")
        peers = {k: v for k, v in results.items() if k.startswith("torch")}
        summary = {"world": world, "parameters": numel, "threads": threads, "median_step_s": results,
                   "errors": errors}
        if ours and on_nvme:
            summary["nvme_over_host"] = on_nvme / ours
            summary["nvme_state_bytes_per_s_per_rank"] = 16 * numel / world / on_nvme
        if ours and peers:
            for name, seconds in peers.items():
                print(f"  tierflow over {name}: {seconds / ours:.2f}×")
            best = min(peers, key=peers.get)
            ratio = peers[best] / ours
            summary["speedup_over_fastest_torch"] = ratio
            print(f"tierflow over the fastest torch ({best}): {ratio:.2f}× "
                  f"({'meets' if ratio >= 2 else 'misses'} the target ≥ 2×)")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(summary, f, indent=1)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
