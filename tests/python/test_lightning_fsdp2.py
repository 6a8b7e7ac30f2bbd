"""A trainer no one here wrote, with the plugin: Lightning's ``Trainer`` and
its ``ModelParallelStrategy`` (FSDP2's ``fully_shard``) on 2 CPU processes
over gloo (lightning_fsdp2_worker.py), its own training loop (which steps
with a closure), with and without the README's lines."""

import json
import os
import subprocess
import sys

import pytest
import torch

import tierflow

pytest.importorskip("lightning")


def test_lightning_trainer_with_shards_and_gradients_on_nvme_reaches_torchs_losses(tmp_path):
    """20 steps: tierflow's AdamW, every shard and its gradient homed on NVMe
    through 64 KiB of host memory, against torch.optim.AdamW with the shards
    in memory (measured: 1.3e-7 relative; bound 1e-6); close() leaves no file."""
    worker = os.path.join(os.path.dirname(__file__), "lightning_fsdp2_worker.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([os.path.dirname(os.path.dirname(tierflow.__file__)),
                                          os.environ.get("PYTHONPATH", "")])}
    losses = {}
    for case in ("torch", "tierflow"):
        out = tmp_path / f"{case}.json"
        done = subprocess.run([sys.executable, worker, str(out), str(tmp_path), case], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        losses[case] = json.loads(out.read_text())
    assert len(losses["tierflow"]) == 20
    torch.testing.assert_close(torch.tensor(losses["tierflow"]), torch.tensor(losses["torch"]), rtol=1e-6, atol=0)
    assert not os.path.exists(tmp_path / "tierflow-fsdp")
