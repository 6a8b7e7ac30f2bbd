#!/usr/bin/env python3
"""ZenFlow as a fine-tune: tierflow's ZenFlow beside DeepSpeed's ZenFlow and
torch's AdamW, from the same pretrained checkpoint, on text the pretraining
never saw.

    bench/python/zenflow_convergence.py [--seeds 0,1,2] [--steps 40] [--pretrain-steps 150]
        [--topk-ratio 0.1] [--update-interval 4] [--out zenflow_convergence_out] [--json FILE]

1. Pretraining (once, cached as ``OUT/pretrained.pt`` and reused when it is
   there and matches): examples/gpt.py's ``tiny`` preset (4 layers × 256,
   context 128, 3.26M parameters) trained with torch.optim.AdamW on the
   corpus's training split (examples/corpus.py: the standard library's source,
   as bytes), ``--pretrain-steps`` steps of 16 × 128 tokens, lr 2e-3.
2. Fine-tuning on the held-out split (the files the pretraining never saw):
   its first three quarters are the fine-tune's training text, the last
   quarter its validation. Each contender starts from the checkpoint, with the
   same seed, the same batches (16 × 128 tokens a step), lr 5e-4 on the same
   WarmupCosineLR schedule, gradient clipping 1.0, fp32, ``--steps`` steps:

   * tierflow: ``tierflow.initialize``, ZeRO stage 2, ``offload_optimizer``
     cpu, the ``zenflow`` section below;
   * DeepSpeed: ``deepspeed.initialize`` with the same config, unchanged
     (stage 2, CPU, ``topk_ratio``, ``update_interval``, ``overlap_step``
     true), on DeepSpeed's CPU accelerator and a one-rank gloo group. One
     correction is made to it, and said when the bench runs: DeepSpeed
     0.19.8's ZeRO-1/2 optimizer lays a ZenFlow run's matrices out
     transposed in its flat buffer (``zenflow_utils._flatten_dense_tensors``)
     but points each parameter back at its piece untransposed
     (``_update_model_bit16_weights``: ``narrow().view(shape)``), so every
     matrix of the pretrained model is scrambled by ``initialize`` and the
     fine-tune starts from noise. The bench points them back through the
     transpose, as ``zenflow_utils._unflatten_dense_tensors`` does
     (``--deepspeed-as-shipped`` leaves it as it is);
   * AdamW: torch.optim.AdamW in memory, the reference.

   Each (contender, seed) runs in its own child process. The validation loss
   is the mean over 8 fixed batches of the fine-tune's validation text,
   measured before the first step and every ``--eval-every`` steps. Every
   contender must start from the checkpoint's loss: the first validation
   losses are compared, and a contender that starts elsewhere is named.

It plots the three validation curves (mean over the seeds, a band from min to
max) to ``OUT/zenflow_convergence.png`` and prints each contender's final
validation loss (mean and per seed), tierflow's over DeepSpeed's (the target is
≤ 1.005) and each ZenFlow's gap to AdamW. With the defaults it takes about
5-10 minutes on two CPU cores.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))

PRESET = "tiny"
MICRO_BATCH = 16
PRETRAIN_LR = 2e-3
FINETUNE_LR = 5e-4
EVAL_BATCHES = 8
CONTENDERS = ("tierflow", "deepspeed", "adamw")
TITLES = {"tierflow": "tierflow ZenFlow (stage 2, optimizer cpu)",
          "deepspeed": "DeepSpeed ZenFlow (stage 2, optimizer cpu)",
          "adamw": "torch AdamW in memory (reference)"}


def ds_config(steps: int, topk_ratio: float, update_interval: int, lr: float = FINETUNE_LR) -> dict:
    """The config both ZenFlow engines read, as DeepSpeed reads it."""
    return {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": False},
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "betas": [0.9, 0.95], "eps": 1e-8,
                                                  "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": steps,
                                                          "warmup_num_steps": max(1, steps // 10)}},
        "zero_optimization": {
            "stage": 2,
            "offload_optimizer": {"device": "cpu", "pin_memory": True},
            "zenflow": {"topk_ratio": topk_ratio, "update_interval": update_interval, "overlap_step": True},
        },
    }


def correct_deepspeed_zenflow_views() -> None:
    """Makes DeepSpeed's ZeRO-1/2 optimizer point a ZenFlow run's matrices at
    their transposed pieces of its flat buffer (see the module's docstring)."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    shipped = DeepSpeedZeroOptimizer._update_model_bit16_weights

    def update_model_bit16_weights(self, group_index):
        if not self.zenflow:
            return shipped(self, group_index)
        flat = self.bit16_groups_flat[group_index]
        for p, meta, offset in zip(self.round_robin_bit16_groups[group_index],
                                   self.round_robin_bit16_meta[group_index],
                                   self.round_robin_bit16_offsets[group_index]):
            piece = flat.narrow(0, offset, meta.numel())
            # zenflow_utils._flatten_dense_tensors wrote a matrix as its transpose.
            p.data = piece.view(meta.shape[1], meta.shape[0]).t() if meta.dim() == 2 else piece.view(meta.shape)
        for param_index, param in enumerate(self.bit16_groups[group_index]):
            param.data = self.round_robin_bit16_groups[group_index][
                self.round_robin_bit16_indices[group_index][param_index]].data

    DeepSpeedZeroOptimizer._update_model_bit16_weights = update_model_bit16_weights


def splits():
    """(the corpus, pretraining text, fine-tune training text, fine-tune validation text)."""
    from corpus import load_stdlib

    corpus = load_stdlib()
    return (corpus, corpus.train, *corpus.fine_tune())


def threads():
    import torch

    torch.set_num_threads(len(os.sched_getaffinity(0)))


# ---- pretraining ---------------------------------------------------------------------------

def pretrain(path: Path, steps: int) -> None:
    import torch
    from corpus import Batches
    from gpt import GPT, PRESETS

    corpus, train, _, _ = splits()
    key = {"preset": PRESET, "steps": steps, "corpus": corpus.digest, "lr": PRETRAIN_LR}
    if path.exists():
        saved = torch.load(path, map_location="cpu", weights_only=True)
        if saved.get("key") == key:
            print(f"pretrained: {path} (cached, {steps} steps)", flush=True)
            return
    threads()
    cfg = PRESETS[PRESET]
    torch.manual_seed(1234)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=PRETRAIN_LR, betas=(0.9, 0.95), weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / max(1, steps // 10)) * 0.5 * (1 + __import__("math").cos(
            __import__("math").pi * min(s, steps) / steps)))
    batches = Batches(train, batch=MICRO_BATCH, context=cfg.context, seed=1234)
    start = time.perf_counter()
    for step in range(steps):
        loss = model(*batches.next())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        if (step + 1) % max(1, steps // 5) == 0:
            print(f"  pretrain step {step + 1}/{steps}: loss {loss.item():.3f}", flush=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"key": key, "module": model.state_dict()}, path)
    print(f"pretrained: {path} ({steps} steps, {time.perf_counter() - start:.0f} s)", flush=True)


