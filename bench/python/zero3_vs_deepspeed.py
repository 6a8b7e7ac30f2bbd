#!/usr/bin/env python3
"""tierflow's ZeRO-3 engine and its ZenFlow beside DeepSpeed's, in one run, on
one model and one batch stream.

The model: 24 blocks of Linear(1024, 1024) + GELU, in bf16 (24 × (1024·1024 +
1024) = 25,190,400 parameters), trained on an MSE loss against a fixed random
target; batch 64 rows of 1024 features. A "token" of this MLP is one row of
the batch, so tokens/s is 64 / the step time.

Contenders, each in a fresh subprocess (so its peak RSS and its /proc/PID/io
are its own), one at a time:
  (a) torch in RAM: bf16 parameters, an fp32 master stepped by
      torch.optim.AdamW(fused=True) — the floor, reported, not a target;
  (b) DeepSpeed ZeRO-3, offload_param and offload_optimizer on NVMe,
      stage3_prefetch_bucket_size 0;
  (b') the same with prefetch on (stage3_prefetch_bucket_size --prefetch,
      default DeepSpeed's 5e7), to show whether it runs;
  (c) tierflow's ZeRO-3 engine under (b)'s config, unchanged (its host budgets
      follow DeepSpeed's buffer keys);
  (d) tierflow's ZeRO-3 with ZenFlow: (c)'s config (offload_optimizer on
      NVMe: the windowed side's masters and moments are files, streamed a
      weight at a time by each CPU step) and (e)'s zenflow section;
  (d') the same with offload_optimizer on the CPU (ZenFlow's whole state in
      host memory, as DeepSpeed's ZenFlow requires);
  (d'') (d) under (b')'s config: prefetch on, which (b) turns off (with
      stage3_prefetch_bucket_size 0 tierflow, as DeepSpeed, loads each
      module's parameters into the device when it is reached, from host
      memory, where offload_param's buffers have staged them from NVMe);
  (e) DeepSpeed's ZenFlow: stage 2, offload_optimizer cpu, topk_ratio 0.1,
      update_interval 4, overlap_step true;
  (f) tierflow's ZenFlow under (e)'s config (the bf16 model's fp32 masters
      stepped by ZenFlow and written back into it);
  (e') and (f'): (e) and (f) with bf16 off (fp32 parameters, which
      tierflow's ZenFlow steps in place);
  (c0) and (d0): (c) and (d) with nothing on NVMe (offload_param and
      offload_optimizer on the CPU): the same engine, hooks and optimizer,
      what (c) and (d) compute when no byte goes to storage.

Each runs --warmup untimed steps then --steps timed ones (the defaults put
DeepSpeed's ZenFlow past its first update window, where it spawns its
optimizer process, and time two whole windows) and reports the mean
step time (forward, backward and optimizer step; for the engines also split
into forward + backward and step()), tokens/s, peak RSS
(ru_maxrss of the child, plus the peak of any helper process it runs, as
DeepSpeed's ZenFlow does for its optimizer), the storage bytes read and
written per timed step (/proc/PID/io read_bytes/write_bytes deltas, helpers
included; page-cache hits read nothing),
and the timed steps' losses. The --nvme-dir filesystem's bandwidth is measured
alone (an O_DIRECT sequential write then read of 512 MiB in 8 MiB requests,
8 in flight), and the bound of (c) and of (d) is max(its compute alone, read
bytes / read bandwidth + write bytes / write bandwidth); reads and writes share
the device, so their times add. Its compute alone is (c0)'s or (d0)'s step:
on this machine the optimizer's arithmetic (ZenFlow's update of the selected
columns every step, on the "device") runs on the CPUs the model's compute
uses. The bound with (a)'s forward + backward instead (the model's compute
without any optimizer) is printed beside it, as a floor.

Targets: (c) ≤ (b), (c) within 1.15× of its bound, (d) ≤ 0.5 × (b), (d) within
1.15× of its bound, (f) ≤ (e).

  bench/python/zero3_vs_deepspeed.py [--nvme-dir DIR] [--steps 8] [--warmup 5] [--only a,b,c] [--json FILE]
      [--gradient-clipping C] [--check-grad-overflow true|false]   (default: DeepSpeed's, 1.0 and true)
"""
import argparse
import json
import mmap
import os
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import time

