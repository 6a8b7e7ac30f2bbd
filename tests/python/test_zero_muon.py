"""The engine with ``optimizer.type: "Muon"`` (DeepSpeed's MuonWithAuxAdam:
Muon for the hidden matrices, AdamW for the rest) against a plain torch loop
over the same split: tierflow's two optimizers as MuonConfig.build makes
them (the same kernels: losses to fp32 rounding), and torch.optim.Muon with
torch.optim.AdamW (a measured tolerance: torch's Newton–Schulz rounds to
bf16 at other points than the kernel's, see test_muon.py). Stages 2 and 3,
the state in host memory and on NVMe, a checkpoint resume, and the cases
the engine refuses."""

import json

import pytest
import torch
import torch.nn as nn

import tierflow
from tierflow.config import from_deepspeed
from tierflow.torch.optim import muon_param_groups
from tierflow.zero.comm import Group
from tierflow.zero.muon import ShardedMuon

from test_zero import tierflow_losses
from zero_models import TiedLM

STEPS = 4
GAS = 2
MUON = {"type": "Muon", "params": {"muon_lr": 0.02, "adam_lr": 3e-3, "momentum": 0.95, "weight_decay": 0.01}}


class SmallLM(TiedLM):
    """An embedding tied to the LM head (AdamW's), two blocks whose Linears' weights are Muon's."""

    def __init__(self, vocab=32, d=32, layers=2):
        super().__init__(vocab, d, layers)


def batches(n, seed=3, vocab=32, batch=4, seq=8):
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randint(0, vocab, (batch, seq), generator=g) for _ in range(n)]
    return [(x, (3 * x + 1) % vocab) for x in xs]


def config(tmp_path, stage, state, clip=1.0, **extra):
    """A DeepSpeed config with the Muon section; ``state``: where
    offload_optimizer puts the state ("cpu" or "nvme")."""
    z = {"stage": stage, "offload_optimizer": {"device": state}}
    if state == "nvme":
        z["offload_optimizer"]["nvme_path"] = str(tmp_path / "nvme")
    if stage == 3:
        z["offload_param"] = {"device": "cpu"}
        z["stage3_param_persistence_threshold"] = 0
    c = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": GAS, "gradient_clipping": clip,
         "optimizer": MUON, "zero_optimization": z}
    c.update(extra)
    return c


def engine_losses(engine, steps=STEPS, first=0, data=None):
    """test_zero's loop over this module's batches (a vocabulary of 32)."""
    return tierflow_losses(engine, steps, gas=GAS, data=data or batches((first + steps) * GAS), first=first)


def plain_losses(make_optimizers, clip=1.0, steps=STEPS):
    """The same training in a plain loop, ``make_optimizers(model)`` giving the optimizers."""
    torch.manual_seed(0)
    model = SmallLM()
    optimizers = make_optimizers(model)
    data = batches(steps * GAS)
    losses = []
    for step in range(steps):
        for micro in range(GAS):
            x, y = data[step * GAS + micro]
            loss = model(x, y)
            (loss / GAS).backward()
            losses.append(loss.item())
        if clip > 0:
            clip_as_deepspeed(model.parameters(), clip)
        for opt in optimizers:
            opt.step()
            opt.zero_grad()
    return losses


def clip_as_deepspeed(params, clip):
    """DeepSpeed's clipping (the engine's): the global norm in fp64, the
    gradients times clip / (norm + 1e-6) when it exceeds ``clip``. Muon's
    bf16 Newton–Schulz turns a last-bit difference in a gradient (torch's
    clip_grad_norm_ sums its norm in fp32) into a visible one, so the
    reference clips as the engine does."""
    grads = [p.grad for p in params if p.grad is not None]
    norm = sum(float(torch.linalg.vector_norm(g, dtype=torch.float64)) ** 2 for g in grads) ** 0.5
    if norm > clip:
        for g in grads:
            g.mul_(clip / (norm + 1e-6))