# ---- the child: one contender, one seed ----------------------------------------------------

def child(args) -> dict:
    import torch
    from corpus import Batches
    from gpt import GPT, PRESETS

    threads()
    cfg = PRESETS[PRESET]
    _, _, tune, val = splits()
    config = ds_config(args.steps, args.topk_ratio, args.update_interval)
    state = torch.load(args.checkpoint, map_location="cpu", weights_only=True)["module"]
    torch.manual_seed(args.seed)
    model = GPT(cfg)
    model.load_state_dict(state)
    close = lambda: None  # noqa: E731
    if args.child == "adamw":
        from train_gpt import TorchEngine

        # torch.optim.AdamW and DeepSpeed's schedule, from the same config's optimizer and scheduler.
        engine = TorchEngine(cfg, config, args.seed, torch.device("cpu"))
        engine.module.load_state_dict(state)
        module = engine.module
    elif args.child == "tierflow":
        import tierflow

        engine, _, _, _ = tierflow.initialize(model=model, model_parameters=model.parameters(), config=config)
        close = engine.close
        module = engine
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
        if not args.deepspeed_as_shipped:
            correct_deepspeed_zenflow_views()
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        close = getattr(engine, "destroy", lambda: None)
        module = engine

    evals = Batches(val, batch=MICRO_BATCH, context=cfg.context, seed=10_000)
    fixed = [evals.next() for _ in range(EVAL_BATCHES)]

    @torch.no_grad()
    def evaluate() -> float:
        was = getattr(module, "training", True)
        if hasattr(module, "eval"):
            module.eval()
        value = statistics.fmean(engine(x, y).item() for x, y in fixed)
        if was and hasattr(module, "train"):
            module.train()
        return value

    batches = Batches(tune, batch=MICRO_BATCH, context=cfg.context, seed=args.seed)
    curve = [(0, evaluate())]
    losses = []
    start = time.perf_counter()
    try:
        for step in range(1, args.steps + 1):
            x, y = batches.next()
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
            if step % args.eval_every == 0 or step == args.steps:
                curve.append((step, evaluate()))
    finally:
        close()
    return {"val": curve, "train": losses, "seconds": time.perf_counter() - start}


