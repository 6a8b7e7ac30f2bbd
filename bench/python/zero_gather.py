#!/usr/bin/env python3
"""The ZeRO-3 engine's gather pipeline with its shards on NVMe, between gloo
ranks, beside each of its two stages measured alone in the same run.

    torchrun --nproc-per-node 2 bench/python/zero_gather.py --nvme-dir DIR [--params 16]
        [--numel 4194304] [--host-memory BYTES] [--iterations 10] [--queue-depth 8]
        [--gather-chunk 16777216] [--json FILE]

Each rank stores ``--params`` bf16 parameters of ``--numel`` elements, its
shard of each homed on NVMe, through ``--host-memory`` bytes of host memory
(default: a quarter of a rank's shards), so that every iteration reads every
shard from NVMe again. The NVMe engine's ``--queue-depth`` (DeepSpeed's aio
default, 8) is the device's: the ranks sharing it split it. The stages, each
with a store of its own (the read alone's and the all-gather alone's shared),
take turns in a balanced order: after one run of each (which records the
fetch order, and is not kept), every stage follows each of the others
equally often (a circuit through every ordered pair of stages), so neither
a stage that leaves the machine slower for the next one nor a disk whose
speed drifts over the run (a virtual disk's bursts) favours any of them.
tierflow's stages take turns first; then torch.distributed's pipeline takes
turns with the read alone, in a phase of its own: among tierflow's stages it
slowed tierflow's pipeline in most runs, by up to 45%, for the rest of the
run and whatever ran just before (run apart, the same pipeline is as fast
as with no peer at all), and the read alone beside it shows how fast the disk was by then.
Each stage's figure is the median, over its runs, of the slowest rank's.
``--iterations`` (runs of each stage) is rounded up to a whole number of
circuits: a multiple of one less than the number of stages. A store's
iteration ends once it has no transfer in flight (the reads its end starts
for the next iteration included), so no stage's work runs in another's time:

* **NVMe read alone**: each shard leased into host memory and released, in
  order, through the store's prefetch scheduler (what the pipeline reads, as
  fast as the store reads it);
* **all-gather alone**: each parameter all-gathered in place from host
  memory already holding the shard, every gather issued at once on
  tierflow's Gloo communicator (as fast as it gathers);
* **the pipeline**: each parameter fetched and released as a forward does —
  its shard read from NVMe straight into its slot of the gather buffer,
  gathered in place once the read is done, the next ones ahead; a shard
  larger than ``--gather-chunk`` (``tierflow.gather_chunk``, default 16 MiB)
  read and gathered a chunk at a time. With tierflow's communicator; where
  the shards are larger than a chunk, the same with parameters gathered
  whole (``gather_chunk`` 0); and with torch.distributed's gloo group
  running the pipeline's collectives (whole: it has no gather into strided
  places).

Bandwidths are the gathered parameters' bytes per second. Rank 0 prints
them and the pipeline's over the lesser of the two stages alone (the target
is at least 0.8: the pipeline overlaps them), and each rank's read alone
with their fairness: the fastest rank's time over the slowest's, 1 when the
ranks reading the device at once get equal parts of it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist


def build(args, collectives: str, chunk: int | None = None):
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
        # DeepSpeed's aio defaults, written out: the node's ranks split the queue depth.
        "aio": {"block_size": 1 << 20, "queue_depth": args.queue_depth, "thread_count": 1},
        "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": args.nvme_dir},
                              "offload_optimizer": {"device": "cpu"}, "stage3_param_persistence_threshold": 0},
        # the parameter in use and the gathers ahead, whole
        "tierflow": {"device_memory": (2 + 4) * args.numel * 2, "collectives": collectives,
                     "gather_chunk": args.gather_chunk if chunk is None else chunk},
    }, world_size=world)
    # The planner sizes the host tier for gradients of every parameter, these
    # frozen ones' too: the budget is set on the plan instead.
    plan = dataclasses.replace(make_plan(model, config, world_size=world), host_budget=host)
    store = ParamStore(plan, group=Group.from_options(config.tierflow))
    parts = [store.adopt(p, name, persistent=False) for name, p in model.named_parameters()]
    return store, parts, host


def read_alone(store, parts):
    """One iteration of the read alone: each shard leased into host memory
    and released, in order, through the store's prefetch scheduler, and its
    host copy dropped, so that it is read from NVMe again the next time, as
    the pipeline reads every shard (with few parameters the host memory
    would hold them all)."""
    def one():
        store.begin_iteration()
        for part in parts:
            store._unlease(store._lease(part.block, "host", "read"), dirty=False)
            store.store.evict(part.block, "host")
        store.end_iteration()
        store.flush()  # its prefetches for the next iteration: in its own time, not the next stage's
    return one


def gather_alone(store, parts):
    """One iteration of the all-gather alone: every parameter gathered in
    place from host memory already holding the shard, all issued at once."""
    world = dist.get_world_size()
    fulls = [torch.empty(part.shard_numel * world, dtype=part.dtype) for part in parts]
    for full in fulls:
        store.group.slot(full).fill_(1.0)

    def one():
        for pending in [store.group.gather_in_place(full) for full in fulls]:
            pending.wait()
    return one


def pipeline(store, parts):
    """One iteration of the pipeline: each parameter fetched and released as
    a forward does."""
    def one():
        store.begin_iteration()
        for part in parts:
            store.fetch(part)
            store.release(part)
        store.end_iteration()
        store.flush()
    return one


def each_rank_seconds(work) -> list[float]:
    """The seconds ``work()`` took on each rank, started together (a barrier)."""
    dist.barrier()
    t0 = time.perf_counter()
    work()
    mine = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return [t.item() for t in every]


def balanced_order(count: int, circuits: int) -> list[int]:
    """The order ``count`` stages run in: each once first (those runs are not
    kept), then ``circuits`` times a circuit through every ordered pair of
    distinct stages (an Eulerian circuit of the complete directed graph on
    them), the first runs ending where the circuit does. So each stage runs
    ``circuits * (count - 1)`` kept times, and each kept run follows each
    other stage exactly ``circuits`` times and never itself."""
    if count < 2:
        raise ValueError(f"balanced_order: at least 2 stages take turns, not {count}")
    remaining = {v: [u for u in range(count) if u != v] for v in range(count)}
    stack, circuit = [0], []
    while stack:  # Hierholzer's: walk unused edges, splice in the detours on the way back
        if remaining[stack[-1]]:
            stack.append(remaining[stack[-1]].pop())
        else:
            circuit.append(stack.pop())
    circuit = circuit[::-1][:-1]  # 0, ..., the last before returning to 0
    first = [v for v in range(count) if v != circuit[-1]] + [circuit[-1]]
    return first + circuit * circuits


def runs(args, stages: dict, kept_from: Any = None) -> dict[str, list[tuple[str, list[float]]]]:
    """Each stage's iteration timed on every rank, in :func:`balanced_order`:
    per stage, its kept runs, each as (the stage that ran before it, the
    ranks' seconds). ``kept_from()``, if given, is called once the first
    runs (not kept) are done."""
    names = list(stages)
    order = balanced_order(len(names), circuits(args, len(names)))
    times: dict[str, list[tuple[str, list[float]]]] = {name: [] for name in names}
    before = None
    for i, stage in enumerate(order):
        if i == len(names) and kept_from is not None:
            kept_from()
        seconds = each_rank_seconds(stages[names[stage]])
        if i >= len(names):
            times[names[stage]].append((names[before], seconds))
        before = stage
    return times


def circuits(args, stages: int) -> int:
    """How many circuits of :func:`balanced_order` give each stage at least
    ``--iterations`` runs."""
    return -(-args.iterations // (stages - 1))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nvme-dir", required=True)
    p.add_argument("--params", type=int, default=16)
    p.add_argument("--numel", type=int, default=4 << 20)
    p.add_argument("--host-memory", type=int)
    p.add_argument("--iterations", type=int, default=12)
    p.add_argument("--queue-depth", type=int, default=8)
    p.add_argument("--gather-chunk", type=int, default=16 << 20)
    p.add_argument("--json")
    args = p.parse_args(argv)
    for name in ("params", "numel", "iterations", "queue_depth"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}: {getattr(args, name)} is not positive")
    if args.gather_chunk < 0:
        p.error(f"--gather-chunk: {args.gather_chunk} is negative (0: parameters gathered whole)")
    if not os.path.isdir(args.nvme_dir):
        p.error(f"--nvme-dir: {args.nvme_dir} is not a directory")
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    gathered = args.params * args.numel * 2  # bytes of full parameters an iteration makes

    from tierflow.zero.plan import links_of

    # Whether the pipeline gathers its shards a chunk at a time: if not, the
    # same with parameters gathered whole would time the same path twice.
    shard_bytes = -(-args.numel // world) * 2
    chunked = 0 < args.gather_chunk < shard_bytes
    # A store for each stage that runs a store's iteration: the schedule one
    # records is its own (the read alone's would prefetch host copies the
    # pipeline never asks for).
    made = [("read", "tierflow", None), ("pipeline", "tierflow", None)]
    made += [("pipeline_whole", "tierflow", 0)] if chunked else []
    made += [("pipeline_torch", "torch", None)]
    built = {name: build(args, collectives, chunk) for name, collectives, chunk in made}
    host = built["read"][2]
    read_bytes = {name: (lambda store=store: links_of(store.telemetry()).get("nvme->host", 0))
                  for name, (store, _, _) in built.items()}
    read = read_alone(*built["read"][:2])
    stages = {"read": read, "gather": gather_alone(*built["read"][:2])}  # tierflow's phase
    stages.update((name, pipeline(*built[name][:2])) for name, _, _ in made[1:-1])
    try:
        before = {}  # what each store had read when the kept runs began
        times = runs(args, stages, kept_from=lambda: before.update((k, f()) for k, f in read_bytes.items()))
        iterations = len(times["read"])  # each store's kept ones
        read_per = (read_bytes["read"]() - before["read"]) / iterations
        pipeline_per = (read_bytes["pipeline"]() - before["pipeline"]) / iterations
        ours = built["pipeline"][0]
        chunks_per = ours.gather_chunks / (1 + iterations) / args.params
        # torch.distributed's pipeline in a phase of its own, beside the read
        # alone again: taking turns with tierflow's stages, it slows their
        # pipeline for the rest of the run, whatever ran just before.
        peer = runs(args, {"read_beside_torch": read, "pipeline_torch": pipeline(*built["pipeline_torch"][:2])})
        times.update(peer)
        ahead, dropped, direct = ours.gathered_ahead, ours.gathers_dropped, ours.shards_read_into_slots
        depth = ours.store.io_config()["queue_depth"]
    finally:
        for store, _, _ in built.values():
            store.close()

    if rank == 0:
        mib = 1 << 20
        slowest = {k: [max(seconds) for _, seconds in v] for k, v in times.items()}  # the slowest rank's
        med = {k: statistics.median(v) for k, v in slowest.items()}
        # How evenly the ranks reading at once share the device: the fastest
        # rank's time over the slowest's, in the read alone (1: evenly).
        fairness = statistics.median(min(r) / max(r) for _, r in times["read"])
        each_read = ", ".join(f"{statistics.median(r[i] for _, r in times['read']) * 1e3:.1f}" for i in range(world))
        # The pipeline after each other stage: what one leaves behind for the next.
        after = {other: statistics.median(max(r) for b, r in times["pipeline"] if b == other)
                 for other in stages if other != "pipeline"}
        bw = {k: gathered / v for k, v in med.items()}
        bound = min(bw["read"], bw["gather"])
        ratio = bw["pipeline"] / bound
        runs_each = len(times["read"])
        print(f"{args.params} bf16 parameters of {args.numel} elements over {world} gloo ranks "
              f"({gathered / mib:.0f} MiB gathered an iteration, {gathered / world / mib:.0f} MiB of shards a rank "
              f"on NVMe, through {host / mib:.0f} MiB of host memory, a queue depth of {depth} of the device's "
              f"{args.queue_depth} a rank); median of {runs_each} runs of each stage, each stage after each "
              f"other of its phase {runs_each // (len(stages) - 1)} times")
        if chunked:
            print(f"each {shard_bytes / mib:g} MiB shard read and gathered in {chunks_per:g} chunks "
                  f"(--gather-chunk {args.gather_chunk / mib:g} MiB)")
        else:
            print(f"each {shard_bytes / mib:g} MiB shard read and gathered whole "
                  f"(--gather-chunk {args.gather_chunk / mib:g} MiB{', no larger' if args.gather_chunk else ''})")
        rows = (("NVMe read alone", "read"), ("all-gather alone (tierflow's Gloo)", "gather"),
                ("pipeline on tierflow's Gloo", "pipeline"),
                ("  the same, parameters gathered whole", "pipeline_whole"),
                ("pipeline on torch.distributed's gloo", "pipeline_torch"),
                ("  NVMe read alone, in torch's phase", "read_beside_torch"))
        for label, key in rows:
            if key in med:
                print(f"  {label:<38}{med[key] * 1e3:9.1f} ms  {bw[key] / mib:8.1f} MiB/s")
        print(f"pipeline over min(read, all-gather): {ratio:.2f} "
              f"({'meets' if ratio >= 0.8 else 'misses'} the target ≥ 0.8); "
              f"over torch.distributed's: {med['pipeline_torch'] / med['pipeline']:.2f}× faster")
        print("the pipeline after each other stage: "
              + ", ".join(f"{name} {seconds * 1e3:.1f}" for name, seconds in after.items()) + " ms")
        print(f"{ahead} gathers issued ahead, {dropped} dropped, {direct} shards read straight into their slot; "
              f"read from NVMe a rank per iteration: {read_per / mib:.0f} MiB alone, {pipeline_per / mib:.0f} MiB "
              f"in the pipeline; the ranks' read alone took {each_read} ms "
              f"(fairness, fastest over slowest: {fairness:.2f})")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"world": world, "params": args.params, "numel": args.numel, "host_memory": host,
                           "gather_chunk": args.gather_chunk, "chunks_per_shard": chunks_per,
                           "runs": {k: [{"after": b, "seconds": r} for b, r in v] for k, v in times.items()},
                           "median_bytes_per_second": bw, "pipeline_over_bound": ratio, "read_fairness": fairness,
                           "pipeline_seconds_after": after,
                           "queue_depth": {"device": args.queue_depth, "rank": depth},
                           "gathered_ahead": ahead, "ahead_dropped": dropped, "shards_read_into_slots": direct,
                           "nvme_read_bytes_per_iteration": {"read": read_per, "pipeline": pipeline_per}}, f, indent=1)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
