"""tierflow.torch.optim.Muon against torch.optim.Muon on the same model, data
and seed, the kernel binding under it, and muon_param_groups' split.

Two comparisons, because torch.optim.Muon runs Newton–Schulz in bf16:

* ns_dtype=torch.float32 against torch.optim.Muon with its Newton–Schulz
  made fp32 (FP32_NS below, torch's function with the one dtype changed):
  the same algorithm with the same precision, element by element within
  RTOL. Measured over 50 steps at lr 0.02: parameters within 3.3e-6 of each
  tensor's largest magnitude, losses within 2.3e-7 relative (GEMM summation
  order only).
* the default ns_dtype=torch.bfloat16 against stock torch.optim.Muon. Both
  round every GEMM operand to 8 significant bits, but not at the same points
  (torch rounds the momentum update to bf16 before normalising it and rounds
  b A + c A^2 and a X + B X separately; the kernel normalises in fp32 and
  folds a X into the last GEMM as (a I + b A + c A^2) X), and the rounding
  noise compounds over 50 steps. Measured: parameters within 3.0e-2 of each
  tensor's largest magnitude, losses within 4.7e-4 relative, which is the
  size of torch's own bf16 drift from the fp32 iteration (1.3e-2 to 2.7e-2,
  1.2e-4 to 4.0e-4). The test allows BF16_PARAM_TOL and BF16_LOSS_RTOL.
"""

import contextlib
import copy
import pickle
import threading
import time
from unittest import mock

import pytest
import torch
import torch.optim._muon as torch_muon

import tierflow
from tierflow.torch.optim import MASTER_KEY, AdamW, Muon, muon_param_groups

STEPS = 50
LR = 0.02
RTOL = 2e-5
BF16_PARAM_TOL = 6e-2
BF16_LOSS_RTOL = 2e-3
DEFAULT_NS = (3.4445, -4.775, 2.0315)


def fp32_newton_schulz(grad, ns_coefficients, ns_steps, eps):
    """torch.optim._muon._zeropower_via_newtonschulz with fp32 for bf16."""
    a, b, c = ns_coefficients
    x = grad.to(dtype=torch.float32, copy=True)
    if grad.size(0) > grad.size(1):
        x = x.T
    x.div_(x.norm().clamp(min=eps))
    for _ in range(ns_steps):
        gram = x @ x.T
        update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, update, x, beta=a)
    if grad.size(0) > grad.size(1):
        x = x.T
    return x


def torch_with_fp32_ns():
    """torch.optim.Muon's step, every line its own, with fp32 Newton–Schulz."""
    return mock.patch.object(torch_muon, "_zeropower_via_newtonschulz", fp32_newton_schulz)


def assert_close_to(actual, expected, what="", rtol=RTOL):
    """Element by element within rtol of the tensor's own largest magnitude."""
    atol = rtol * float(expected.detach().abs().max()) if expected.numel() else 0.0
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


def make_model(seed=0):
    """Three matrices: tall (64 x 32), wide (48 x 64), tall again (96 x 48)."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(32, 64, bias=False), torch.nn.Tanh(),
        torch.nn.Linear(64, 48, bias=False), torch.nn.Tanh(),
        torch.nn.Linear(48, 96, bias=False))


def make_data(seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(STEPS, 16, 32, generator=g), torch.randn(STEPS, 16, 96, generator=g)


def train(model, optimizer, xs, ys, steps=STEPS):
    losses = []
    for x, y in zip(xs[:steps], ys[:steps]):
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def run_both(kwargs, ns_dtype, steps=STEPS):
    """Trains one model with torch.optim.Muon (fp32 NS when ns_dtype is fp32)
    and its copy with tierflow's Muon; returns both models and optimizers."""
    xs, ys = make_data()
    model_peer = make_model()
    model_ours = copy.deepcopy(model_peer)
    peer = torch.optim.Muon(model_peer.parameters(), **kwargs)
    ours = Muon(model_ours.parameters(), ns_dtype=ns_dtype, **kwargs)
    with torch_with_fp32_ns() if ns_dtype == torch.float32 else contextlib.nullcontext():
        losses_peer = train(model_peer, peer, xs, ys, steps)
    losses_ours = train(model_ours, ours, xs, ys, steps)
    return (model_peer, peer, losses_peer), (model_ours, ours, losses_ours)


CASES = [
    {"lr": LR},
    {"lr": LR, "nesterov": False},
    {"lr": LR, "adjust_lr_fn": "original"},
    {"lr": LR, "adjust_lr_fn": "match_rms_adamw", "weight_decay": 0.05},
    {"lr": LR, "adjust_lr_fn": "match_rms_adamw", "nesterov": False},
    {"lr": LR, "adjust_lr_fn": "spectral_unclamped"},
    {"lr": LR, "momentum": 0.8, "weight_decay": 0.0, "ns_steps": 3, "eps": 1e-5,
     "ns_coefficients": (3.0, -3.2, 1.2)},
]