def tierflow_pair(model):
    """MuonConfig.build's two optimizers (tierflow's Muon and AdamW)."""
    section = from_deepspeed({"train_micro_batch_size_per_gpu": 4, "optimizer": MUON}).optimizer
    return [o for o in section.build(model) if o is not None]


def torch_pair(model):
    """torch.optim.Muon and torch.optim.AdamW over the same split, with the section's values."""
    hidden, rest = muon_param_groups(model)
    p = MUON["params"]
    return [torch.optim.Muon(hidden, lr=p["muon_lr"], momentum=p["momentum"], weight_decay=p["weight_decay"],
                             nesterov=True, ns_steps=5),
            torch.optim.AdamW(rest, lr=p["adam_lr"], betas=(0.9, 0.95), eps=1e-10, weight_decay=p["weight_decay"])]


def make_engine(cfg):
    torch.manual_seed(0)
    engine, *_ = tierflow.initialize(model=SmallLM(), config=cfg)
    return engine


CASES = [(2, "cpu", 0.0), (2, "nvme", 0.0), (3, "cpu", 0.0), (3, "nvme", 0.0), (2, "cpu", 1.0), (3, "nvme", 1.0)]


@pytest.mark.parametrize("stage,state,clip", CASES,
                         ids=[f"stage{s}-{where}-{'clipped' if c else 'unclipped'}" for s, where, c in CASES])
def test_the_engine_steps_muon_as_a_plain_loop_over_muon_config_build(tmp_path, stage, state, clip):
    reference = plain_losses(tierflow_pair, clip=clip)
    engine = make_engine(config(tmp_path, stage, state, clip=clip))
    try:
        opt = engine.optimizer
        assert isinstance(opt, torch.optim.Optimizer) and opt.offload == state
        assert [g["use_muon"] for g in opt.param_groups] == [True, False]
        assert [len(g["params"]) for g in opt.param_groups] == [4, 11]  # 2 blocks x (up, down); the embedding, norms, biases
        losses = engine_losses(engine)
        if stage == 3 and not clip:  # nothing global to know first: every parameter stepped in the backward
            assert engine.runtime._overlap.overlapped > 0
    finally:
        engine.close()
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference), rtol=1e-5, atol=1e-6)


def test_the_engine_tracks_torch_optim_muon_and_adamw_within_bf16_newton_schulz(tmp_path):
    # Measured over these 8 micro-batches: losses within 4.7e-4 relative of torch's, the bf16 Newton–Schulz
    # noise test_muon.py measures too (the bound is its BF16_LOSS_RTOL).
    reference = plain_losses(torch_pair)
    engine = make_engine(config(tmp_path, 2, "cpu"))
    try:
        losses = engine_losses(engine)
    finally:
        engine.close()
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference), rtol=2e-3, atol=0)


RESUMES = [(2, "cpu", None), (3, "nvme", None), (3, "cpu", "bf16"), (3, "nvme", "bf16")]


@pytest.mark.parametrize("stage,state,precision", RESUMES,
                         ids=[f"stage{s}-{where}-{p or 'fp32'}" for s, where, p in RESUMES])
def test_a_checkpoint_resumes_both_groups_as_if_never_stopped(tmp_path, stage, state, precision):
    extra = {precision: {"enabled": True}} if precision else {}
    cfg = config(tmp_path, stage, state, **extra)
    data = batches(2 * STEPS * GAS)
    engine = make_engine(cfg)
    try:
        engine_losses(engine, STEPS, data=data)
        engine.save_checkpoint(tmp_path / "ckpt", tag="t")
        uninterrupted = engine_losses(engine, STEPS, first=STEPS, data=data)
    finally:
        engine.close()
    torch.manual_seed(1)  # other initial values: the checkpoint gives them back
    cfg["zero_optimization"]["offload_optimizer"].get("nvme_path") and cfg["zero_optimization"][
        "offload_optimizer"].update(nvme_path=str(tmp_path / "nvme2"))
    resumed, *_ = tierflow.initialize(model=SmallLM(), config=cfg)
    try:
        resumed.load_checkpoint(tmp_path / "ckpt", tag="t")
        momentum = [s["momentum_buffer"] for s in resumed.optimizer.state_dict()["state"].values()
                    if "momentum_buffer" in s]
        assert len(momentum) == 4 and all(m.abs().sum() > 0 for m in momentum)
        again = engine_losses(resumed, STEPS, first=STEPS, data=data)
    finally:
        resumed.close()
    assert again == uninterrupted


