"""The engine as DeepSpeed's where a script or Hugging Face's Trainer calls
it: the engine's queries, ``load_checkpoint``'s arguments and meaning, the
step counters, checkpoints that load as plain data and are checked before
anything changes, the files DeepSpeed's ``zero_to_fp32.py`` reads, the
Trainer's calls (and the Trainer itself), and
``GatheredParameters(modifier_rank=r)`` over two ranks."""

import copy
import inspect
import json
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn as nn

import tierflow
from tierflow.zero.engine import Engine

from test_zero import TinyLM, batches, ds_config, make_engine, model_bytes, stage2_config, tierflow_losses


def _engine(tmp_path, *, precision="fp32", optimizer="nvme", stage=3, clip=1.0, seed=0, model=None, **extra):
    """An engine over TinyLM (or ``model``): ``precision`` fp32/bf16/fp16, the
    optimizer's state on ``optimizer`` ("nvme" or "cpu")."""
    torch.manual_seed(seed)
    model = model if model is not None else TinyLM()
    if stage == 3:
        config = ds_config(tmp_path / "nvme", device_memory=max(model_bytes(model) // 3, 200_000), clip=clip, **extra)
        if optimizer == "cpu":
            config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    else:
        config = stage2_config(tmp_path / "nvme" if optimizer == "nvme" else None)
        config["gradient_clipping"] = clip
        config.update(extra)
    if precision != "fp32":
        config[precision] = {"enabled": True}
    engine, *_ = tierflow.initialize(model=model, config=config)
    return engine


def _same(a, b, where="state"):
    """Whether two nested states (dicts, lists, tensors, numbers) are equal, element by element."""
    if torch.is_tensor(a) or torch.is_tensor(b):
        assert torch.is_tensor(a) and torch.is_tensor(b), where
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for k in a:
            _same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def _snapshot(engine):
    """The model's state_dict and the optimizer's state, copied."""
    return ({k: v.clone() for k, v in engine.module.state_dict().items()},
            copy.deepcopy(engine.optimizer.state_dict()))


# ---- the engine's queries -------------------------------------------------------------------------

def test_the_engine_answers_deepspeeds_queries_as_deepspeed(tmp_path):
    """DeepSpeed's methods and attributes, with its meaning: the batch
    figures are methods (Trainer calls gradient_accumulation_steps()), the
    norm is the gradients' before clipping, was_step_applied() says whether
    the last step() updated the parameters."""
    engine = _engine(tmp_path)
    try:
        assert engine.gradient_accumulation_steps() == 2
        assert engine.train_micro_batch_size_per_gpu() == 4
        assert engine.train_batch_size() == 4 * 2 * 1
        assert engine.world_size == 1 and engine.global_rank == 0
        assert engine.local_rank == int(os.environ.get("LOCAL_RANK", 0))
        cuda = engine.runtime.params.store.device_is_cuda
        assert engine.device == (torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu"))
        assert engine.zero_optimization_stage() == 3
        assert not engine.bfloat16_enabled() and not engine.fp16_enabled()
        assert engine.get_global_grad_norm() is None and not engine.was_step_applied()

        # The first boundary's norm is torch's over the same two micro-batches.
        torch.manual_seed(0)
        reference = TinyLM()
        data = batches(2)
        for x, y in data:
            (reference(x, y) / 2).backward()
        norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0).item()
        x, y = data[0]
        engine.backward(engine(x, y))
        engine.step()
        assert not engine.was_step_applied() and engine.global_steps == 0
        x, y = data[1]
        engine.backward(engine(x, y))
        engine.step()
        assert engine.was_step_applied() and engine.global_steps == 1
        assert engine.get_global_grad_norm() == pytest.approx(norm, rel=1e-5)
    finally:
        engine.close()
    bf16 = _engine(tmp_path / "bf16", precision="bf16", stage=2, optimizer="cpu")
    try:
        assert bf16.bfloat16_enabled() and bf16.zero_optimization_stage() == 2 and bf16.device.type == "cpu"
    finally:
        bf16.close()


def test_a_skipped_fp16_step_counts_in_global_steps_and_leaves_the_schedule_as_deepspeeds_does(tmp_path):
    """DeepSpeed's _take_model_step: an overflow adds to skipped_steps and to
    global_steps, and the lr scheduler does not step."""
    schedule = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 3e-3, "warmup_num_steps": 10,
                                               "warmup_type": "linear"}}
    engine = _engine(tmp_path, precision="fp16", fp16={"enabled": True, "initial_scale_power": 8},
                     scheduler=schedule)
    try:
        assert engine.lr_scheduler.last_epoch == 0
        x, y = batches(1)[0]
        engine.backward(engine(x, y))
        engine.step()
        engine.backward(engine(x, y) * float("inf"))  # the boundary's gradients overflow
        with pytest.warns(RuntimeWarning, match="overflow"):
            engine.step()
        assert engine.skipped_steps == 1 and engine.global_steps == 1 and not engine.was_step_applied()
        assert engine.lr_scheduler.last_epoch == 0  # the schedule did not move
        for _ in range(2):
            engine.backward(engine(x, y))
            engine.step()
        assert engine.skipped_steps == 1 and engine.global_steps == 2 and engine.was_step_applied()
        assert engine.lr_scheduler.last_epoch == 1  # one step of the schedule, for the one applied
    finally:
        engine.close()