@pytest.mark.parametrize("kwargs", CASES)
def test_fp32_newton_schulz_matches_torchs_step_element_by_element(kwargs):
    (model_peer, peer, losses_peer), (model_ours, ours, losses_ours) = run_both(kwargs, torch.float32)
    torch.testing.assert_close(losses_ours, losses_peer, rtol=RTOL / 10, atol=0)
    for p_ours, p_peer in zip(model_ours.parameters(), model_peer.parameters()):
        assert_close_to(p_ours, p_peer, "param")
        assert set(ours.state[p_ours]) == set(peer.state[p_peer]) == {"momentum_buffer"}
        assert_close_to(ours.state[p_ours]["momentum_buffer"], peer.state[p_peer]["momentum_buffer"],
                        "momentum_buffer")


@pytest.mark.parametrize("kwargs", [
    {"lr": LR}, {"lr": LR, "nesterov": False},
    {"lr": LR, "adjust_lr_fn": "match_rms_adamw"},
    {"lr": LR, "adjust_lr_fn": "match_rms_adamw", "nesterov": False},
])
def test_bf16_newton_schulz_tracks_stock_torch_optim_muon(kwargs):
    (model_peer, peer, losses_peer), (model_ours, ours, losses_ours) = run_both(kwargs, torch.bfloat16)
    torch.testing.assert_close(losses_ours, losses_peer, rtol=BF16_LOSS_RTOL, atol=0)
    for p_ours, p_peer, p0 in zip(model_ours.parameters(), model_peer.parameters(),
                                  make_model().parameters()):
        assert_close_to(p_ours, p_peer, "param", rtol=BF16_PARAM_TOL)
        # Not a pass by standing still: both moved far more than they differ.
        assert (p_peer - p0).abs().max() > 10 * BF16_PARAM_TOL * p_peer.abs().max()


def round_trip(source_cls, target_cls):
    """Trains 10 steps with source_cls, moves its state_dict into target_cls and
    into source_cls again; both continue with the same losses (fp32 NS on both
    sides, so that only a lost or misread momentum buffer could part them)."""
    xs, ys = make_data()
    model = make_model()

    def make(cls, params):
        return cls(params, lr=LR, **({"ns_dtype": torch.float32} if cls is Muon else {}))

    with torch_with_fp32_ns():
        opt = make(source_cls, model.parameters())
        train(model, opt, xs, ys, 10)
        state = copy.deepcopy(opt.state_dict())
        model_a, model_b, model_fresh = copy.deepcopy(model), copy.deepcopy(model), copy.deepcopy(model)
        a, b = make(source_cls, model_a.parameters()), make(target_cls, model_b.parameters())
        a.load_state_dict(copy.deepcopy(state))
        b.load_state_dict(copy.deepcopy(state))
        losses_a = train(model_a, a, xs[10:], ys[10:], 10)
        losses_b = train(model_b, b, xs[10:], ys[10:], 10)
        losses_fresh = train(model_fresh, make(target_cls, model_fresh.parameters()), xs[10:], ys[10:], 10)
    assert losses_b[0] == losses_a[0]  # the same parameters came along
    torch.testing.assert_close(losses_b, losses_a, rtol=RTOL / 10, atol=0)
    # Without the momentum the continuation parts visibly: the buffers carried it.
    assert max(abs(f - s) / s for f, s in zip(losses_fresh, losses_a)) > 100 * RTOL


def test_state_dict_moves_from_tierflow_to_torch():
    round_trip(Muon, torch.optim.Muon)


def test_state_dict_moves_from_torch_to_tierflow():
    round_trip(torch.optim.Muon, Muon)


def test_state_dict_has_torchs_layout():
    (_, peer, _), (_, ours, _) = run_both({}, torch.bfloat16, steps=2)
    mine, theirs = ours.state_dict(), peer.state_dict()
    assert mine["param_groups"] == theirs["param_groups"]
    assert set(mine["state"]) == set(theirs["state"]) == {0, 1, 2}
    for i, entry in mine["state"].items():
        assert set(entry) == {"momentum_buffer"}
        assert entry["momentum_buffer"].shape == theirs["state"][i]["momentum_buffer"].shape


def test_defaults_and_signature_are_torchs():
    import inspect
    ours = inspect.signature(Muon.__init__).parameters
    theirs = inspect.signature(torch.optim.Muon.__init__).parameters
    assert list(ours)[: len(theirs)] == list(theirs)
    for name, p in theirs.items():
        assert ours[name].default == p.default, name
    assert list(ours)[len(theirs):] == ["ns_dtype", "threads", "state_dtype", "offload", "nvme_dir", "host_memory"]
    opt = Muon(make_model().parameters())
    assert opt.threads == torch.get_num_threads() and opt.ns_dtype == torch.bfloat16
    assert isinstance(opt, torch.optim.Optimizer)


