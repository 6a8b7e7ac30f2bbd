"""A checkpoint resumed with its optimizer on the other placement: saved with
``offload_optimizer.device`` "cpu" and loaded where it is "nvme", and the
reverse. The resumed run must be the run that never stopped, bit for bit
(both placements step with the same kernel), and a load that cannot be
done changes nothing."""

import copy
import glob
import os

import pytest
import torch

import tierflow
from test_deepspeed_api import _engine, _same
from test_zero import stage2_config, tierflow_losses


def _state(engine):
    """A copy of the optimizer's whole state (read from NVMe when it lives there), with its param groups."""
    return copy.deepcopy(engine.optimizer.state_dict())


@pytest.mark.parametrize("saved,loaded", [("cpu", "nvme"), ("nvme", "cpu")], ids=["cpu_to_nvme", "nvme_to_cpu"])
@pytest.mark.parametrize("stage,precision", [(2, "fp32"), (3, "fp32"), (3, "bf16")])
def test_a_checkpoint_resumes_on_the_other_placement_as_if_never_stopped(tmp_path, saved, loaded, stage, precision):
    engine = _engine(tmp_path / "a", precision=precision, optimizer=saved, stage=stage, clip=0.0)
    try:
        tierflow_losses(engine, 3)
        engine.save_checkpoint(tmp_path / "ckpt")
        state_at_save = _state(engine)
        expected = tierflow_losses(engine, 2, first=3)
    finally:
        engine.close()
    engine = _engine(tmp_path / "b", precision=precision, optimizer=loaded, stage=stage, clip=0.0, seed=1)
    try:
        assert engine.runtime.state.on_nvme == (loaded == "nvme")
        engine.load_checkpoint(tmp_path / "ckpt")
        assert engine.global_steps == 3
        _same(_state(engine), state_at_save, "the loaded optimizer state")
        assert tierflow_losses(engine, 2, first=3) == expected
    finally:
        engine.close()
    # The state read from NVMe went through a scratch store beside the checkpoint, removed after.
    assert glob.glob(str(tmp_path / "ckpt" / ".tierflow-moving-state-*")) == []


def test_a_corrupt_nvme_checkpoint_loaded_into_host_memory_is_refused_and_changes_nothing(tmp_path):
    engine = _engine(tmp_path / "a", optimizer="nvme", stage=2, clip=0.0)
    try:
        tierflow_losses(engine, 2)
        path = engine.save_checkpoint(tmp_path / "ckpt")
    finally:
        engine.close()
    blocks = sorted(glob.glob(os.path.join(path, "optimizer", "blocks-*.bin")))
    assert blocks, os.listdir(os.path.join(path, "optimizer"))
    middle = os.path.getsize(blocks[0]) // 2
    with open(blocks[0], "r+b") as f:  # one flipped byte, in some block's bytes
        f.seek(middle)
        byte = f.read(1)
        f.seek(middle)
        f.write(bytes([byte[0] ^ 0xFF]))
    engine = _engine(tmp_path / "b", optimizer="cpu", stage=2, clip=0.0, seed=1)
    try:
        tierflow_losses(engine, 1)
        weights = {k: v.clone() for k, v in engine.module.state_dict().items()}
        state = _state(engine)
        with pytest.raises(tierflow.TierflowError, match=r"checksum mismatch \(corrupt data file blocks-"):
            engine.load_checkpoint(tmp_path / "ckpt")
        _same(engine.module.state_dict(), weights, "the weights")
        _same(_state(engine), state, "the optimizer state")
        assert engine.global_steps == 1
    finally:
        engine.close()
    assert glob.glob(str(tmp_path / "ckpt" / ".tierflow-moving-state-*")) == []


_ZENFLOW = {"topk_ratio": 0.25, "update_interval": 2, "select_interval": 2, "overlap_step": True}


