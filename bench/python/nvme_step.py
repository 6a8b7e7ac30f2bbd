#!/usr/bin/env python3
"""The step of tierflow's AdamW with its state on NVMe against the same step with
the state in RAM, and against the state's I/O alone.

A list of fp32 tensors (default ~50M parameters, a transformer's shapes), their
gradients fixed; for each of
  - offload="cpu": the state as torch tensors in RAM (the fused kernel alone),
  - offload="nvme": the state in files of --nvme-dir, streamed through
    --host-memory (default 1/8 of the state) with read(i+1) ‖ update(i) ‖ write(i-1),
  - the NVMe state read and written back with no update (the store's stream
    with a no-op update: the I/O bound of the nvme step),
the median of --steps timed steps (after one untimed step that makes the
state), in seconds, and the nvme step's ratio to the other two. torch's own
torch.optim.AdamW (fused=True when it has a CPU fused kernel) is printed beside
them as the peer of the cpu step.

  bench/python/nvme_step.py --nvme-dir /nvme/scratch [--params 50M] [--host-memory 50M] [--steps 5]
"""
import argparse
import statistics
import sys
import tempfile
import time

import torch

import tierflow
from tierflow.torch.optim import AdamW


def count(text):
    units = {"K": 1e3, "M": 1e6, "G": 1e9}
    return int(float(text[:-1]) * units[text[-1].upper()]) if text[-1].upper() in units else int(text)


def make_params(total, hidden=1024):
    """Square-ish matrices and vectors summing to about `total` elements."""
    params = []
    while sum(p.numel() for p in params) < total:
        params.append(torch.nn.Parameter(torch.randn(hidden, 4 * hidden) * 0.02))
        params.append(torch.nn.Parameter(torch.zeros(4 * hidden)))
        params.append(torch.nn.Parameter(torch.ones(hidden)))
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    return params


def timed(step, steps):
    step()  # makes the state
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nvme-dir", default=None, help="where the state's files go (default: a temporary directory in /tmp)")
    parser.add_argument("--params", default="50M", help="parameters in all (K/M/G)")
    parser.add_argument("--host-memory", default=None, help="the nvme step's host budget (default: 1/8 of the state)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()

    params = make_params(count(args.params))
    n = sum(p.numel() for p in params)
    state_bytes = n * 8
    host_memory = args.host_memory or state_bytes // 8
    with tempfile.TemporaryDirectory(dir=args.nvme_dir or "/tmp") as directory:
        results = {}
        try:
            peer = torch.optim.AdamW(params, fused=True)
            results["torch.optim.AdamW"] = timed(peer.step, args.steps)
        except (RuntimeError, ValueError):  # a torch without a fused CPU AdamW
            peer = torch.optim.AdamW(params)
            results["torch.optim.AdamW"] = timed(peer.step, args.steps)
        del peer
        cpu = AdamW(params, threads=args.threads)
        results["cpu"] = timed(cpu.step, args.steps)
        del cpu
        nvme = AdamW(params, threads=args.threads, offload="nvme", nvme_dir=directory, host_memory=host_memory)
        results["nvme"] = timed(nvme.step, args.steps)
        io = [nvme._nvme.stream_without_update() for _ in range(args.steps)]
        results["nvme I/O alone"] = statistics.median(io)
        host = [t for t in nvme.telemetry()["tiers"] if t["kind"] == "host"][0]
        nvme.close()

    print(f"{n / 1e6:.1f}M fp32 parameters, state {state_bytes / 2**20:.0f} MiB, "
          f"host_memory {host['budget_bytes'] / 2**20:.1f} MiB (high water {host['high_water_bytes'] / 2**20:.1f} MiB), "
          f"{args.threads} threads, median of {args.steps} steps, state in {directory}")
    for name, seconds in results.items():
        print(f"  {name:<20} {seconds * 1e3:9.1f} ms   {state_bytes * 2 / seconds / 2**30:6.2f} GiB/s of state read+written")
    print(f"  nvme / cpu          {results['nvme'] / results['cpu']:9.2f}x")
    print(f"  nvme / I/O alone    {results['nvme'] / results['nvme I/O alone']:9.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