def matrix():
    return torch.nn.Parameter(torch.ones(4, 3))


@pytest.mark.parametrize("kwargs,message,torch_checks", [
    ({"lr": -1e-3}, "Learning rate should be >= 0 but is: -0.001", "init"),
    ({"lr": torch.tensor([1e-3, 1e-3])}, "Tensor lr must be 1-element", "init"),
    ({"momentum": -0.5}, "momentum should be >= 0 but is: -0.5", "init"),
    ({"weight_decay": -0.1}, "weight decay should be >= 0 but is: -0.1", "init"),
    ({"adjust_lr_fn": "rms"}, "Adjust learning rate function rms is not supported", "init"),
    ({"ns_steps": 100}, "Number of steps must be less than 100 for computational efficiency", "step"),
    ({"ns_coefficients": (3.4, -4.7)}, "Coefficients must be a tuple of exactly 3 values", "step"),
    ({"momentum": 1.0}, "momentum should be < 1 but is: 1.0", None),
    ({"eps": 0.0}, "eps should be > 0 but is: 0.0", None),
    ({"ns_steps": -1}, "ns_steps should be an int >= 0 but is: -1", None),
    ({"ns_steps": 2.5}, "ns_steps should be an int >= 0 but is: 2.5", None),
    ({"lr": float("inf")}, "Learning rate should be finite but is: inf", None),
    ({"ns_coefficients": (3.4, float("nan"), 2.0)}, "ns_coefficients should be finite", None),
    ({"ns_dtype": torch.float16}, "Invalid ns_dtype: torch.float16", None),
    ({"threads": 0}, "Invalid threads: 0", None),
])
def test_bad_hyper_parameters_raise_value_error_naming_them(kwargs, message, torch_checks):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        Muon([matrix()], **kwargs)
    # In a later group as well; the refused group is not kept.
    opt = Muon([matrix()])
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        if "ns_dtype" in kwargs or "threads" in kwargs:
            Muon([matrix()], **kwargs)
        else:
            opt.add_param_group({"params": [matrix()], **kwargs})
    assert len(opt.param_groups) == 1
    # torch says the same where it checks the same (some only at its first step).
    if torch_checks is not None:
        with pytest.raises(ValueError, match=message.replace("(", r"\(")):
            p = matrix()
            peer = torch.optim.Muon([p], **kwargs)
            p.grad = torch.ones_like(p)
            peer.step()


def test_a_parameter_that_is_not_a_matrix_is_refused_with_torchs_words():
    message = r"Muon only supports 2D parameters whereas we found a parameter with size: torch.Size\(\[5\]\)"
    for cls in (Muon, torch.optim.Muon):
        with pytest.raises(ValueError, match=message):
            cls([matrix(), torch.nn.Parameter(torch.ones(5))])
    opt = Muon([matrix()])
    with pytest.raises(ValueError, match=message):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(5))]})
    with pytest.raises(ValueError, match=r"params\[0\] is torch.float64"):
        Muon([torch.nn.Parameter(torch.ones(3, 3, dtype=torch.float64))])


def test_parameters_without_gradients_are_skipped_and_zero_size_ones_step():
    frozen, empty, used = (torch.nn.Parameter(torch.ones(4, 3)), torch.nn.Parameter(torch.zeros(0, 3)),
                           torch.nn.Parameter(torch.ones(4, 3)))
    opt = Muon([frozen, empty, used], lr=0.1)
    (used * torch.arange(12.0).view(4, 3)).sum().backward()
    empty.grad = torch.zeros(0, 3)
    opt.step()
    assert torch.equal(frozen, torch.ones(4, 3)) and frozen not in opt.state
    assert opt.state[empty]["momentum_buffer"].shape == (0, 3)
    assert not torch.equal(used, torch.ones(4, 3))


def test_steps_parameters_and_momentum_in_place_without_a_copy():
    model = make_model()
    opt = Muon(model.parameters())
    xs, ys = make_data()
    addresses = [p.data_ptr() for p in model.parameters()]
    before = [p.detach().clone() for p in model.parameters()]
    train(model, opt, xs, ys, 1)
    buffers = [opt.state[p]["momentum_buffer"].data_ptr() for p in model.parameters()]
    train(model, opt, xs[1:], ys[1:], 1)
    for p, address, old, buffer in zip(model.parameters(), addresses, before, buffers):
        state = opt.state[p]
        # What the extension reads and writes is the tensors' own memory.
        assert tierflow._core.address_of(p.detach()) == p.data_ptr() == address
        assert tierflow._core.address_of(state["momentum_buffer"]) == state["momentum_buffer"].data_ptr() == buffer
        assert not torch.equal(p, old)


