#!/usr/bin/env python3
"""The CPU optimizer step beside its bound and its peers, in one run.

Measures, at each thread count:
  (a) the bandwidth bound of the step, as `tierflow bench optim` reports it: the
      higher of a plain loop over the step's own streams (reads p, g, m, v and
      writes p, m, v: 28 bytes per fp32 parameter; compiled apart from tierflow's
      kernels for the CPU it runs on) and memcpy over as many bytes, on the same
      threads and kind of pages;
  (b) tierflow's fp32 AdamW over --params parameters (and its bf16 modes, which
      move fewer bytes: reported in parameters per second);
  (c) torch.optim.AdamW(fused=True) on the CPU, when torch is installed;
  (d) DeepSpeed's DeepSpeedCPUAdam, when deepspeed is installed and its CPU op builds;
  (e) (b)-(d) again as an offloaded trainer runs the step: also writing the bf16
      copy of the updated parameters that goes back up to the GPU (tierflow in
      the same pass; the peers, which have no such output, with a copy_ after);
and for Muon on one --muon-shape matrix: tierflow's Newton–Schulz against its
GEMMs alone, and tierflow's whole Muon step against torch.optim.Muon's.

Every figure is the median of --repeat rounds (each round runs tierflow and
every peer once, so load changes on a shared host hit all alike), each run
the median of its timed steps. Peers run in their own processes with their
thread count set there.
Missing peers are reported as "not installed", never as failures.

AdamW is compared on both page sizes (--pages): tierflow's host tier maps its
state with transparent huge pages, and torch does the same for large tensors
when THP_MEM_ALLOC_ENABLE=1, so "huge" gives every contender huge pages and
"4k" gives none of them.

  bench/optim_vs_peers.py [--tierflow build/bin/tierflow] [--params 64M] [--threads 1,2] [--pages huge,4k] [--json]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import textwrap

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def parse_count(text):
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    t = text.strip().upper()
    if t and t[-1] in units:
        return int(float(t[:-1]) * units[t[-1]])
    return int(t)


def run_json(cmd, env=None):
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
    return json.loads(out.stdout)


def tierflow(args, *flags):
    return run_json([args.tierflow, "bench", "optim", "--json", *flags])


def median_of(runs, key):
    return statistics.median(r[key] for r in runs)


# ---- peers: each in its own interpreter, thread count set before import ----

TORCH_ADAMW = textwrap.dedent("""
    import json, sys, time, statistics
    import torch
    n, threads, steps, copy = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "copy"
    torch.set_num_threads(threads)
    p = torch.nn.Parameter(torch.full((n,), 0.5))
    p.grad = torch.full((n,), 1e-3)
    opt = torch.optim.AdamW([p], lr=1e-3, weight_decay=1e-2, fused=True)
    device_copy = torch.empty(n, dtype=torch.bfloat16)  # what goes back up to the GPU
    times = []
    for i in range(steps + 2):
        t = time.perf_counter()
        opt.step()
        if copy: device_copy.copy_(p.detach())
        dt = time.perf_counter() - t
        if i >= 2: times.append(dt)
    print(json.dumps({"seconds_per_step": statistics.median(times), "version": torch.__version__}))
""")

DEEPSPEED_ADAM = textwrap.dedent("""
    import json, sys, time, statistics, os
    import torch
    n, threads, steps, copy = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "copy"
    torch.set_num_threads(threads)
    import deepspeed
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    p = torch.nn.Parameter(torch.full((n,), 0.5))
    p.grad = torch.full((n,), 1e-3)
    opt = DeepSpeedCPUAdam([p], lr=1e-3, weight_decay=1e-2, adamw_mode=True)
    device_copy = torch.empty(n, dtype=torch.bfloat16)  # ZeRO-Offload copies the result like this
    times = []
    for i in range(steps + 2):
        t = time.perf_counter()
        opt.step()
        if copy: device_copy.copy_(p.detach())
        dt = time.perf_counter() - t
        if i >= 2: times.append(dt)
    print(json.dumps({"seconds_per_step": statistics.median(times), "version": deepspeed.__version__}))
""")

TORCH_MUON = textwrap.dedent("""
    import json, sys, time, statistics
    import torch
    rows, cols, threads, steps = (int(a) for a in sys.argv[1:5])
    torch.set_num_threads(threads)
    p = torch.nn.Parameter(torch.full((rows, cols), 0.5))
    p.grad = torch.randn(rows, cols) * 1e-3
    opt = torch.optim.Muon([p], lr=1e-3)
    times = []
    for i in range(steps + 1):
        t = time.perf_counter(); opt.step(); dt = time.perf_counter() - t
        if i >= 1: times.append(dt)
    print(json.dumps({"seconds_per_step": statistics.median(times), "version": torch.__version__}))
