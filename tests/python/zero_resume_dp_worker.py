"""One rank of a data-parallel stage-3 run whose optimizer keeps whole
matrices (``torchrun --nproc-per-node N zero_resume_dp_worker.py OUT NVME
STATE KIND``), or, imported, the same run in one process: zero_dp_worker.py's
model and data (d = 45: odd shards, the last padded), ``FIRST`` steps, a
checkpoint, then a fresh engine that loads it and trains the rest; then the
same steps without the stop. ``STATE``: where the optimizer's state lives
("cpu" or "nvme"). ``KIND``: "muon" (``optimizer.type: Muon``) or "zenflow"
(AdamW with a ``zenflow`` section: a window of 2 steps, overlapped, so a
checkpoint falls inside a window). ZERO_RESUME_BF16=1 in the environment
trains in bf16 (fp32 masters)."""

import json
import os
import subprocess
import sys

import torch

import tierflow

from zero_dp_worker import GAS, GLOBAL_BATCH, TinyLM, batches, train_on_rows, train_with_a_resume

STEPS, FIRST = 6, 3


# ZenFlow's section: half of each matrix's columns stepped at once, the rest
# over windows of 2 steps applied a window late, a refresh every 4 steps.
ZENFLOW = {"topk_ratio": 0.5, "update_interval": 2, "select_interval": 4, "overlap_step": True}


def config(nvme: str, state: str, kind: str = "muon") -> dict:
    optimizer = {"device": state}
    if state == "nvme":
        optimizer["nvme_path"] = nvme
    precision = {"bf16": {"enabled": True}} if os.environ.get("ZERO_RESUME_BF16") == "1" else {}
    zero = {"stage": 3, "offload_param": {"device": "cpu"}, "offload_optimizer": optimizer,
            "stage3_param_persistence_threshold": 0}
    if kind == "muon":
        opt = {"type": "Muon", "params": {"muon_lr": 0.02, "adam_lr": 3e-3, "weight_decay": 0.01}}
    else:
        opt = {"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.9, 0.99], "eps": 1e-8, "weight_decay": 0.01}}
        zero["zenflow"] = dict(ZENFLOW)
    return {**precision,
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH,
        "gradient_accumulation_steps": GAS,
        "gradient_clipping": 0.5,
        "optimizer": opt,
        "zero_optimization": zero,
    }


def run(nvme: str, checkpoint_dir: str, state: str, kind: str = "muon") -> dict:
    """The run on this process's rank (one process without a process group)."""
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    rows = slice(rank * GLOBAL_BATCH // world, (rank + 1) * GLOBAL_BATCH // world)
    data = batches(STEPS * GAS)

    def make():
        torch.manual_seed(0)
        engine, *_ = tierflow.initialize(model=TinyLM(), config=config(nvme, state, kind))
        return engine

    def train(engine, steps):
        return train_on_rows(engine, data, steps, rows, world)

    losses, engine = train_with_a_resume(make, train, checkpoint_dir, FIRST, STEPS)
    kinds = [type(part).__name__ for part in getattr(engine.optimizer, "parts", [engine.optimizer])]
    weights = {k: v.tolist() for k, v in engine.module.state_dict().items()}  # gathered on every rank
    engine.close()
    engine = make()
    uninterrupted = train(engine, range(STEPS))
    engine.close()
    return {"losses": losses, "uninterrupted": uninterrupted, "weights": weights, "parts": kinds, "world": world}


def two_ranks(tmp_path, state: str, kind: str, timeout: int = 300) -> list[dict]:
    """This worker under torchrun, 2 gloo ranks, its NVMe and checkpoints
    under ``tmp_path / "two"``: each rank's result (the tierflow imported
    here, and this folder, on the ranks' path)."""
    import tierflow as imported

    out = tmp_path / "two.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([os.path.dirname(os.path.dirname(imported.__file__)),
                                          os.path.dirname(os.path.abspath(__file__)), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           os.path.abspath(__file__), str(out), str(tmp_path / "two"), state, kind],
                          env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads((tmp_path / f"two.json.rank{r}").read_text()) for r in range(2)]


if __name__ == "__main__":
    out, nvme, state, kind = sys.argv[1:5]
    torch.distributed.init_process_group("gloo")
    result = run(nvme, os.path.join(nvme, "checkpoints"), state, kind)
    with open(f"{out}.rank{torch.distributed.get_rank()}", "w") as f:
        json.dump(result, f)
    torch.distributed.destroy_process_group()
