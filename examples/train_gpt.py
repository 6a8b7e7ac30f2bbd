#!/usr/bin/env python3
"""Trains a GPT on the Python standard library's source with tierflow's ZeRO-3
engine, its parameters and AdamW state offloaded to NVMe files, and checks the
loss against plain torch.

    examples/train_gpt.py [--model tiny] [--steps 80] [--compare] [--engine tierflow|torch]
                          [--config examples/train_gpt.json] [--out ./train_gpt_out]
                          [--nvme-dir DIR] [--keep] [--seed 0] [--zenflow] [--init-from CHECKPOINT]

The model (gpt.py) is a decoder-only transformer in plain torch; the corpus
(corpus.py) is the standard library's ``*.py`` files as bytes, so nothing is
downloaded and nothing is tokenized. Each optimizer step is
``gradient_accumulation_steps`` micro-batches driven through the engine as a
DeepSpeed user drives DeepSpeed's:

    loss = engine(x, y); engine.backward(loss); engine.step()

A progress bar (on a terminal; a log line every tenth of the run otherwise)
shows the loss, tokens/s, the time the device waited for data (the stall) and
what each tier holds. At the end the script evaluates the loss on the held-out
files and writes into ``--out``: ``loss.png`` (the loss curves), ``trace.json``
(a Perfetto / Chrome trace: open it at ui.perfetto.dev), ``checkpoint/`` (the
engine's checkpoint), ``ds_config.json`` (the config as the engine got it) and
``metrics.json`` (every step's loss, tokens/s and the eval loss of each run).

``--compare`` trains the same model again from the same seed on the same
batches with torch.optim.AdamW (or Adam, as the config says) and the same
learning-rate schedule, everything in memory, and plots both curves: the
offloaded run should follow the reference, and the largest gap between the two
curves is printed. ``--engine torch`` runs that reference as the main run, with
no tierflow engine; with ``--compare`` it then trains twice and the curves
coincide exactly.

Presets (``--model``), a byte vocabulary of 256 and tied embeddings:

    preset        layers×width  context  parameters  micro-batch  lr
    tiny          4×256         128      3.26M       16           2e-3   (the default, for a CPU)
    gpt2-small    12×768        1024     86.0M       16           6e-4
    gpt2-medium   24×1024       1024     304M        8            3e-4
    gpt2-large    36×1280       1024     710M        8            2.5e-4
    1.3b          24×2048       2048     1.21B       4            2e-4
    2.7b          32×2560       2048     2.52B       2            1.6e-4
    6.7b          32×4096       2048     6.45B       1            1.2e-4

(GPT-2's and GPT-3's shapes and learning rates. Without activation
checkpointing, the micro-batches hold a preset's bf16 activations to about
5-15 GB, by the usual estimate of 34 bytes per token, layer and unit of width,
leaving most of an H200 to the device tier.) The model runs on the GPU when
there is one; on the CPU, torch uses every CPU this process may run on.

The config (train_gpt.json) is a DeepSpeed config as DeepSpeed reads it: ZeRO
stage 3 with ``offload_param`` and ``offload_optimizer`` on NVMe, the ``aio``
engine's settings, AdamW with a WarmupCosineLR schedule, two micro-batches per
step, gradients clipped at norm 1. Its ``tierflow`` section sets the tier
budgets and turns the trace on. It has no ``zenflow`` section: the synchronous
AdamW step streams the optimizer's state from NVMe, beyond its host budget.
``--zenflow`` trains with ZenFlow instead: it adds ``zenflow`` (``topk_ratio``
0.1, ``update_interval`` 4, ``overlap_step`` true); the parameters and the
windowed side's masters and moments stay on NVMe (``offload_optimizer``
"nvme", streamed a weight at a time by each of its CPU steps), and
``tierflow.host_memory`` "auto" then adds what ZenFlow keeps in host memory
(the fp32 masters the store is written from, the gradients and their window
sums, the selected columns' moments: about 23 bytes per parameter at these
settings) and its stream's budget.

``--init-from`` makes the run a fine-tune, where ZenFlow is meant to be used:
the model starts from a checkpoint's weights (a tag directory this script
wrote: the engine's ``model.safetensors`` or the torch reference's
``state.pt``; the checkpoint directory, whose ``latest`` names the tag; or a
``.safetensors`` file), trains on text the
pretraining never saw (the held-out files' first three quarters,
``corpus.Corpus.fine_tune``) and is evaluated on the rest of them, before the
first step and after the last; the learning rate "auto" is a quarter of the
preset's. The main job pretrains with AdamW, then fine-tunes that checkpoint
with ZenFlow beside torch.optim.AdamW from the same weights (``--compare``).
Values
written ``"auto"`` are filled in by this script, as Hugging Face's Trainer
fills its own, and each is printed with where it came from:

* ``train_micro_batch_size_per_gpu`` and ``optimizer.params.lr``: the preset's
  (the lr a quarter of it with ``--init-from``);
* ``bf16.enabled``: true on a GPU, false on the CPU. fp32 on the CPU because
  most CPUs multiply bf16 matrices slower than fp32 ones in torch (only AMX or
  AVX512-BF16 parts do better), and because fp32 keeps ``--compare`` a test of
  the offload alone rather than of two roundings; on a GPU, bf16 is its
  fastest precision and halves what crosses PCIe. The reference runs bf16 as
  torch.autocast over fp32 weights, as the engine keeps fp32 masters;
* ``scheduler.params.total_num_steps``: ``--steps``; ``warmup_num_steps``: a
  tenth of them;
* ``nvme_path`` (both offload sections): ``--nvme-dir``, else a fresh
  directory under /var/tmp removed at exit (kept with ``--keep``); a path
  written in the config is used as is unless ``--nvme-dir`` is given;
* ``tierflow.device_memory`` and ``tierflow.host_memory``: 8 bytes per
  parameter each, half of the 16 bytes a parameter takes in training (fp32
  weight, gradient and AdamW's two moments; in bf16, a bf16 weight and
  gradient plus the fp32 master and moments, also 16). Neither tier can hold
  the whole state, so the engine must stream it from NVMe. For the tiny model:
  3,257,856 parameters need 52.1 MB (49.7 MiB); the device budget is 26.1 MB
  (24.9 MiB), as is the host's.

Several processes: ``torchrun --nproc-per-node N examples/train_gpt.py`` trains
data-parallel (gloo on the CPU, NCCL over the GPUs, one per process): each
rank's store holds 1/N of every parameter, gradient and optimizer state, each
rank draws its own micro-batches (the seed plus its rank), the loss shown is
the mean over the ranks, tokens/s counts them all, and rank 0 prints and
writes the outputs. ``--compare`` and ``--engine torch`` run in one process.

Exit status 0 on success; 1 with one line on stderr when a value is refused or
a file cannot be read or written; 2 when the command line does not parse.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch

from corpus import Batches, load_stdlib
from gpt import GPT, PRESETS, GPTConfig

HERE = Path(__file__).resolve().parent
AUTO = "auto"
BYTES_PER_PARAMETER = 16  # fp32 weight + gradient + Adam's exp_avg and exp_avg_sq
EVAL_TOKENS = 1 << 16  # tokens of held-out text the final loss is the mean over
FINE_TUNE_LR_DIVISOR = 4  # a fine-tune's lr "auto": the preset's pretraining lr over this


@dataclass(frozen=True)
class Training:
    """What a preset's ``"auto"`` values become: sequences per micro-batch and the peak lr."""

    micro_batch: int
    lr: float