def test_param_groups_lr_scheduler_and_closure_as_torch():
    xs, ys = make_data()
    results = []
    for cls in (torch.optim.Muon, Muon):
        model = make_model()
        extra = {"ns_dtype": torch.float32} if cls is Muon else {}
        opt = cls([{"params": model[0].parameters(), "lr": 3e-2, "nesterov": False},
                   {"params": model[2].parameters(), "adjust_lr_fn": "match_rms_adamw"},
                   {"params": model[4].parameters(), "weight_decay": 0.0, "momentum": 0.9}],
                  lr=1e-2, **extra)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
        losses = []
        with torch_with_fp32_ns():
            for x, y in zip(xs[:20], ys[:20]):
                def closure():
                    opt.zero_grad(set_to_none=True)
                    loss = torch.nn.functional.mse_loss(model(x), y)
                    loss.backward()
                    return loss
                losses.append(opt.step(closure).item())
                sched.step()
        results.append((losses, [p.detach().clone() for p in model.parameters()]))
    (peer_losses, peer_params), (losses, params) = results
    torch.testing.assert_close(losses, peer_losses, rtol=RTOL / 10, atol=0)
    for a, b in zip(params, peer_params):
        assert_close_to(a, b, "param")


def test_a_tensor_lr_and_grad_scaler_work_as_with_torch():
    xs, ys = make_data()
    results = []
    for cls in (torch.optim.Muon, Muon):
        model = make_model()
        extra = {"ns_dtype": torch.float32} if cls is Muon else {}
        opt = cls(model.parameters(), lr=torch.tensor(LR), **extra)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
        losses = []
        with torch_with_fp32_ns():
            for i, (x, y) in enumerate(zip(xs[:10], ys[:10])):
                opt.zero_grad()
                loss = torch.nn.functional.mse_loss(model(x), y)
                scaler.scale(loss).backward()
                if i == 3:  # an overflowed step: the scaler skips it and halves its scale
                    next(model.parameters()).grad[0, 0] = float("inf")
                scaler.step(opt)
                scaler.update()
                losses.append(loss.item())
        results.append((losses, scaler.get_scale(), [p.detach().clone() for p in model.parameters()]))
    (peer_losses, peer_scale, peer_params), (losses, scale, params) = results
    assert scale == peer_scale == 2.0 ** 9
    torch.testing.assert_close(losses, peer_losses, rtol=RTOL / 10, atol=0)
    for a, b in zip(params, peer_params):
        assert_close_to(a, b, "param")


def test_a_transposed_parameter_steps_as_with_torch():
    torch.manual_seed(3)
    peer_params = [torch.nn.Parameter(torch.randn(6, 9).t())]  # 9 x 6, a transposed view
    ours_params = [torch.nn.Parameter(p.detach().clone(memory_format=torch.preserve_format))
                   for p in peer_params]
    assert not ours_params[0].is_contiguous()
    peer = torch.optim.Muon(peer_params, lr=LR)
    ours = Muon(ours_params, lr=LR, ns_dtype=torch.float32)
    with torch_with_fp32_ns():
        for step in range(5):
            for params in (peer_params, ours_params):
                p = params[0]
                p.grad = torch.full_like(p, 0.1 * (step + 1)) + torch.arange(p.numel()).view(p.shape) * 1e-2
            peer.step()
            ours.step()
    assert ours_params[0].stride() == peer_params[0].stride()
    assert_close_to(ours_params[0], peer_params[0], "param")


def test_bf16_parameters_step_an_fp32_master_as_torch_steps_an_fp32_model():
    xs, ys = make_data()
    peer_model = make_model().to(torch.bfloat16)  # a bf16 model for forward and backward,
    master_model = copy.deepcopy(peer_model).float()  # its fp32 master for torch's step
    ours_model = copy.deepcopy(peer_model)
    peer = torch.optim.Muon(master_model.parameters(), lr=LR)
    ours = Muon(ours_model.parameters(), lr=LR, ns_dtype=torch.float32)
    with torch_with_fp32_ns():
        for x, y in zip(xs[:10], ys[:10]):
            x, y = x.to(torch.bfloat16), y.to(torch.bfloat16)
            peer_model.zero_grad(set_to_none=True)
            torch.nn.functional.mse_loss(peer_model(x), y).backward()
            # The same gradients on both sides, so that a bf16 rounding tie
            # broken differently cannot grow into two trajectories.
            for master, low, ours_p in zip(master_model.parameters(), peer_model.parameters(),
                                           ours_model.parameters()):
                master.grad = low.grad.float()
                ours_p.grad = low.grad.clone()
            peer.step()
            ours.step()
            with torch.no_grad():
                for master, low in zip(master_model.parameters(), peer_model.parameters()):
                    low.copy_(master)
    for p, master, peer_low in zip(ours_model.parameters(), master_model.parameters(),
                                   peer_model.parameters()):
        assert p.dtype == torch.bfloat16
        state = ours.state[p]
        assert state[MASTER_KEY].dtype == state["momentum_buffer"].dtype == torch.float32
        assert_close_to(state[MASTER_KEY], master, MASTER_KEY)
        # The bf16 parameter is the master rounded, written by the kernel's pass.
        assert torch.equal(p, state[MASTER_KEY].to(torch.bfloat16))
        # torch's bf16 model is its master rounded too: the same, but where
        # masters within RTOL round to neighbouring bf16s (one ulp, 2^-7 at most).
        torch.testing.assert_close(p, peer_low, rtol=2 ** -7, atol=RTOL * float(master.detach().abs().max()))
        assert (p == peer_low).float().mean() > 0.99