""")


def peer(python, script, argv, threads, huge_pages=False):
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    # PyTorch's CPU allocator advises transparent huge pages for large tensors
    # when THP_MEM_ALLOC_ENABLE=1 (DeepSpeed's CPU Adam steps torch tensors, so
    # it follows too); without it their buffers get 4 KiB pages.
    env["THP_MEM_ALLOC_ENABLE"] = "1" if huge_pages else "0"
    env.setdefault("DS_ACCELERATOR", "cpu")
    try:
        return run_json([python, "-c", script, *map(str, argv)], env=env)
    except subprocess.CalledProcessError as e:
        last = (e.stderr or "").strip().splitlines()
        reason = last[-1] if last else f"exit {e.returncode}"
        if "ModuleNotFoundError" in reason or "No module named" in reason:
            return {"unavailable": "not installed"}
        return {"unavailable": reason[:160]}


def has_module(python, name):
    return subprocess.run([python, "-c", f"import {name}"], capture_output=True).returncode == 0


def adamw_row(args, python, n, t, pg, steps, have_torch, have_ds, peers_ok, copy=False):
    """fp32 AdamW at `t` threads on `pg` pages: tierflow, its bound, and each peer.
    With `copy`, every contender also writes the bf16 copy of the updated
    parameters that goes back up to the GPU: tierflow in the same pass
    (30 B/param), the peers with a copy_ after their step (28 + 6 B/param)."""
    huge = pg == "huge"
    flags = ("--param-dtype", "bf16", "--grad-dtype", "fp32") if copy else ()
    peer_bytes = 34.0 if copy else 28.0
    # Round-robin: each round runs tierflow and every peer once, so a change
    # in the machine's load (a shared host) hits all of them alike.
    contenders = {"torch_fused": (TORCH_ADAMW, have_torch), "deepspeed": (DEEPSPEED_ADAM, have_ds)}
    runs, peer_runs = [], {name: [] for name in contenders}
    for _ in range(args.repeat):
        runs.append(tierflow(args, "--optimizer", "adamw", "--pages", pg, *flags, *steps))
        for name, (script, ok) in contenders.items():
            if ok and not any("unavailable" in r for r in peer_runs[name]):
                peer_runs[name].append(peer(python, script, [n, t, args.steps, "copy" if copy else "none"], t,
                                            huge_pages=huge))
    row = {"threads": t, "pages": pg, "simd": runs[0]["simd"], "bf16_copy": copy,
           "bound_bytes_per_second": median_of(runs, "bound_bytes_per_second"),
           "tierflow_bytes_per_second": median_of(runs, "bytes_per_second"),
           "tierflow_params_per_second": median_of(runs, "params_per_second"),
           "ratio_to_bound": median_of(runs, "ratio_to_bound")}
    for name, (script, ok) in contenders.items():
        prs = peer_runs[name]
        if not ok:
            row[name] = {"unavailable": "not installed" if peers_ok else "skipped"}
        elif any("unavailable" in r for r in prs):
            row[name] = next(r for r in prs if "unavailable" in r)
        else:
            s = statistics.median(r["seconds_per_step"] for r in prs)
            row[name] = {"version": prs[0]["version"], "seconds_per_step": s,
                         "bytes_per_second": peer_bytes * n / s, "params_per_second": n / s,
                         "tierflow_speedup": row["tierflow_params_per_second"] / (n / s)}
    return row


def print_adamw_table(rows):
    gib = float(1 << 30)
    print(f"{'threads':>7} {'pages':>5} {'simd':>7} {'bound GiB/s':>12} {'tierflow GiB/s':>15} {'/bound':>7} "
          f"{'torch fused':>12} {'tf/torch':>9} {'deepspeed':>12} {'tf/ds':>7}")
    for r in rows:
        def cell(p):
            return (f"{p['bytes_per_second'] / gib:12.2f}", f"{p['tierflow_speedup']:.2f}x") if "bytes_per_second" in p \
                else (f"{p['unavailable'][:12]:>12}", "-")
        tc, tr = cell(r["torch_fused"])
        dc, dr = cell(r["deepspeed"])
        print(f"{r['threads']:>7} {r['pages']:>5} {r['simd']:>7} {r['bound_bytes_per_second'] / gib:12.2f} "
              f"{r['tierflow_bytes_per_second'] / gib:15.2f} {r['ratio_to_bound']:7.3f} {tc} {tr:>9} {dc} {dr:>7}")
    for name in ("torch_fused", "deepspeed"):
        u = [r[name]["unavailable"] for r in rows if "unavailable" in r[name]]
        if u:
            print(f"  {name}: {u[0]}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tierflow", default=os.path.join(ROOT, "build", "bin", "tierflow"))
    ap.add_argument("--python", default=None, help="interpreter for the peers (default: .venv's, else this one)")
    ap.add_argument("--params", default="64M")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--pages", default="huge,4k",
                    help="page sizes to compare AdamW on: huge (tierflow --pages huge, peers with "
                         "THP_MEM_ALLOC_ENABLE=1) and/or 4k")
    ap.add_argument("--muon-shape", default="1024x4096")
    ap.add_argument("--skip-peers", action="store_true")
    ap.add_argument("--json", action="store_true", help="one JSON object instead of the tables")
    args = ap.parse_args()
    venv_python = os.path.join(ROOT, ".venv", "bin", "python")
    python = args.python or (venv_python if os.path.exists(venv_python) else sys.executable)
    n = parse_count(args.params)
    threads = [int(t) for t in args.threads.split(",")]
    rows, cols = (int(x) for x in args.muon_shape.split("x"))
    peers_ok = not args.skip_peers
    have_torch = peers_ok and has_module(python, "torch")
    have_ds = peers_ok and has_module(python, "deepspeed")

    result = {"params": n, "adamw": [], "adamw_copy": [], "modes": [], "muon": []}
    pages = [p for p in args.pages.split(",") if p]
    for t in threads:
        steps = ["--params", args.params, "--threads", str(t), "--steps", str(args.steps)]
        for pg in pages:
            result["adamw"].append(adamw_row(args, python, n, t, pg, steps, have_torch, have_ds, peers_ok))
        # The step as an offloaded trainer runs it, on the host tier's pages.
        result["adamw_copy"].append(adamw_row(args, python, n, t, pages[0], steps, have_torch, have_ds, peers_ok,
                                              copy=True))

        for pd, sd in (("fp32", "bf16"), ("bf16", "fp32"), ("bf16", "bf16")):
            mruns = [tierflow(args, "--optimizer", "adamw", "--param-dtype", pd, "--state-dtype", sd, "--no-bound",
                              *steps) for _ in range(args.repeat)]
            result["modes"].append({"threads": t, "param_dtype": pd, "state_dtype": sd,
                                    "bytes_per_param": mruns[0]["bytes_per_param"],
                                    "params_per_second": median_of(mruns, "params_per_second"),
                                    "bytes_per_second": median_of(mruns, "bytes_per_second")})

        mu, tm = [], []
        for _ in range(args.repeat):
            mu.append(tierflow(args, "--optimizer", "muon", "--shape", args.muon_shape, "--threads", str(t),
                               "--steps", "3"))
            if have_torch and not any("unavailable" in r for r in tm):
                tm.append(peer(python, TORCH_MUON, [rows, cols, t, 3], t))
        mrow = {"threads": t, "shape": args.muon_shape, "gemm_dtype": mu[0]["gemm_dtype"],
                "ns_seconds": median_of(mu, "ns_seconds"), "gemm_seconds": median_of(mu, "gemm_seconds"),
                "ns_to_gemm_ratio": median_of(mu, "ns_to_gemm_ratio"),
                "tierflow_step_seconds": median_of(mu, "seconds_per_step")}
        if not have_torch:
            mrow["torch_muon"] = {"unavailable": "not installed" if peers_ok else "skipped"}
        elif any("unavailable" in r for r in tm):
            mrow["torch_muon"] = next(r for r in tm if "unavailable" in r)
        else:
            s = statistics.median(r["seconds_per_step"] for r in tm)
            mrow["torch_muon"] = {"seconds_per_step": s, "tierflow_speedup": s / mrow["tierflow_step_seconds"]}
        result["muon"].append(mrow)

    if args.json:
        print(json.dumps(result, indent=2))
        return
    gib = float(1 << 30)
    print(f"AdamW fp32, {n} parameters (28 B/param); medians of {args.repeat} runs")
    print_adamw_table(result["adamw"])
    print("  pages: huge = tierflow --pages huge and the peers with THP_MEM_ALLOC_ENABLE=1; 4k = neither")
    print(f"\nAdamW fp32 + the bf16 copy for the GPU: tierflow in the same pass (30 B/param), the peers with a "
          f"copy_ after the step (34 B/param)")
    print_adamw_table(result["adamw_copy"])
    print("\ntierflow AdamW, other dtypes (params/s counts the work, bytes/s the traffic)")
    print(f"{'threads':>7} {'param':>6} {'state':>6} {'B/param':>8} {'Gparams/s':>10} {'GiB/s':>7}")
    for m in result["modes"]:
        print(f"{m['threads']:>7} {m['param_dtype']:>6} {m['state_dtype']:>6} {m['bytes_per_param']:8.0f} "
              f"{m['params_per_second'] / 1e9:10.3f} {m['bytes_per_second'] / gib:7.2f}")
    print(f"\nMuon, one {args.muon_shape} matrix, {result['muon'][0]['gemm_dtype']} GEMMs")
    print(f"{'threads':>7} {'NS ms':>8} {'GEMMs ms':>9} {'NS/GEMMs':>9} {'step ms':>8} {'torch ms':>9} {'tf/torch':>9}")
    for m in result["muon"]:
        tm = m["torch_muon"]
        tcell = f"{tm['seconds_per_step'] * 1e3:9.1f}" if "seconds_per_step" in tm else f"{tm['unavailable'][:9]:>9}"
        tr = f"{tm['tierflow_speedup']:.2f}x" if "tierflow_speedup" in tm else "-"
        print(f"{m['threads']:>7} {m['ns_seconds'] * 1e3:8.1f} {m['gemm_seconds'] * 1e3:9.1f} "
              f"{m['ns_to_gemm_ratio']:9.3f} {m['tierflow_step_seconds'] * 1e3:8.1f} {tcell} {tr:>9}")


if __name__ == "__main__":
    main()
