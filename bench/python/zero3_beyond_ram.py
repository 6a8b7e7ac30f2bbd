#!/usr/bin/env python3
"""Trains a GPT whose parameters, gradients and Adam states exceed this
machine's RAM for a few steps with tierflow's ZeRO-3 engine: built under
``tierflow.zero.Init`` (never whole in RAM), everything on NVMe, the host
memory bounded by the config's budgets. Not part of CI: it needs tens of GB
of free disk and minutes.

    bench/python/zero3_beyond_ram.py --nvme-dir /nvme/scratch [--params 2e9] [--steps 3]
                                     [--host-memory 4G] [--device-memory 2G] [--peer deepspeed]

It checks the free space first (16 bytes per parameter and a margin), sizes
the model from ``--params`` (24 layers, the width that gives that count),
trains on one short batch of random bytes, and prints per step the loss, the
time, the bytes each tier link moved and the process's peak RSS, then the
peak RSS against the budgets. The device tier is the host stand-in on a
machine without a GPU, so RAM holds both budgets.

``--peer deepspeed`` runs DeepSpeed's ZeRO-Infinity on the same model
instead: ``deepspeed.zero.Init`` with parameters and optimizer on NVMe, its
swap buffers sized for the model's largest weight and its optimizer's
sub-groups of 1e8 elements (at its default of 1e9 its swap buffers alone
would take 16 GB of pinned memory), bf16 (its NVMe parameter swapper holds
16-bit parameters). A watchdog ends it when the process's RSS passes
``--rss-limit`` (default 90% of RAM), so the machine is never driven into
swap; the script then says so.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent / "examples"))

import tierflow  # noqa: E402
from gpt import GPT, GPTConfig  # noqa: E402


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(float(text))


def gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nvme-dir", required=True, type=Path, help="a directory on the NVMe drive (its files are removed)")
    p.add_argument("--params", type=float, default=2e9, help="parameters (default 2e9)")
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--tokens", type=int, default=64, help="tokens per step (one sequence)")
    p.add_argument("--host-memory", default="4G", help="tierflow.host_memory (default 4G)")
    p.add_argument("--device-memory", default="2G", help="tierflow.device_memory (default 2G)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--peer", choices=["deepspeed"], help="run DeepSpeed's ZeRO-Infinity on the same model instead")
    p.add_argument("--rss-limit", default=None, help="the peer's RSS limit (default 90%% of RAM)")
    a = p.parse_args()

    # The width that gives --params over --layers blocks of 12·d² (and a byte vocabulary).
    d = int(math.sqrt(a.params / (12 * a.layers)) // 128 * 128)
    cfg = GPTConfig(n_layer=a.layers, n_head=d // 128, n_embd=d, context=a.tokens)
    n = cfg.parameters
    need = 16 * n * 1.1
    a.nvme_dir.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(a.nvme_dir).free
    print(f"model: {a.layers} layers × {d} wide, {n / 1e9:.2f}B parameters; training state {gb(16 * n)} "
          f"(fp32 weights, gradients, Adam's two moments); RAM {gb(os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES'))}; "
          f"free on {a.nvme_dir}: {gb(free)}")
    if free < need:
        print(f"zero3_beyond_ram: {a.nvme_dir} has {gb(free)} free, the run needs about {gb(need)}; "
              "give a smaller --params or another --nvme-dir", file=sys.stderr)
        return 2
    scratch = Path(tempfile.mkdtemp(prefix="tierflow-beyond-ram-", dir=a.nvme_dir))
    if a.peer == "deepspeed":
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        try:
            return run_deepspeed(cfg, scratch, a.steps, a.tokens, size(a.rss_limit) if a.rss_limit else int(0.9 * ram))
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    host, device = size(a.host_memory), size(a.device_memory)
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.1}},
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "nvme", "nvme_path": str(scratch)},
            "offload_optimizer": {"device": "nvme", "nvme_path": str(scratch)},
        },
        "tierflow": {"host_memory": host, "device_memory": device},
    }
    results: dict = {"parameters": n, "host_memory": host, "device_memory": device, "steps": []}
    try:
        base = peak_rss()
        start = time.perf_counter()
        torch.manual_seed(0)
        with tierflow.zero.Init(config=config):
            model = GPT(cfg)
        built = time.perf_counter() - start
        print(f"built under zero.Init in {built:.0f} s; peak RSS {gb(peak_rss())} (growth {gb(peak_rss() - base)})")
        engine, *_ = tierflow.initialize(model=model, config=config)
        x = torch.randint(0, 256, (1, a.tokens), generator=torch.Generator().manual_seed(1))
        y = torch.roll(x, -1, 1)
        for step in range(a.steps):
            t0 = time.perf_counter()
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            dt = time.perf_counter() - t0
            stats = engine.memory_stats()
            moved = {**stats["bytes"], **{f"optimizer {k}": v for k, v in stats.get("optimizer", {}).get("bytes", {}).items()}}
            results["steps"].append({"loss": loss.item(), "seconds": dt, "peak_rss": peak_rss(), "moved": moved})
            print(f"step {step + 1}/{a.steps}: loss {loss.item():.4f}, {dt:.0f} s, peak RSS {gb(peak_rss())}, "
                  f"nvme read {gb(moved.get('nvme->host', 0) + moved.get('nvme->device', 0) + moved.get('optimizer nvme->host', 0))} "
                  f"written {gb(moved.get('host->nvme', 0) + moved.get('device->nvme', 0) + moved.get('optimizer host->nvme', 0))} (so far)")
        engine.close()
        results["build_seconds"] = built
        results["peak_rss"] = peak_rss()
        budgets = host + device
        print(f"peak RSS {gb(peak_rss())} against the budgets' {gb(budgets)} (host {gb(host)} + device stand-in "
              f"{gb(device)}) and a training state of {gb(16 * n)}")
        if a.json:
            print(json.dumps(results))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def run_deepspeed(cfg: GPTConfig, scratch: Path, steps: int, tokens: int, rss_limit: int) -> int:
    import socket
    import threading

    with socket.socket() as s:  # a free port for the one-rank process group
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    import deepspeed

    largest = max(4 * cfg.n_embd * cfg.n_embd, 256 * cfg.n_embd)
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.1}},
        "zero_optimization": {
            "stage": 3,
            "sub_group_size": 100_000_000,
            "stage3_prefetch_bucket_size": 0,
            "stage3_max_live_parameters": largest,
            "stage3_max_reuse_distance": largest,
            "offload_param": {"device": "nvme", "nvme_path": str(scratch), "pin_memory": True,
                              "buffer_count": 5, "buffer_size": largest, "max_in_cpu": 0},
            "offload_optimizer": {"device": "nvme", "nvme_path": str(scratch), "pin_memory": True,
                                  "buffer_count": 4},
        },
        "aio": {"block_size": 1 << 20, "queue_depth": 8, "single_submit": False, "overlap_events": True,
                "thread_count": 1},
    }
    stop = threading.Event()

    def watchdog() -> None:  # RSS beyond the limit: end the run before the machine swaps
        while not stop.wait(0.5):
            if rss() > rss_limit:
                print(f"deepspeed: RSS {gb(rss())} passed the limit {gb(rss_limit)}; ended", flush=True)
                os._exit(3)

    threading.Thread(target=watchdog, daemon=True).start()
    deepspeed.init_distributed(dist_backend="gloo")
    start = time.perf_counter()
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=config, remote_device="nvme"):
        model = GPT(cfg)
    print(f"deepspeed: built under deepspeed.zero.Init in {time.perf_counter() - start:.0f} s; "
          f"peak RSS {gb(peak_rss())}", flush=True)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    print(f"deepspeed: initialized after {time.perf_counter() - start:.0f} s; peak RSS {gb(peak_rss())}", flush=True)
    x = torch.randint(0, 256, (1, tokens), generator=torch.Generator().manual_seed(1))
    y = torch.roll(x, -1, 1)
    for step in range(steps):
        t0 = time.perf_counter()
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        print(f"deepspeed step {step + 1}/{steps}: loss {loss.item():.4f}, {time.perf_counter() - t0:.0f} s, "
              f"peak RSS {gb(peak_rss())}", flush=True)
    stop.set()
    return 0


if __name__ == "__main__":
    sys.exit(main())
