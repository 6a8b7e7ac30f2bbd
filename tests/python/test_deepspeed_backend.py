"""tierflow beneath an unchanged DeepSpeed run: ``tierflow.deepspeed.install()``
puts tierflow's AdamW where DeepSpeed's ZeRO-Offload would load its JIT-built
DeepSpeedCPUAdam (deepspeed_backend_worker.py runs each DeepSpeed run in a
process of its own)."""

import json
import os
import subprocess
import sys

import pytest
import torch

import tierflow

pytest.importorskip("deepspeed")


def _run(tmp_path, stage, kind):
    out = tmp_path / f"{kind}{stage}.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([os.path.dirname(os.path.dirname(tierflow.__file__)),
                                          os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")])}
    worker = os.path.join(os.path.dirname(__file__), "deepspeed_backend_worker.py")
    done = subprocess.run([sys.executable, worker, str(out), str(stage), kind, str(tmp_path / f"ck-{kind}{stage}")],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("stage", [2, 3])
def test_install_makes_deepspeeds_zero_offload_step_with_tierflows_adamw_and_checkpoint_as_its_own(tmp_path, stage):
    """DeepSpeed's ZeRO-2 and ZeRO-3 with offload_optimizer cpu and the
    config's AdamW, after install(), step with tierflow's CPUAdam, and train
    as DeepSpeed with torch.optim.AdamW as its client optimizer (measured:
    losses within 1.0e-7 relative over 10 steps at both stages; bound 1e-6). DeepSpeed's own
    save_checkpoint / load_checkpoint at step 5 resumes the run bit for bit."""
    ours, theirs = _run(tmp_path, stage, "tierflow"), _run(tmp_path, stage, "torch")
    assert ours["optimizer"] == "tierflow.deepspeed.CPUAdam"
    assert theirs["optimizer"] == "torch.optim.adamw.AdamW"
    torch.testing.assert_close(torch.tensor(ours["losses"]), torch.tensor(theirs["losses"]), rtol=1e-6, atol=0)
    assert ours["resumed"] == ours["losses"]


def test_cpu_adam_takes_deepspeeds_arguments_and_refuses_what_it_does_not_compute():
    import deepspeed.ops.adam as ops_adam
    from deepspeed.runtime.zero import utils as zero_utils

    from tierflow.deepspeed import CPUAdam, install, installed, uninstall

    shipped = ops_adam.DeepSpeedCPUAdam
    p = torch.nn.Parameter(torch.randn(4, 3))
    opt = CPUAdam([p], lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, adamw_mode=False)
    assert opt.param_groups[0]["decoupled_weight_decay"] is False and opt.param_groups[0]["bias_correction"]
    with pytest.raises(RuntimeError, match="does not support the AMSGrad variant"):
        CPUAdam([p], amsgrad=True)
    with pytest.raises(ValueError, match="bias_correction=False"):
        CPUAdam([p], bias_correction=False)
    install()
    install()  # idempotent
    try:
        assert installed() and ops_adam.DeepSpeedCPUAdam is CPUAdam
        assert type(opt) in zero_utils.ZERO_SUPPORTED_OPTIMIZERS  # what is_zero_supported_optimizer checks
    finally:
        uninstall()
    assert not installed() and ops_adam.DeepSpeedCPUAdam is shipped and CPUAdam not in zero_utils.ZERO_SUPPORTED_OPTIMIZERS