def test_the_lr_scheduler_get_lr_and_state_dict_see_one_optimizer_in_torchs_layout(tmp_path):
    def halving(opt):
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5 ** step)

    def scheduled_pair(model):
        pair = tierflow_pair(model)
        schedules.extend(halving(o) for o in pair)
        return pair

    schedules = []  # the plain loop steps each optimizer's own schedule after it
    torch.manual_seed(0)
    engine, optimizer, _, scheduler = tierflow.initialize(model=SmallLM(), config=config(tmp_path, 3, "cpu"),
                                                          lr_scheduler=halving)
    try:
        assert scheduler.optimizer is optimizer is engine.optimizer
        losses = engine_losses(engine)
        assert engine.get_lr() == pytest.approx([0.02 * 0.5 ** STEPS, 3e-3 * 0.5 ** STEPS])
        assert [g["lr"] for part in optimizer.parts for g in part.param_groups] == engine.get_lr()
        saved = optimizer.state_dict()
    finally:
        engine.close()
    # The reference: the same schedule on each of MuonConfig.build's optimizers.
    torch.manual_seed(0)
    model = SmallLM()
    pair = scheduled_pair(model)
    data = batches(STEPS * GAS)
    reference = []
    for step in range(STEPS):
        for micro in range(GAS):
            loss = model(*data[step * GAS + micro])
            (loss / GAS).backward()
            reference.append(loss.item())
        clip_as_deepspeed(model.parameters(), 1.0)
        for opt, schedule in zip(pair, schedules):
            opt.step()
            opt.zero_grad()
            schedule.step()
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference), rtol=1e-5, atol=1e-6)
    # torch's layout: Muon's group, then AdamW's, each loading into torch's own optimizer.
    assert [g["use_muon"] for g in saved["param_groups"]] == [True, False]
    muon_ids, adamw_ids = (g["params"] for g in saved["param_groups"])
    assert muon_ids == [0, 1, 2, 3] and adamw_ids == list(range(4, 15))
    assert all(set(saved["state"][i]) == {"momentum_buffer"} for i in muon_ids)
    assert all(set(saved["state"][i]) == {"step", "exp_avg", "exp_avg_sq"} for i in adamw_ids)
    hidden, rest = muon_param_groups(SmallLM())
    for params, group, cls in ((hidden, saved["param_groups"][0], torch.optim.Muon),
                               (rest, saved["param_groups"][1], torch.optim.AdamW)):
        peer = cls(params)
        peer.load_state_dict({"state": {i: saved["state"][i] for i in group["params"]}, "param_groups": [group]})
        for i, p in zip(group["params"], params):
            for key, value in saved["state"][i].items():
                torch.testing.assert_close(peer.state[p][key], value, rtol=0, atol=0)


def test_an_fp16_overflow_skips_both_groups(tmp_path):
    engine = make_engine(config(tmp_path, 3, "cpu", fp16={"enabled": True, "initial_scale_power": 8}))
    try:
        before = {k: v.clone() for k, v in engine.module.state_dict().items()}
        x, y = batches(1)[0]
        for _ in range(GAS):
            engine.backward(engine(x, y) * float("inf"))
            if engine.is_gradient_accumulation_boundary():
                with pytest.warns(RuntimeWarning, match="overflow"):
                    engine.step()
            else:
                engine.step()
        assert engine.skipped_steps == 1 and engine.optimizer.overflow
        assert len(engine.optimizer.state) == 0  # neither part stepped
        after = engine.module.state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before)
        engine_losses(engine, 1)  # the next boundary steps both groups
        assert not engine.optimizer.overflow and len(engine.optimizer.state) == 15
    finally:
        engine.close()


