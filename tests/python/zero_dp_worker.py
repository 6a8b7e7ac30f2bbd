"""One rank of a data-parallel ZeRO-3 run (``torchrun --nproc-per-node N
zero_dp_worker.py OUT NVME``), or, imported, the same run in one process.

Every micro-batch is the same global batch of ``GLOBAL_BATCH`` sequences;
rank r trains on its slice of the rows. The losses recorded are the global
batch's (the mean of the ranks' losses, which have equal rows), so one
process training on the whole batch must record the same ones.

The run: ``FIRST`` steps, a checkpoint, then a fresh engine that loads it
and trains ``STEPS - FIRST`` more — the losses of both halves in one list;
then the same model built under ``tierflow.zero.Init`` trains 2 steps.
"""

import json
import os
import sys

import torch

import tierflow

from zero_models import TiedLM

VOCAB, D, SEQ, GLOBAL_BATCH = 64, 45, 16, 8
STEPS, FIRST, GAS = 10, 6, 2


class TinyLM(TiedLM):
    """An embedding tied to the LM head and three blocks; d = 45 gives
    tensors of odd sizes (the LayerNorms', the biases'), whose last shard is
    padded."""

    def __init__(self):
        super().__init__(VOCAB, D, 3)


def train_on_rows(engine, data, steps, rows: slice, world: int) -> list[float]:
    """Each of ``steps``' GAS micro-batches of ``data``, this rank's
    ``rows`` of it; returns each micro-batch's loss over the global batch
    (the mean of the ranks')."""
    losses = []
    for step in steps:
        for micro in range(GAS):
            x, y = data[step * GAS + micro]
            loss = engine(x[rows], y[rows])
            engine.backward(loss)
            engine.step()
            mean = loss.detach().clone()
            if world > 1:
                torch.distributed.all_reduce(mean)
                mean /= world
            losses.append(mean.item())
    return losses


def train_with_a_resume(make, train, checkpoint_dir: str, first: int, steps: int):
    """``train(engine, range(first))`` on ``make()``'s engine, a checkpoint,
    then a fresh engine that loads it and trains to ``steps``: the losses of
    both halves and that engine, still open."""
    engine = make()
    losses = train(engine, range(first))
    engine.save_checkpoint(checkpoint_dir)
    engine.close()
    engine = make()
    engine.load_checkpoint(checkpoint_dir)
    return losses + train(engine, range(first, steps)), engine


def config(nvme: str, device_memory: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH,
        "gradient_accumulation_steps": GAS,
        # Clipping (the global norm over the ranks) steps after the backward;
        # without it each parameter is stepped during the backward.
        "gradient_clipping": float(os.environ.get("ZERO_DP_CLIP", "0.5")),
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.9, 0.99], "eps": 1e-8,
                                                   "weight_decay": 0.01}},
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "nvme", "nvme_path": nvme},
            "offload_optimizer": {"device": "nvme", "nvme_path": nvme},
            # The LayerNorms and biases stay gathered for the whole step; the
            # weights are gathered around each use.
            "stage3_param_persistence_threshold": 200,
        },
        "tierflow": {"device_memory": device_memory, "host_memory": 4 << 20,
                     # who gathers and reduce-scatters: tierflow's communicators or torch.distributed
                     "collectives": os.environ.get("ZERO_DP_COLLECTIVES", "tierflow"),
                     # bytes of a rank's shard gathered at once (0: whole parameters)
                     "gather_chunk": int(os.environ.get("ZERO_DP_GATHER_CHUNK", 16 << 20))},
    }


def batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(11)
    out = []
    for _ in range(n):
        t = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=g)
        out.append((t[:, :-1], t[:, 1:]))
    return out


def run(nvme: str, checkpoint_dir: str) -> dict:
    """The run on this process's rank (one process without a process group)."""
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    rows = slice(rank * GLOBAL_BATCH // world, (rank + 1) * GLOBAL_BATCH // world)
    data = batches(STEPS * GAS)
    device_memory = 192 << 10  # the whole model takes 260 KiB of pages in fp32: the device holds a module's at a time

    def make(built_in_store=False):
        torch.manual_seed(0)
        if built_in_store:  # each rank builds its shards; the values are rank 0's
            with tierflow.zero.Init(config=config(nvme, device_memory)):
                model = TinyLM()
        else:
            model = TinyLM()
        engine, _, _, _ = tierflow.initialize(model=model, config=config(nvme, device_memory))
        return engine

    def train(engine, steps):
        return train_on_rows(engine, data, steps, rows, world)

    losses, engine = train_with_a_resume(make, train, checkpoint_dir, FIRST, STEPS)
    state = {k: v.tolist() for k, v in engine.module.state_dict().items()}  # gathered on every rank
    stats = engine.memory_stats()
    try:  # refused over several ranks, as DeepSpeed refuses it at stage 3
        with engine.no_sync():
            no_sync = "accepted"
    except RuntimeError as e:
        no_sync = str(e)
    engine.close()
    engine = make(built_in_store=True)
    built = train(engine, range(2))
    engine.close()
    return {"losses": losses, "built_in_store": built, "state": state, "tiers": stats["tiers"], "world": world, "no_sync": no_sync,
            "collectives": stats.get("collectives")}


if __name__ == "__main__":
    out, nvme = sys.argv[1], sys.argv[2]
    torch.distributed.init_process_group("gloo")
    rank = torch.distributed.get_rank()
    result = run(nvme, os.path.join(nvme, "checkpoints"))
    with open(f"{out}.rank{rank}", "w") as f:
        json.dump(result, f)
    torch.distributed.destroy_process_group()
