#!/usr/bin/env python3
"""tierflow.torch.optim.AdamW's step beside its peers and the C++ kernel, in one run.

The parameters are a GPT-2 model's (gpt2-small by default: 124M parameters in
148 tensors, the LM head tied to the embedding), on the CPU. Each contender
steps the same list of tensors:

  tierflow     tierflow.torch.optim.AdamW, the Python package (one C++ call
               per param group that runs the fused kernel on each tensor, the
               GIL released meanwhile);
  kernel       `tierflow bench optim --tensors ...`: the same kernel over the
               same shapes from C++, with no Python at all;
  torch        torch.optim.AdamW(fused=True);
  deepspeed    DeepSpeed's DeepSpeedCPUAdam, when deepspeed is installed and
               its CPU op builds (`scripts/setup.sh --bench`), else reported as
               not available, with the reason.

Two cases:
  fp32   fp32 parameters and gradients, updated in place.
  bf16   the offloaded trainer's case: the model's parameters are bf16 and so
         are its gradients. tierflow keeps an fp32 master and writes the bf16
         copy in the same pass; the peers step an fp32 master (given fp32
         gradients, their conversion not charged to them) and then copy_ it
         into the bf16 parameters, as a trainer using them must.

Every contender runs once per round and the rounds alternate, so load on a
shared machine hits all alike; a figure is the median over --rounds of each
run's median step time (after three warm-up steps). Before the first round
the script touches as much memory as the largest contender holds and frees
it: on a virtual machine whose host backs guest memory on first touch, the
first contender would otherwise pay for every page the machine has not yet
used (several times its step, for several steps). All use --threads threads
(default: torch.get_num_threads()). Printed: each step time, the Python
layer's overhead over the kernel, and tierflow's speed over each peer.

  bench/torch_optim_step.py [--model gpt2-small|gpt2-medium] [--steps 5] [--rounds 3]
                            [--threads N] [--cases fp32,bf16] [--tierflow build/bin/tierflow] [--json]
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import subprocess
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

MODELS = {  # layers, width, vocabulary, context
    "gpt2-small": (12, 768, 50257, 1024),
    "gpt2-medium": (24, 1024, 50257, 1024),
}


def gpt2_shapes(layers: int, width: int, vocab: int, context: int) -> list[tuple[int, ...]]:
    """The parameter shapes of a GPT-2 model, the LM head tied to the embedding."""
    shapes: list[tuple[int, ...]] = [(vocab, width), (context, width)]
    for _ in range(layers):
        shapes += [(width,), (width,)]                        # ln_1
        shapes += [(width, 3 * width), (3 * width,)]          # attn.c_attn
        shapes += [(width, width), (width,)]                  # attn.c_proj
        shapes += [(width,), (width,)]                        # ln_2
        shapes += [(width, 4 * width), (4 * width,)]          # mlp.c_fc
        shapes += [(4 * width, width), (width,)]              # mlp.c_proj
    shapes += [(width,), (width,)]                            # ln_f
    return shapes


def numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def median_step(step, steps: int) -> float:
    for _ in range(3):
        step()  # warm-up: state allocated, pages mapped, threads started
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def model_tensors(shapes, dtype):
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(s, generator=gen).mul_(0.02).to(dtype) for s in shapes]
    grads = [torch.randn(s, generator=gen).mul_(1e-3).to(dtype) for s in shapes]
    return params, grads


def run_tierflow(shapes, case, steps, threads):
    from tierflow.torch.optim import AdamW

    params, grads = model_tensors(shapes, torch.bfloat16 if case == "bf16" else torch.float32)
    params = [torch.nn.Parameter(p) for p in params]
    for p, g in zip(params, grads):
        p.grad = g
    opt = AdamW(params, lr=1e-4, threads=threads)
    return median_step(opt.step, steps)


def fp32_master(shapes):
    """fp32 parameters with their gradients, as a peer steps them."""
    master, grads = model_tensors(shapes, torch.float32)
    master = [torch.nn.Parameter(p) for p in master]
    for p, g in zip(master, grads):
        p.grad = g
    return master


def time_peer(opt, master, case, steps):
    """A peer's step on its fp32 master; in the bf16 case followed by the
    copy_ into the model's bf16 parameters a trainer using it must make."""
    if case == "fp32":
        return median_step(opt.step, steps)
    model = [p.detach().to(torch.bfloat16) for p in master]

    def step():
        opt.step()
        with torch.no_grad():
            for m, p in zip(model, master):
                m.copy_(p)

    return median_step(step, steps)


