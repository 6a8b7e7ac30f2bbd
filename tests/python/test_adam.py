"""tierflow.torch.optim.Adam / AdamW against torch.optim's on the same model,
data and seed: the same losses, parameters and state, element by element."""

import copy

import pytest
import torch

import tierflow
from tierflow.torch.optim import MASTER_KEY, Adam, AdamW

STEPS = 50
RTOL = 1e-5


def assert_close_to(actual, expected, what=""):
    """Element by element within RTOL of each tensor's own scale: torch's
    for-loop step and tierflow's fused one round differently (as torch's own
    fused and for-loop steps do), so an element near zero after 50 steps at lr
    1e-2 differs by up to 1.5e-7 absolute from one near 1e-2 in magnitude."""
    atol = RTOL * float(expected.detach().abs().max()) if expected.numel() else 0.0
    torch.testing.assert_close(actual, expected, rtol=RTOL, atol=atol,
                               msg=lambda m: f"{what}: {m}")

# (name, constructor arguments) as torch's own optimizer tests vary them.
CASES = [
    ("adamw", {}),
    ("adamw", {"weight_decay": 0.1, "amsgrad": True}),
    ("adamw", {"lr": 1e-2, "betas": (0.8, 0.99), "eps": 1e-6, "maximize": True}),
    ("adam", {}),
    ("adam", {"weight_decay": 0.05}),
    ("adam", {"weight_decay": 0.05, "amsgrad": True, "maximize": True}),
    ("adam", {"weight_decay": 0.05, "decoupled_weight_decay": True}),
]


def make_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1, bias=False))