def test_bf16_state_keeps_its_fp32_master_through_state_dicts():
    model = make_model().to(torch.bfloat16)
    opt = Muon(model.parameters())
    xs, ys = make_data()
    x, y = xs[0].to(torch.bfloat16), ys[0].to(torch.bfloat16)
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    saved = copy.deepcopy(opt.state_dict())

    again = Muon(copy.deepcopy(model).parameters())
    again.load_state_dict(copy.deepcopy(saved))
    for p, q in zip(opt.state.values(), again.state.values()):
        for key in (MASTER_KEY, "momentum_buffer"):
            assert q[key].dtype == torch.float32 and torch.equal(q[key], p[key]), key

    # tierflow -> torch (a bf16 buffer, the master carried along stale) -> tierflow.
    peer_model = copy.deepcopy(model)
    peer = torch.optim.Muon(peer_model.parameters())
    peer.load_state_dict(copy.deepcopy(saved))
    torch.nn.functional.mse_loss(peer_model(x), y).backward()
    peer.step()
    back_model = copy.deepcopy(peer_model)
    back = Muon(back_model.parameters())
    back.load_state_dict(copy.deepcopy(peer.state_dict()))
    for p in back_model.parameters():
        assert torch.equal(back.state[p][MASTER_KEY], p.float())
        assert back.state[p]["momentum_buffer"].dtype == torch.float32
    torch.nn.functional.mse_loss(back_model(x), y).backward()
    back.step()
    for p in back_model.parameters():
        assert torch.equal(p, back.state[p][MASTER_KEY].to(torch.bfloat16))


def test_a_saved_state_dict_loads_with_weights_only_and_the_optimizer_copies(tmp_path):
    xs, ys = make_data()
    model = make_model()
    opt = Muon(model.parameters(), ns_dtype=torch.float32, threads=2)
    train(model, opt, xs, ys, 3)
    torch.save(opt.state_dict(), tmp_path / "opt.pt")
    loaded = torch.load(tmp_path / "opt.pt", weights_only=True)
    peer = torch.optim.Muon(copy.deepcopy(model).parameters())
    peer.load_state_dict(loaded)
    for a, b in zip(opt.state.values(), peer.state.values()):
        assert torch.equal(a["momentum_buffer"], b["momentum_buffer"])

    for twin in (copy.deepcopy(opt), pickle.loads(pickle.dumps(opt))):
        assert twin.threads == 2 and twin.ns_dtype == torch.float32
        params = [p for group in twin.param_groups for p in group["params"]]
        before = [p.detach().clone() for p in params]
        for p in params:
            p.grad = torch.ones_like(p)
        twin.step()  # on an executor and workspace made again for it
        assert all(not torch.equal(p, b) for p, b in zip(params, before))


def test_the_step_gives_torch_its_thread_count_back():
    """The kernel's GEMMs run on the OpenMP runtime torch's intra-op pool uses:
    a one-thread step must not leave torch with one thread."""
    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        model = make_model()
        opt = Muon(model.parameters(), threads=1)
        xs, ys = make_data()
        train(model, opt, xs, ys, 1)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(saved)


def test_the_step_releases_the_gil_while_it_runs():
    """Another Python thread runs while a long step is in the kernel: with the
    GIL held it could not run at all in the middle of the step."""
    param = torch.nn.Parameter(torch.zeros(512, 768))
    param.grad = torch.randn(512, 768)
    opt = Muon([param], threads=1, ns_dtype=torch.float32)
    opt.step()  # the state and the GEMM plans are made outside the measured steps
    windows, ticks, done = [], [], threading.Event()

    def steps():
        for _ in range(3):
            start = time.perf_counter()
            opt.step()
            windows.append((start, time.perf_counter()))
        done.set()

    stepper = threading.Thread(target=steps)
    stepper.start()
    while not done.wait(0.001):
        ticks.append(time.perf_counter())
    stepper.join()
    middles = [(start + 0.4 * (end - start), end - 0.4 * (end - start)) for start, end in windows]
    assert any(low <= t <= high for low, high in middles for t in ticks), \
        f"no Python ran in the middle of any of the steps: {windows}"