LAYERS, WIDTH, BATCH = 24, 1024, 64
CLIPPING = None  # --gradient-clipping: every engine's gradient_clipping (None: the key left out)
OVERFLOW_CHECK = None  # --check-grad-overflow: every bf16 run's bf16.check_grad_overflow (None: left out)
LR, BETAS, EPS, WEIGHT_DECAY = 1e-3, (0.9, 0.999), 1e-8, 0.01
CONTENDERS = ("a", "b", "b'", "c", "c0", "d", "d0", "d'", "d''", "e", "f", "e'", "f'")
TITLES = {
    "a": "torch in RAM (AdamW fused, fp32 master)",
    "b": "DeepSpeed ZeRO-3, NVMe params+optimizer, prefetch 0",
    "b'": "DeepSpeed ZeRO-3, NVMe, prefetch on (--prefetch)",
    "c": "tierflow ZeRO-3, (b)'s config",
    "d": "tierflow ZeRO-3 + ZenFlow",
    "d'": "tierflow ZeRO-3 + ZenFlow, optimizer cpu",
    "d''": "tierflow ZeRO-3 + ZenFlow, prefetch on (--prefetch)",
    "e": "DeepSpeed ZenFlow, stage 2, optimizer cpu",
    "c0": "(c) with nothing on NVMe: its compute alone",
    "d0": "(d) with nothing on NVMe: its compute alone",
    "f": "tierflow ZenFlow, (e)'s config",
    "e'": "(e) in fp32 (bf16 off)",
    "f'": "(f) in fp32 (bf16 off)",
}


# ---- configs ---------------------------------------------------------------------------------

def optimizer_section():
    return {"type": "AdamW", "params": {"lr": LR, "betas": list(BETAS), "eps": EPS, "weight_decay": WEIGHT_DECAY}}


def with_step_checks(config):
    """``config`` with --gradient-clipping's and --check-grad-overflow's values, when given."""
    if CLIPPING is not None:
        config["gradient_clipping"] = CLIPPING
    if OVERFLOW_CHECK is not None and config["bf16"]["enabled"]:
        config["bf16"]["check_grad_overflow"] = OVERFLOW_CHECK
    return config


def zero3_config(nvme_dir, prefetch):
    # One weight is 2^20 elements: the parameter swap buffers hold one each.
    # The optimizer's sub-groups are four layers, so its NVMe state streams
    # through buffer_count × 4M fp32 elements (64 MiB) rather than all of it.
    # Live parameters and reuse distance stay within the five swap buffers:
    # at DeepSpeed's defaults (1e9) its NVMe swapper fails ("Not enough
    # buffers 0 for swapping 1") whatever the prefetch bucket.
    return with_step_checks({
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": True},
        "optimizer": optimizer_section(),
        "zero_optimization": {
            "stage": 3,
            "sub_group_size": 4 * WIDTH * WIDTH,
            "stage3_prefetch_bucket_size": prefetch,
            "stage3_max_live_parameters": 4 * WIDTH * WIDTH,
            "stage3_max_reuse_distance": 4 * WIDTH * WIDTH,
            "offload_param": {"device": "nvme", "nvme_path": nvme_dir, "pin_memory": True,
                              "buffer_count": 5, "buffer_size": WIDTH * WIDTH, "max_in_cpu": 1_000_000},
            "offload_optimizer": {"device": "nvme", "nvme_path": nvme_dir, "pin_memory": True,
                                  "buffer_count": 4},
        },
        "aio": {"block_size": 1 << 20, "queue_depth": 8, "single_submit": False, "overlap_events": True,
                "thread_count": 1},
    })


