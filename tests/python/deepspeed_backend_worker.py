"""One DeepSpeed run, unchanged, for test_deepspeed_backend.py
(``python deepspeed_backend_worker.py OUT STAGE KIND CHECKPOINTS [WIDTH]``): ZeRO
stage STAGE with ``offload_optimizer`` cpu and the config's AdamW, on
DeepSpeed's CPU accelerator and a one-rank gloo group. KIND "tierflow" calls
``tierflow.deepspeed.install()`` first (the config's AdamW becomes
tierflow's CPUAdam); KIND "torch" gives DeepSpeed torch.optim.AdamW as the
client optimizer instead (``zero_force_ds_cpu_optimizer`` false), a
reference that needs no JIT-built op; KIND "tierflow_nvme" is "tierflow" with
``offload_param`` and ``offload_optimizer`` on NVMe (files under
CHECKPOINTS/nvme), DeepSpeed's swappers moving them (DeepSpeed swaps only
tensors of 1 MB and more: give WIDTH 512). WIDTH: the blocks' width
(default 24). 10 steps, a DeepSpeed checkpoint at
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


def keep_given_init_dtype() -> None:
    """DeepSpeed 0.19.8's ``zero.Init._set_dtype`` sets, with a dtype given,
    ``dtype or torch.float16 if fp16_supported else torch.bfloat16 if ...``:
    by Python's precedence the given dtype is dropped wherever the accelerator
    lacks fp16, as its CPU accelerator does on a CPU without oneDNN fp16
    (AVX512-FP16/AMX-FP16). ZeRO-3's NVMe parameter swapper then holds bf16
    buffers for the fp32 parameters and the first forward fails on their
    dtypes. The given dtype is kept here, as the line means; on a CPU with
    fp16 (and on every GPU) DeepSpeed already keeps it and this changes nothing."""
    from deepspeed.runtime.zero.partition_parameters import InsertPostInitMethodToModuleSubClasses as Init

    set_dtype = Init._set_dtype

    def _set_dtype(self, ds_config, dtype):
        set_dtype(self, ds_config, dtype)
        if dtype is not None:
            self.dtype = dtype

    Init._set_dtype = _set_dtype


def main() -> None:
    out, stage, kind, checkpoints = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    width = int(sys.argv[5]) if len(sys.argv) > 5 else 24
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    import deepspeed

    keep_given_init_dtype()
    served = [0]  # requests tierflow's aio_handle saw end (counted here, around its wait)
    if kind.startswith("tierflow"):
        import tierflow.deepspeed

        tierflow.deepspeed.install()
        wait = tierflow.deepspeed.AioHandle.wait

        def counted(self):
            n = wait(self)
            served[0] += n
            return n

        tierflow.deepspeed.AioHandle.wait = counted
    deepspeed.init_distributed(dist_backend="gloo")
    adamw = dict(ADAMW, lr=ADAMW["lr"] * min(1.0, 24 / width))  # a wider model, a smaller step
    config = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
              "zero_optimization": {"stage": stage, "offload_optimizer": {"device": "cpu"}}}
    if kind == "torch":
        config["zero_force_ds_cpu_optimizer"] = False  # (KIND "deepspeed_nvme": DeepSpeed's own ops, for a bench)
    else:
        config["optimizer"] = {"type": "AdamW", "params": adamw}
    if kind.endswith("_nvme"):
        nvme = os.path.join(checkpoints, "nvme")
        os.makedirs(nvme, exist_ok=True)
        config["zero_optimization"] = {"stage": stage, "offload_optimizer": {"device": "nvme", "nvme_path": nvme},
                                       # max_in_cpu 0: DeepSpeed keeps none of the parameters in RAM
                                       "offload_param": {"device": "nvme", "nvme_path": nvme, "buffer_count": 16,
                                                         "buffer_size": 4 * width * width, "max_in_cpu": 0},
                                       "stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 0}
        config["aio"] = {"block_size": 1 << 20, "queue_depth": 8, "intra_op_parallelism": 1,
                         "single_submit": False, "overlap_events": True}

    def engine():
        torch.manual_seed(0)
        model = nn.Sequential(*(Block(width) for _ in range(3)), nn.Linear(width, 5))
        client = None
        if kind == "torch":
            p = dict(adamw, betas=tuple(adamw["betas"]))
            client = torch.optim.AdamW(model.parameters(), **p)
        e, *_ = deepspeed.initialize(model=model, optimizer=client, model_parameters=model.parameters(),
                                     config=config)
        return e

    g = torch.Generator().manual_seed(5)
    data = [(torch.randn(8, width, generator=g), torch.randn(8, 5, generator=g)) for _ in range(STEPS)]

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
    result["aio_requests"] = served[0]
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