HYPER = dict(lr=1e-2, weight_decay=0.1, momentum=0.9, nesterov=True, ns_coefficients=DEFAULT_NS,
             eps=1e-7, ns_steps=5, adjust_lr_fn=None, ns_dtype="float32")


def test_the_kernel_call_scales_gradients_writes_a_copy_and_reuses_a_workspace():
    executor, workspace = tierflow._core.Executor(1), tierflow._core.MuonWorkspace()
    torch.manual_seed(4)
    grad = torch.randn(24, 40)
    p_scaled, p_plain, p_work = torch.ones(24, 40), torch.ones(24, 40), torch.ones(24, 40)
    b_scaled, b_plain, b_work = torch.zeros(24, 40), torch.zeros(24, 40), torch.zeros(24, 40)
    copy16 = torch.empty(24, 40, dtype=torch.bfloat16)
    tierflow._core.muon_step(executor, p_scaled, grad * 4, b_scaled, copy16, rows=24, cols=40,
                             grad_scale=0.25, **HYPER)
    tierflow._core.muon_step(executor, p_plain, grad, b_plain, rows=24, cols=40, **HYPER)
    assert_close_to(p_scaled, p_plain, "param")
    assert_close_to(b_scaled, b_plain, "momentum_buffer")
    assert torch.equal(copy16, p_scaled.to(torch.bfloat16))
    assert not torch.equal(p_plain, torch.ones(24, 40))
    # A workspace kept across shapes and hyper-parameters gives what a fresh one does.
    tierflow._core.muon_step(executor, torch.ones(64, 8), torch.randn(64, 8), torch.zeros(64, 8),
                             rows=64, cols=8, workspace=workspace, **{**HYPER, "ns_dtype": "bfloat16"})
    tierflow._core.muon_step(executor, p_work, grad, b_work, rows=24, cols=40, workspace=workspace, **HYPER)
    assert torch.equal(p_work, p_plain) and torch.equal(b_work, b_plain)


@pytest.mark.parametrize("change,name", [
    ({"rows": 25}, "param"),
    ({"grad": torch.ones(24, 39)}, "grad"),
    ({"momentum_buffer": torch.zeros(24, 40, dtype=torch.float16)}, "momentum_buffer"),
    ({"momentum_buffer": torch.zeros(24, 39, dtype=torch.bfloat16)}, "momentum_buffer"),
    ({"momentum_buffer": torch.zeros(24, 40, dtype=torch.bfloat16), "lr": -1.0}, "lr"),
    ({"param": torch.ones(24, 40, dtype=torch.bfloat16)}, "param"),
    ({"grad": torch.ones(24, 40, dtype=torch.float64)}, "grad"),
    ({"param_copy": torch.ones(24, 40)}, "param_copy"),
    ({"lr": -1.0}, "lr"),
    ({"momentum": 1.0}, "momentum"),
    ({"ns_steps": 101}, "ns_steps"),
    ({"eps": 0.0}, "eps"),
    ({"adjust_lr_fn": "rms"}, "adjust_lr_fn"),
    ({"ns_dtype": "float16"}, "gemm_dtype"),
    ({"grad_scale": 0.0}, "grad_scale"),
])
def test_the_kernel_call_names_a_bad_argument_and_writes_nothing(change, name):
    args = {"param": torch.ones(24, 40), "grad": torch.ones(24, 40), "momentum_buffer": torch.zeros(24, 40),
            "param_copy": None, "rows": 24, "cols": 40, **HYPER}
    args.update(change)
    before = (args["param"].clone(), args["momentum_buffer"].clone())
    executor = tierflow._core.Executor(1)
    with pytest.raises(ValueError, match=f"^{name}"):
        tierflow._core.muon_step(executor, args.pop("param"), args.pop("grad"), args.pop("momentum_buffer"),
                                 args.pop("param_copy"), **args)
    p, buf = (change.get("param", before[0]), change.get("momentum_buffer", before[1]))
    assert torch.equal(p, before[0]) and torch.equal(buf, before[1])


class TinyGPT(torch.nn.Module):
    """A GPT-shaped module: token and position embeddings, two pre-norm blocks
    (attention's qkv and projection, an MLP, biases and LayerNorms), a final
    norm and an LM head tied to the token embedding, which is named `tok` (no
    embedding marker): only the head's own name says what the tensor is."""

    def __init__(self, vocab=64, width=32, context=16):
        super().__init__()
        self.tok = torch.nn.Embedding(vocab, width)
        self.wpe = torch.nn.Embedding(context, width)
        self.blocks = torch.nn.ModuleList(torch.nn.ModuleDict({
            "ln_1": torch.nn.LayerNorm(width),
            "qkv": torch.nn.Linear(width, 3 * width),
            "proj": torch.nn.Linear(width, width),
            "ln_2": torch.nn.LayerNorm(width),
            "fc": torch.nn.Linear(width, 4 * width),
            "fc_out": torch.nn.Linear(4 * width, width)}) for _ in range(2))
        self.ln_f = torch.nn.LayerNorm(width)
        self.lm_head = torch.nn.Linear(width, vocab, bias=False)
        self.lm_head.weight = self.tok.weight

    def forward(self, idx):
        h = self.tok(idx) + self.wpe(torch.arange(idx.shape[1]))
        for b in self.blocks:
            q, k, v = b["qkv"](b["ln_1"](h)).chunk(3, dim=-1)
            h = h + b["proj"](torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))
            h = h + b["fc_out"](torch.nn.functional.gelu(b["fc"](b["ln_2"](h))))
        return self.lm_head(self.ln_f(h))


