"""A Lightning ``Trainer`` (Lightning's own training loop, its
``ModelParallelStrategy``: FSDP2's ``fully_shard`` in the module's
``configure_model``) on 2 CPU processes over gloo, as Lightning's docs write
it, run as ``python lightning_fsdp2_worker.py OUT NVME CASE``. ``CASE``:
"torch" (torch.optim.AdamW, the shards in memory) or "tierflow" (the lines
the README shows added: tierflow's AdamW, and the shards and their gradients
homed on NVMe by ``tierflow.torch.fsdp.offload`` within 64 KiB of host
memory). Lightning calls ``optimizer.step(closure)``. Rank 0 writes OUT: the
loss of each step (each rank's, averaged by Lightning's ``sync_dist``)."""

import json
import sys

import lightning as L
import torch
import torch.nn as nn
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.fsdp import fully_shard

from fsdp2_worker import HYPER, Block  # (this directory: the script's)

STEPS = 20


class Regression(L.LightningModule):
    def __init__(self, case: str, nvme: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.case, self.nvme = case, nvme
        self.model = nn.Sequential(*(Block(24) for _ in range(3)), nn.Linear(24, 5))
        self.losses: list[float] = []

    def configure_model(self) -> None:
        for block in self.model[:3]:
            fully_shard(block, mesh=self.device_mesh["data_parallel"])
        fully_shard(self.model, mesh=self.device_mesh["data_parallel"])
        if self.case == "tierflow":
            import tierflow.torch.fsdp

            policy = tierflow.torch.fsdp.OffloadPolicy(nvme_dir=self.nvme, host_memory=64 << 10, gradients="nvme")
            self.shards = tierflow.torch.fsdp.offload(self.model, policy)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.model(x), y)
        self.log("loss", loss, sync_dist=True, on_step=True)
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        self.losses.append(float(self.trainer.callback_metrics["loss"]))

    def configure_optimizers(self):
        if self.case == "tierflow":
            import tierflow.torch.optim

            return tierflow.torch.optim.AdamW(self.parameters(), **HYPER)
        return torch.optim.AdamW(self.parameters(), **HYPER)


def data() -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(100)
    x, y = torch.randn(STEPS * 16, 24, generator=g), torch.randn(STEPS * 16, 5, generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)


def main() -> None:
    out, nvme, case = sys.argv[1:4]
    torch.set_num_threads(1)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=ModelParallelStrategy(data_parallel_size=2,
                                                                                      tensor_parallel_size=1),
                        max_steps=STEPS, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    module = Regression(case, nvme)
    trainer.fit(module, data())
    if case == "tierflow":
        module.shards.close()
    if trainer.global_rank == 0:
        with open(out, "w") as f:
            json.dump(module.losses, f)


if __name__ == "__main__":
    main()