def zenflow_config(bf16=True):
    return with_step_checks({
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": bf16},
        "optimizer": optimizer_section(),
        "zero_optimization": {
            "stage": 2,
            "offload_optimizer": {"device": "cpu", "pin_memory": True},
            "zenflow": {"topk_ratio": 0.1, "update_interval": 4, "overlap_step": True},
        },
    })


def in_memory(config):
    """``config`` with parameters and optimizer state in host memory: no byte to storage."""
    z = config["zero_optimization"]
    z["offload_param"] = {"device": "cpu", "pin_memory": True}
    z["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    return config


# ---- the child: one contender --------------------------------------------------------------------

def make_model():
    import torch

    torch.manual_seed(0)
    layers = []
    for _ in range(LAYERS):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.GELU()]
    return torch.nn.Sequential(*layers)


def batches(n):
    import torch

    g = torch.Generator().manual_seed(1)
    target = torch.randn(BATCH, WIDTH, generator=g) * 0.1
    return [torch.randn(BATCH, WIDTH, generator=g).to(torch.bfloat16) for _ in range(n)], target


def proc_io(pid="self"):
    out = {}
    with open(f"/proc/{pid}/io") as f:
        for line in f:
            key, value = line.split(":")
            out[key.strip()] = int(value)
    return out["read_bytes"], out["write_bytes"]


def helpers():
    """The live child processes of this one (DeepSpeed's ZenFlow steps its
    optimizer in one when overlap_step is on): their pids."""
    pids = set()
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/children") as f:
                pids.update(f.read().split())
        except FileNotFoundError:  # a thread that ended meanwhile
            pass
    return sorted(pids)


def helper_peak_rss(pids):
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/status") as f:
                total += next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmHWM:"))
        except (FileNotFoundError, StopIteration):
            pass
    return total


def io_of(pids):
    """{pid: (read, write)}: the storage bytes of this process ("self") and of ``pids``."""
    out = {"self": proc_io()}
    for pid in pids:
        try:
            out[pid] = proc_io(pid)
        except FileNotFoundError:  # ended meanwhile
            pass
    return out


def train(step, steps, warmup):
    """Runs warmup + steps calls of step(x) -> loss; times the last steps."""
    xs, _ = batches(warmup + steps)
    for x in xs[:warmup]:
        step(x)
    before = io_of(helpers())
    times, losses = [], []
    for x in xs[warmup:]:
        start = time.perf_counter()
        losses.append(float(step(x)))
        times.append(time.perf_counter() - start)
    # DeepSpeed's ZenFlow starts its process at its first optimizer step, which
    # may fall among the timed ones: a helper born meanwhile counts from zero.
    pids = sorted(set(helpers()) | (set(before) - {"self"}))
    after = io_of(pids)
    read = sum(r - before.get(pid, (0, 0))[0] for pid, (r, _) in after.items())
    write = sum(w - before.get(pid, (0, 0))[1] for pid, (_, w) in after.items())
    return {"times": times, "losses": losses, "read_bytes": read / steps, "write_bytes": write / steps,
            "helpers": len(pids), "helper_rss": helper_peak_rss(pids)}


def run_torch(args):
    import torch

    model = make_model().to(torch.bfloat16)
    params = list(model.parameters())
    masters = [p.detach().float().clone().requires_grad_(True) for p in params]
    opt = torch.optim.AdamW(masters, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, fused=True)
    _, target = batches(0)
    compute = []  # forward + backward of every step: the model's compute alone

    def step(x):
        start = time.perf_counter()
        loss = torch.nn.functional.mse_loss(model(x).float(), target)
        loss.backward()
        compute.append(time.perf_counter() - start)
        for p, m in zip(params, masters):
            m.grad = p.grad.float()
            p.grad = None
        opt.step()
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            for p, m in zip(params, masters):
                p.copy_(m)
        return loss.item()

    out = train(step, args.steps, args.warmup)
    out["compute"] = compute[args.warmup:]
    return out