def test_set_gradient_accumulation_boundary_drives_the_step_as_accelerate_does(tmp_path):
    """accelerate sets the boundary before every backward and calls step()
    only at it: the same updates as the micro-step count's."""
    reference, _ = make_engine(tmp_path / "a")
    try:
        expected = tierflow_losses(reference, 3)
        want = {k: v.clone() for k, v in reference.module.state_dict().items()}
    finally:
        reference.close()
    engine, _ = make_engine(tmp_path / "b")
    try:
        data, losses = batches(6), []
        for i, (x, y) in enumerate(data):
            boundary = i % 2 == 1
            engine.set_gradient_accumulation_boundary(boundary)
            assert engine.is_gradient_accumulation_boundary() == boundary
            loss = engine(x, y)
            engine.backward(loss)
            if boundary:
                engine.step()
                assert engine.was_step_applied()
            losses.append(loss.item())
        assert losses == expected and engine.global_steps == 3
        _same({k: v for k, v in engine.module.state_dict().items()}, want)
    finally:
        engine.close()


# ---- load_checkpoint's arguments -------------------------------------------------------------------

def test_load_checkpoint_takes_deepspeeds_arguments_in_deepspeeds_order(tmp_path):
    ours = list(inspect.signature(Engine.load_checkpoint).parameters)
    expected = ["self", "load_dir", "tag", "load_module_strict", "load_optimizer_states", "load_lr_scheduler_states",
                "load_module_only", "custom_load_fn"]
    assert ours == expected
    try:
        from deepspeed.runtime.engine import DeepSpeedEngine
    except Exception:  # DeepSpeed is optional: the list above is its 0.19 signature
        pass
    else:
        assert ours == list(inspect.signature(DeepSpeedEngine.load_checkpoint).parameters)
        save = list(inspect.signature(DeepSpeedEngine.save_checkpoint).parameters)
        assert list(inspect.signature(Engine.save_checkpoint).parameters) == save
    engine = _engine(tmp_path)
    try:
        tierflow_losses(engine, 1)
        engine.save_checkpoint(tmp_path / "ckpt")
        with pytest.raises(ValueError, match="custom_load_fn: not taken"):
            engine.load_checkpoint(tmp_path / "ckpt", custom_load_fn=lambda src, dst: None)
        with pytest.warns(RuntimeWarning, match="no 'latest' file"):
            assert engine.load_checkpoint(tmp_path / "elsewhere") == (None, None)
        with pytest.raises(ValueError, match="save_filename: 'pytorch_model.bin'"):
            engine.save_16bit_model(tmp_path / "export", "pytorch_model.bin")
    finally:
        engine.close()


@pytest.mark.parametrize("optimizer", ["cpu", "nvme"])
def test_a_stage_3_bf16_run_resumes_bit_for_bit(tmp_path, optimizer):
    """The fp32 masters come back as saved: the optimizer's own load, made for
    a parameter that holds its values, remade them from the placeholder a
    parameter in the store holds (a loss of 4.2 after the resume, where the
    run without one had 1.2)."""
    engine = _engine(tmp_path / "a", precision="bf16", optimizer=optimizer, clip=0.0)
    try:
        tierflow_losses(engine, 3)
        engine.save_checkpoint(tmp_path / "ckpt")
        expected = tierflow_losses(engine, 2, first=3)
    finally:
        engine.close()
    engine = _engine(tmp_path / "b", precision="bf16", optimizer=optimizer, clip=0.0)
    try:
        engine.load_checkpoint(tmp_path / "ckpt")
        assert engine.global_steps == 3
        assert tierflow_losses(engine, 2, first=3) == expected
    finally:
        engine.close()


