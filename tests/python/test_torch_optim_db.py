"""tierflow's Adam/AdamW driven by torch's own optimizer test database,
``torch.testing._internal.common_optimizers.optim_db``: its Adam and AdamW
inputs (``optim_inputs_func``, with the global flags torch's tests add to
them) and error inputs (``optim_error_inputs_func``), each its own test.

Every input tierflow takes is stepped by torch.optim's class and by
tierflow's with the same arguments on copies of the same parameters (a 2-D
weight, a 1-D bias that misses its gradient at one step, a zero-size
parameter), five steps of changing seeded gradients, and each step compared
element by element: the parameters and every state key (``step``,
``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq``). Every input tierflow does
not take is refused by name at construction; every error input raises
torch's error type with a message matching torch's ``error_regex``.

What sets the tolerances (fp32, measured on these inputs):

* Parameters agree within ``rtol=1e-6, atol=1e-7``: an ulp of rounding.
  With weight decay off or L2 (Adam) a step rounds as torch's in all but
  0.5% of the elements (the update's terms are grouped differently: fused
  ``sqrt(v)*(1/sqrt(bc2))+eps`` and ``lr/bc1*(m/d)`` where torch divides and
  multiplies in turn). AdamW's decoupled decay rounds as torch's: the kernel
  multiplies ``p`` by ``1 - lr*wd`` rounded to fp32 and rounds, then adds the
  update and rounds again (it once subtracted both with one rounding, and
  29-31% of the elements differed from torch's by an ulp after one step);
  :func:`test_one_step_rounds_as_torch` pins the agreement.
* Every state key agrees within the same ``rtol`` relative to its own scale
  (``atol`` = ``rtol`` times the largest element). The hyper-parameters reach
  the kernel as the doubles they are in Python, and each weight is rounded to
  fp32 once, as torch's scalar reaches an fp32 tensor: ``fp32(1 - beta2)``.
  (When the bindings took fp32 betas, ``1 - fp32(0.999)`` was 1.3e-5 below
  torch's weight and ``exp_avg_sq`` agreed only within 3e-5.)
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
from torch.testing._internal.common_optimizers import (
    OptimizerErrorEnum,
    _get_optim_inputs_including_global_cliquey_kwargs,
    optim_db,
)

from tierflow.torch.optim import Adam, AdamW

STEPS = 5
RTOL, ATOL = 1e-6, 1e-7

_OURS = {torch.optim.Adam: Adam, torch.optim.AdamW: AdamW}
_INFOS = [info for info in optim_db if info.optim_cls in _OURS]
assert [info.optim_cls for info in _INFOS] == [torch.optim.Adam, torch.optim.AdamW], "optim_db changed"

# What tierflow does not take, by the option that asks for it, and why.
_OUT_OF_SCOPE = {
    # A step captured into a CUDA graph, with its state on the device: tierflow's
    # step runs on the CPU, between the graph's replays.
    "capturable": "capturable=True is not supported",
    # Gradients through the step itself: the C++ kernel runs outside autograd.
    "differentiable": "differentiable=True is not supported",
}


def _inputs():
    """(name, desc, kwargs) of every optim_inputs_func input for the CPU with
    the global flags torch's own tests add (fused, differentiable), the same
    with foreach=True (which torch's helper leaves out on the CPU), and the
    inputs torch lists only for other devices (Tensor lr; capturable ones,
    which tierflow refuses), stepped here on CPU parameters."""
    cases = []
    for info in _INFOS:
        name = info.optim_cls.__name__
        seen = set()
        for given in _get_optim_inputs_including_global_cliquey_kwargs("cpu", torch.float32, info):
            cases.append((name, given.desc, given.kwargs))
            seen.add(given.desc)
        for given in info.optim_inputs_func("cpu"):
            cases.append((name, f"{given.desc} & foreach", {**given.kwargs, "foreach": True}))
        for device in ("cuda", "mps"):
            for given in info.optim_inputs_func(device):
                if given.desc not in seen:
                    cases.append((name, f"{given.desc} (inputs for {device})", given.kwargs))
                    seen.add(given.desc)
    return cases


def _refused_option(kwargs):
    """The option of kwargs tierflow refuses, or None."""
    return next((flag for flag in _OUT_OF_SCOPE if kwargs.get(flag)), None)


_CASES = _inputs()
_TAKEN = [pytest.param(n, k, id=f"{n}-{d}") for n, d, k in _CASES if _refused_option(k) is None]
_REFUSED = [pytest.param(n, k, id=f"{n}-{d}") for n, d, k in _CASES if _refused_option(k) is not None]


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(24, 37, generator=g), torch.randn(37, generator=g), torch.empty(0)]


def _grads(step, params):
    """Gradients of `step`, different at each step; the bias (params[1])
    has none at step 2 (it is skipped: neither moved nor counted)."""
    g = torch.Generator().manual_seed(100 + step)
    grads = [torch.randn(p.shape, generator=g) * (0.5 + step) for p in params]
    if step == 2:
        grads[1] = None
    return grads


def _close(actual, expected, what, rtol=RTOL, atol=ATOL):
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


def _step_both(torch_cls, kwargs, check, steps=STEPS):
    """Steps torch's and tierflow's optimizer side by side; after each step
    calls check(step, torch's params, torch's optimizer, ours, ours')."""
    init = _params()
    theirs = [torch.nn.Parameter(p.clone()) for p in init]
    ours = [torch.nn.Parameter(p.clone()) for p in init]
    peer = torch_cls(theirs, **copy.deepcopy(kwargs))
    opt = _OURS[torch_cls](ours, **copy.deepcopy(kwargs))
    for step in range(1, steps + 1):
        for p, q, grad in zip(theirs, ours, _grads(step, init)):
            p.grad = None if grad is None else grad.clone()
            q.grad = None if grad is None else grad.clone()
        peer.step()
        opt.step()
        check(step, theirs, peer, ours, opt)


@pytest.mark.parametrize("name, kwargs", _TAKEN)
def test_step_matches_torch(name, kwargs):
    torch_cls = getattr(torch.optim, name)
    keys = ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if kwargs.get("amsgrad") else [])

    def check(step, theirs, peer, ours, opt):
        for i, (p, q) in enumerate(zip(theirs, ours)):
            _close(q.detach(), p.detach(), f"step {step} params[{i}]")
            want, got = peer.state[p], opt.state[q]
            assert set(got) == set(want), f"step {step} params[{i}]: state keys {sorted(got)} != {sorted(want)}"
            if not want:
                continue
            assert float(got["step"]) == float(want["step"]), f"step {step} params[{i}] step"
            for key in keys:
                # Relative to the moment's own scale: an element that cancelled
                # to near zero carries the rounding of the terms it summed.
                scale = float(want[key].abs().max()) if want[key].numel() else 0.0
                _close(got[key], want[key], f"step {step} params[{i}] {key}", rtol=RTOL, atol=RTOL * scale)

    _step_both(torch_cls, kwargs, check)


def _one_ulp_share(name, kwargs):
    """The share of the weight's elements whose value after one step differs
    from torch's (each differs by an ulp or two at most)."""
    shares = []

    def check(step, theirs, peer, ours, opt):
        shares.append(float((theirs[0].detach() != ours[0].detach()).float().mean()))

    _step_both(getattr(torch.optim, name), kwargs, check, steps=1)
    return shares[0]


@pytest.mark.parametrize("name", ["Adam", "AdamW"])
@pytest.mark.parametrize("weight_decay", [0.0, 1e-2, 0.1])
def test_one_step_rounds_as_torch(name, weight_decay):
    """One step rounds as torch's for all but a few elements (torch's own
    foreach and fused steps differ from its for-loop step in under 0.2%).
    AdamW's decay included: the kernel multiplies p by fp32(1 - lr*wd) and
    rounds, then adds the update, as torch's p.mul_ then addcdiv_ does."""
    assert _one_ulp_share(name, {"weight_decay": weight_decay}) < 0.02


@pytest.mark.parametrize("name, kwargs", _REFUSED)
def test_refuses_what_it_does_not_do(name, kwargs):
    option = _refused_option(kwargs)
    params = [torch.nn.Parameter(p) for p in _params()]
    with pytest.raises((ValueError, NotImplementedError), match=re.escape(_OUT_OF_SCOPE[option])):
        _OURS[getattr(torch.optim, name)](params, **copy.deepcopy(kwargs))


@pytest.mark.parametrize("cls", [Adam, AdamW])
def test_refuses_complex_params(cls):
    # torch steps a complex parameter as its real view; tierflow's kernel takes
    # float32, bfloat16 and float16 parameters only.
    with pytest.raises(ValueError, match=r"params\[0\] is torch.complex64"):
        cls([torch.nn.Parameter(torch.randn(4, 3, dtype=torch.complex64))])


def _error_cases():
    cases = []
    for info in _INFOS:
        for error in info.optim_error_inputs_func(device="cpu", dtype=torch.float32):
            given = error.optimizer_error_input
            cases.append(pytest.param(info.optim_cls, error, id=f"{info.optim_cls.__name__}-{given.desc}"))
    return cases


def _raises_as_torch(cls, error):
    """Constructs (and for a step error steps) cls with the error input,
    expecting torch's error or warning as torch's own test_errors does."""
    given = error.optimizer_error_input
    if issubclass(error.error_type, Warning):
        expect = pytest.warns(error.error_type, match=error.error_regex)
    else:
        expect = pytest.raises(error.error_type, match=error.error_regex)
    if error.error_on == OptimizerErrorEnum.CONSTRUCTION_ERROR:
        with expect:
            cls(given.params, **given.kwargs)
    elif error.error_on == OptimizerErrorEnum.STEP_ERROR:
        opt = cls(given.params, **given.kwargs)
        with expect:
            opt.step()
    else:
        raise AssertionError(f"unknown error_on {error.error_on}")


@pytest.mark.parametrize("torch_cls, error", _error_cases())
def test_errors_as_torch(torch_cls, error):
    _raises_as_torch(torch_cls, error)  # the database's expectation holds for this torch
    _raises_as_torch(_OURS[torch_cls], error)


def test_the_database_gives_both_kinds_of_input():
    # An empty parametrization would pass by running nothing.
    for name in ("Adam", "AdamW"):
        assert sum(n == name for n, _, _ in _CASES) >= 5
    assert any("fused" in d for _, d, _ in _CASES) and any("capturable" in d for _, d, _ in _CASES)
