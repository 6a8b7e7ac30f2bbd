"""torch.distributed's backend "tierflow" and FSDP2's custom collectives on
tierflow's Gloo communicator (torch_backend_worker.py, 2 ranks under
torchrun): every collective of torch's API exact, with async_op, futures and
clear refusals; FSDP2 training on it, and with set_custom_all_gather /
set_custom_reduce_scatter on a gloo group, bit for bit as on torch's gloo."""

import json
import os
import subprocess
import sys

import pytest
import torch.distributed as dist

import tierflow

WORKER = os.path.join(os.path.dirname(__file__), "torch_backend_worker.py")


def run(tmp_path, mode: str) -> list[dict]:
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([os.path.dirname(os.path.dirname(tierflow.__file__)),
                                          os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           WORKER, str(tmp_path / mode), mode], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "leaked" not in done.stderr, done.stderr[-3000:]
    return [json.loads((tmp_path / f"{mode}.rank{r}").read_text()) for r in range(2)]


@pytest.mark.skipif(not hasattr(dist.Backend, "register_backend"), reason="this torch has no register_backend")
def test_fsdp2_on_the_tierflow_backend_and_custom_collectives_trains_as_on_gloo(tmp_path):
    gloo = run(tmp_path, "gloo")
    ours = run(tmp_path, "tierflow")
    custom = run(tmp_path, "custom")
    assert gloo[0]["losses"][-1] < gloo[0]["losses"][0], "the model did not learn"
    for g, o, c in zip(gloo, ours, custom):
        assert o["failures"] == [] and c["failures"] == []
        # two ranks' fp32 sums do not depend on who adds them: the same bits
        assert o["losses"] == g["losses"] and c["losses"] == g["losses"]
        # 30 steps of 4 modules: every forward's and backward's all-gather, every reduce-scatter, ours
        assert c["calls"]["reduce_scatter"] == 30 * 4 and c["calls"]["all_gather"] >= 30 * 4, c["calls"]