def engine_step(engine, config):
    """One training step through a DeepSpeed-shaped engine (DeepSpeed's or
    tierflow's): forward, MSE loss, backward, step; returns the loss. Each
    call appends (forward + backward, step) seconds to ``step.phases``."""
    import torch

    _, target = batches(0)
    dtype = torch.bfloat16 if config["bf16"]["enabled"] else torch.float32

    def step(x):
        start = time.perf_counter()
        loss = torch.nn.functional.mse_loss(engine(x.to(dtype)).float(), target)
        engine.backward(loss)
        value = loss.item()
        middle = time.perf_counter()
        engine.step()
        step.phases.append((middle - start, time.perf_counter() - middle))
        return value

    step.phases = []
    return step


def with_phases(out, step, steps):
    """``out`` with the timed steps' mean forward + backward and step seconds."""
    timed = step.phases[-steps:]
    out["phases"] = {"forward_backward": mean([f for f, _ in timed]), "step": mean([s for _, s in timed])}
    return out


def run_deepspeed(args, config):
    with socket.socket() as s:  # a free port for the one-rank process group
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    model = make_model()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    step = engine_step(engine, config)

    try:
        return with_phases(train(step, args.steps, args.warmup), step, args.steps)
    finally:
        if hasattr(engine, "destroy"):
            engine.destroy()


def run_tierflow(args, config):
    import tierflow

    model = make_model()
    engine, _, _, _ = tierflow.initialize(model=model, config=config)
    step = engine_step(engine, config)

    try:
        before = engine.memory_stats()["bytes"]
        out = with_phases(train(step, args.steps, args.warmup), step, args.steps)
        stats = engine.memory_stats()
        moved = {k: (v - before.get(k, 0)) / args.steps for k, v in stats["bytes"].items()}
        out["engine"] = {"bytes_per_step": moved, "stall_fraction": stats["stall_fraction"],
                         "tiers": stats["tiers"], "optimizer": stats.get("optimizer")}
        return out
    finally:
        engine.close()


