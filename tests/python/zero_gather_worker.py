"""One rank of the ZeRO-3 gather pipeline with its shards on NVMe
(``torchrun --nproc-per-node N zero_gather_worker.py OUT NVME [MODE]``).

The ranks store bf16 parameters of odd sizes (last shards padded, one
smaller than the ranks, one whose shards are whole pages: read from NVMe
straight into their slot) homed on NVMe, with a host tier too small to keep
them, and fetch them as a forward and a backward would, for several
iterations: the first records the order, the next gather ahead, the last
departs from the order. The ranks' NVMe directories lie on one device, so
they split the aio queue depth. Every fetched parameter is compared byte for byte
with a plain gather of the same bytes: each rank's shard read from its
block and all-gathered by torch.distributed.

MODE ``chunks``: the shards larger than a page are read or copied into
their slot and gathered a page at a time (``tierflow.gather_chunk``).
MODE ``kill``: rank 1 exits in the middle of an iteration, its gathers
issued ahead and unanswered; the others must fail with a clear error within
the communicator's timeout. Writes OUT.rank<r> (JSON).
"""

import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

import tierflow
from tierflow.zero.comm import Group
from tierflow.zero.partition import ParamStore, data_of
from tierflow.zero.plan import links_of, make_plan, pages

# 12_288: shards of whole pages on 2 and 3 ranks, read from NVMe straight into their slot
SIZES = (1, 777, 4096, 12_345, 65_537, 3, 20_000, 12_288)
TIMEOUT = 5.0
QUEUE_DEPTH = 6


def model() -> nn.Module:
    torch.manual_seed(3)
    m = nn.Module()
    for i, n in enumerate(SIZES):
        m.register_parameter(f"p{i}", nn.Parameter(torch.randn(n).to(torch.bfloat16)))
    return m


def config(nvme: str, mode: str) -> dict:
    c = {
        "train_micro_batch_size_per_gpu": 1,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "aio": {"queue_depth": QUEUE_DEPTH},  # the device's: the ranks split it
        "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": nvme},
                              "offload_optimizer": {"device": "cpu"},
                              "stage3_param_persistence_threshold": 0},
        "tierflow": {"device_memory": 1 << 20, "host_memory": 400 << 10, "collectives_timeout": TIMEOUT},
    }
    if mode == "kill":  # one gather ahead, left unanswered when rank 1 dies (a bucket of 1 element)
        c["zero_optimization"]["stage3_prefetch_bucket_size"] = 1
    if mode == "chunks":  # each shard larger than a page gathered a page at a time
        c["tierflow"]["gather_chunk"] = 4096
    if mode == "no_prefetch":  # DeepSpeed's prefetch off: nothing gathered ahead
        c["zero_optimization"]["stage3_prefetch_bucket_size"] = 0
    return c


def plain_gather(store: ParamStore, part) -> torch.Tensor:
    """``part``'s full bytes from every rank's shard, read from its block and
    gathered by torch.distributed (not through the pipeline)."""
    lease = store.store.acquire(part.block, "host", "read")
    try:
        mine = store._local(lease, part).clone()
    finally:
        lease.release(False)
    full = torch.empty(mine.numel() * dist.get_world_size(), dtype=mine.dtype)
    dist.all_gather_into_tensor(full, mine)
    return full[: part.numel]


def main() -> None:
    out, nvme = sys.argv[1], sys.argv[2]
    mode = sys.argv[3] if len(sys.argv) > 3 else "check"
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    cfg = tierflow.config.from_deepspeed(config(nvme, mode), world_size=dist.get_world_size())
    m = model()
    values = {name: p.detach().clone() for name, p in m.named_parameters()}
    store = ParamStore(make_plan(m, cfg, world_size=dist.get_world_size()), group=Group.from_options(cfg.tierflow))
    parts = [store.adopt(p, name, persistent=False) for name, p in m.named_parameters()]
    if mode == "tight":
        # Room for the three largest gathered at once, fewer than the order
        # offers ahead (the smallest device_memory the plan takes holds all of
        # this model twice): the one being fetched counts beside those ahead.
        store.gather_budget = sum(sorted(pages(part.nbytes) for part in parts)[-3:])
    expected = [plain_gather(store, part) for part in parts]
    for part in parts:  # every shard at home only, as after a first pass over a larger model
        store.store.evict(part.block, "host")
    store.store.flush()
    result = {"mismatches": [], "errors": []}
    for part, want in zip(parts, expected):
        if not torch.equal(want.view(torch.int16), values[part.name].view(torch.int16)):
            result["mismatches"].append(f"{part.name}: the plain gather is not the model's value")

    def fetch(part, where):
        store.fetch(part)
        got = data_of(part.param).reshape(-1)
        if not torch.equal(got.view(torch.int16), expected[part.index].view(torch.int16)):
            result["mismatches"].append(f"{part.name} ({where}) differs from the plain gather")
        store.release(part)

    orders = [list(range(len(parts)))] * 4 + [[3, 0, 6, 1, 5, 2, 4]]
    for iteration, order in enumerate(orders):
        store.begin_iteration()
        try:
            for n, index in enumerate(order + order[::-1]):  # a forward, then a backward
                if mode == "kill" and iteration == 2 and n == 4:
                    if rank == 1:
                        os._exit(0)  # the gathers issued ahead stay unanswered
                    time.sleep(1.0)  # rank 1 is gone before rank 0's next gather
                fetch(parts[index], f"iteration {iteration}")
        except Exception as e:  # noqa: BLE001 - reported, with the time it took
            result["errors"].append(f"{type(e).__name__}: {e}")
            started = time.monotonic()
            try:
                store.fetch(parts[0])  # the communicator is broken: at once
            except Exception as again:  # noqa: BLE001
                result["errors"].append(f"{type(again).__name__}: {again}")
            result["after_seconds"] = time.monotonic() - started
            break
        finally:
            if not result["errors"]:
                store.end_iteration()
        if iteration == 1:
            result["ahead_after_second"] = store.gathered_ahead
    result.update(ahead=store.gathered_ahead, dropped=store.gathers_dropped, direct=store.shards_read_into_slots, departures=store._order.departures,
                  counts=store.group.counts, read=links_of(store.telemetry()).get("nvme->host", 0),
                  sharing=store.nvme_sharing, queue_depth=store.store.io_config()["queue_depth"],
                  high_water=store.gathered_high_water, gather_budget=store.gather_budget,
                  chunks=store.gather_chunks)
    nvme_dir = store.nvme_dir
    store.close()  # after a failure too: no hang, no error raised twice, the files removed
    result["files_left"] = sorted(os.listdir(nvme_dir)) if os.path.isdir(nvme_dir) else []
    with open(f"{out}.rank{rank}", "w") as f:
        json.dump(result, f)
    if mode == "kill":
        os._exit(0)  # torch.distributed's group has lost a rank too: no clean exit
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
