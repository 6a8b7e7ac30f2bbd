"""The main job, examples/train_gpt.py, launched as a user launches it with
several processes: torchrun, two gloo ranks on the CPU."""

import json
import os
import subprocess
import sys
from pathlib import Path

import tierflow

ROOT = Path(__file__).resolve().parents[2]


def torchrun(tmp_path, *args, timeout=300):
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(Path(tierflow.__file__).parent.parent), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(ROOT / "examples" / "train_gpt.py"), "--out", str(tmp_path / "out"), *args],
                          env=env, capture_output=True, text=True, timeout=timeout, cwd=tmp_path)


def test_two_ranks_train_the_main_job_and_rank_0_writes_its_outputs(tmp_path):
    done = torchrun(tmp_path, "--steps", "3")
    assert done.returncode == 0, done.stderr[-3000:]
    out = tmp_path / "out"
    metrics = json.loads((out / "metrics.json").read_text())
    (run,) = metrics["runs"]
    assert len(run["loss"]) == 3 and all(0 < loss < 6 for loss in run["loss"])
    assert "gathered" in metrics["memory"]["tiers"]
    for name in ("loss.png", "trace.json", "ds_config.json"):
        assert (out / name).stat().st_size > 0, name
    tag = out / "checkpoint" / "global_step3"
    # tierflow's files, and each rank's pair that DeepSpeed's zero_to_fp32.py reads.
    assert sorted(p.name for p in tag.iterdir()) == [
        "engine.pt", "model.safetensors", "optimizer.rank0", "optimizer.rank1",
        *(f"zero_pp_rank_{r}_mp_rank_00_{kind}_states.pt" for r in (0, 1) for kind in ("model", "optim"))]
    # Rank 0 speaks for the run: one summary, not two.
    assert done.stdout.count("checkpoint: ") == 1


def test_the_in_memory_reference_is_refused_under_torchrun(tmp_path):
    done = torchrun(tmp_path, "--steps", "1", "--compare", timeout=120)
    assert done.returncode != 0
    assert "--compare: the in-memory reference runs in one process" in done.stderr