def run_torch(shapes, case, steps, threads):
    master = fp32_master(shapes)
    return time_peer(torch.optim.AdamW(master, lr=1e-4, fused=True), master, case, steps)


def warm_memory(shapes) -> None:
    """Touches, then frees, the memory of the largest contender: fp32
    parameters, gradients, two moments and a bf16 copy."""
    total = sum(numel(s) for s in shapes)
    block = torch.ones(total * 9 // 2, dtype=torch.float32)
    del block


def run_deepspeed(shapes, case, steps, threads):
    try:
        with contextlib.redirect_stdout(sys.stderr):  # its import logs to stdout
            from deepspeed.ops.adam import DeepSpeedCPUAdam
    except Exception as e:  # not installed, or its import fails
        return f"not available: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}".strip()
    master = fp32_master(shapes)
    try:
        with contextlib.redirect_stdout(sys.stderr):  # so does its op's build
            opt = DeepSpeedCPUAdam(master, lr=1e-4, adamw_mode=True)
    except Exception as e:  # its CPU op did not build
        return f"not available: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}".strip()
    return time_peer(opt, master, case, steps)


def run_kernel(shapes, case, steps, threads, binary):
    counts = ",".join(str(numel(s)) for s in shapes)
    cmd = [binary, "bench", "optim", "--tensors", counts, "--threads", str(threads), "--steps", str(steps),
           "--pages", "4k", "--no-bound", "--json"]
    if case == "bf16":
        cmd += ["--param-dtype", "bf16"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads(out.stdout)["seconds_per_step"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt2-small", choices=sorted(MODELS))
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--cases", default="fp32,bf16")
    ap.add_argument("--tierflow", default=os.path.join(ROOT, "build", "bin", "tierflow"))
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    cases = args.cases.split(",")
    for c in cases:
        if c not in ("fp32", "bf16"):
            ap.error(f"--cases: unknown case {c!r} (fp32, bf16)")
    if args.steps < 1 or args.rounds < 1 or args.threads < 1:
        ap.error("--steps, --rounds and --threads must be at least 1")
    if not os.access(args.tierflow, os.X_OK):
        ap.error(f"--tierflow: {args.tierflow} is not an executable (build the project first)")
    torch.set_num_threads(args.threads)

    shapes = gpt2_shapes(*MODELS[args.model])
    total = sum(numel(s) for s in shapes)
    contenders = {
        "tierflow": lambda c: run_tierflow(shapes, c, args.steps, args.threads),
        "kernel": lambda c: run_kernel(shapes, c, args.steps, args.threads, args.tierflow),
        "torch": lambda c: run_torch(shapes, c, args.steps, args.threads),
        "deepspeed": lambda c: run_deepspeed(shapes, c, args.steps, args.threads),
    }
    warm_memory(shapes)
    results: dict[str, dict[str, list[float] | str]] = {c: {name: [] for name in contenders} for c in cases}
    for r in range(args.rounds):
        for case in cases:
            names = list(contenders)
            if r % 2:
                names.reverse()  # the order flips every round
            for name in names:
                if isinstance(results[case][name], str):
                    continue  # not available: said once
                got = contenders[name](case)
                gc.collect()
                if isinstance(got, str):
                    results[case][name] = got
                else:
                    results[case][name].append(got)

    report = {"model": args.model, "parameters": total, "tensors": len(shapes), "threads": args.threads,
              "steps": args.steps, "rounds": args.rounds, "torch": torch.__version__, "cases": {}}
    for case in cases:
        med = {n: (statistics.median(v) if isinstance(v, list) else v) for n, v in results[case].items()}
        entry = {"seconds_per_step": med}
        t = med["tierflow"]
        entry["python_overhead_over_kernel"] = t / med["kernel"] - 1
        entry["speed_vs"] = {n: med[n] / t for n in ("torch", "deepspeed") if isinstance(med[n], float)}
        report["cases"][case] = entry

    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"{args.model}: {total / 1e6:.1f}M parameters in {len(shapes)} tensors, {args.threads} thread(s), "
          f"median of {args.rounds} rounds of {args.steps} steps; torch {torch.__version__}")
    for case, entry in report["cases"].items():
        print(f"  {case}:")
        for name, v in entry["seconds_per_step"].items():
            print(f"    {name:10s} " + (f"{v * 1e3:8.1f} ms" if isinstance(v, float) else v))
        print(f"    Python layer over the kernel: {entry['python_overhead_over_kernel'] * 100:+.1f}%")
        for peer, ratio in entry["speed_vs"].items():
            print(f"    tierflow vs {peer}: {ratio:.2f}x as fast")
    return 0


if __name__ == "__main__":
    sys.exit(main())
