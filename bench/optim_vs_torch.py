#!/usr/bin/env python3
"""tierflow's optimizers against PyTorch's on identical inputs, step for step.

For each case the same initial parameters and the same gradients go to
  - tierflow (optim/, through build/bin/tierflow_optim_replay),
  - PyTorch: torch.optim.AdamW / Adam (fused=True, the kernel tierflow's
    arithmetic follows) or torch.optim.Muon,
  - and, for Adam, a float64 evaluation of the same formulas (the exact
    answer both are rounded from),
and the final parameters are compared. Adam's cases print the largest error
relative to the parameter's magnitude (|a - b| / max(|b|, RMS(b))) of tierflow
against the float64 answer, of torch against it, and of tierflow against
torch; Muon's print the relative error of tierflow's parameter change
against torch's, ||dp_tf - dp_torch|| / ||dp_torch||, since both run
Newton-Schulz in bf16 with different GEMM kernels.

A case passes when tierflow is within its tolerance of the float64 answer and
(fp32 Adam) no farther from it than torch is. Adam fp32: 2e-6, fp32's own
rounding (each of 100 steps rounds a parameter by up to half an ulp, and the
worst of 65537 elements is reported); bf16 moments: 4e-4, the bound of
rounding each moment to 8 bits every step. Muon: within 5e-2 of torch (both
run Newton-Schulz in bf16, with GEMMs accumulated in different orders).
Exit status 1 when any fails; 0 with "torch not installed" when it is not.

  bench/optim_vs_torch.py [--replay build/bin/tierflow_optim_replay] [--simd auto] [--json]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

try:
    import numpy as np
    import torch
except ImportError:
    np = torch = None


def write_case(directory, case, param, grads):
    with open(os.path.join(directory, "case.json"), "w") as f:
        json.dump(case, f)
    param.numpy().astype(np.float32).tofile(os.path.join(directory, "param.bin"))
    dtype = case.get("grad_dtype", "fp32")
    if dtype == "fp32":
        grads.numpy().astype(np.float32).tofile(os.path.join(directory, "grad.bin"))
    else:
        half = grads.to(torch.bfloat16 if dtype == "bf16" else torch.float16)
        half.view(torch.int16).numpy().tofile(os.path.join(directory, "grad.bin"))


def read(directory, name, shape):
    return torch.from_numpy(np.fromfile(os.path.join(directory, name), dtype=np.float32)).reshape(shape)


def run_tierflow(args, case, param, grads):
    with tempfile.TemporaryDirectory(prefix="tierflow-vs-torch-") as d:
        write_case(d, case, param, grads)
        subprocess.run([args.replay, d, "--simd", args.simd], check=True)
        return read(d, "param_out.bin", param.shape)


def grads_as_seen(case, grads):
    """The gradients as tierflow reads them: rounded to the case's dtype."""
    dtype = case.get("grad_dtype", "fp32")
    if dtype == "fp32":
        return grads
    return grads.to(torch.bfloat16 if dtype == "bf16" else torch.float16).float()


def adam_float64(case, param, grads):
    """Adam / AdamW in float64, with the same formulas (torch's, unrounded)."""
    p = param.double().clone()
    m = torch.zeros_like(p)
    v = torch.zeros_like(p)
    vmax = torch.zeros_like(p)
    lr, b1, b2, eps, wd = (case[k] for k in ("lr", "beta1", "beta2", "eps", "weight_decay"))
    for t, g in enumerate(grads_as_seen(case, grads).double(), start=1):
        if case["optimizer"] == "adam":
            g = g + wd * p
        else:
            p = p * (1 - lr * wd)
        m = m + (1 - b1) * (g - m)
        v = b2 * v + (1 - b2) * g * g
        if case.get("amsgrad"):
            vmax = torch.maximum(vmax, v)
        denom = (vmax if case.get("amsgrad") else v).sqrt() / (1 - b2**t) ** 0.5 + eps
        p = p - lr / (1 - b1**t) * m / denom
    return p


def adam_torch(case, param, grads):
    p = torch.nn.Parameter(param.clone())
    cls = torch.optim.Adam if case["optimizer"] == "adam" else torch.optim.AdamW
    opt = cls([p], lr=case["lr"], betas=(case["beta1"], case["beta2"]), eps=case["eps"],
              weight_decay=case["weight_decay"], amsgrad=case.get("amsgrad", False), fused=True)
    for g in grads_as_seen(case, grads):
        p.grad = g.clone()
        opt.step()
    return p.detach()


def muon_torch(case, param, grads):
    p = torch.nn.Parameter(param.clone())
    opt = torch.optim.Muon([p], lr=case["lr"], weight_decay=case["weight_decay"], momentum=case["momentum"],
                           nesterov=case["nesterov"], eps=case["eps"], ns_steps=case["ns_steps"],
                           adjust_lr_fn=case.get("adjust_lr", "original"))
    for g in grads_as_seen(case, grads):
        p.grad = g.clone()
        opt.step()
    return p.detach()


def relative(a, b):
    """Largest error relative to the element, or to the parameters' RMS for
    elements near zero (where a relative error means nothing)."""
    b = b.double()
    rms = b.square().mean().sqrt()
    return ((a.double() - b).abs() / b.abs().clamp(min=rms.item())).max().item()