def test_muon_param_groups_splits_a_gpt_by_the_engines_rule():
    torch.manual_seed(5)
    model = TinyGPT()
    hidden, rest = muon_param_groups(model)
    names = {id(p): n for n, p in model.named_parameters()}
    assert [names[id(p)] for p in hidden] == [
        f"blocks.{i}.{m}.weight" for i in range(2) for m in ("qkv", "proj", "fc", "fc_out")]
    assert [names[id(p)] for p in rest] == ["tok.weight", "wpe.weight"] + [
        f"blocks.{i}.{m}" for i in range(2) for m in
        ("ln_1.weight", "ln_1.bias", "qkv.bias", "proj.bias", "ln_2.weight", "ln_2.bias",
         "fc.bias", "fc_out.bias")] + ["ln_f.weight", "ln_f.bias"]
    # Every parameter once, the tied one included.
    assert sorted(map(id, hidden + rest)) == sorted(id(p) for p in model.parameters())
    # The rule is the C++ one, name by name; the tied tensor is AdamW's
    # because one of its two names (lm_head) is a head's.
    named = list(model.named_parameters(remove_duplicate=False))
    muon_idx, adamw_idx = tierflow._core.group_parameters([(n, tuple(p.shape)) for n, p in named])
    assert {named[i][0] for i in muon_idx} == {names[id(p)] for p in hidden} | {"tok.weight"}
    assert "lm_head.weight" in {named[i][0] for i in adamw_idx}
    # (name, parameter) pairs do as well; deduplicated pairs lose the head's name.
    assert muon_param_groups(model.named_parameters(remove_duplicate=False)) == (hidden, rest)
    assert model.tok.weight in muon_param_groups(model.named_parameters()).muon
    with pytest.raises(ValueError, match="a module or \\(name, parameter\\) pairs"):
        muon_param_groups(model.parameters())

    # The split trains: Muon for the matrices, AdamW for the rest.
    opt_muon, opt_adamw = Muon(hidden, lr=0.02), AdamW(rest, lr=3e-3)
    g = torch.Generator().manual_seed(6)
    idx = torch.randint(0, 64, (8, 16), generator=g)
    losses = []
    for _ in range(8):
        opt_muon.zero_grad()
        opt_adamw.zero_grad()
        logits = model(idx[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 64), idx[:, 1:].reshape(-1))
        loss.backward()
        opt_muon.step()
        opt_adamw.step()
        losses.append(loss.item())
    assert losses[-1] < 0.9 * losses[0]


# bf16 momentum buffers against torch's fp32 ones over 30 steps (fp32
# Newton–Schulz on both sides, so that the buffer's rounding is all that
# differs), measured: parameters within 1.8e-2 of each one's scale, buffers
# within 1.2e-2 of theirs, losses within 6.6e-5 relative.
BF16_STATE_STEPS = 30
BF16_STATE_PARAM_TOL = 4e-2
BF16_STATE_BUFFER_TOL = 3e-2
BF16_STATE_LOSS_RTOL = 5e-4


def test_bf16_state_tracks_torch_muon_and_halves_the_momentum_buffers():
    xs, ys = make_data()
    model_peer = make_model()
    model_ours = copy.deepcopy(model_peer)
    peer = torch.optim.Muon(model_peer.parameters(), lr=LR)
    ours = Muon(model_ours.parameters(), lr=LR, ns_dtype=torch.float32, state_dtype="bf16")
    with torch_with_fp32_ns():
        losses_peer = train(model_peer, peer, xs, ys, BF16_STATE_STEPS)
    losses_ours = train(model_ours, ours, xs, ys, BF16_STATE_STEPS)
    torch.testing.assert_close(losses_ours, losses_peer, rtol=BF16_STATE_LOSS_RTOL, atol=0)
    for a, b in zip(model_ours.parameters(), model_peer.parameters()):
        mine, theirs = ours.state[a]["momentum_buffer"], peer.state[b]["momentum_buffer"]
        assert mine.dtype == torch.bfloat16 and mine.nbytes * 2 == theirs.nbytes
        for actual, expected, tol, what in ((a, b, BF16_STATE_PARAM_TOL, "param"),
                                            (mine, theirs, BF16_STATE_BUFFER_TOL, "momentum_buffer")):
            err = float((actual.detach().float() - expected.detach()).abs().max())
            assert err <= tol * float(expected.detach().abs().max()), what