@pytest.mark.parametrize("optimizer", ["cpu", "nvme"])
def test_load_module_only_loads_the_weights_alone_and_the_masters_follow_them(tmp_path, optimizer):
    """DeepSpeed's load_module_only (Trainer's warm start): the weights
    change, the optimizer's moments, the schedule and the counters do not,
    and the fp32 masters start again from the loaded bf16 weights — else the
    next step writes the old masters' values back."""
    source = _engine(tmp_path / "a", precision="bf16", optimizer=optimizer, seed=1)
    try:
        tierflow_losses(source, 3)
        source.save_checkpoint(tmp_path / "ckpt", client_state={"note": "three steps"})
        saved = {k: v.clone() for k, v in source.module.state_dict().items()}
    finally:
        source.close()
    engine = _engine(tmp_path / "b", precision="bf16", optimizer=optimizer, seed=0)
    try:
        tierflow_losses(engine, 1, data=batches(2, seed=5))
        before = copy.deepcopy({i: {k: v for k, v in s.items() if k != "master_param"}
                                for i, s in engine.optimizer.state_dict()["state"].items()})
        path, client = engine.load_checkpoint(tmp_path / "ckpt", load_optimizer_states=False,
                                              load_lr_scheduler_states=False, load_module_only=True)
        assert client == {"note": "three steps"} and os.path.basename(path) == "global_step3"
        assert engine.global_steps == 1 and engine.micro_steps == 2  # its own counters
        _same(engine.module.state_dict(), saved, "weights")
        after = {i: {k: v for k, v in s.items() if k != "master_param"}
                 for i, s in engine.optimizer.state_dict()["state"].items()}
        _same(after, before, "moments")
        import safetensors.torch

        exported = safetensors.torch.load_file(engine.save_fp32_model(tmp_path / "export"))
        assert exported.keys() == {k for k in saved if k != "head.weight"}
        for name, value in exported.items():  # the masters are the loaded weights, widened
            assert torch.equal(value, saved[name].to(torch.float32)), name
        tierflow_losses(engine, 1, data=batches(2, seed=5))
        moved = max((engine.module.state_dict()[k].float() - v.float()).abs().max().item() for k, v in saved.items())
        assert 0 < moved < 0.05  # one step from the loaded weights (lr 3e-3), not back to its own
    finally:
        engine.close()


class _WithFrozen(TinyLM):
    """TinyLM with a frozen parameter (as LoRA's base weights) and a
    persistent buffer in the forward."""

    def __init__(self):
        super().__init__()
        self.frozen = nn.Parameter(torch.randn(64) * 0.1, requires_grad=False)
        self.register_buffer("shift", torch.linspace(-0.1, 0.1, 64))

    def forward(self, x, y):
        h = self.emb(x)
        h = h + (self.frozen + self.shift).to(h.dtype)
        for b in self.blocks:
            h = b(h)
        logits = self.head(self.ln(h))
        return nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))


def test_load_module_strict_false_loads_what_both_hold_as_torchs_strict_false(tmp_path):
    """Trainer with PEFT saves with exclude_frozen_parameters=True and loads
    with load_module_strict=False: the frozen parameter keeps its value, the
    rest (buffers too) are loaded; strict names what is missing."""
    source = _engine(tmp_path / "a", model=_WithFrozen(), seed=1)
    try:
        tierflow_losses(source, 2)
        with torch.no_grad():
            source.module.shift.add_(1.0)
        source.save_checkpoint(tmp_path / "ckpt", exclude_frozen_parameters=True)
        saved = {k: v.clone() for k, v in source.module.state_dict().items()}
    finally:
        source.close()
    engine = _engine(tmp_path / "b", model=_WithFrozen(), seed=0)
    try:
        frozen = engine.module.state_dict()["frozen"].clone()
        with pytest.raises(ValueError, match=r"does not hold this model's parameters and buffers: missing 'frozen'"):
            engine.load_checkpoint(tmp_path / "ckpt")
        engine.load_checkpoint(tmp_path / "ckpt", load_module_strict=False)
        now = engine.module.state_dict()
        assert torch.equal(now["frozen"], frozen) and not torch.equal(frozen, saved["frozen"])
        for name, value in saved.items():
            if name != "frozen":
                assert torch.equal(now[name], value), name
        assert engine.global_steps == 2
    finally:
        engine.close()
    # A shape that differs is refused even so.
    other = _engine(tmp_path / "c", model=TinyLM(d=32))
    try:
        with pytest.raises(ValueError, match=r"holds 'emb.weight' as \[64, 64\] F32, the model's is \[64, 32\] F32"):
            other.load_checkpoint(tmp_path / "ckpt", load_module_strict=False)
    finally:
        other.close()