def _zenflow_engine(tmp_path, where, stage, precision, seed=0):
    """TinyLM under ZenFlow, its windowed state in host memory or on NVMe."""
    from test_zero import TinyLM, ds_config, model_bytes

    if stage == 2:
        config = stage2_config(tmp_path / "nvme" if where == "nvme" else None, zenflow=dict(_ZENFLOW))
    else:
        config = ds_config(tmp_path / "nvme", device_memory=model_bytes(TinyLM()) // 3)
        config["zero_optimization"]["zenflow"] = dict(_ZENFLOW)
        if where == "cpu":
            config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    config["gradient_clipping"] = 0.0
    if precision != "fp32":
        config[precision] = {"enabled": True}
    torch.manual_seed(seed)
    engine, *_ = tierflow.initialize(model=TinyLM(), config=config)
    return engine


@pytest.mark.parametrize("saved,loaded", [("cpu", "nvme"), ("nvme", "cpu")], ids=["cpu_to_nvme", "nvme_to_cpu"])
@pytest.mark.parametrize("stage,precision", [(2, "fp32"), (3, "bf16")], ids=["stage2-in-place", "stage3-bf16"])
def test_a_zenflow_checkpoint_resumes_on_the_other_placement_as_one_kept_in_host_memory(tmp_path, saved, loaded,
                                                                                         stage, precision):
    """ZenFlow's state saved on one placement and loaded on the other (a
    window open at the save) resumes as a checkpoint saved and loaded in
    host memory does, bit for bit: both placements train to the same bits,
    and either way the state arrives as ZenFlow's state_dict (the moments at
    the device's count, the selection, the trigger; a bf16 run's masters)."""
    runs = {}
    for name, (first, then) in {"reference": ("cpu", "cpu"), "moved": (saved, loaded)}.items():
        engine = _zenflow_engine(tmp_path / name / "a", first, stage, precision)
        try:
            tierflow_losses(engine, 3)
            engine.save_checkpoint(tmp_path / name / "ckpt")
        finally:
            engine.close()
        engine = _zenflow_engine(tmp_path / name / "b", then, stage, precision, seed=1)
        try:
            assert engine.runtime.state.on_nvme == (then == "nvme")
            engine.load_checkpoint(tmp_path / name / "ckpt")
            assert engine.global_steps == 3
            runs[name] = (tierflow_losses(engine, 4, first=3), engine.module.state_dict())
        finally:
            engine.close()
        assert glob.glob(str(tmp_path / name / "ckpt" / ".tierflow-moving-state-*")) == []
    assert runs["moved"][0] == runs["reference"][0]
    _same(runs["moved"][1], runs["reference"][1], "the weights")


@pytest.mark.parametrize("saved,loaded", [("cpu", "nvme"), ("nvme", "cpu")], ids=["cpu_to_nvme", "nvme_to_cpu"])
@pytest.mark.parametrize("stage,precision", [(2, "fp32"), (3, "fp32"), (3, "bf16")])
def test_a_muon_checkpoint_resumes_on_the_other_placement_as_if_never_stopped(tmp_path, saved, loaded, stage,
                                                                              precision):
    """Muon's and AdamW's parts saved on one placement and loaded on the
    other: the run that never stopped, bit for bit (both placements step
    each part with the same kernel), the momentum buffers and a bf16 run's
    masters carried."""
    from test_zero_muon import SmallLM, batches, config, engine_losses

    data = batches(12)

    def make(where, name, seed=0):
        cfg = config(tmp_path / name, stage, where, clip=0.0)
        if precision == "bf16":
            cfg["bf16"] = {"enabled": True}
        torch.manual_seed(seed)
        engine, *_ = tierflow.initialize(model=SmallLM(), config=cfg)
        return engine

    engine = make(saved, "a")
    try:
        engine_losses(engine, 3, data=data)
        engine.save_checkpoint(tmp_path / "ckpt")
        state_at_save = _state(engine)
        expected = engine_losses(engine, 3, first=3, data=data)
    finally:
        engine.close()
    engine = make(loaded, "b", seed=1)
    try:
        assert engine.runtime.state.on_nvme == (loaded == "nvme")
        engine.load_checkpoint(tmp_path / "ckpt")
        _same(_state(engine), state_at_save, "the loaded optimizer state")
        assert engine_losses(engine, 3, first=3, data=data) == expected
    finally:
        engine.close()
    assert glob.glob(str(tmp_path / "ckpt" / ".tierflow-moving-state-*")) == []