@pytest.mark.parametrize("nesterov", [True, False])
def test_a_bf16_momentum_buffer_steps_as_the_fp32_one_and_stores_it_rounded(nesterov):
    """The same step from the same values: the bf16 buffer widened exactly,
    the fp32 arithmetic, so the parameter is the same bits and the buffer the
    fp32 one rounded to nearest-even (torch's .bfloat16())."""
    executor, workspace = tierflow._core.Executor(2), tierflow._core.MuonWorkspace()
    torch.manual_seed(5)
    hyper = {**HYPER, "nesterov": nesterov}
    b16 = torch.randn(24, 40).bfloat16()
    b32 = b16.float()
    p16, p32 = torch.randn(24, 40), None
    p32 = p16.clone()
    for step in range(3):
        grad = torch.randn(24, 40)
        tierflow._core.muon_step(executor, p16, grad, b16, rows=24, cols=40, workspace=workspace, **hyper)
        tierflow._core.muon_step(executor, p32, grad, b32, rows=24, cols=40, **hyper)
        assert torch.equal(p16, p32), step
        assert b16.dtype == torch.bfloat16 and torch.equal(b16, b32.bfloat16()), step
        b32 = b16.float()  # the next step from the stored buffer on both sides
    nan = torch.full((4, 4), float("nan"), dtype=torch.bfloat16)
    tierflow._core.muon_step(executor, torch.ones(4, 4), torch.ones(4, 4), nan, rows=4, cols=4, **hyper)
    assert nan.view(torch.int16).eq(0x7FC0).all()  # torch's one quiet nan


def test_bf16_momentum_buffers_through_state_dicts_both_ways():
    xs, ys = make_data()
    model = make_model()
    ours = Muon(model.parameters(), lr=LR, state_dtype=torch.bfloat16)
    train(model, ours, xs, ys, 3)
    saved = copy.deepcopy(ours.state_dict())
    assert all(entry["momentum_buffer"].dtype == torch.bfloat16 for entry in saved["state"].values())
    peer_model = copy.deepcopy(model)
    peer = torch.optim.Muon(peer_model.parameters(), lr=LR)
    peer.load_state_dict(copy.deepcopy(saved))  # torch casts the buffers to its parameters' fp32
    train(peer_model, peer, xs[3:], ys[3:], 2)
    back_model = copy.deepcopy(peer_model)
    back = Muon(back_model.parameters(), lr=LR, state_dtype="bf16")
    back.load_state_dict(copy.deepcopy(peer.state_dict()))
    for p, q in zip(back_model.parameters(), peer_model.parameters()):
        assert torch.equal(back.state[p]["momentum_buffer"], peer.state[q]["momentum_buffer"].bfloat16())
    train(back_model, back, xs[5:], ys[5:], 2)
    assert copy.deepcopy(back).state_dtype == torch.bfloat16
    with pytest.raises(ValueError, match="Invalid state_dtype"):
        Muon(make_model().parameters(), state_dtype="fp16")


def test_step_parameters_steps_the_given_matrices_alone_as_step_does():
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(6, 4)) for _ in range(3)]
    peers = [torch.nn.Parameter(p.detach().clone()) for p in params]
    ours = Muon([{"params": params[:2]}, {"params": params[2:], "lr": 0.05}], lr=0.02)
    whole = Muon([{"params": peers[:2]}, {"params": peers[2:], "lr": 0.05}], lr=0.02)
    untouched = params[1].detach().clone()
    for step in range(3):
        grads = [torch.randn(6, 4) for _ in params]
        for p, q, g in zip(params, peers, grads):
            p.grad, q.grad = g.clone(), g.clone()
        peers[1].grad = None  # the whole step of the same parameters: 0 and 2
        assert ours.step_parameters([params[2], params[0]]) == set()
        whole.step()
    for i in (0, 2):
        torch.testing.assert_close(params[i], peers[i], rtol=0, atol=0)
        torch.testing.assert_close(ours.state[params[i]]["momentum_buffer"],
                                   whole.state[peers[i]]["momentum_buffer"], rtol=0, atol=0)
    assert torch.equal(params[1], untouched) and params[1] not in ours.state
    params[0].grad = None
    with pytest.raises(ValueError, match="^step_parameters: a parameter without a gradient$"):
        ours.step_parameters([params[0]])
    stranger = torch.nn.Parameter(torch.randn(6, 4))
    stranger.grad = torch.randn(6, 4)
    with pytest.raises(ValueError, match="^step_parameters: a parameter this optimizer does not hold$"):
        ours.step_parameters([stranger])