# ---- checkpoints as plain data, checked before anything changes -------------------------------------

class _Runs:
    """An object whose unpickling makes a directory: code a checkpoint file could run."""

    def __init__(self, where):
        self.where = where

    def __reduce__(self):
        return (os.mkdir, (self.where,))


@pytest.mark.parametrize("victim", ["engine.pt", "optimizer.pt"])
def test_a_checkpoint_file_that_would_run_code_is_refused_and_nothing_runs(tmp_path, victim):
    engine = _engine(tmp_path, optimizer="cpu")
    try:
        tierflow_losses(engine, 1)
        path = engine.save_checkpoint(tmp_path / "ckpt")
        marker = str(tmp_path / "ran")
        file = os.path.join(path, victim)
        state = torch.load(file, weights_only=True)
        key = "client_state" if victim == "engine.pt" else "param_groups"
        state[key] = [_Runs(marker)] + ([] if victim == "engine.pt" else state[key])
        torch.save(state, file)
        torch.load(file, weights_only=False)  # the payload is live: an unsafe load runs it
        assert os.path.isdir(marker)
        os.rmdir(marker)
        tierflow_losses(engine, 1, first=1)  # the engine moves on; the load must not move it back
        before = _snapshot(engine)
        with pytest.raises(ValueError, match=rf"load_checkpoint: {re.escape(file)} .*was not loaded"):
            engine.load_checkpoint(tmp_path / "ckpt")
        assert not os.path.exists(marker)
        _same(_snapshot(engine), before)
    finally:
        engine.close()


def test_save_refuses_a_client_state_a_plain_load_could_not_read_before_writing(tmp_path):
    engine = _engine(tmp_path)
    try:
        with pytest.raises(ValueError, match="client_state: holds an object a checkpoint cannot keep"):
            engine.save_checkpoint(tmp_path / "ckpt", client_state={"sampler": _Runs(str(tmp_path / "x"))})
        assert not (tmp_path / "ckpt").exists()
    finally:
        engine.close()


def _rewrite_engine_pt(path, **changes):
    file = os.path.join(path, "engine.pt")
    state = torch.load(file, weights_only=True)
    state.update(changes)
    torch.save(state, file)


@pytest.mark.parametrize("fault", ["world_size", "missing_optimizer", "other_model", "truncated_model",
                                   "no_schedule"])
