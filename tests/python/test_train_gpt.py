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


def run_script(tmp_path, *args, timeout=300):
    env = {**os.environ,
           "PYTHONPATH": os.pathsep.join([str(Path(tierflow.__file__).parent.parent), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, str(ROOT / "examples" / "train_gpt.py"), *args],
                          env=env, capture_output=True, text=True, timeout=timeout, cwd=tmp_path)


def test_the_main_jobs_zenflow_fine_tune_starts_from_the_pretrained_checkpoint(tmp_path):
    """The main job's second run: ZenFlow fine-tuning the first run's
    checkpoint on held-out text, beside torch AdamW from the same weights.
    Both start where the checkpoint is (the same loss before the first step,
    well below an untrained model's ln 256 = 5.55) and learn; a path that
    holds no weights is one line naming it."""
    pre = run_script(tmp_path, "--engine", "torch", "--steps", "4", "--out", str(tmp_path / "pre"))
    assert pre.returncode == 0, pre.stderr[-3000:]
    done = run_script(tmp_path, "--zenflow", "--steps", "3", "--compare", "--init-from", str(tmp_path / "pre" / "checkpoint"),
                      "--out", str(tmp_path / "tune"))
    assert done.returncode == 0, done.stderr[-3000:]
    metrics = json.loads((tmp_path / "tune" / "metrics.json").read_text())
    assert metrics["init_from"] == str(tmp_path / "pre" / "checkpoint" / "global_step4" / "state.pt")
    zenflow, adamw = metrics["runs"]
    assert zenflow["label"] == "tierflow ZeRO-3 + ZenFlow fine-tune, NVMe offload"
    assert abs(zenflow["start_eval_loss"] - adamw["start_eval_loss"]) < 1e-5
    assert zenflow["start_eval_loss"] < 5.0
    assert zenflow["loss"][0] == adamw["loss"][0]  # the same weights on the same first batch
    assert zenflow["eval_loss"] < zenflow["start_eval_loss"] and adamw["eval_loss"] < adamw["start_eval_loss"]
    assert "fine-tune: from " in done.stdout and "(auto: tiny's over 4, for a fine-tune (--init-from))" in done.stdout
    # The engine's checkpoint (model.safetensors) serves as well: the fine-tune's own.
    again = run_script(tmp_path, "--engine", "torch", "--steps", "1", "--init-from",
                       str(tmp_path / "tune" / "checkpoint"), "--out", str(tmp_path / "again"))
    assert again.returncode == 0, again.stderr[-3000:]
    assert json.loads((tmp_path / "again" / "metrics.json").read_text())["init_from"].endswith(
        "tune/checkpoint/global_step3/model.safetensors")
    bad = tmp_path / "bad.safetensors"
    bad.write_text("{}")
    refused = run_script(tmp_path, "--steps", "1", "--init-from", str(bad), "--out", str(tmp_path / "bad"), timeout=120)
    assert refused.returncode == 1
    (line,) = refused.stderr.strip().splitlines()
    assert line.startswith(f"train_gpt.py: --init-from: {bad} is not a readable safetensors file (")
