"""ZeRO-3 parameters used where no module hook announces them: writes under
zero.Init, a parameter read outside its own module, a computation with a
parameter whose values are away, frozen parameters in the backward. Each of
these once gave a silently wrong result (or a budget error); each test here
compares against the same model in plain torch."""

import contextlib
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tierflow
from tierflow.zero import GatheredParameters, NotGatheredError, register_external_parameter

from test_zero import ds_config


def config_for(tmp_path, **kwargs):
    kwargs.setdefault("gas", 1)
    kwargs.setdefault("clip", 0.0)
    return ds_config(tmp_path / "nvme", **kwargs)


class Child(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d, d) / d ** 0.5)

    def forward(self, x):
        return x @ self.weight


class Parent(nn.Module):
    """A forward that reads its child's weight itself, outside the child's forward."""

    def __init__(self, d=32):
        super().__init__()
        self.a = Child(d)
        self.b = nn.Linear(d, d)

    def forward(self, x):
        h = self.b(self.a(x))
        return torch.tanh(h @ self.a.weight.t())  # the child's weight, used by the parent


def _init_weights(module):
    """transformers 4.x's _init_weights: writes through .data."""
    if isinstance(module, nn.Linear):
        module.weight.data.normal_(mean=0.0, std=0.02)
        if module.bias is not None:
            module.bias.data.zero_()
    elif isinstance(module, nn.Embedding):
        module.weight.data.normal_(mean=0.0, std=0.02)
        module.weight.data[module.padding_idx].zero_()
    elif isinstance(module, nn.LayerNorm):
        module.weight.data.fill_(1.0)
        module.bias.data.zero_()