def test_a_load_that_fails_its_checks_leaves_the_model_and_the_optimizer_as_they_were(tmp_path, fault):
    """Every check runs before the first write: the model's values (loaded
    first) and the optimizer's state are exactly as before the call. Before
    the checks moved, a checkpoint of another world size overwrote the model
    and then raised."""
    model = TinyLM(layers=3) if fault == "other_model" else None
    source = _engine(tmp_path / "a", model=model, seed=1)
    try:
        tierflow_losses(source, 2)
        path = source.save_checkpoint(tmp_path / "ckpt")
    finally:
        source.close()
    if fault == "world_size":
        _rewrite_engine_pt(path, world_size=2)
        match = "holds the optimizer state of 2 ranks, this run has 1"
    elif fault == "missing_optimizer":
        os.remove(os.path.join(path, "optimizer", "manifest.json"))
        match = r"optimizer/manifest.json is missing"
    elif fault == "other_model":
        match = r"does not hold this model's parameters and buffers: missing 'blocks.3.ln.weight'"
    elif fault == "truncated_model":
        file = os.path.join(path, "model.safetensors")
        os.truncate(file, os.path.getsize(file) - 8)
        match = r"model.safetensors is truncated \('ln.bias' ends past"
    else:
        _rewrite_engine_pt(path, lr_scheduler=None)
        match = "holds no lr scheduler state and this engine has a scheduler"
    schedule = {"type": "WarmupLR", "params": {"warmup_num_steps": 4}} if fault == "no_schedule" else None
    engine = _engine(tmp_path / "b", **({"scheduler": schedule} if schedule else {}))
    try:
        tierflow_losses(engine, 1, data=batches(2, seed=7))
        before = _snapshot(engine)
        counters = (engine.global_steps, engine.micro_steps, engine.skipped_steps)
        with pytest.raises((ValueError, FileNotFoundError), match=match):
            engine.load_checkpoint(tmp_path / "ckpt")
        _same(_snapshot(engine), before)
        assert (engine.global_steps, engine.micro_steps, engine.skipped_steps) == counters
        if fault == "world_size":  # the model alone loads, as the message says
            engine.load_checkpoint(tmp_path / "ckpt", load_optimizer_states=False)
            assert not torch.equal(engine.module.state_dict()["emb.weight"], before[0]["emb.weight"])
    finally:
        engine.close()


# ---- DeepSpeed's zero_to_fp32 ----------------------------------------------------------------------------

def _zero_to_fp32():
    try:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    except Exception as e:  # optional: scripts/setup.sh --bench installs it
        pytest.skip(f"deepspeed is not importable ({type(e).__name__}: {e}); its zero_to_fp32 reads these files")
    return get_fp32_state_dict_from_zero_checkpoint


@pytest.mark.parametrize("stage,precision,optimizer", [(3, "bf16", "cpu"), (3, "bf16", "nvme"), (3, "fp32", "nvme"),
                                                       (2, "bf16", "cpu"), (2, "fp32", "nvme")])
def test_deepspeeds_zero_to_fp32_reads_the_engines_fp32_masters(tmp_path, stage, precision, optimizer):
    """get_fp32_state_dict_from_zero_checkpoint(save_dir) gives every
    parameter's fp32 master (bf16: the optimizer's, not the bf16 weights
    widened), the frozen one, the buffer and the tied head."""
    read = _zero_to_fp32()
    engine = _engine(tmp_path, model=_WithFrozen(), stage=stage, precision=precision, optimizer=optimizer)
    try:
        tierflow_losses(engine, 3)
        engine.save_checkpoint(tmp_path / "ckpt")
        import safetensors.torch

        masters = safetensors.torch.load_file(engine.save_fp32_model(tmp_path / "export"))
        weights = {k: v.clone() for k, v in engine.module.state_dict().items()}
    finally:
        engine.close()
    files = sorted(os.listdir(tmp_path / "ckpt" / "global_step3"))
    prefix = "bf16_" if precision == "bf16" else ""
    model_states = "zero_pp_rank_0_mp_rank_00_model_states.pt" if stage == 3 else "mp_rank_00_model_states.pt"
    assert f"{prefix}zero_pp_rank_0_mp_rank_00_optim_states.pt" in files and model_states in files
    for name in files:  # DeepSpeed's files load as plain data too
        if name.endswith("_states.pt"):
            torch.load(tmp_path / "ckpt" / "global_step3" / name, weights_only=True)
    got = read(str(tmp_path / "ckpt"))
    assert set(got) == set(weights)
    for name, value in masters.items():
        if name == "frozen":  # DeepSpeed keeps a frozen parameter as it is (its compute dtype)
            assert torch.equal(got[name], weights[name]), name
        else:
            assert got[name].dtype == torch.float32 and torch.equal(got[name], value), name
    assert torch.equal(got["head.weight"], got["emb.weight"]) and torch.equal(got["shift"], weights["shift"])
    if precision == "bf16":  # the masters hold bits the bf16 weights do not
        assert any(not torch.equal(masters[k], weights[k].float()) for k in masters if k != "frozen")
    _same_as_zero_to_fp32(tmp_path / "ckpt", tmp_path / "consolidated", got)