def run_child(name: str, seed: int, args, checkpoint: Path) -> dict:
    out = args.out / f"{name}.seed{seed}.json"
    cmd = [sys.executable, os.path.abspath(__file__), "--child", name, "--seed", str(seed),
           "--checkpoint", str(checkpoint), "--child-out", str(out), "--steps", str(args.steps),
           "--topk-ratio", str(args.topk_ratio), "--update-interval", str(args.update_interval),
           "--eval-every", str(args.eval_every)] + (["--deepspeed-as-shipped"] if args.deepspeed_as_shipped else [])
    out.unlink(missing_ok=True)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {args.timeout} s"}
    if proc.returncode == 0 and out.exists():
        return json.loads(out.read_text())
    lines = [l for l in (proc.stderr + proc.stdout).splitlines() if l.strip()]
    return {"error": f"exit {proc.returncode}: " + (lines[-1].strip() if lines else "no output")}


# ---- the report ------------------------------------------------------------------------------

def plot(results: dict, path: Path, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=120)
    for name, style in zip(CONTENDERS, ("-", "--", ":")):
        runs = [r for r in results[name].values() if "error" not in r]
        if not runs:
            continue
        steps = [s for s, _ in runs[0]["val"]]
        columns = list(zip(*[[v for _, v in r["val"]] for r in runs]))
        mean = [statistics.fmean(c) for c in columns]
        (line,) = ax.plot(steps, mean, style, linewidth=1.5, label=f"{TITLES[name]} (final {mean[-1]:.4f})")
        ax.fill_between(steps, [min(c) for c in columns], [max(c) for c in columns],
                        color=line.get_color(), alpha=0.2)
    ax.set_xlabel("fine-tune step")
    ax.set_ylabel("validation loss (nats per byte)")
    ax.set_title(f"{PRESET} fine-tuned on held-out text, seeds {args.seeds}, topk_ratio {args.topk_ratio}, "
                 f"update_interval {args.update_interval}", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog=__doc__.split("\n\n", 2)[2], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", default="0,1,2", help="comma-separated seeds (default: 0,1,2)")
    p.add_argument("--steps", type=int, default=40, help="fine-tune steps (default: 40)")
    p.add_argument("--pretrain-steps", type=int, default=150, help="pretraining steps (default: 150)")
    p.add_argument("--topk-ratio", type=float, default=0.1, help="zenflow.topk_ratio (default: 0.1)")
    p.add_argument("--update-interval", type=int, default=4, help="zenflow.update_interval (default: 4)")
    p.add_argument("--eval-every", type=int, default=5, help="steps between validation losses (default: 5)")
    p.add_argument("--out", type=Path, default=Path("zenflow_convergence_out"),
                   help="output folder: the checkpoint, the plot (default: ./zenflow_convergence_out)")
    p.add_argument("--json", type=Path, help="also write the results as JSON to this file")
    p.add_argument("--timeout", type=int, default=600, help="seconds one child may run (default: 600)")
    p.add_argument("--deepspeed-as-shipped", action="store_true",
                   help="run DeepSpeed's ZenFlow without the bench's correction of its matrices' views")
    p.add_argument("--child", choices=CONTENDERS, help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, help=argparse.SUPPRESS)
    p.add_argument("--checkpoint", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--child-out", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    try:
        args.seed_list = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        p.error(f"--seeds: {args.seeds!r} is not comma-separated integers")
    if not args.seed_list or any(s < 0 for s in args.seed_list):
        p.error(f"--seeds: {args.seeds!r} needs one or more integers ≥ 0")
    for name in ("steps", "pretrain_steps", "update_interval", "eval_every", "timeout"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}: {getattr(args, name)} is not ≥ 1")
    if not 0 < args.topk_ratio <= 1:
        p.error(f"--topk-ratio: {args.topk_ratio} is not in (0, 1]")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child is not None:
        result = child(args)
        args.child_out.write_text(json.dumps(result))
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    checkpoint = args.out / "pretrained.pt"
    pretrain(checkpoint, args.pretrain_steps)
    results: dict = {name: {} for name in CONTENDERS}
    for seed in args.seed_list:
        for name in CONTENDERS:
            r = run_child(name, seed, args, checkpoint)
            results[name][seed] = r
            said = r["error"] if "error" in r else f"final val {r['val'][-1][1]:.4f}, {r['seconds']:.0f} s"
            print(f"  {name} seed {seed}: {said}", flush=True)
    # Every contender starts from the checkpoint: the same first validation loss, to fp32 rounding.
    displaced: dict = {}
    firsts = [r["val"][0][1] for r in results["adamw"].values() if "error" not in r]
    if firsts:
        reference = firsts[0]
        for name in CONTENDERS:
            for seed, r in results[name].items():
                if "error" not in r and abs(r["val"][0][1] - reference) > 1e-4 * abs(reference):
                    displaced.setdefault(name, {})[seed] = r["val"][0][1]
                    print(f"  {name} seed {seed}: did not start from the checkpoint (validation loss "
                          f"{r['val'][0][1]:.4f} before the first step, the checkpoint's {reference:.4f})", flush=True)
    figure = args.out / "zenflow_convergence.png"
    plot(results, figure, args)

    finals = {name: {s: r["val"][-1][1] for s, r in results[name].items() if "error" not in r} for name in CONTENDERS}
    summary = {"preset": PRESET, "steps": args.steps, "pretrain_steps": args.pretrain_steps,
               "seeds": args.seed_list, "topk_ratio": args.topk_ratio, "update_interval": args.update_interval,
               "final_val": finals, "errors": {n: {s: r["error"] for s, r in results[n].items() if "error" in r}
                                               for n in CONTENDERS},
               "started_elsewhere": displaced, "deepspeed_as_shipped": args.deepspeed_as_shipped,
               "runs": results}
    print(f"final validation loss after {args.steps} fine-tune steps (mean; per seed):")
    means = {}
    for name in CONTENDERS:
        if finals[name]:
            means[name] = statistics.fmean(finals[name].values())
            per = ", ".join(f"{s}: {v:.4f}" for s, v in finals[name].items())
            print(f"  {TITLES[name]:<45} {means[name]:.4f}  ({per})")
        for s, e in summary["errors"][name].items():
            print(f"  {TITLES[name]:<45} seed {s} failed: {e}")
    if "tierflow" in means and "deepspeed" in means:
        ratio = means["tierflow"] / means["deepspeed"]
        summary["tierflow_over_deepspeed"] = ratio
        print(f"tierflow / DeepSpeed: {ratio:.4f} ({'meets' if ratio <= 1.005 else 'misses'} the target ≤ 1.005)")
    for name in ("tierflow", "deepspeed"):
        if name in means and "adamw" in means:
            summary[f"{name}_minus_adamw"] = means[name] - means["adamw"]
            print(f"{name} − AdamW: {means[name] - means['adamw']:+.4f}")
    print(f"plot: {figure}")
    if args.json is not None:
        args.json.write_text(json.dumps(summary, indent=1) + "\n")
        print(f"json: {args.json}")
    expected = {"deepspeed"} if args.deepspeed_as_shipped else set()
    failed = any(summary["errors"].values()) or bool(set(displaced) - expected)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