TRAINING: dict[str, Training] = {
    "tiny": Training(micro_batch=16, lr=2e-3),
    "gpt2-small": Training(micro_batch=16, lr=6e-4),
    "gpt2-medium": Training(micro_batch=8, lr=3e-4),
    "gpt2-large": Training(micro_batch=8, lr=2.5e-4),
    "1.3b": Training(micro_batch=4, lr=2e-4),
    "2.7b": Training(micro_batch=2, lr=1.6e-4),
    "6.7b": Training(micro_batch=1, lr=1.2e-4),
}
assert TRAINING.keys() == PRESETS.keys()


# ---- the engines --------------------------------------------------------------------------

def tierflow_engine(model_cfg: GPTConfig, ds_config: dict[str, Any], seed: int) -> Any:
    """The one place this example meets tierflow: the model built straight into
    the engine's store, and the ZeRO-3 engine over it. The engine builds the
    optimizer and the lr schedule from the config's sections."""
    try:
        import tierflow
        import tierflow.zero
    except ImportError as e:
        raise ImportError(f"--engine tierflow: tierflow's ZeRO-3 engine cannot be imported ({e}); "
                          "--engine torch trains without it") from e
    torch.manual_seed(seed)
    zenflow = ds_config.get("zero_optimization", {}).get("zenflow") is not None
    # ZenFlow keeps fp32 masters of the whole model in host memory, so the
    # model need not avoid RAM while it is built (and zero.Init, which sizes
    # its store before the model is known, would take ZenFlow's share).
    with tierflow.zero.Init(config=ds_config, enabled=not zenflow) as built:
        model = GPT(model_cfg)
    try:
        engine, _optimizer, _dataloader, _lr_scheduler = tierflow.initialize(
            model=model, model_parameters=model.parameters(), config=ds_config)
    except BaseException:
        built.close()  # the store's files go now, before their directory does
        raise
    return engine