def adam_cases():
    base = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "steps": 100}
    fp32 = 2e-6
    return [
        ("AdamW fp32", {**base, "optimizer": "adamw", "weight_decay": 1e-2}, fp32),
        ("Adam fp32, L2 decay", {**base, "optimizer": "adam", "weight_decay": 1e-2}, fp32),
        ("Adam fp32, amsgrad", {**base, "optimizer": "adam", "weight_decay": 0.0, "amsgrad": True}, fp32),
        ("AdamW, bf16 gradients", {**base, "optimizer": "adamw", "weight_decay": 1e-2, "grad_dtype": "bf16"}, fp32),
        ("AdamW, fp16 gradients", {**base, "optimizer": "adamw", "weight_decay": 1e-2, "grad_dtype": "fp16"}, fp32),
        # Each moment rounded to bf16 (8 bits) every step: the update moves by
        # up to 2^-8 of itself, and 100 steps of lr 1e-3 move a parameter by at
        # most 0.1, so |error| <= 0.1 * 2^-8 ~ 4e-4.
        ("AdamW, bf16 moments", {**base, "optimizer": "adamw", "weight_decay": 1e-2, "state_dtype": "bf16"}, 4e-4),
    ]


def muon_cases():
    base = {"optimizer": "muon", "lr": 2e-2, "weight_decay": 0.1, "momentum": 0.95, "nesterov": True,
            "eps": 1e-7, "ns_steps": 5, "steps": 20, "gemm_dtype": "bf16"}
    return [
        ("Muon 256x512", {**base, "rows": 256, "cols": 512}, 5e-2),
        ("Muon 512x256 (tall: transposed)", {**base, "rows": 512, "cols": 256}, 5e-2),
        ("Muon 256x512, no Nesterov, match_rms_adamw",
         {**base, "rows": 256, "cols": 512, "nesterov": False, "adjust_lr": "match_rms_adamw"}, 5e-2),
    ]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replay", default=os.path.join(ROOT, "build", "bin", "tierflow_optim_replay"))
    ap.add_argument("--simd", default="auto", help="tierflow's SIMD target")
    ap.add_argument("--elements", type=int, default=65537, help="Adam's parameters (odd: the tail runs too)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if torch is None:
        print("torch not installed: nothing to compare (scripts/setup.sh --bench installs it)")
        return 0
    if not os.access(args.replay, os.X_OK):
        print(f"{args.replay}: not built (scripts/build.sh)", file=sys.stderr)
        return 1

    torch.manual_seed(0)
    results, failed = [], False
    for name, case, tolerance in adam_cases():
        n = args.elements
        case = {**case, "elements": n}
        param = torch.randn(n)
        # Gradients whose scale changes from step to step, with outliers.
        grads = torch.randn(case["steps"], n) * torch.logspace(-3, 0, case["steps"]).unsqueeze(1)
        grads[:, ::97] *= 30
        tf = run_tierflow(args, case, param, grads)
        exact = adam_float64(case, param, grads)
        theirs = adam_torch(case, param, grads)
        r = {"case": name, "tierflow_vs_exact": relative(tf, exact), "torch_vs_exact": relative(theirs, exact),
             "tierflow_vs_torch": relative(tf, theirs), "tolerance": tolerance}
        r["pass"] = r["tierflow_vs_exact"] <= tolerance
        if case.get("state_dtype", "fp32") == "fp32":
            r["pass"] = r["pass"] and r["tierflow_vs_exact"] <= 1.05 * r["torch_vs_exact"]
        results.append(r)
    for name, case, tolerance in muon_cases():
        rows, cols = case["rows"], case["cols"]
        case = {**case, "elements": rows * cols}
        param = torch.randn(rows, cols) * 0.02
        grads = torch.randn(case["steps"], rows, cols) * 1e-2
        tf = run_tierflow(args, case, param, grads)
        theirs = muon_torch(case, param, grads)
        change = (theirs - param).double()
        err = ((tf - param).double() - change).norm().item() / change.norm().item()
        r = {"case": name, "tierflow_vs_torch": err, "tolerance": tolerance, "pass": err <= tolerance}
        results.append(r)
    failed = any(not r["pass"] for r in results)

    if args.json:
        print(json.dumps({"torch": torch.__version__, "simd": args.simd, "results": results}, indent=2))
    else:
        print(f"tierflow vs torch {torch.__version__} on identical inputs (tierflow SIMD: {args.simd})")
        print(f"  {'case':44} {'tf vs exact':>12} {'torch vs exact':>15} {'tf vs torch':>12} {'tolerance':>10}")
        for r in results:
            exact = lambda k: f"{r[k]:.2e}" if k in r else "-"
            print(f"  {r['case']:44} {exact('tierflow_vs_exact'):>12} {exact('torch_vs_exact'):>15} "
                  f"{r['tierflow_vs_torch']:12.2e} {r['tolerance']:10.0e}  {'ok' if r['pass'] else 'FAIL'}")
        print("  Adam: max |a - b| / max(|b|, RMS(b)) of the parameters after 100 steps; exact: float64."
              "\n  Muon: ||dp_tierflow - dp_torch|| / ||dp_torch|| after 20 steps.")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