def test_muon_with_zenflow_param_groups_and_an_unresolved_lr_are_refused(tmp_path):
    cfg = config(tmp_path, 2, "cpu")
    cfg["zero_optimization"]["zenflow"] = {"topk_ratio": 0.1}
    with pytest.raises(ValueError, match=r"^optimizer.type: Muon with zenflow; ZenFlow steps Adam or AdamW$"):
        tierflow.initialize(model=SmallLM(), config=cfg)
    model = SmallLM()
    with pytest.raises(ValueError, match=r"^model_parameters: param groups with optimizer.type Muon"):
        tierflow.initialize(model=model, config=config(tmp_path, 2, "cpu"),
                            model_parameters=[{"params": list(model.parameters())}])
    section = json.loads(json.dumps(MUON))
    section["params"]["lr"] = "auto"
    del section["params"]["muon_lr"]
    with pytest.raises(ValueError, match=r'^optimizer.params.lr: "auto" is unresolved'):
        tierflow.initialize(model=SmallLM(), config={**config(tmp_path, 2, "cpu"), "optimizer": section})


@pytest.mark.parametrize("stage,state", [(3, "cpu"), (3, "nvme"), (2, "nvme")])
def test_deepspeeds_zero_to_fp32_reads_both_groups_fp32_masters(tmp_path, stage, state):
    """A bf16 run's checkpoint: DeepSpeed's get_fp32_state_dict_from_zero_checkpoint
    gives each parameter the fp32 master its part keeps (Muon's in RAM,
    AdamW's in RAM or on NVMe), the engine's fp32 export the same; the
    NVMe stores' tiers are reported."""
    try:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    except Exception as e:  # optional: scripts/setup.sh --bench installs it
        pytest.skip(f"deepspeed is not importable ({type(e).__name__}: {e})")
    import safetensors.torch

    engine = make_engine(config(tmp_path, stage, state, bf16={"enabled": True}))
    try:
        engine_losses(engine, 2)
        engine.save_checkpoint(tmp_path / "ckpt")
        masters = safetensors.torch.load_file(engine.save_fp32_model(tmp_path / "export"))
        weights = {k: v.clone() for k, v in engine.module.state_dict().items()}
        stats = engine.memory_stats().get("optimizer")
    finally:
        engine.close()
    got = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / "ckpt"))
    assert set(got) == set(weights) and set(masters) <= set(got)
    for name, value in masters.items():
        assert got[name].dtype == torch.float32 and torch.equal(got[name], value), name
    for name in ("blocks.0.up.weight", "emb.weight"):  # a Muon and an AdamW parameter: masters, not bf16 widened
        assert not torch.equal(masters[name], weights[name].float()), name
    if state == "nvme":
        assert stats["tiers"]["nvme"]["used"] > 0 and stats["bytes"]["host->nvme"] > 0


@pytest.mark.parametrize("stage", [2, 3])
def test_weights_loaded_without_the_optimizer_state_restart_both_groups_masters(tmp_path, stage):
    """load_checkpoint(load_optimizer_states=False) in a bf16 run that has
    stepped: each part's fp32 masters start again from the loaded weights
    (DeepSpeed's refresh_fp32_params), so the next step moves the loaded
    weights by one update, not back to the masters of before."""
    cfg = config(tmp_path, stage, "cpu", bf16={"enabled": True})
    engine = make_engine(cfg)
    try:
        engine_losses(engine, 1)
        engine.save_checkpoint(tmp_path / "ckpt", tag="t")
        loaded = {k: v.float().clone() for k, v in engine.module.state_dict().items()}
    finally:
        engine.close()
    torch.manual_seed(1)
    other, *_ = tierflow.initialize(model=SmallLM(), config=cfg)
    try:
        engine_losses(other, 1)  # masters of its own values
        other.load_checkpoint(tmp_path / "ckpt", tag="t", load_optimizer_states=False)
        engine_losses(other, 1, first=1)
        after = {k: v.float() for k, v in other.module.state_dict().items()}
    finally:
        other.close()
    # One update moves a Muon matrix by about lr·sqrt(4)·|O| (<= 0.04 here) and an AdamW weight by about lr.
    for name in ("blocks.0.up.weight", "blocks.1.down.weight", "emb.weight"):
        assert (after[name] - loaded[name]).abs().max() < 0.06, name