class TorchEngine:
    """The reference: plain torch in memory behind the engine's training calls.

    torch.optim.AdamW (or Adam with L2 decay) with the config's
    hyper-parameters, DeepSpeed's lr schedule rebuilt by
    ``tierflow.config`` step for step, DeepSpeed's accumulation (each loss
    scaled by 1/gradient_accumulation_steps; clipping, the update and the
    schedule's step at the boundary) and bf16 as autocast over fp32 weights.
    The ZeRO, aio and tierflow sections are the offloading engine's and are
    not read: there are no tiers, so no memory_stats() and no trace.
    """

    def __init__(self, model_cfg: GPTConfig, ds_config: dict[str, Any], seed: int, device: torch.device) -> None:
        from tierflow.config import AdamConfig

        config = loop_config(ds_config)
        if config.fp16.enabled is True:
            raise ValueError("fp16.enabled: the torch reference trains in fp32 or bf16; enable bf16 instead")
        if not isinstance(config.optimizer, AdamConfig):
            found = "none" if config.optimizer is None else config.optimizer.type
            raise ValueError(f"optimizer.type: the torch reference runs Adam or AdamW, the config has {found}")
        torch.manual_seed(seed)
        self.module = GPT(model_cfg).to(device)  # built on the CPU, as the engine's store is filled
        o = config.optimizer
        optimizer_class = torch.optim.AdamW if o.decoupled_weight_decay else torch.optim.Adam
        self.optimizer = optimizer_class(self.module.parameters(), lr=o.lr, betas=o.betas, eps=o.eps,
                                         weight_decay=o.weight_decay, amsgrad=o.amsgrad)
        self.lr_scheduler = config.scheduler.build(self.optimizer) if config.scheduler is not None else None
        self.gradient_accumulation_steps = int(config.gradient_accumulation_steps)
        self.gradient_clipping = float(config.gradient_clipping)
        self.bf16 = config.bf16.enabled is True
        self.device = device
        self.micro_steps = 0
        self.global_steps = 0

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16):
            return self.module(x, y)

    def backward(self, loss: torch.Tensor) -> None:
        (loss / self.gradient_accumulation_steps).backward()

    def is_gradient_accumulation_boundary(self) -> bool:
        return (self.micro_steps + 1) % self.gradient_accumulation_steps == 0

    def step(self) -> None:
        if self.is_gradient_accumulation_boundary():
            if self.gradient_clipping > 0:
                torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.gradient_clipping)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            if self.lr_scheduler is not None:
                self.lr_scheduler.step()
            self.global_steps += 1
        self.micro_steps += 1

    def memory_stats(self) -> None:
        """None: everything is in torch's memory, there are no tiers to report."""
        return None

    def save_checkpoint(self, save_dir: str, tag: str | None = None, client_state: dict | None = None) -> str:
        """``save_dir/tag/state.pt`` (model, optimizer, schedule, step counts,
        ``client_state``) and ``save_dir/latest`` naming the tag, as DeepSpeed
        lays them out. Returns the tag's path."""
        tag = tag or f"global_step{self.global_steps}"
        directory = Path(save_dir) / tag
        directory.mkdir(parents=True, exist_ok=True)
        torch.save({"module": self.module.state_dict(), "optimizer": self.optimizer.state_dict(),
                    "lr_scheduler": None if self.lr_scheduler is None else self.lr_scheduler.state_dict(),
                    "global_steps": self.global_steps, "micro_steps": self.micro_steps,
                    "client_state": client_state or {}}, directory / "state.pt")
        (Path(save_dir) / "latest").write_text(tag)
        return str(directory)

    def close(self) -> None:
        """Nothing to release: the state is torch's."""


# ---- the config ---------------------------------------------------------------------------

# The sections a torch training loop has a use for.
_LOOP_SECTIONS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                  "gradient_clipping", "optimizer", "scheduler", "fp16", "bf16")


def loop_config(ds_config: dict[str, Any]) -> Any:
    """The batch sizes, optimizer, schedule and precision of ``ds_config``,
    read by DeepSpeed's rules (``tierflow.config.from_deepspeed``: a missing
    micro-batch size derived from ``train_batch_size``, DeepSpeed's defaults).
    An ``"auto"`` left that this script does not fill is refused, naming it."""
    from tierflow.config import from_deepspeed

    config = from_deepspeed({k: ds_config[k] for k in _LOOP_SECTIONS if k in ds_config})
    if config.unresolved:
        raise ValueError(f'{config.unresolved[0]}: "auto" is not filled in by this script; give a value')
    return config

@dataclass
class ResolvedConfig:
    ds_config: dict[str, Any]
    notes: list[str] = field(default_factory=list)  # "key = value (auto: why)"
    scratch: Path | None = None  # the NVMe directory made here, removed at exit unless --keep