def child(args):
    name, scratch = args.child, args.scratch
    global CLIPPING, OVERFLOW_CHECK
    CLIPPING = args.gradient_clipping
    OVERFLOW_CHECK = None if args.check_grad_overflow is None else args.check_grad_overflow == "true"
    if name == "a":
        result = run_torch(args)
    elif name in ("b", "b'"):
        result = run_deepspeed(args, zero3_config(scratch, 0 if name == "b" else args.prefetch))
    elif name in ("c", "c0"):
        config = zero3_config(scratch, 0)
        if name == "c0":
            in_memory(config)
        result = run_tierflow(args, config)
    elif name in ("d", "d'", "d''", "d0"):
        config = zero3_config(scratch, args.prefetch if name == "d''" else 0)
        if name == "d'":
            config["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        if name == "d0":
            in_memory(config)
        config["zero_optimization"]["zenflow"] = zenflow_config()["zero_optimization"]["zenflow"]
        result = run_tierflow(args, config)
    elif name == "e":
        result = run_deepspeed(args, zenflow_config())
    elif name == "f":
        result = run_tierflow(args, zenflow_config())
    elif name == "e'":
        result = run_deepspeed(args, zenflow_config(bf16=False))
    else:
        result = run_tierflow(args, zenflow_config(bf16=False))
    # A helper process's memory is the contender's too: its peak adds in.
    result["max_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 + result["helper_rss"]
    return result


# ---- the parent ----------------------------------------------------------------------------------

def nvme_bandwidth(directory, size=512 << 20, request=8 << 20, depth=8):
    """(write, read) bytes/s of an O_DIRECT sequential pass over a fresh file,
    ``depth`` requests in flight (one thread each: pwrite and preadv release
    the GIL), as fio's fastest equivalent (direct=1, iodepth 8) would keep
    the device busy: one request at a time leaves it idle between them."""
    from concurrent.futures import ThreadPoolExecutor

    path = os.path.join(directory, "bandwidth.probe")
    bufs = [mmap.mmap(-1, request) for _ in range(depth)]  # page-aligned, as O_DIRECT needs
    for buf in bufs:
        buf.write(os.urandom(request))
    offsets = list(range(0, size, request))

    def run(io, fd):
        with ThreadPoolExecutor(depth) as pool:
            list(pool.map(lambda k: io(fd, bufs[k % depth], offsets[k]), range(len(offsets))))

    try:
        fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC | os.O_DIRECT, 0o600)
        try:
            start = time.perf_counter()
            run(lambda f, b, o: os.pwrite(f, b, o), fd)
            os.fsync(fd)
            write = size / (time.perf_counter() - start)
        finally:
            os.close(fd)
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        try:
            start = time.perf_counter()
            run(lambda f, b, o: os.preadv(f, [b], o), fd)
            read = size / (time.perf_counter() - start)
        finally:
            os.close(fd)
    finally:
        for buf in bufs:
            buf.close()
        if os.path.exists(path):
            os.unlink(path)
    return write, read


# DeepSpeed JIT-compiles its C++ ops at their first use (torch's extension
# cache keeps them): async_io for NVMe offload, cpu_adam for its CPU
# optimizer. Their first build takes minutes on a small machine, and would
# count against a contender's timeout, so they are built once before any.
_DEEPSPEED_OPS = {"b": ("AsyncIOBuilder", "CPUAdamBuilder"), "b'": ("AsyncIOBuilder", "CPUAdamBuilder"),
                  "e": ("CPUAdamBuilder",), "e'": ("CPUAdamBuilder",)}


def build_deepspeed_ops(chosen, timeout=1800):
    """Builds (or finds built) the DeepSpeed ops the chosen contenders use;
    a failure is printed, and the contender then fails with its own error."""
    builders = sorted({b for name in chosen for b in _DEEPSPEED_OPS.get(name, ())})
    if not builders:
        return
    print(f"building DeepSpeed's {', '.join(builders)} ops (once: torch caches them) ...", file=sys.stderr, flush=True)
    code = ("import deepspeed.ops.op_builder as b\n"
            f"for name in {builders!r}:\n    getattr(b, name)().load()\n")
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        print(f"  not built within {timeout} s", file=sys.stderr)
        return
    if proc.returncode != 0:
        lines = [l for l in (proc.stderr + proc.stdout).splitlines() if l.strip()]
        print(f"  failed: {lines[-1].strip() if lines else 'no output'}", file=sys.stderr)


def run_contender(name, args, root):
    scratch = tempfile.mkdtemp(prefix="zero3-", dir=root)
    out = os.path.join(scratch, "result.json")
    cmd = [sys.executable, os.path.abspath(__file__), "--child", name, "--scratch", scratch, "--out", out,
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--prefetch", str(args.prefetch)]
    if args.gradient_clipping is not None:
        cmd += ["--gradient-clipping", str(args.gradient_clipping)]
    if args.check_grad_overflow is not None:
        cmd += ["--check-grad-overflow", args.check_grad_overflow]
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
        if os.path.exists(out):
            with open(out) as f:
                result = json.load(f)
        else:
            lines = [l for l in (proc.stderr + proc.stdout).splitlines() if l.strip()]
            result = {"error": f"exit {proc.returncode}: " + (lines[-1].strip() if lines else "no output")}
    except subprocess.TimeoutExpired:
        result = {"error": f"timed out after {args.timeout} s"}
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    result["wall"] = time.perf_counter() - start
    return result


def mean(xs):
    return sum(xs) / len(xs)


def mib(n):
    return f"{n / (1 << 20):.1f}"


def report(results, bandwidth, args):
    write_bw, read_bw = bandwidth
    print(f"model: {LAYERS} × (Linear({WIDTH}, {WIDTH}) + GELU), bf16, "
          f"{LAYERS * (WIDTH * WIDTH + WIDTH):,} parameters; batch {BATCH} rows (a token = one row); "
          f"{args.warmup} warm-up + {args.steps} timed steps")
    print("load average (1 min) before / after the contenders: " + " / ".join(f"{x:.2f}" for x in args.load))
    print(f"--nvme-dir bandwidth alone (O_DIRECT, 8 MiB requests, 8 in flight, 512 MiB): write {mib(write_bw)} MiB/s, "
          f"read {mib(read_bw)} MiB/s")
    step = {k: mean(r["times"]) for k, r in results.items() if "times" in r}
    print()
    print(f"{'':5}{'contender':52} {'step s':>8} {'tok/s':>8} {'vs (b)':>7} {'vs (a)':>7} "
          f"{'RSS MiB':>8} {'rd MiB/st':>9} {'wr MiB/st':>9}")
    for k, r in results.items():
        if "error" in r:
            print(f"({k}){'':{4 - len(k)}}{TITLES[k]:52} FAILED: {r['error']}")
            continue
        s = step[k]
        vb = f"{s / step['b']:.2f}" if "b" in step else "-"
        va = f"{s / step['a']:.2f}" if "a" in step else "-"
        print(f"({k}){'':{4 - len(k)}}{TITLES[k]:52} {s:8.3f} {BATCH / s:8.1f} {vb:>7} {va:>7} "
              f"{mib(r['max_rss']):>8} {mib(r['read_bytes']):>9} {mib(r['write_bytes']):>9}")
    print()
    for k, r in results.items():
        if r.get("helpers"):
            print(f"({k}) ran {r['helpers']} helper process(es): RSS and storage bytes include them "
                  f"({mib(r['helper_rss'])} MiB of the RSS; pages shared with the trainer count twice)")
    for k, r in results.items():
        if "losses" in r:
            print(f"({k}) losses: " + " ".join(f"{x:.5f}" for x in r["losses"]))
    for k in ("c", "d", "d'", "d''"):
        if k in results and "engine" in results[k]:
            e = results[k]["engine"]
            moved = ", ".join(f"{link} {mib(v)}" for link, v in sorted(e["bytes_per_step"].items()) if v)
            print(f"({k}) engine's links per step (MiB): {moved or 'none'}; stall fraction {e['stall_fraction']:.3f}")
    for k, r in results.items():
        if "phases" in r:
            p = r["phases"]
            print(f"({k}) phases: forward + backward {p['forward_backward']:.3f} s, step {p['step']:.3f} s")
    print()
    verdicts = []
    bounds = {}
    floor = mean(results["a"]["compute"]) if "a" in step else None
    for k in ("c", "d", "d'", "d''"):
        if k not in step:
            continue
        r = results[k]
        io_time = r["read_bytes"] / read_bw + r["write_bytes"] / write_bw
        own = step.get(k[0] + "0")  # (c0) for (c), (d0) for (d), (d') and (d'')
        print(f"({k}) I/O alone: {mib(r['read_bytes'])} MiB read / {mib(read_bw)} MiB/s + "
              f"{mib(r['write_bytes'])} MiB written / {mib(write_bw)} MiB/s = {io_time:.3f} s")
        if own is not None:
            bounds[k] = max(own, io_time)
            print(f"({k}) bound: max(its compute alone = ({k[0]}0) {own:.3f} s, I/O {io_time:.3f} s) = "
                  f"{bounds[k]:.3f} s; ({k}) is {step[k] / bounds[k]:.2f}× it")
        else:
            print(f"({k}) bound: ({k[0]}0) did not run")
        if floor is not None:
            print(f"({k}) floor: max((a)'s forward + backward {floor:.3f} s, I/O {io_time:.3f} s) = "
                  f"{max(floor, io_time):.3f} s; ({k}) is {step[k] / max(floor, io_time):.2f}× it")
    bound = bounds.get("c")
    def verdict(label, ok):
        verdicts.append((label, ok))
        print(f"{'PASS' if ok else 'MISS' if ok is not None else 'N/A '}  {label}")
    def no_slower(label, mine, peer):
        if mine in step and peer in step:
            verdict(f"{label}: {step[mine]:.3f} vs {step[peer]:.3f} s", step[mine] <= step[peer])
        else:
            verdict(label, None)

    no_slower("(c) ≤ (b)", "c", "b")
    if bound and "c" in step:
        verdict(f"(c) ≤ 1.15 × bound: {step['c']:.3f} vs {1.15 * bound:.3f} s", step["c"] <= 1.15 * bound)
    else:
        verdict("(c) ≤ 1.15 × bound", None)
    if "d" in step and "b" in step:
        verdict(f"(d) ≤ 0.5 × (b): {step['d']:.3f} vs {0.5 * step['b']:.3f} s", step["d"] <= 0.5 * step["b"])
    else:
        verdict("(d) ≤ 0.5 × (b)", None)
    if "d" in bounds:
        verdict(f"(d) ≤ 1.15 × its bound: {step['d']:.3f} vs {1.15 * bounds['d']:.3f} s",
                step["d"] <= 1.15 * bounds["d"])
    else:
        verdict("(d) ≤ 1.15 × its bound", None)
    no_slower("(f) ≤ (e)", "f", "e")
    no_slower("(f') ≤ (e') (fp32)", "f'", "e'")
    return {"bandwidth": {"write": write_bw, "read": read_bw}, "bound_c": bound, "bound_d": bounds.get("d"),
            "results": results,
            "targets": [{"target": t, "pass": ok} for t, ok in verdicts]}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nvme-dir", default=None, help="where NVMe files go (default: a temporary directory in /tmp)")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per contender (two ZenFlow windows of 4)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps before them (past the first ZenFlow window)")
    parser.add_argument("--only", default=",".join(CONTENDERS), help="contenders to run, comma-separated")
    parser.add_argument("--prefetch", type=int, default=50_000_000,
                        help="(b')'s stage3_prefetch_bucket_size (default DeepSpeed's own, 5e7)")
    parser.add_argument("--timeout", type=int, default=300, help="seconds each contender may run")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    parser.add_argument("--gradient-clipping", type=float, default=None,
                        help="every contender's gradient_clipping (default: left out, so DeepSpeed's default "
                             "of 1.0; 0 turns clipping off)")
    parser.add_argument("--check-grad-overflow", choices=("true", "false"), default=None,
                        help="every bf16 run's bf16.check_grad_overflow (default: left out, so DeepSpeed's "
                             "default of true). With --gradient-clipping 0 and this false, nothing global is "
                             "needed before a step, and tierflow steps each parameter during the backward")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--scratch", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.steps < 1:
        parser.error(f"--steps: {args.steps}; give at least 1")
    if args.warmup < 0:
        parser.error(f"--warmup: {args.warmup}; give 0 or more")
    if args.child is not None:
        try:
            result = child(args)
        except Exception as e:  # the parent prints this line and goes on with the others
            message = " ".join(f"{type(e).__name__}: {e}".split())
            result = {"error": message[:400]}
        with open(args.out, "w") as f:
            json.dump(result, f)
        return
    chosen = [c.strip() for c in args.only.split(",") if c.strip()]
    unknown = [c for c in chosen if c not in CONTENDERS]
    if unknown:
        parser.error(f"--only: unknown contender {unknown[0]!r}; choose from {', '.join(CONTENDERS)}")
    root = args.nvme_dir or tempfile.gettempdir()
    if not os.path.isdir(root):
        parser.error(f"--nvme-dir: {root} is not a directory")
    build_deepspeed_ops(chosen)
    load_before = os.getloadavg()[0]
    bandwidth = nvme_bandwidth(root)
    results = {}
    for name in CONTENDERS:
        if name in chosen:
            print(f"running ({name}) {TITLES[name]} ...", file=sys.stderr, flush=True)
            results[name] = run_contender(name, args, root)
    # Contenders share the CPUs with whatever else runs: the load says how much.
    args.load = (load_before, os.getloadavg()[0])
    summary = report(results, bandwidth, args)
    summary["load_average"] = args.load
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
