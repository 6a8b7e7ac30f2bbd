"""One DeepSpeed run, unchanged, for test_deepspeed_backend.py
(``python deepspeed_backend_worker.py OUT STAGE KIND CHECKPOINTS``): ZeRO
stage STAGE with ``offload_optimizer`` cpu and the config's AdamW, on
DeepSpeed's CPU accelerator and a one-rank gloo group. KIND "tierflow" calls
``tierflow.deepspeed.install()`` first (the config's AdamW becomes
tierflow's CPUAdam); KIND "torch" gives DeepSpeed torch.optim.AdamW as the
client optimizer instead (``zero_force_ds_cpu_optimizer`` false), a
reference that needs no JIT-built op. 10 steps, a DeepSpeed checkpoint at
step 5, and a fresh engine that loads it and runs the rest. Writes OUT:
the losses, the resumed losses and the optimizer's class."""

import json
import os
import socket
import sys

import torch
import torch.nn as nn

from fsdp2_worker import Block

STEPS, STOP = 10, 5
ADAMW = {"lr": 3e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.01}


def main() -> None:
    out, stage, kind, checkpoints = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    import deepspeed

    if kind == "tierflow":
        import tierflow.deepspeed

        tierflow.deepspeed.install()
    deepspeed.init_distributed(dist_backend="gloo")
    config = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
              "zero_optimization": {"stage": stage, "offload_optimizer": {"device": "cpu"}}}
    if kind == "torch":
        config["zero_force_ds_cpu_optimizer"] = False
    else:
        config["optimizer"] = {"type": "AdamW", "params": ADAMW}

    def engine():
        torch.manual_seed(0)
        model = nn.Sequential(*(Block(24) for _ in range(3)), nn.Linear(24, 5))
        client = None
        if kind == "torch":
            p = dict(ADAMW, betas=tuple(ADAMW["betas"]))
            client = torch.optim.AdamW(model.parameters(), **p)
        e, *_ = deepspeed.initialize(model=model, optimizer=client, model_parameters=model.parameters(),
                                     config=config)
        return e

    g = torch.Generator().manual_seed(5)
    data = [(torch.randn(8, 24, generator=g), torch.randn(8, 5, generator=g)) for _ in range(STEPS)]

    def train(e, steps):
        losses = []
        for step in steps:
            x, y = data[step]
            loss = torch.nn.functional.mse_loss(e(x), y)
            e.backward(loss)
            e.step()
            losses.append(loss.item())
        return losses

    e = engine()
    result = {"optimizer": type(e.optimizer.optimizer).__module__ + "." + type(e.optimizer.optimizer).__name__}
    result["losses"] = train(e, range(STEPS))
    e = engine()
    resumed = train(e, range(STOP))
    e.save_checkpoint(checkpoints, tag="half")
    e = engine()
    e.load_checkpoint(checkpoints, tag="half")
    result["resumed"] = resumed + train(e, range(STOP, STEPS))
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