def load_config(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text()
    except OSError as e:
        raise OSError(e.errno, f"--config: {e.strerror}", str(path)) from None
    try:
        config = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--config: {path} is not JSON ({e})") from None
    if not isinstance(config, dict):
        raise ValueError(f"--config: {path} holds a JSON {type(config).__name__}, not an object")
    return config


def resolve_config(config: dict[str, Any], *, preset: str, steps: int, device: torch.device, engine: str,
                   nvme_dir: Path | None, fine_tune: bool = False) -> ResolvedConfig:
    """``config`` with this script's ``"auto"`` values filled in (see the
    module's docstring); other ``"auto"`` values are left to the engine."""
    out = ResolvedConfig(json.loads(json.dumps(config)))
    model_cfg, training = PRESETS[preset], TRAINING[preset]
    budget = BYTES_PER_PARAMETER // 2 * model_cfg.parameters

    def fill(path: str, value: Any, why: str) -> None:
        *parents, last = path.split(".")
        node = out.ds_config
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict) and node.get(last) == AUTO:
            node[last] = value
            out.notes.append(f"{path} = {json.dumps(value)} (auto: {why})")

    def nvme_path() -> str:
        if nvme_dir is not None:
            return str(nvme_dir)
        if out.scratch is None:
            out.scratch = Path(tempfile.mkdtemp(prefix="train_gpt-", dir="/var/tmp"))
        return str(out.scratch)

    fill("train_micro_batch_size_per_gpu", training.micro_batch, f"{preset}'s")
    if fine_tune:
        fill("optimizer.params.lr", training.lr / FINE_TUNE_LR_DIVISOR,
             f"{preset}'s over {FINE_TUNE_LR_DIVISOR}, for a fine-tune (--init-from)")
    fill("optimizer.params.lr", training.lr, f"{preset}'s")
    fill("bf16.enabled", device.type == "cuda", f"{'bf16 on the GPU' if device.type == 'cuda' else 'fp32 on the CPU'}")
    fill("scheduler.params.total_num_steps", steps, "--steps")
    fill("scheduler.params.warmup_num_steps", max(1, steps // 10), "a tenth of --steps")
    if engine == "tierflow":
        zero = out.ds_config.get("zero_optimization")
        for section in ("offload_param", "offload_optimizer"):
            node = zero.get(section) if isinstance(zero, dict) else None
            if isinstance(node, dict) and node.get("nvme_path") == AUTO:
                fill(f"zero_optimization.{section}.nvme_path", nvme_path(),
                     "--nvme-dir" if nvme_dir is not None else "a fresh directory, removed at exit")
            elif nvme_dir is not None and isinstance(node, dict) and node.get("device") == "nvme":
                node["nvme_path"] = str(nvme_dir)
                out.notes.append(f"zero_optimization.{section}.nvme_path = {json.dumps(str(nvme_dir))} (--nvme-dir)")
        fill("tierflow.device_memory", budget, f"8 bytes per parameter, half of the {_size(2 * budget)} "
                                              "the training state needs")
        zenflow = zero.get("zenflow") if isinstance(zero, dict) else None
        if isinstance(zenflow, dict):
            nvme = isinstance(zero.get("offload_optimizer"), dict) and zero["offload_optimizer"].get("device") == "nvme"
            state = zenflow_state_bytes(model_cfg, zenflow, nvme=nvme)
            fill("tierflow.host_memory", budget + state, f"8 bytes per parameter and ZenFlow's host state, "
                                                         f"{_size(state)}")
        fill("tierflow.host_memory", budget, "8 bytes per parameter")
    return out


def zenflow_state_bytes(model_cfg: GPTConfig, zenflow: dict[str, Any], *, nvme: bool) -> int:
    """What ZenFlow keeps in host memory for the model (its fp32 masters,
    moments and gradient windows; with ``nvme`` its windowed state is on NVMe
    and four of the largest matrix's stream through host memory), by the
    engine's own count."""
    from tierflow.zero.plan import zenflow_host_bytes, zenflow_nvme_bytes

    with torch.device("meta"):  # shapes only, no memory
        shapes = [tuple(p.shape) for p in GPT(model_cfg).parameters()]
    host = sum(zenflow_host_bytes(shapes, float(zenflow.get("topk_ratio", 0.1)),
                                  bool(zenflow.get("overlap_step", False)), nvme=nvme))
    if not nvme:
        return host
    on_nvme, largest = zenflow_nvme_bytes(shapes)
    return host + min(on_nvme, 4 * largest)


# ZenFlow's settings for --zenflow: DeepSpeed ZenFlow's example values.
ZENFLOW = {"topk_ratio": 0.1, "update_interval": 4, "overlap_step": True}


def with_zenflow(config: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """``config`` with ZenFlow on at stage 3 (``--zenflow``) and what changed."""
    config = json.loads(json.dumps(config))
    zero = config.setdefault("zero_optimization", {})
    if not isinstance(zero, dict):
        raise ValueError("zero_optimization: --zenflow needs it to be an object")
    notes = []
    if zero.get("zenflow") is None:
        zero["zenflow"] = dict(ZENFLOW)
        notes.append(f"zero_optimization.zenflow = {json.dumps(ZENFLOW)} (--zenflow)")
    return config, notes


def _size(n: float) -> str:
    """Bytes as a short figure in SI units: 512 B, 26.1 MB, 1.2 GB."""
    for unit in ("B", "kB", "MB", "GB"):
        if abs(n) < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def _bytes_of(value: Any, key: str) -> int | None:
    """A budget as bytes: an int, or a size string read by tierflow's own parser."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, (int, float)):
        return int(value)
    from tierflow import _core
    return int(_core.parse_size(str(value), key))


# ---- a fine-tune's weights ------------------------------------------------------------------

WEIGHT_FILES = ("model.safetensors", "state.pt")  # in a tag: the tierflow engine's, the torch reference's


def weights_file(path: Path) -> Path:
    """The weights that ``--init-from PATH`` names: a file itself, a
    checkpoint tag's (``model.safetensors``, or the torch reference's
    ``state.pt``), or those of the tag ``PATH/latest`` names."""
    if path.is_file():
        return path
    if not path.is_dir():
        raise FileNotFoundError(f"--init-from: {path} does not exist")
    latest = path / "latest"
    tag = path / latest.read_text().strip() if latest.is_file() else path
    for name in WEIGHT_FILES:
        if (tag / name).is_file():
            return tag / name
    if tag != path:
        raise FileNotFoundError(f"--init-from: {tag} (named by {latest}) has neither {' nor '.join(WEIGHT_FILES)}")
    raise FileNotFoundError(f"--init-from: {path} is neither a weights file nor a checkpoint "
                            f"(a tag directory with {' or '.join(WEIGHT_FILES)}, or a directory with latest)")


def load_weights(path: Path, model_cfg: GPTConfig) -> dict[str, torch.Tensor]:
    """The model's state_dict from ``path`` (see :func:`weights_file`: a
    safetensors file, or a torch file of plain tensors whose ``"module"``
    holds them), checked against ``model_cfg``'s names and shapes; a tied
    weight saved once under its first name is given its other names too."""
    file = weights_file(path)
    if file.suffix == ".safetensors":
        try:
            from safetensors.torch import load_file
        except ImportError as e:
            raise ImportError(f"--init-from: safetensors cannot be imported ({e}); scripts/setup.sh installs it") from e
        try:
            saved = load_file(str(file))
        except Exception as e:  # safetensors raises its own types for a truncated or foreign file
            raise ValueError(f"--init-from: {file} is not a readable safetensors file ({e})") from None
    else:
        try:
            saved = torch.load(file, map_location="cpu", weights_only=True)
        except Exception as e:
            raise ValueError(f"--init-from: {file} is not a readable torch file of tensors ({e})") from None
        saved = saved.get("module", saved) if isinstance(saved, dict) else None
        if not isinstance(saved, dict):
            raise ValueError(f"--init-from: {file} holds no state_dict")
    with torch.device("meta"):
        reference = GPT(model_cfg)
    ties = {name: first for first, names in _tied_names(reference).items() for name in names}
    out = {}
    for name, meta in reference.state_dict().items():
        value = saved.get(name, saved.get(ties.get(name, name)))
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"--init-from: {file} has no '{name}' (was it saved from another --model?)")
        if tuple(value.shape) != tuple(meta.shape):
            raise ValueError(f"--init-from: '{name}' in {file} is {list(value.shape)}, this --model's "
                             f"{list(meta.shape)}")
        out[name] = value.to(meta.dtype)
    return out


def _tied_names(model: torch.nn.Module) -> dict[str, list[str]]:
    """Each parameter's first name and the other names it goes by."""
    first: dict[int, str] = {}
    out: dict[str, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            out.setdefault(first[id(p)], []).append(name)
        else:
            first[id(p)] = name
    return out


# ---- the loop ------------------------------------------------------------------------------

@dataclass
class Run:
    label: str
    losses: list[float] = field(default_factory=list)  # mean over each optimizer step's micro-batches
    tokens_per_second: list[float] = field(default_factory=list)
    eval_loss: float = math.nan
    start_loss: float = math.nan  # a fine-tune's: the eval loss of the weights it started from
    seconds: float = 0.0


class Progress:
    """tqdm's bar on a terminal; otherwise a plain line at the first step,
    every tenth of the run and the last (a bar redrawn with carriage returns
    makes an unreadable log)."""

    def __init__(self, label: str, total: int, shown: bool = True) -> None:
        from tqdm import tqdm

        self.label, self.total = label, total
        self.interactive = shown and sys.stderr.isatty()
        self.every = max(1, total // 10)
        self.bar = tqdm(total=total, desc=label, unit="step", dynamic_ncols=True, disable=not self.interactive)

    def update(self, step: int, fields: dict[str, str]) -> None:
        text = "  ".join(f"{k} {v}" for k, v in fields.items())
        if self.interactive:
            self.bar.set_postfix_str(text, refresh=False)
            self.bar.update(1)
        elif step == 1 or step % self.every == 0 or step == self.total:
            print(f"{self.label}: step {step}/{self.total}  {text}", flush=True)

    def close(self) -> None:
        self.bar.close()


def _fields(loss: float, tokens_per_second: float, stats: dict[str, Any] | None) -> dict[str, str]:
    fields = {"loss": f"{loss:.3f}", "tok/s": f"{tokens_per_second / 1000:.1f}k"}
    if stats is not None:
        fields["stall"] = f"{100 * stats['stall_fraction']:.1f}%"
        for tier in ("device", "host", "nvme"):
            if tier in stats["tiers"]:
                fields[tier] = _size(stats["tiers"][tier]["used"])
    return fields


def train(engine: Any, run: Run, batches: Batches, steps: int, device: torch.device, ranks: "Ranks") -> None:
    """``steps`` optimizer steps; each runs micro-batches until the engine
    reports the accumulation boundary."""
    progress = Progress(run.label, steps, shown=ranks.rank == 0)
    started = time.perf_counter()
    try:
        for step in range(1, steps + 1):
            t0 = time.perf_counter()
            total, micro_batches = 0.0, 0
            while True:
                x, y = batches.next()
                loss = engine(x, y)
                engine.backward(loss)
                total += loss.item()
                micro_batches += 1
                boundary = engine.is_gradient_accumulation_boundary()
                engine.step()
                if boundary:
                    break
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            rate = ranks.world_size * micro_batches * x.numel() / (time.perf_counter() - t0)
            run.losses.append(ranks.mean(total / micro_batches))
            run.tokens_per_second.append(rate)
            progress.update(step, _fields(run.losses[-1], rate, engine.memory_stats()))
    finally:
        progress.close()
    run.seconds = time.perf_counter() - started


@torch.no_grad()
def evaluate(engine: Any, batches: Batches) -> float:
    """The mean loss over EVAL_TOKENS of held-out windows (the same for every
    run given batches of the same seed)."""
    count = max(1, EVAL_TOKENS // (batches.batch * batches.context))
    return statistics.fmean(engine(*batches.next()).item() for _ in range(count))


# ---- the outputs ---------------------------------------------------------------------------

def plot(runs: list[Run], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed, none looked for
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=120)
    for run, style in zip(runs, ("-", "--")):
        steps = range(1, len(run.losses) + 1)
        (line,) = ax.plot(steps, run.losses, style, linewidth=1.4, label=f"{run.label} (val {run.eval_loss:.3f})")
        ax.plot([len(run.losses)], [run.eval_loss], "o", color=line.get_color())
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("train loss (nats per byte)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def print_memory(stats: dict[str, Any]) -> None:
    """The engine's tiers, the stall, the bytes each link moved; then the
    optimizer's own (its state's host memory, stream and files) when it
    reports them."""
    optimizer = stats.get("optimizer") or {"tiers": {}, "bytes": {}}
    print("tiers (budget / used / high water):")
    rows = [(tier, t) for tier, t in stats["tiers"].items()] + \
        [(f"opt. {tier}", t) for tier, t in optimizer["tiers"].items()]
    for tier, t in rows:
        budget = "disk" if t["budget"] is None else _size(t["budget"])  # NVMe: the filesystem's free space
        print(f"  {tier:<11} {budget:>8} / {_size(t['used']):>8} / {_size(t['high_water']):>8}")
    print(f"stall: {stats['stall_seconds']:.2f} s ({100 * stats['stall_fraction']:.1f}% of the run)")
    for label, links in (("moved", stats["bytes"]), ("optimizer moved", optimizer["bytes"])):
        if links:
            print(f"{label}: " + ", ".join(f"{link} {_size(n)}" for link, n in links.items()))


# ---- main ------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=list(PRESETS), default="tiny", help="the model preset (default: tiny)")
    p.add_argument("--steps", type=int, default=80, help="optimizer steps (default: 80)")
    p.add_argument("--config", type=Path, default=HERE / "train_gpt.json",
                   help="the DeepSpeed config (default: train_gpt.json beside this script)")
    p.add_argument("--out", type=Path, default=Path("train_gpt_out"), help="output folder (default: ./train_gpt_out)")
    p.add_argument("--seed", type=int, default=0, help="the seed of the weights and of the batches (default: 0)")
    p.add_argument("--compare", action="store_true",
                   help="also train with torch.optim.AdamW in memory and plot both curves")
    p.add_argument("--engine", choices=("tierflow", "torch"), default="tierflow",
                   help="tierflow's ZeRO-3 engine (default), or the plain torch reference alone")
    p.add_argument("--nvme-dir", type=Path, help="the NVMe tier's directory (default: a fresh one under /var/tmp)")
    p.add_argument("--keep", action="store_true", help="keep the fresh NVMe directory at exit")
    p.add_argument("--zenflow", action="store_true",
                   help="train with ZenFlow at stage 3 (the parameters and the windowed state on NVMe)")
    p.add_argument("--init-from", type=Path, metavar="CHECKPOINT",
                   help="fine-tune: start from these weights (a checkpoint directory or tag this script wrote, "
                        "or a .safetensors file) and train on held-out text")
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error(f"--steps: {args.steps} is not ≥ 1")
    if args.seed < 0:
        p.error(f"--seed: {args.seed} is not ≥ 0")
    if args.engine == "torch" and (args.nvme_dir is not None or args.keep):
        p.error(f"{'--nvme-dir' if args.nvme_dir is not None else '--keep'}: --engine torch keeps everything in "
                "memory; the NVMe directory is --engine tierflow's")
    if args.nvme_dir is not None and args.keep:
        p.error("--keep: it keeps the fresh directory made without --nvme-dir; a --nvme-dir given is never removed")
    if args.nvme_dir is not None and not args.nvme_dir.is_dir():
        p.error(f"--nvme-dir: {args.nvme_dir} is not a directory")
    if args.zenflow and args.engine == "torch":
        p.error("--zenflow: it is the tierflow engine's; --engine torch runs AdamW")
    return args


@dataclass(frozen=True)
class Ranks:
    """This process's place in a torchrun launch (rank 0 of 1 without one)."""

    rank: int = 0
    world_size: int = 1

    def mean(self, value: float) -> float:
        """``value`` averaged over the ranks."""
        if self.world_size == 1:
            return value
        t = torch.tensor([value], dtype=torch.float64)
        torch.distributed.all_reduce(t)
        return t.item() / self.world_size


def _launch() -> tuple[Ranks, torch.device]:
    """The process group of a torchrun launch, made here (gloo on the CPU,
    NCCL with one GPU per process), and this process's device."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cuda = torch.cuda.is_available()
    if world == 1:
        return Ranks(), torch.device("cuda" if cuda else "cpu")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if cuda:
        torch.cuda.set_device(local)
    torch.distributed.init_process_group("nccl" if cuda else "gloo")
    ranks = Ranks(torch.distributed.get_rank(), torch.distributed.get_world_size())
    return ranks, torch.device("cuda", local) if cuda else torch.device("cpu")


def _total_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@contextlib.contextmanager
def _scratch(resolved: ResolvedConfig, keep: bool) -> Iterator[None]:
    try:
        yield
    finally:
        if resolved.scratch is not None:
            if keep:
                print(f"nvme: {resolved.scratch} (kept)")
            else:
                shutil.rmtree(resolved.scratch, ignore_errors=True)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    model_cfg, training = PRESETS[args.model], TRAINING[args.model]
    ranks, device = _launch()
    if ranks.world_size > 1:
        if args.compare or args.engine == "torch":
            raise ValueError(f"{'--compare' if args.compare else '--engine torch'}: the in-memory reference runs in "
                             "one process; launch it without torchrun")
        if ranks.rank != 0:  # rank 0 speaks for the run
            sys.stdout = open(os.devnull, "w")
    if device.type == "cpu":
        # torch's default is the physical cores of the whole machine; this process may be held to fewer.
        torch.set_num_threads(len(os.sched_getaffinity(0)))
    else:
        torch.set_float32_matmul_precision("high")  # fp32 matmuls on the tensor cores (TF32), both engines alike

    need = BYTES_PER_PARAMETER * model_cfg.parameters
    if args.compare and need > 0.9 * _total_memory(device):
        raise ValueError(f"--compare: the in-memory reference needs {_size(need)} for {args.model}'s fp32 weights, "
                         f"gradients and AdamW moments, more than this {device.type} device's "
                         f"{_size(_total_memory(device))} holds with activations")
    config, changed = load_config(args.config), []
    if args.zenflow:
        config, changed = with_zenflow(config)
    resolved = resolve_config(config, preset=args.model, steps=args.steps, device=device,
                              engine=args.engine, nvme_dir=args.nvme_dir, fine_tune=args.init_from is not None)
    resolved.notes[:0] = changed
    ds_config = resolved.ds_config
    args.out.mkdir(parents=True, exist_ok=True)
    if ranks.rank == 0:
        (args.out / "ds_config.json").write_text(json.dumps(ds_config, indent=2) + "\n")

    corpus = load_stdlib()
    weights = None if args.init_from is None else load_weights(args.init_from, model_cfg)
    train_text, val_text = (corpus.train, corpus.val) if weights is None else corpus.fine_tune()
    loop = loop_config(ds_config)
    micro_batch, accumulation = int(loop.train_micro_batch_size_per_gpu), int(loop.gradient_accumulation_steps)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu, {torch.get_num_threads()} threads"
    print(f"model: {args.model}, {model_cfg.parameters:,} parameters ({model_cfg.n_layer}×{model_cfg.n_embd}, "
          f"context {model_cfg.context}), on {where}")
    print(f"corpus: {corpus.describe()}")
    if weights is not None:
        mib = 1 << 20
        print(f"fine-tune: from {weights_file(args.init_from)}, on held-out text the pretraining never saw "
              f"({train_text.numel() / mib:.1f} MiB train, {val_text.numel() / mib:.1f} MiB val)")
    print(f"config: {args.config}")
    for note in resolved.notes:
        print(f"  {note}")
    budget = None
    if args.engine == "tierflow":
        budget = _bytes_of(ds_config.get("tierflow", {}).get("device_memory"), "tierflow.device_memory")
    print(f"training state: {_size(need)} ({BYTES_PER_PARAMETER} bytes per parameter)"
          + ("" if budget is None else f", device budget {_size(budget)}"))

    def batches(split: torch.Tensor, own: bool = False) -> Batches:
        # Each rank trains on its own micro-batches; all evaluate the same ones.
        seed = args.seed + (ranks.rank if own else 0)
        return Batches(split, batch=micro_batch, context=model_cfg.context, seed=seed, device=device)

    tuned = " fine-tune" if weights is not None else ""
    trace: Path | None = None
    with _scratch(resolved, args.keep):
        if args.engine == "tierflow":
            engine = tierflow_engine(model_cfg, ds_config, args.seed)
            main_run = Run(("tierflow ZeRO-3 + ZenFlow" if ds_config.get("zero_optimization", {}).get("zenflow")
                            is not None else "tierflow ZeRO-3") + tuned + ", NVMe offload")
        else:
            engine = TorchEngine(model_cfg, ds_config, args.seed, device)
            main_run = Run(f"torch{tuned}, in memory")
        try:
            if weights is not None:
                engine.module.load_state_dict(weights)
                main_run.start_loss = evaluate(engine, batches(val_text))
            train(engine, main_run, batches(train_text, own=True), args.steps, device, ranks)
            main_run.eval_loss = evaluate(engine, batches(val_text))
            stats = engine.memory_stats()
            checkpoint = args.out / "checkpoint" / f"global_step{engine.global_steps}"
            engine.save_checkpoint(str(checkpoint.parent), tag=checkpoint.name,
                                   client_state={"model": args.model, "seed": args.seed, "corpus": corpus.digest,
                                                 "init_from": None if weights is None else str(args.init_from)})
            if args.engine == "tierflow" and ds_config.get("tierflow", {}).get("trace") is True:
                trace = args.out / ("trace.json" if ranks.rank == 0 else f"trace.rank{ranks.rank}.json")
                engine.write_trace(str(trace))
        finally:
            engine.close()  # the NVMe files go before their directory does
    runs = [main_run]

    if args.compare:
        reference = TorchEngine(model_cfg, ds_config, args.seed, device)
        runs.append(Run(f"torch AdamW{tuned}, in memory (--compare)"))
        if weights is not None:
            reference.module.load_state_dict(weights)
            runs[-1].start_loss = evaluate(reference, batches(val_text))
        train(reference, runs[-1], batches(train_text, own=True), args.steps, device, ranks)
        runs[-1].eval_loss = evaluate(reference, batches(val_text))
        reference.close()

    if ranks.rank != 0:
        torch.distributed.destroy_process_group()
        return
    figure = args.out / "loss.png"
    text = "held-out files of the Python standard library" if weights is not None else "the Python standard library"
    plot(runs, figure, f"{args.model} ({model_cfg.parameters / 1e6:.1f}M parameters){tuned.replace(' ', ', ')} on "
                       f"{text}, {args.steps} steps of {accumulation} × {micro_batch * model_cfg.context} tokens")
    (args.out / "metrics.json").write_text(json.dumps({
        "model": args.model, "parameters": model_cfg.parameters, "steps": args.steps, "seed": args.seed,
        "corpus": corpus.digest, "device": str(device),
        "init_from": None if weights is None else str(weights_file(args.init_from)),
        "runs": [{"label": r.label, "loss": r.losses, "tokens_per_second": r.tokens_per_second,
                  "eval_loss": r.eval_loss, "start_eval_loss": None if math.isnan(r.start_loss) else r.start_loss,
                  "seconds": r.seconds} for r in runs],
        "memory": stats}, indent=1) + "\n")

    for run in runs:
        val = f"val {run.eval_loss:.3f}" if math.isnan(run.start_loss) else \
            f"val {run.start_loss:.3f} → {run.eval_loss:.3f}"
        print(f"{run.label}: loss {run.losses[0]:.3f} → {run.losses[-1]:.3f}, {val}, "
              f"{statistics.median(run.tokens_per_second) / 1000:.1f}k tokens/s, {run.seconds:.0f} s")
    if args.compare:
        gap = max(abs(a - b) for a, b in zip(runs[0].losses, runs[1].losses))
        print(f"largest gap between the curves: {gap:.4f}; validation loss {runs[0].eval_loss:.4f} against "
              f"{runs[1].eval_loss:.4f} ({runs[0].eval_loss - runs[1].eval_loss:+.4f})")
    if stats is not None:
        print_memory(stats)
    print(f"plot: {figure}")
    if trace is not None:
        print(f"trace: {trace}")
    elif args.engine == "tierflow":
        print("trace: not recorded (tierflow.trace is not true in the config)")
    else:
        print("trace: none (the torch engine has no tiers to trace)")
    print(f"checkpoint: {checkpoint}")
    if ranks.world_size > 1:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    failure = None
    try:
        main()
    except (ValueError, OSError, MemoryError, ImportError) as e:
        # A refused value, an unreadable file, a full tier, a missing engine:
        # one line, as tierflow's command does.
        failure = f"train_gpt.py: {e}"
    # Exited outside the handler, so that the traceback and the engine its
    # frames hold are freed before the interpreter shuts down.
    if failure is not None:
        print(failure, file=sys.stderr)
        sys.exit(1)