def make_data(seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(STEPS, 16, 32, generator=g), torch.randn(STEPS, 16, 1, generator=g)


def peer_class(name):
    return {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[name]


def tierflow_class(name):
    return {"adam": Adam, "adamw": AdamW}[name]


def train(model, optimizer, xs, ys, steps):
    losses = []
    for x, y in zip(xs[:steps], ys[:steps]):
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def assert_same_state(ours, theirs):
    for p_ours, p_theirs in zip(ours.state.keys(), theirs.state.keys()):
        a, b = ours.state[p_ours], theirs.state[p_theirs]
        assert set(b) <= set(a), f"tierflow's state lacks {set(b) - set(a)}"
        for key in b:
            assert_close_to(a[key], b[key], key)


@pytest.mark.parametrize("name,kwargs", CASES)
def test_same_losses_parameters_and_state_as_torch(name, kwargs):
    xs, ys = make_data()
    model_peer = make_model()
    model_ours = copy.deepcopy(model_peer)
    peer = peer_class(name)(model_peer.parameters(), **kwargs)
    ours = tierflow_class(name)(model_ours.parameters(), **kwargs)

    losses_peer = train(model_peer, peer, xs, ys, STEPS)
    losses_ours = train(model_ours, ours, xs, ys, STEPS)

    torch.testing.assert_close(losses_ours, losses_peer, rtol=RTOL, atol=0)
    for a, b in zip(model_ours.parameters(), model_peer.parameters()):
        assert_close_to(a, b, "param")
    assert_same_state(ours, peer)


def test_steps_parameters_in_place_without_a_copy():
    model = make_model()
    opt = AdamW(model.parameters())
    xs, ys = make_data()
    addresses = [p.data_ptr() for p in model.parameters()]
    before = [p.detach().clone() for p in model.parameters()]
    train(model, opt, xs, ys, 1)
    for p, address, old in zip(model.parameters(), addresses, before):
        state = opt.state[p]
        # What the extension reads and writes is the tensor's own memory.
        assert tierflow._core.address_of(p.detach()) == p.data_ptr() == address
        assert tierflow._core.address_of(state["exp_avg"]) == state["exp_avg"].data_ptr()
        assert not torch.equal(p, old)  # updated where it lies


def round_trip(source_cls, target_cls, kwargs):
    """Trains 10 steps with source_cls, moves its state_dict into target_cls and
    into source_cls again; both continue with the same losses."""
    xs, ys = make_data()
    model = make_model()
    opt = source_cls(model.parameters(), **kwargs)
    train(model, opt, xs, ys, 10)
    state = copy.deepcopy(opt.state_dict())

    model_a, model_b = copy.deepcopy(model), copy.deepcopy(model)
    a = source_cls(model_a.parameters(), **kwargs)
    b = target_cls(model_b.parameters(), **kwargs)
    a.load_state_dict(copy.deepcopy(state))
    b.load_state_dict(copy.deepcopy(state))
    losses_a = train(model_a, a, xs[10:], ys[10:], 10)
    losses_b = train(model_b, b, xs[10:], ys[10:], 10)
    torch.testing.assert_close(losses_b, losses_a, rtol=RTOL, atol=0)


@pytest.mark.parametrize("amsgrad", [False, True])
def test_state_dict_moves_from_tierflow_to_torch(amsgrad):
    round_trip(AdamW, torch.optim.AdamW, {"amsgrad": amsgrad, "weight_decay": 0.1})


@pytest.mark.parametrize("amsgrad", [False, True])
def test_state_dict_moves_from_torch_to_tierflow(amsgrad):
    round_trip(torch.optim.AdamW, AdamW, {"amsgrad": amsgrad, "weight_decay": 0.1})


def test_state_dict_has_torchs_layout():
    model = make_model()
    ours = AdamW(model.parameters(), amsgrad=True)
    peer = torch.optim.AdamW(copy.deepcopy(model).parameters(), amsgrad=True)
    xs, ys = make_data()
    train(model, ours, xs, ys, 2)
    sd = ours.state_dict()
    assert set(sd["param_groups"][0]) == set(peer.state_dict()["param_groups"][0])
    assert set(sd["state"][0]) == {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"}
    assert sd["state"][0]["step"].dtype == torch.float32 and sd["state"][0]["step"].item() == 2


@pytest.mark.parametrize("argument,kwargs,message", [
    ("lr", {"lr": -1e-3}, "Invalid learning rate: -0.001"),
    ("eps", {"eps": -1.0}, "Invalid epsilon value: -1.0"),
    ("betas[0]", {"betas": (1.0, 0.999)}, "Invalid beta parameter at index 0: 1.0"),
    ("betas[1]", {"betas": (0.9, -0.1)}, "Invalid beta parameter at index 1: -0.1"),
    ("weight_decay", {"weight_decay": -0.5}, "Invalid weight_decay value: -0.5"),
    ("lr", {"lr": torch.tensor([1e-3, 1e-3])}, "Tensor lr must be 1-element"),
    ("capturable", {"capturable": True}, "capturable=True is not supported"),
    ("differentiable", {"differentiable": True}, "differentiable=True is not supported"),
    ("offload", {"offload": "disk"}, "Invalid offload: 'disk'"),
    ("threads", {"threads": 0}, "Invalid threads: 0"),
])
@pytest.mark.parametrize("cls", [Adam, AdamW])
def test_bad_hyper_parameters_raise_value_error_naming_them(cls, argument, kwargs, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(")):
        cls(make_model().parameters(), **kwargs)
    # torch says the same where it checks the same.
    if argument in ("lr", "eps", "betas[0]", "betas[1]", "weight_decay"):
        with pytest.raises(ValueError, match=message.replace("[", r"\[")):
            torch.optim.AdamW(make_model().parameters(), **kwargs)


def test_foreach_and_fused_are_accepted_and_a_torch_state_dict_carrying_them_loads():
    model = make_model()
    peer = torch.optim.AdamW(copy.deepcopy(model).parameters(), fused=True)
    ours = AdamW(model.parameters(), foreach=True)
    ours.load_state_dict(peer.state_dict())
    assert ours.param_groups[0]["fused"] is True
    with pytest.raises(RuntimeError, match="`fused` and `foreach` cannot be `True` together") as theirs:
        torch.optim.AdamW(model.parameters(), foreach=True, fused=True)
    with pytest.raises(type(theirs.value), match="`fused` and `foreach` cannot be `True` together"):
        AdamW(model.parameters(), foreach=True, fused=True)


def test_bf16_parameters_match_torch_adamw_on_an_fp32_master():
    xs, ys = make_data()
    peer_model = make_model().to(torch.bfloat16)  # torch's recipe: a bf16 model for forward and
    master_model = copy.deepcopy(peer_model).float()  # backward, its fp32 master for the step
    ours_model = copy.deepcopy(peer_model)
    peer = torch.optim.AdamW(master_model.parameters(), weight_decay=0.1)
    ours = AdamW(ours_model.parameters(), weight_decay=0.1)
    for x, y in zip(xs[:20], ys[:20]):
        x, y = x.to(torch.bfloat16), y.to(torch.bfloat16)
        peer_model.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(peer_model(x), y).backward()
        # The same gradients on both sides, so that a bf16 rounding tie broken
        # differently cannot grow into two trajectories.
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
        assert_close_to(ours.state[p][MASTER_KEY], master, MASTER_KEY)
        assert ours.state[p]["exp_avg"].dtype == torch.float32
        # The bf16 parameter is the master rounded, written by the same pass
        # (equal but where nearly equal masters round to neighbouring bf16s).
        torch.testing.assert_close(p, peer_low, rtol=2 ** -8, atol=0)
        assert (p == peer_low).float().mean() > 0.99


def test_parameters_without_gradients_are_skipped_and_zero_size_ones_step():
    frozen = torch.nn.Parameter(torch.ones(4))
    empty = torch.nn.Parameter(torch.zeros(0))
    used = torch.nn.Parameter(torch.ones(4))
    opt = AdamW([frozen, empty, used], lr=0.1)
    (used.sum() + empty.sum()).backward()
    opt.step()
    assert torch.equal(frozen, torch.ones(4)) and frozen not in opt.state
    assert opt.state[empty]["step"].item() == 1
    assert (used < 1).all()


def test_param_groups_lr_scheduler_and_closure_as_torch():
    xs, ys = make_data()
    results = []
    for cls in (torch.optim.AdamW, AdamW):
        model = make_model()
        opt = cls([{"params": model[0].parameters(), "lr": 3e-3},
                   {"params": model[2].parameters(), "weight_decay": 0.0}], lr=1e-3)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
        losses = []
        for x, y in zip(xs[:20], ys[:20]):
            def closure():
                opt.zero_grad(set_to_none=True)
                loss = torch.nn.functional.mse_loss(model(x), y)
                loss.backward()
                return loss
            losses.append(opt.step(closure).item())
            sched.step()
        results.append(losses)
    assert isinstance(AdamW(make_model().parameters()), torch.optim.Optimizer)
    torch.testing.assert_close(results[1], results[0], rtol=RTOL, atol=0)


def test_parameters_off_the_cpu_or_of_other_dtypes_are_refused_by_name():
    with pytest.raises(ValueError, match=r"params\[0\] is torch.float64"):
        AdamW([torch.nn.Parameter(torch.ones(3, dtype=torch.float64))])


def test_bf16_state_keeps_its_fp32_master_through_state_dicts():
    xs, ys = make_data()
    model = make_model().to(torch.bfloat16)
    opt = AdamW(model.parameters())
    x, y = xs[0].to(torch.bfloat16), ys[0].to(torch.bfloat16)
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    saved = copy.deepcopy(opt.state_dict())

    # tierflow -> tierflow: torch's stock load would round the master to bf16.
    again = AdamW(copy.deepcopy(model).parameters())
    again.load_state_dict(copy.deepcopy(saved))
    for p, q in zip(opt.state.values(), again.state.values()):
        for key in (MASTER_KEY, "exp_avg", "exp_avg_sq"):
            assert q[key].dtype == torch.float32
            assert torch.equal(q[key], p[key]), key

    # tierflow -> torch, which steps (carrying the master along untouched, so
    # stale), then back: the master is made again from the parameter.
    peer_model = copy.deepcopy(model)
    peer = torch.optim.AdamW(peer_model.parameters())
    peer.load_state_dict(copy.deepcopy(saved))
    torch.nn.functional.mse_loss(peer_model(x), y).backward()
    peer.step()
    back_model = copy.deepcopy(peer_model)
    back = AdamW(back_model.parameters())
    back.load_state_dict(copy.deepcopy(peer.state_dict()))
    for p in back_model.parameters():
        assert torch.equal(back.state[p][MASTER_KEY], p.float())
    torch.nn.functional.mse_loss(back_model(x), y).backward()
    back.step()
    for p in back_model.parameters():
        assert back.state[p][MASTER_KEY].dtype == torch.float32
        assert back.state[p]["exp_avg"].dtype == torch.float32
        assert back.state[p]["step"].item() == 3


def test_the_step_releases_the_gil_while_it_runs():
    """Another Python thread runs while a long step is in the kernel: with the
    GIL held it could not run at all in the middle of the step."""
    import threading
    import time

    n = 1 << 24
    param = torch.nn.Parameter(torch.zeros(n))
    param.grad = torch.ones(n)
    opt = AdamW([param], threads=1)
    opt.step()  # the state is made outside the measured steps
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


def assert_grad_scaler_steps_as_torch(make_model, xs, ys, device, lr):
    """torch.optim.AdamW and tierflow's under torch.amp.GradScaler on the same
    model and data, one overflowed step among them: the same losses, scale
    and parameters."""
    results = []
    for cls in (torch.optim.AdamW, AdamW):
        model = make_model()
        opt = cls(model.parameters(), lr=lr)
        scaler = torch.amp.GradScaler(device, init_scale=2.0 ** 10)
        losses = []
        for i, (x, y) in enumerate(zip(xs, ys)):
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
    torch.testing.assert_close(losses, peer_losses, rtol=RTOL, atol=0)
    for a, b in zip(params, peer_params):
        assert_close_to(a, b, "param")


def test_a_tensor_lr_and_grad_scaler_work_as_with_torch():
    xs, ys = make_data()
    assert_grad_scaler_steps_as_torch(make_model, xs[:10], ys[:10], "cpu", torch.tensor(2e-3))


def test_a_saved_state_dict_loads_with_weights_only_and_the_optimizer_deep_copies(tmp_path):
    xs, ys = make_data()
    model = make_model()
    opt = AdamW(model.parameters(), amsgrad=True, threads=2)
    train(model, opt, xs, ys, 3)
    torch.save(opt.state_dict(), tmp_path / "opt.pt")
    loaded = torch.load(tmp_path / "opt.pt", weights_only=True)
    peer = torch.optim.AdamW(copy.deepcopy(model).parameters(), amsgrad=True)
    peer.load_state_dict(loaded)
    assert_same_state(opt, peer)

    twin = copy.deepcopy(opt)  # its own copies of the parameters and state
    assert twin.threads == 2 and twin.offload == "cpu"
    params = [p for group in twin.param_groups for p in group["params"]]
    before = [p.detach().clone() for p in params]
    for p in params:
        p.grad = torch.ones_like(p)
    twin.step()  # on an executor made again for it
    assert all(not torch.equal(p, b) for p, b in zip(params, before))


@pytest.mark.parametrize("maximize", [False, True])
def test_non_contiguous_and_channels_last_parameters_step_as_with_torch(maximize):
    torch.manual_seed(3)
    def make():
        return [torch.nn.Parameter(torch.randn(6, 5).t()),  # a transposed view
                torch.nn.Parameter(torch.randn(4, 3, 3, 3).to(memory_format=torch.channels_last))]
    peer_params = make()
    ours_params = [torch.nn.Parameter(p.detach().clone(memory_format=torch.preserve_format))
                   for p in peer_params]
    assert not ours_params[0].is_contiguous()
    peer = torch.optim.AdamW(peer_params, lr=1e-2, maximize=maximize)
    ours = AdamW(ours_params, lr=1e-2, maximize=maximize)
    for step in range(5):
        for params in (peer_params, ours_params):
            for i, p in enumerate(params):
                # Gradients with the parameters' strides, as autograd makes them.
                p.grad = torch.full_like(p, 0.1 * (step + 1)) + torch.arange(p.numel()).view(p.shape) * 1e-3
        peer.step()
        ours.step()
    for a, b in zip(ours_params, peer_params):
        assert a.stride() == b.stride()
        assert_close_to(a, b, "param")


def test_the_kernel_call_scales_gradients_and_skips_a_nonfinite_step():
    n = 1000
    executor = tierflow._core.Executor(1)
    hyper = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, decoupled=True)
    p_scaled, p_plain = torch.ones(n), torch.ones(n)
    m, v, m2, v2 = (torch.zeros(n) for _ in range(4))
    grad = torch.linspace(-1, 1, n)
    assert tierflow._core.adam_step(executor, p_scaled, grad * 4, m, v, step=1, grad_scale=0.25, **hyper)
    assert tierflow._core.adam_step(executor, p_plain, grad, m2, v2, step=1, **hyper)
    assert_close_to(p_scaled, p_plain, "param")
    assert_close_to(m, m2, "exp_avg")

    bad = grad.clone()
    bad[7] = float("nan")
    before = (p_plain.clone(), m2.clone(), v2.clone())
    assert not tierflow._core.adam_step(executor, p_plain, bad, m2, v2, step=2, skip_nonfinite=True, **hyper)
    for after, old in zip((p_plain, m2, v2), before):
        assert torch.equal(after, old)  # nothing written
    with pytest.raises(ValueError, match="exp_avg_sq"):
        tierflow._core.adam_step(executor, p_plain, grad, m2, torch.zeros(n - 1), step=2, **hyper)


def test_a_group_step_is_the_kernel_called_per_parameter_and_checks_every_gradient_first():
    core = tierflow._core
    executor = core.Executor(2)
    hyper = dict(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1, decoupled=False, maximize=True)
    gen = torch.Generator().manual_seed(5)

    def buffers(n, low_precision):  # param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, copy, step
        param = torch.randn(n, generator=gen)
        return [param, torch.randn(n, generator=gen).to(torch.bfloat16 if low_precision else torch.float32),
                torch.rand(n, generator=gen), torch.rand(n, generator=gen), torch.rand(n, generator=gen),
                param.to(torch.bfloat16) if low_precision else None, torch.tensor(2.0)]

    ours = [buffers(1000, False), buffers(0, False), buffers(37, True)]
    peers = [[None if t is None else t.clone() for t in b] for b in ours]
    slots = [core.AdamSlot(p, m, v, v_max, copy, step) for p, _, m, v, v_max, copy, step in ours]
    core.adam_step_group(executor, slots, [b[1] for b in ours], **hyper)
    for p, g, m, v, v_max, copy, step in peers:
        step += 1
        core.adam_step(executor, p, g, m, v, v_max, copy, step=int(step.item()), **hyper)
    for a, b in zip(ours, peers):
        for x, y in zip(a, b):
            assert x is None or torch.equal(x, y)  # the same bits, the step counts at 3

    before = [[None if t is None else t.clone() for t in b] for b in ours]
    grads = [b[1] for b in ours]
    with pytest.raises(ValueError, match=r"grads\[2\]: 36 elements for a param of 37"):
        core.adam_step_group(executor, slots, grads[:2] + [grads[2][:36]], **hyper)
    with pytest.raises(ValueError, match=r"grads\[0\]: float32, bfloat16 or float16 expected"):
        core.adam_step_group(executor, slots, [grads[0].double()] + grads[1:], **hyper)
    for a, b in zip(ours, before):
        for x, y in zip(a, b):
            assert x is None or torch.equal(x, y)  # nothing written, no count advanced
    with pytest.raises(ValueError, match="exp_avg_sq: 36 elements for a param of 37"):
        core.AdamSlot(torch.zeros(37), torch.zeros(37), torch.zeros(36), None, None, torch.tensor(0.0))
    with pytest.raises(ValueError, match="step: a float32 or float64 tensor expected"):
        core.AdamSlot(torch.zeros(3), torch.zeros(3), torch.zeros(3), None, None, torch.tensor(0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_replaced_state_and_moved_parameters_step_where_they_now_are(dtype):
    torch.manual_seed(4)
    peer_param = torch.nn.Parameter(torch.randn(3, 5).to(dtype))
    ours_param = torch.nn.Parameter(peer_param.detach().clone())
    master = torch.nn.Parameter(peer_param.detach().float())  # torch steps an fp32 master
    peer = torch.optim.AdamW([master], lr=1e-2)
    ours = AdamW([ours_param], lr=1e-2)
    for step in range(6):
        grad = torch.full((3, 5), 0.1 * (step + 1)) + torch.arange(15.0).view(3, 5) * 1e-2
        master.grad, ours_param.grad = grad.to(dtype).float(), grad.to(dtype)  # the same values
        if step == 2:  # a parameter's storage replaced: the step follows it
            old = ours_param.detach()
            ours_param.data = ours_param.detach().clone()
            kept = old.clone()
        if step == 4:  # a state tensor replaced, as a user or a tool may do
            ours.state[ours_param]["exp_avg"] = ours.state[ours_param]["exp_avg"].clone()
        peer.step()
        ours.step()
        with torch.no_grad():
            peer_param.copy_(master)
    assert torch.equal(old, kept)  # the storage left behind is not written
    state = ours.state[ours_param]
    assert tierflow._core.address_of(state["exp_avg"]) == state["exp_avg"].data_ptr()
    assert state["step"].item() == 6 and state["step"].dtype == torch.float32
    assert_close_to(state["exp_avg"], peer.state[master]["exp_avg"], "exp_avg")
    if dtype == torch.float32:
        assert_close_to(ours_param, peer_param, "param")
    else:  # the master rounded, as torch's copy_ rounds it
        torch.testing.assert_close(ours_param, peer_param, rtol=2 ** -8, atol=0)


def poison(step, params):
    """The gradients a step makes non-finite: a nan at step 2 in the first
    weight, an inf at step 4 in the last one, both at step 6."""
    bad = {2: {0: float("nan")}, 4: {len(params) - 1: float("inf")},
           6: {0: float("-inf"), len(params) - 1: float("nan")}}.get(step, {})
    for index, value in bad.items():
        params[index].grad.view(-1)[params[index].numel() // 2] = value
    return set(bad)


@pytest.mark.parametrize("name,kwargs", [("adamw", {"amsgrad": True}), ("adam", {"weight_decay": 0.05})])
def test_skip_nonfinite_leaves_a_parameter_with_an_inf_or_nan_gradient_as_it_was(name, kwargs):
    """Per parameter: the one with a bad gradient keeps its value, state and
    count (as torch leaves a parameter without a gradient), the others step."""
    xs, ys = make_data()
    model_peer = make_model()
    model_ours = copy.deepcopy(model_peer)
    peer = peer_class(name)(model_peer.parameters(), **kwargs)
    ours = tierflow_class(name)(model_ours.parameters(), skip_nonfinite=True, **kwargs)
    assert ours.skipped_steps == 0 and ours.last_step_skipped is False
    params_peer, params_ours = list(model_peer.parameters()), list(model_ours.parameters())
    for step, (x, y) in enumerate(zip(xs[:10], ys[:10])):
        for model, opt in ((model_peer, peer), (model_ours, ours)):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
        bad = poison(step, params_ours)
        for index in bad:
            params_peer[index].grad = None  # torch's way of leaving a parameter out of a step
        before = {i: (params_ours[i].detach().clone(), copy.deepcopy(ours.state[params_ours[i]])) for i in bad}
        peer.step()
        ours.step()
        assert ours.last_step_skipped is bool(bad)
        for index, (value, state) in before.items():
            assert torch.equal(params_ours[index], value)
            for key, tensor in state.items():
                assert torch.equal(ours.state[params_ours[index]][key], tensor), key
    assert ours.skipped_steps == 3
    for a, b in zip(params_ours, params_peer):
        assert_close_to(a, b, "param")
        assert torch.isfinite(a).all()
    assert_same_state(ours, peer)
    assert [ours.state[p]["step"].item() for p in params_ours] == [8, 10, 8]


def test_without_skip_nonfinite_a_nan_flows_into_the_update_as_in_torch():
    results = []
    for cls in (torch.optim.AdamW, AdamW):
        p = torch.nn.Parameter(torch.ones(8))
        opt = cls([p])
        p.grad = torch.ones(8)
        p.grad[3] = float("nan")
        opt.step()
        results.append(p.detach().clone())
    torch.testing.assert_close(results[1], results[0], equal_nan=True)
    assert results[1][3].isnan() and torch.isfinite(results[1][:3]).all()
    with pytest.raises(ValueError, match="Invalid skip_nonfinite: 1"):
        AdamW([torch.nn.Parameter(torch.ones(2))], skip_nonfinite=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_skipped_non_contiguous_parameter_is_not_written_from_its_stand_in(dtype):
    param = torch.nn.Parameter(torch.randn(6, 5).to(dtype).t())
    assert not param.is_contiguous()
    opt = AdamW([param], skip_nonfinite=True)
    param.grad = torch.ones_like(param)
    opt.step()
    before = param.detach().clone()
    param.grad = torch.ones_like(param)
    param.grad[1, 2] = float("inf")
    opt.step()
    assert opt.last_step_skipped and torch.equal(param, before)
    assert opt.state[param]["step"].item() == 1


def test_skip_counts_survive_a_copy_and_grad_scaler_still_skips_first():
    xs, ys = make_data()
    model = make_model()
    opt = AdamW(model.parameters(), skip_nonfinite=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    for i, (x, y) in enumerate(zip(xs[:6], ys[:6])):
        opt.zero_grad()
        scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
        if i == 2:  # the scaler sees the overflow and never calls step(): nothing counts here
            next(model.parameters()).grad[0, 0] = float("inf")
        scaler.step(opt)
        scaler.update()
    assert scaler.get_scale() == 2.0 ** 9 and opt.skipped_steps == 0
    for p in model.parameters():
        p.grad = torch.full_like(p, float("nan"))
    opt.step()
    twin = copy.deepcopy(opt)
    assert twin.skip_nonfinite and twin.skipped_steps == 1 and twin.last_step_skipped
    assert [s["step"].item() for s in twin.state.values()] == [5, 5, 5]


def test_the_group_call_returns_the_slots_it_skipped_and_leaves_their_counts():
    core = tierflow._core
    executor = core.Executor(2)
    hyper = dict(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1, decoupled=True)
    slots, buffers = [], []
    for n in (100, 1000, 0, 37):
        param, m, v, step = torch.ones(n), torch.zeros(n), torch.zeros(n), torch.tensor(4.0)
        slots.append(core.AdamSlot(param, m, v, None, None, step))
        buffers.append((param, m, v, step))
    grads = [torch.full((len(b[0]),), 0.5, dtype=torch.bfloat16) for b in buffers]
    assert core.adam_step_group(executor, slots, grads, skip_nonfinite=True, **hyper) == []
    grads[1][999] = float("nan")  # the last elements: the whole gradient is read first
    grads[3][36] = float("-inf")
    kept = [[t.clone() for t in b] for b in buffers]
    assert core.adam_step_group(executor, slots, grads, skip_nonfinite=True, **hyper) == [1, 3]
    assert [b[3].item() for b in buffers] == [6, 5, 6, 5]
    for index in (1, 3):
        for after, old in zip(buffers[index], kept[index]):
            assert torch.equal(after, old)
    assert not torch.equal(buffers[0][0], kept[0][0])
    assert core.adam_step_group(executor, slots, grads, **hyper) == []  # off: nothing skipped
    assert buffers[1][0].isnan().any() and [b[3].item() for b in buffers] == [7, 6, 7, 6]


# bf16 moments against torch's fp32 ones after 30 steps, measured: the
# parameters within 4.7e-4 (lr 1e-3) and 7.6e-3 (lr 1e-2, amsgrad) of each
# one's scale, the moments within 1.2e-2 of theirs: each store rounds a moment
# to 8 bits of mantissa, and the roundings compound through the trajectory.
BF16_STATE_STEPS = 30
BF16_PARAM_TOL = 1.5e-2
BF16_STATE_TOL = 2.5e-2


def assert_within_scale(actual, expected, tol, what):
    scale = float(expected.detach().abs().max())
    err = float((actual.detach().float() - expected.detach().float()).abs().max())
    assert err <= tol * scale, f"{what}: {err:.3g} off, more than {tol} of its scale {scale:.3g}"


@pytest.mark.parametrize("kwargs", [{}, {"lr": 1e-2, "amsgrad": True, "weight_decay": 0.1}])
def test_bf16_state_tracks_torch_adamw_and_halves_the_state(kwargs):
    xs, ys = make_data()
    model_peer = make_model()
    model_ours, model_fp32 = copy.deepcopy(model_peer), copy.deepcopy(model_peer)
    peer = torch.optim.AdamW(model_peer.parameters(), **kwargs)
    ours = AdamW(model_ours.parameters(), state_dtype="bf16", **kwargs)
    fp32 = AdamW(model_fp32.parameters(), **kwargs)
    losses_peer = train(model_peer, peer, xs, ys, BF16_STATE_STEPS)
    losses_ours = train(model_ours, ours, xs, ys, BF16_STATE_STEPS)
    train(model_fp32, fp32, xs, ys, BF16_STATE_STEPS)
    torch.testing.assert_close(losses_ours, losses_peer, rtol=1e-2, atol=0)
    for a, b in zip(model_ours.parameters(), model_peer.parameters()):
        assert a.dtype == torch.float32
        assert_within_scale(a, b, BF16_PARAM_TOL, "param")
    keys = {"exp_avg", "exp_avg_sq"} | ({"max_exp_avg_sq"} if kwargs.get("amsgrad") else set())
    for p_ours, p_peer, p_fp32 in zip(model_ours.parameters(), model_peer.parameters(), model_fp32.parameters()):
        for key in keys:
            mine, wide = ours.state[p_ours][key], fp32.state[p_fp32][key]
            assert mine.dtype == torch.bfloat16 and wide.dtype == torch.float32
            assert mine.nbytes * 2 == wide.nbytes == 4 * p_ours.numel()
            assert_within_scale(mine, peer.state[p_peer][key], BF16_STATE_TOL, key)


def test_bf16_moments_are_the_fp32_step_rounded_to_nearest_even():
    """Each step from the kernel's own state: the reference widens the bf16
    moments, steps in fp32 as torch does and rounds the moments (torch's
    .bfloat16() is round-to-nearest-even), so no drift accumulates and the
    difference is the kernel's fp32 rounding: a bf16 step of a moment where
    it falls on a tie, 1e-6 on the parameter."""
    torch.manual_seed(7)
    n, lr, betas, eps, wd = 4096, 1e-2, (0.9, 0.99), 1e-8, 0.1
    param = torch.nn.Parameter(torch.randn(n))
    opt = AdamW([param], lr=lr, betas=betas, eps=eps, weight_decay=wd, amsgrad=True, state_dtype=torch.bfloat16)
    for step in range(1, 6):
        grad = torch.randn(n) * 10 ** (step - 3)
        p = param.detach().clone()
        state = opt.state[param]
        m, v, v_max = ((state[k].float() if k in state else torch.zeros(n))
                       for k in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"))
        p.mul_(1 - lr * wd)
        m.lerp_(grad, 1 - betas[0])
        v.mul_(betas[1]).addcmul_(grad, grad, value=1 - betas[1])
        v_max = torch.maximum(v_max, v)
        denom = v_max.sqrt() / (1 - betas[1] ** step) ** 0.5 + eps
        p.addcdiv_(m, denom, value=-lr / (1 - betas[0] ** step))
        param.grad = grad
        opt.step()
        assert_close_to(param, p, "param")
        for key, wide in (("exp_avg", m), ("exp_avg_sq", v), ("max_exp_avg_sq", v_max)):
            stored = opt.state[param][key]
            assert stored.dtype == torch.bfloat16
            torch.testing.assert_close(stored.float(), wide.bfloat16().float(), rtol=2 ** -7, atol=0)
            assert (stored == wide.bfloat16()).float().mean() > 0.99, key


def test_bf16_state_dicts_keep_bf16_moments_and_load_both_ways_with_torch():
    xs, ys = make_data()
    model = make_model()
    ours = AdamW(model.parameters(), state_dtype="bfloat16", amsgrad=True)
    train(model, ours, xs, ys, 5)
    saved = copy.deepcopy(ours.state_dict())
    assert all(saved["state"][i][k].dtype == torch.bfloat16
               for i in saved["state"] for k in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"))
    again = AdamW(copy.deepcopy(model).parameters(), state_dtype="bf16", amsgrad=True)
    again.load_state_dict(copy.deepcopy(saved))
    for a, b in zip(again.state.values(), ours.state.values()):
        for key in b:
            assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key

    peer_model = copy.deepcopy(model)  # into torch: its load casts the moments to fp32
    peer = torch.optim.AdamW(peer_model.parameters(), amsgrad=True)
    peer.load_state_dict(copy.deepcopy(saved))
    train(peer_model, peer, xs[5:], ys[5:], 3)
    back_model = copy.deepcopy(peer_model)  # and torch's fp32 state back: rounded as it loads
    back = AdamW(back_model.parameters(), state_dtype="bf16", amsgrad=True)
    back.load_state_dict(copy.deepcopy(peer.state_dict()))
    for p, q in zip(back_model.parameters(), peer_model.parameters()):
        for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
            assert back.state[p][key].dtype == torch.bfloat16
            assert torch.equal(back.state[p][key], peer.state[q][key].bfloat16()), key
    assert train(back_model, back, xs[8:], ys[8:], 2)


def test_a_bf16_parameter_with_bf16_state_keeps_an_fp32_master():
    xs, ys = make_data()
    model = make_model().to(torch.bfloat16)
    opt = AdamW(model.parameters(), state_dtype="bf16")
    train(model, opt, xs.to(torch.bfloat16), ys.to(torch.bfloat16), 3)
    for p in model.parameters():
        state = opt.state[p]
        assert state[MASTER_KEY].dtype == torch.float32
        assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.bfloat16
        assert torch.equal(state[MASTER_KEY].to(torch.bfloat16), p.detach())
    twin = copy.deepcopy(opt)
    assert twin.state_dtype == torch.bfloat16


@pytest.mark.parametrize("value", ["fp16", torch.float16, "float64", None, ["bf16"]])
def test_a_bad_state_dtype_is_a_value_error_naming_it(value):
    with pytest.raises(ValueError, match="Invalid state_dtype"):
        AdamW(make_model().parameters(), state_dtype=value)