def _same_as_zero_to_fp32(ckpt, out, got):
    """tierflow.zero.consolidate's file holds what zero_to_fp32 gives, a
    tied parameter once (under its first name), a frozen one in fp32."""
    import safetensors.torch

    from tierflow.zero.consolidate import consolidate

    consolidate(ckpt, out)
    joined = safetensors.torch.load_file(os.path.join(out, "model.safetensors"))
    assert set(joined) == set(got) - {"head.weight"}
    for name, value in joined.items():
        assert value.dtype == torch.float32 and torch.equal(value, got[name].float()), name


# ---- Hugging Face's Trainer ------------------------------------------------------------------------------

def test_the_calls_hugging_faces_trainer_makes_train_save_and_resume_as_deepspeeds(tmp_path):
    """The Trainer cannot take a tierflow engine itself: accelerate builds the
    engine by calling deepspeed.initialize (accelerate/accelerator.py
    _prepare_deepspeed), and the Trainer's save_model reads
    ``engine.config.get(...)`` (transformers/trainer.py:4114), DeepSpeed's
    config dict. So this drives the engine through the very functions the
    Trainer runs on a DeepSpeed engine, from transformers 5.24 and
    accelerate 1.16:

    - accelerate/utils/deepspeed.py:264-281, DeepSpeedEngineWrapper.backward:
      ``engine.set_gradient_accumulation_boundary(is_boundary=...)``,
      ``engine.backward(loss)``, ``engine.step()`` at the boundary only
      (trainer.py:1941 ``self.optimizer.step()`` is the wrapper's no-op);
    - accelerate/utils/deepspeed.py:286-292 and accelerator.py:2926-2929,
      ``engine.get_global_grad_norm()`` for the logged grad_norm;
    - accelerate/utils/deepspeed.py:315-318, ``hasattr(optimizer, "overflow")``;
    - trainer.py:3552-3561, _save_optimizer_and_scheduler:
      ``inspect.signature(engine.save_checkpoint)`` has
      ``exclude_frozen_parameters``, then ``engine.save_checkpoint(output_dir)``;
    - accelerator.py:3943-3963, get_state_dict for save_model:
      ``engine.zero_gather_16bit_weights_on_model_save()`` and
      ``engine._zero3_consolidated_16bit_state_dict()``;
    - trainer.py:1811 (resume) and 3753 (best model), through
      integrations/deepspeed.py:680-701 deepspeed_load_checkpoint:
      ``engine.load_checkpoint(path, load_module_strict=..., load_optimizer_states=True,
      load_lr_scheduler_states=True)``;
    - trainer.py:1431, ``lr_scheduler.get_last_lr()``; accelerator.py:3854
      free_memory, ``engine.destroy()``.
    """
    try:
        from accelerate.utils.deepspeed import DeepSpeedEngineWrapper
        from transformers.integrations.deepspeed import deepspeed_load_checkpoint
    except Exception as e:
        pytest.skip(f"transformers and accelerate are not importable ({type(e).__name__}: {e})")
    schedule = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 3e-3, "warmup_num_steps": 4}}
    reference = _engine(tmp_path / "ref", scheduler=schedule)
    try:
        expected = tierflow_losses(reference, 6)
    finally:
        reference.close()

    def train(engine, first, steps):
        wrapped, losses, norms = DeepSpeedEngineWrapper(engine), [], []
        data = batches((first + steps) * 2)
        for step in range(first, first + steps):
            for micro in range(2):
                x, y = data[step * 2 + micro]
                loss = engine(x, y)
                wrapped.backward(loss, sync_gradients=micro == 1)
                losses.append(loss.item())
            norms.append(wrapped.get_global_grad_norm())
            # DeepSpeedOptimizerWrapper reads the optimizer's overflow, as DeepSpeed's optimizers give it:
            # no step was skipped, so the Trainer's (no-op) scheduler wrapper steps; the engine's
            # scheduler is stepped by step()
            assert engine.optimizer.overflow is False
            assert engine.lr_scheduler.get_last_lr() == engine.get_lr()
        return losses, norms

    engine = _engine(tmp_path / "a", scheduler=schedule)
    try:
        losses, norms = train(engine, 0, 3)
        assert all(isinstance(n, float) and n > 0 for n in norms)
        assert "exclude_frozen_parameters" in inspect.signature(engine.save_checkpoint).parameters
        output_dir = tmp_path / "out" / "checkpoint-3"
        engine.save_checkpoint(str(output_dir))
        assert not engine.zero_gather_16bit_weights_on_model_save()
        whole = engine._zero3_consolidated_16bit_state_dict()
        _same(whole, dict(engine.module.state_dict()))
        engine.destroy()
        assert engine._closed
    finally:
        engine.close()
    engine = _engine(tmp_path / "b", scheduler=schedule)
    try:
        deepspeed_load_checkpoint(engine, str(output_dir), load_module_strict=True)
        assert engine.global_steps == 3
        resumed, _ = train(engine, 3, 3)
        assert losses + resumed == expected
        with pytest.raises(ValueError, match="Can't find a valid checkpoint"):
            deepspeed_load_checkpoint(engine, str(tmp_path / "nothing"))
    finally:
        engine.close()