class Small(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(16, 8, padding_idx=3)
        self.proj = nn.Linear(8, 8)
        self.ln = nn.LayerNorm(8)
        self.apply(_init_weights)

    def forward(self, x):
        return self.ln(self.proj(self.emb(x)))


def test_writes_under_zero_init_reach_the_store(tmp_path):
    config = config_for(tmp_path)
    torch.manual_seed(0)
    plain = Small()
    with torch.no_grad():
        plain.proj.weight.data.fill_(0.5)
        plain.proj.weight[0, 0] = 7.0
        plain.proj.bias.copy_(torch.arange(8.0))
    torch.manual_seed(0)
    with tierflow.zero.Init(config=config):
        model = Small()  # _init_weights ran inside the constructor, on parameters already in the store
        with torch.no_grad():
            model.proj.weight.data.fill_(0.5)
            model.proj.weight[0, 0] = 7.0
            model.proj.bias.copy_(torch.arange(8.0))
    engine, *_ = tierflow.initialize(model=model, config=config)
    try:
        ours, theirs = engine.module.state_dict(), plain.state_dict()
        for name, value in theirs.items():
            assert torch.equal(ours[name], value), name
        assert ours["emb.weight"][3].abs().sum() == 0 and ours["emb.weight"].std() < 0.05
        assert ours["proj.weight"][0, 0] == 7.0 and ours["proj.weight"][1, 1] == 0.5
    finally:
        engine.close()


def _adds_a_field(cls):
    """A class decorator that wraps ``__init__``, as transformers' use_kernelized_func does."""
    init = cls.__init__

    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.__dict__["field"] = "set"

    cls.__init__ = __init__
    return cls


def test_a_class_decorated_under_zero_init_keeps_its_decorators_init_after_it(tmp_path):
    """A class made inside zero.Init whose decorator wraps its __init__
    (transformers' attention layers, when their module is first imported
    under Init) lost the decorator's __init__ when Init put the class's own
    back at exit: later instances lacked what it sets, and forward failed."""
    config = config_for(tmp_path)
    with tierflow.zero.Init(config=config) as init:
        @_adds_a_field
        class Layer(nn.Module):
            def __init__(self):
                super().__init__()
                self.weight = nn.Parameter(torch.ones(4))

        inside = Layer()
        assert inside.field == "set" and tierflow.zero.init.store_of(inside) is not None
    assert inside.weight.numel() == 0 and inside.weight.ds_shape == (4,)  # in the store
    init.close()
    after = Layer()
    assert after.field == "set"
    assert after.weight.numel() == 4 and torch.equal(after.weight, torch.ones(4))  # a plain parameter
    assert tierflow.zero.init.store_of(after) is None


def test_a_read_under_zero_init_is_a_read(tmp_path):
    """A read through .data changes nothing, and a copy made from it holds the values."""
    config = config_for(tmp_path)
    with tierflow.zero.Init(config=config) as init:
        model = nn.Linear(4, 4)
        with torch.no_grad():
            model.weight.copy_(torch.arange(16.0).view(4, 4))
        copied = model.weight.data.clone()
        row = model.weight.data[2].sum()
        total = model.weight.sum()
    try:
        assert torch.equal(copied, torch.arange(16.0).view(4, 4))
        assert row.item() == 8 + 9 + 10 + 11 and total.item() == sum(range(16))
        with GatheredParameters(model.weight):
            assert torch.equal(model.weight, torch.arange(16.0).view(4, 4))
    finally:
        init.close()


@pytest.mark.parametrize("first", ["engine", "module"])
def test_a_parameter_used_outside_its_module_is_fetched_for_engine_and_module_calls(tmp_path, first):
    torch.manual_seed(0)
    plain = Parent()
    model = copy.deepcopy(plain)
    x = torch.randn(3, 32)
    expected = plain(x)
    engine, *_ = tierflow.initialize(model=model, config=config_for(tmp_path))
    try:
        with torch.no_grad():
            calls = [engine, engine.module] if first == "engine" else [engine.module, engine]
            for call in calls:
                torch.testing.assert_close(call(x), expected, rtol=0, atol=0)
        # The parent's hooks now fetch the child's weight with its own.
        assert any(p is model.a.weight for p in model.__dict__.get("_tierflow_external_params", []))
        # And training through it matches torch.
        opt = torch.optim.AdamW(plain.parameters(), lr=3e-3, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.01)
        for _ in range(3):
            loss = plain(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            engine.backward(engine(x).square().mean())
            engine.step()
        with torch.no_grad():
            torch.testing.assert_close(engine.module(x), plain(x), rtol=1e-5, atol=1e-6)
    finally:
        engine.close()


def test_register_external_parameter_fetches_it_with_the_module(tmp_path):
    torch.manual_seed(0)
    plain = Parent()
    model = copy.deepcopy(plain)
    register_external_parameter(model, model.a.weight)
    engine, *_ = tierflow.initialize(model=model, config=config_for(tmp_path))
    try:
        fetched = []
        model.register_forward_pre_hook(lambda m, a: fetched.append(engine.runtime.params.part_of(m.a.weight).resident))
        x = torch.randn(3, 32)
        with torch.no_grad():
            torch.testing.assert_close(engine.module(x), plain(x), rtol=0, atol=0)
        assert fetched == [True]
    finally:
        engine.close()


def test_a_computation_with_a_parameter_away_fails_naming_it(tmp_path):
    torch.manual_seed(0)
    model = Parent()
    engine, *_ = tierflow.initialize(model=model, config=config_for(tmp_path))
    try:
        w = model.a.weight
        assert w.numel() == 0 and w.ds_shape == (32, 32) and w.ds_numel == 32 * 32
        with pytest.raises(NotGatheredError, match=r"'a\.weight' \(\[32, 32\]\) is not gathered.*GatheredParameters"):
            w.sum()
        with pytest.raises(NotGatheredError, match="a.weight"):
            torch.randn(2, 32) @ w
        with pytest.raises(NotGatheredError, match="a.weight"):
            w.clone()
        with GatheredParameters(w):
            assert w.shape == (32, 32) and torch.isfinite(w.sum())
        assert w.numel() == 0
    finally:
        engine.close()


class Lora(nn.Module):
    """A frozen base weight per layer and a trainable low-rank update."""

    def __init__(self, d, layers, rank=2):
        super().__init__()
        self.base = nn.ModuleList(nn.Linear(d, d, bias=False) for _ in range(layers))
        self.down = nn.ParameterList(nn.Parameter(torch.randn(rank, d) * 0.1) for _ in range(layers))
        self.up = nn.ParameterList(nn.Parameter(torch.zeros(d, rank)) for _ in range(layers))
        for b in self.base:
            b.weight.requires_grad_(False)

    def forward(self, x):
        for base, down, up in zip(self.base, self.down, self.up):
            x = torch.tanh(base(x) + x @ down.t() @ up.t())
        return x


def test_frozen_parameters_leave_the_device_as_the_backward_passes_them(tmp_path):
    """The frozen weights have no gradient hook: each goes back to the store
    once the node that used it has run, so the backward holds about one layer
    at a time, as the forward does, and trains as torch does."""
    d, layers = 128, 8
    torch.manual_seed(0)
    plain = Lora(d, layers)
    model = copy.deepcopy(plain)
    layer = d * d * 4
    config = config_for(tmp_path, device_memory=6 * layer)  # far less than the 8 frozen layers
    engine, *_ = tierflow.initialize(model=model, config=config, model_parameters=[p for p in model.parameters()
                                                                                   if p.requires_grad])
    try:
        opt = torch.optim.AdamW([p for p in plain.parameters() if p.requires_grad], lr=3e-3, betas=(0.9, 0.99),
                                eps=1e-8, weight_decay=0.01)
        x = torch.randn(4, d)
        for _ in range(3):
            plain(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
            engine.backward(engine(x).square().mean())
            engine.step()
        assert engine.runtime.params.gathered_high_water <= 3 * layer + 64 * 4096
        with torch.no_grad():
            torch.testing.assert_close(engine.module(x), plain(x), rtol=1e-5, atol=1e-6)
    finally:
        engine.close()


class Shared(nn.Module):
    """One weight used in two reentrant checkpoint segments (two backwards of
    its own, two gradient hooks per micro-batch), and a head of its own."""

    def __init__(self, d=32):
        super().__init__()
        self.shared = nn.Linear(d, d)
        self.mid = nn.Linear(d, d)
        self.head = nn.Linear(d, 1)
        self.reentrant = False

    def segment(self, x):
        return torch.tanh(self.shared(x))

    def forward(self, x):
        run = (lambda f, h: torch.utils.checkpoint.checkpoint(f, h, use_reentrant=True)) if self.reentrant \
            else (lambda f, h: f(h))
        h = run(self.segment, x.requires_grad_() if self.reentrant else x)
        h = torch.tanh(self.mid(h))
        h = run(self.segment, h)
        return self.head(h).square().mean()


@pytest.mark.parametrize("case", ["two_backwards", "reentrant_checkpointing"])
def test_the_overlapped_step_steps_each_parameter_once_on_its_whole_gradient(tmp_path, case):
    """Two engine.backward calls per micro-batch, or a weight whose gradient
    hook fires in two reentrant segments: the overlapped step waits for the
    last gradient of each parameter, and trains as the synchronous step and
    as torch do, to the bit."""
    steps, d = 4, 32
    torch.manual_seed(0)
    reference = Shared(d)
    reference.reentrant = case == "reentrant_checkpointing"
    xs = [torch.randn(4, d) for _ in range(steps)]
    runs = {}
    for overlap in (True, False):
        model = copy.deepcopy(reference)
        config = config_for(tmp_path / str(overlap))
        config.setdefault("tierflow", {})["overlap_step"] = overlap
        engine, *_ = tierflow.initialize(model=model, config=config)
        try:
            for x in xs:
                if case == "two_backwards":
                    engine.backward(engine(x))
                    engine.backward(engine(x * 0.5))
                else:
                    engine.backward(engine(x))
                engine.step()
            runs[overlap] = ({k: v.clone() for k, v in engine.module.state_dict().items()}, engine.runtime._overlap)
        finally:
            engine.close()
    assert runs[True][1] is not None and runs[True][1].overlapped > 0, "the step never overlapped the backward"
    for name, value in runs[False][0].items():
        assert torch.equal(runs[True][0][name], value), name
    opt = torch.optim.AdamW(reference.parameters(), lr=3e-3, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.01)
    for x in xs:
        reference(x).backward()
        if case == "two_backwards":
            reference(x * 0.5).backward()
        opt.step()
        opt.zero_grad()
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(runs[True][0][name], value, rtol=1e-5, atol=1e-6)


def test_a_gradient_after_a_parameters_overlapped_step_is_refused_naming_it(tmp_path):
    torch.manual_seed(0)
    model = Shared()
    engine, *_ = tierflow.initialize(model=model, config=config_for(tmp_path))
    try:
        x = torch.randn(4, 32)
        engine.backward(engine(x))
        engine.step()  # one backward a micro-batch, recorded
        engine.backward(engine(x))  # the parameters are stepped during this one
        with pytest.raises(RuntimeError, match=r"parameter 'head\.(weight|bias)' got another gradient after its optimizer step"):
            engine.backward(engine(x))
    finally:
        engine.close()


_NEVER_CLOSED = """
import sys, torch
sys.path.insert(0, {tests!r})
import tierflow
from tierflow.torch.optim import AdamW, Muon, ZenFlow
from test_zero import TinyLM, batches, ds_config
torch.manual_seed(0)
config = ds_config({nvme!r})
engine, *_ = tierflow.initialize(model=TinyLM(), config=config)
x, y = batches(1)[0]
engine.backward(engine(x, y))
engine.step()
with tierflow.zero.Init(config=config):
    unused = torch.nn.Linear(64, 64)  # built into a store no engine took
w = torch.nn.Parameter(torch.randn(32, 32))
w.grad = torch.randn(32, 32)
for opt in (AdamW([w], offload="nvme", nvme_dir={nvme!r}), Muon([w]), ZenFlow([w], zenflow={{"topk_ratio": 0.5}})):
    opt.step()
print("trained")
"""


def test_a_script_that_never_closes_its_engine_exits_silently_and_leaves_no_files(tmp_path):
    import os
    import subprocess
    import sys

    nvme = tmp_path / "nvme"
    script = _NEVER_CLOSED.format(tests=os.path.dirname(__file__), nvme=str(nvme))
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "trained", out.stderr
    assert out.stderr == "", out.stderr  # no "nanobind: leaked ..." lines, nothing else
    left = [os.path.join(d, f) for d, _, files in os.walk(nvme) for f in files]
    assert left == [], left


def test_zero_init_with_zenflow_on_nvme_trains_and_a_tied_heads_own_weight_is_forgotten(tmp_path):
    """zero.Init + ZenFlow + offload_optimizer nvme once failed at the first
    step (zero.Init homed the gradients on NVMe, where ZenFlow cannot read
    them); and the head's own weight, which TinyLM replaces by the
    embedding's, stayed in the store to be stepped and saved."""
    from test_zero import TinyLM, batches

    config = ds_config(tmp_path / "nvme", gas=1, host_memory=16 << 20, device_memory=1 << 20)
    config["zero_optimization"]["zenflow"] = {"topk_ratio": 0.1, "update_interval": 2, "select_interval": 2,
                                              "overlap_step": False}
    torch.manual_seed(0)
    with tierflow.zero.Init(config=config):
        model = TinyLM()
    assert len(tierflow.zero.init.store_of(model).parts) == 28  # the head's own weight too, before the tie
    engine, *_ = tierflow.initialize(model=model, config=config)
    try:
        assert len(engine.runtime.params.parts) == len({id(p) for p in model.parameters()}) == 27
        losses = []
        for x, y in batches(4):
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]
        assert sorted(engine.module.state_dict()) == sorted(TinyLM().state_dict())
    finally:
        engine.close()


def test_a_bf16_step_with_non_finite_gradients_is_skipped_as_deepspeeds_check_grad_overflow(tmp_path):
    """bf16.check_grad_overflow (DeepSpeed's default true): a step whose
    gradient norm is not finite changes nothing and counts as skipped; with
    it false the step goes ahead (and the weights are no longer finite)."""
    results = {}
    for check in (True, False):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 1))
        config = config_for(tmp_path / str(check), bf16={"enabled": True, "check_grad_overflow": check})
        engine, *_ = tierflow.initialize(model=model, config=config)
        try:
            before = {k: v.clone() for k, v in engine.module.state_dict().items()}
            x = torch.randn(4, 16, dtype=torch.bfloat16)
            with pytest.warns(RuntimeWarning, match="check_grad_overflow") if check else contextlib.nullcontext():
                engine.backward(engine(x).float().sum() * float("inf"))
                engine.step()
            after = engine.module.state_dict()
            results[check] = (engine.skipped_steps, engine.global_steps,
                              all(torch.equal(before[k], after[k]) for k in before))
            # accelerate's DeepSpeedOptimizerWrapper.step_was_skipped reads it, as of DeepSpeed's optimizers
            assert engine.optimizer.overflow is check and engine.was_step_applied() is not check
        finally:
            engine.close()
    assert results[True] == (1, 1, True)
    assert results[False][0] == 0 and not results[False][2]