def test_sharded_muon_over_one_rank_is_muon_to_the_bit():
    """ShardedMuon's step (the momentum on the shard, Newton–Schulz and the
    update of the gathered matrix) with the whole matrix as the one shard:
    tierflow's Muon kernel, parameters and momentum bit for bit."""
    torch.manual_seed(0)
    whole = [nn.Parameter(torch.randn(64, 24)), nn.Parameter(torch.randn(16, 40))]
    flat = [nn.Parameter(p.detach().clone().reshape(-1)) for p in whole]
    kwargs = dict(lr=0.02, weight_decay=0.01, momentum=0.95)
    muon = tierflow.torch.optim.Muon(whole, **kwargs)
    sharded = ShardedMuon(flat, {id(f): tuple(p.shape) for f, p in zip(flat, whole)}, Group(), **kwargs)
    for _ in range(5):
        for p, f in zip(whole, flat):
            p.grad = torch.randn(p.shape)
            f.grad = p.grad.reshape(-1).clone()
        muon.step()
        sharded.step_parameters(flat[::-1])
    for p, f in zip(whole, flat):
        assert torch.equal(p.detach().reshape(-1), f.detach())
        assert torch.equal(muon.state[p]["momentum_buffer"].reshape(-1), sharded.state[f]["momentum_buffer"])


# (state, precision, loss rtol, weight atol). Measured over 12 micro-batches: fp32 losses within
# 1.6e-5 relative and weights within 8e-4; bf16 within one bf16 step of the loss (7.2e-3) and of a
# weight (7.8e-3).
GLOO_CASES = [("cpu", "fp32", 1e-4, 4e-3), ("nvme", "fp32", 1e-4, 4e-3), ("nvme", "bf16", 1.6e-2, 1.6e-2)]


@pytest.mark.parametrize("state,precision,rtol,atol", GLOO_CASES, ids=[f"{c[0]}-{c[1]}" for c in GLOO_CASES])
def test_two_gloo_ranks_step_muon_on_gathered_matrices_and_train_as_one_process(tmp_path, monkeypatch, state,
                                                                                 precision, rtol, atol):
    """torchrun with 2 ranks, each holding half of every matrix and of its
    momentum (ShardedMuon), with a checkpoint and a resume midway, against
    the same run in one process on the whole batch. The mean of two
    half-batch gradients is the whole batch's up to fp32 rounding, which
    Muon's bf16 Newton–Schulz makes larger. The resumed run is the
    uninterrupted one to the bit."""
    import zero_resume_dp_worker as worker

    monkeypatch.setenv("ZERO_RESUME_BF16", "1" if precision == "bf16" else "0")
    one = worker.run(str(tmp_path / "one"), str(tmp_path / "one" / "ck"), state, "muon")
    ranks = worker.two_ranks(tmp_path, state, "muon")
    assert one["parts"] == ["Muon", "AdamW"] and ranks[0]["parts"] == ["ShardedMuon", "AdamW"]
    assert ranks[0]["world"] == 2 and ranks[0]["losses"] == ranks[1]["losses"]
    assert ranks[0]["losses"] == ranks[0]["uninterrupted"] and one["losses"] == one["uninterrupted"]
    torch.testing.assert_close(torch.tensor(ranks[0]["losses"]), torch.tensor(one["losses"]), rtol=rtol, atol=0)
    for name, value in one["weights"].items():
        assert ranks[0]["weights"][name] == ranks[1]["weights"][name]
        torch.testing.assert_close(torch.tensor(ranks[0]["weights"][name]), torch.tensor(value), rtol=0, atol=atol)