_TRAINER = textwrap.dedent("""
    import json, os, sys, torch
    import deepspeed
    import tierflow
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    out = sys.argv[1]

    def initialize(model=None, optimizer=None, model_parameters=None, lr_scheduler=None, config=None,
                   config_params=None, **rest):
        # accelerate's _prepare_deepspeed calls deepspeed.initialize with the
        # config the Trainer resolved ("auto" filled in): tierflow's engine instead.
        assert not rest, rest
        return tierflow.initialize(model=model, model_parameters=model_parameters, config=dict(config or config_params),
                                   lr_scheduler=lr_scheduler, optimizer=optimizer)

    deepspeed.initialize = initialize
    g = torch.Generator().manual_seed(0)
    rows = [torch.randint(0, 64, (16,), generator=g) for _ in range(32)]

    class Rows(torch.utils.data.Dataset):
        def __len__(self):
            return len(rows)

        def __getitem__(self, i):
            return {{"input_ids": rows[i], "labels": rows[i]}}

    ds = {{"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
           "train_batch_size": "auto", "gradient_clipping": "auto",
           "optimizer": {{"type": "AdamW", "params": {{"lr": "auto", "betas": "auto", "eps": "auto",
                                                      "weight_decay": "auto"}}}},
           "zero_optimization": {{"stage": 3, "offload_param": {{"device": "cpu"}},
                                  "offload_optimizer": {{"device": "cpu"}}}},
           "tierflow": {{"device_memory": 1 << 20, "host_memory": 64 << 20}}}}

    def run(steps, resume=None):
        torch.manual_seed(0)
        model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16,
                                           resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
        args = TrainingArguments(output_dir=os.path.join(out, "run"), per_device_train_batch_size=2,
                                 gradient_accumulation_steps=2, max_steps=steps, learning_rate=3e-3,
                                 deepspeed=ds, use_cpu=True, report_to=[], save_steps=2, logging_steps=1,
                                 save_only_model=False)
        trainer = Trainer(model=model, args=args, train_dataset=Rows())
        trainer.train(resume_from_checkpoint=resume)
        losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
        return trainer, losses

    result = {{}}
    try:
        trainer, result["whole"] = run(4)
        result["checkpoint"] = sorted(os.listdir(os.path.join(out, "run", "checkpoint-2")))
        result["global_steps"] = trainer.model_wrapped.global_steps
        trainer, result["resumed"] = run(4, resume=os.path.join(out, "run", "checkpoint-2"))
        result["resumed_global_steps"] = trainer.model_wrapped.global_steps
    except Exception as e:
        result["error"] = f"{{type(e).__name__}}: {{e}}"
    print(json.dumps(result))
""")


def test_hugging_faces_trainer_trains_saves_and_resumes_through_the_engine(tmp_path):
    """The Trainer itself, with accelerate's one call of deepspeed.initialize
    routed to tierflow.initialize (what a plugin for accelerate would do): it
    trains a small GPT-2 at stage 3, saves a checkpoint and resumes from it
    to the losses of the run that never stopped."""
    try:
        import accelerate  # noqa: F401
        import deepspeed  # noqa: F401
        import transformers  # noqa: F401
    except Exception as e:
        pytest.skip(f"transformers, accelerate and deepspeed are needed ({type(e).__name__}: {e})")
    script = tmp_path / "trainer.py"
    script.write_text(_TRAINER.format())
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(29500 + os.getpid() % 1000), "RANK": "0",
           "WORLD_SIZE": "1", "LOCAL_RANK": "0", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(script), str(tmp_path)], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    error = result.get("error", "")
    # What the engine still lacks of DeepSpeed's for the Trainer: the Trainer
    # divides the loss itself and calls backward(loss, scale_wrt_gas=False)
    # (trainer.py:2122), and its save_model reads engine.config.get(...)
    # (trainer.py:4114), DeepSpeed's config dict.
    if "unexpected keyword argument 'scale_wrt_gas'" in error or "'Config' object has no attribute 'get'" in error:
        pytest.xfail(f"the engine lacks what the Trainer calls: {error}")
    assert not error, error
    assert len(result["whole"]) == 4 and result["global_steps"] == 4
    assert "global_step2" in result["checkpoint"] and "latest" in result["checkpoint"]
    assert result["resumed_global_steps"] == 4
    assert result["resumed"][-2:] == result["whole"][-2:]


# ---- two ranks ----------------------------------------------------------------------------------------------

_TWO_RANKS = textwrap.dedent("""
    import json, os, sys, torch
    import tierflow
    from tierflow.zero import GatheredParameters
    from test_zero import TinyLM, ds_config, batches, model_bytes

    out, root = sys.argv[1], sys.argv[2]
    torch.distributed.init_process_group("gloo")
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    model = TinyLM()
    config = ds_config(os.path.join(root, "nvme"), device_memory=model_bytes(model) // 2, clip=0.0)
    config["bf16"] = {{"enabled": True}}
    engine, *_ = tierflow.initialize(model=model, config=config)
    result = {{"world": engine.world_size, "rank": engine.global_rank, "local_rank": engine.local_rank,
               "train_batch_size": engine.train_batch_size()}}
    w = engine.module.blocks[0].up.weight
    for modifier in (1, 0):
        with GatheredParameters([w], modifier_rank=modifier):
            with torch.no_grad():
                w.fill_(float(10 * modifier + rank + 1))  # each rank writes its own value
        result[f"seen_after_modifier_{{modifier}}"] = engine.module.state_dict()["blocks.0.up.weight"].unique().tolist()
    try:
        with GatheredParameters([w], modifier_rank=2):
            pass
    except ValueError as e:
        result["bad_rank"] = str(e)
    data = batches(4, seed=rank)
    for x, y in data:
        engine.backward(engine(x, y))
        engine.step()
    engine.save_checkpoint(os.path.join(root, "ckpt"))
    engine.save_fp32_model(os.path.join(root, "export"))
    result["files"] = sorted(os.listdir(os.path.join(root, "ckpt", "global_step2")))
    engine.close()
    with open(f"{{out}}.rank{{rank}}", "w") as f:
        json.dump(result, f)
    torch.distributed.destroy_process_group()
""")


def test_two_ranks_modifier_rank_broadcasts_its_edits_and_zero_to_fp32_joins_their_shards(tmp_path):
    """GatheredParameters(modifier_rank=r) keeps rank r's writes on every
    rank (it kept rank 0's), and zero_to_fp32 joins the two ranks' master
    partitions into the whole fp32 model."""
    script = tmp_path / "two_ranks.py"
    script.write_text(_TWO_RANKS.format())
    out = tmp_path / "result.json"
    tests = os.path.dirname(__file__)
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([tests, os.path.dirname(os.path.dirname(tierflow.__file__)),
                                          os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(script), str(out), str(tmp_path)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"result.json.rank{r}").read_text()) for r in range(2)]
    for r, result in enumerate(ranks):
        assert result["world"] == 2 and result["rank"] == r and result["local_rank"] == r
        assert result["train_batch_size"] == 4 * 2 * 2
        assert result["seen_after_modifier_1"] == [12.0]  # rank 1's value, on both ranks
        assert result["seen_after_modifier_0"] == [1.0]
        assert "modifier_rank: 2 is not a rank of the 2" in result["bad_rank"]
    files = ranks[0]["files"]
    for r in range(2):
        assert f"bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt" in files
        assert f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" in files
    read = _zero_to_fp32()
    import safetensors.torch

    masters = safetensors.torch.load_file(tmp_path / "export" / "model_fp32.safetensors")
    got = read(str(tmp_path / "ckpt"))
    assert set(got) == set(masters) | {"head.weight"}
    for name, value in masters.items():
        assert torch.equal(got[name], value), name
    _same_as_zero_to_fp32(tmp_path / "ckpt", tmp_path / "consolidated", got)  # the two ranks' shards joined
