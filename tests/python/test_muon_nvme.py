"""tierflow.torch.optim.Muon with offload="nvme": the momentum buffers on
NVMe, streamed through a bounded host budget, give offload="cpu"'s bits
(and so track torch.optim.Muon as test_muon measures), move in and out
through state_dicts and save_state/load_state, and keep the host tier
within host_memory."""

import copy
import errno

import pytest
import torch

import tierflow
from test_muon import BF16_LOSS_RTOL, BF16_PARAM_TOL, LR, RTOL, assert_close_to, make_data, make_model, train
from test_nvme import mount_tmpfs, nvme_files, unmount
from tierflow.torch.optim import MASTER_KEY, Muon

STEPS = 20
MIN_HOST = 64 << 10  # the least host_memory: chunks of 16 KiB, 4096 fp32 elements


def nvme_muon(params, tmp_path, **kwargs):
    kwargs.setdefault("host_memory", MIN_HOST)
    tmp_path.mkdir(parents=True, exist_ok=True)  # (the store makes the last directory only)
    return Muon(params, offload="nvme", nvme_dir=tmp_path / "state", **kwargs)


def run_cpu_and_nvme(tmp_path, kwargs, steps=STEPS, dtype=torch.float32):
    """The same model trained with offload="cpu" and with offload="nvme"."""
    xs, ys = make_data()
    model_cpu = make_model().to(dtype)
    model_nvme = copy.deepcopy(model_cpu)
    cpu = Muon(model_cpu.parameters(), **kwargs)
    nvme = nvme_muon(model_nvme.parameters(), tmp_path, **kwargs)
    losses_cpu = train(model_cpu, cpu, xs.to(dtype), ys.to(dtype), steps)
    losses_nvme = train(model_nvme, nvme, xs.to(dtype), ys.to(dtype), steps)
    return (model_cpu, cpu, losses_cpu), (model_nvme, nvme, losses_nvme)


@pytest.mark.parametrize("kwargs", [
    {"lr": LR},
    {"lr": LR, "nesterov": False},
    {"lr": LR, "adjust_lr_fn": "match_rms_adamw", "weight_decay": 0.05},
    {"lr": LR, "momentum": 0.8, "ns_steps": 3, "ns_dtype": torch.float32},
])
def test_momentum_on_nvme_steps_as_the_cpu_offload_bit_for_bit(tmp_path, kwargs):
    (model_cpu, cpu, losses_cpu), (model_nvme, nvme, losses_nvme) = run_cpu_and_nvme(tmp_path, kwargs)
    assert losses_nvme == losses_cpu
    state_cpu, state_nvme = cpu.state_dict(), nvme.state_dict()
    for i, (p_cpu, p_nvme, p0) in enumerate(zip(model_cpu.parameters(), model_nvme.parameters(),
                                               make_model().parameters())):
        assert torch.equal(p_nvme, p_cpu), i
        assert not torch.equal(p_nvme, p0)  # it moved
        assert torch.equal(state_nvme["state"][i]["momentum_buffer"], state_cpu["state"][i]["momentum_buffer"])
    # Nothing but the step counts' place holders in RAM: the buffers are on NVMe.
    assert all(not nvme.state[p] for p in model_nvme.parameters())
    assert nvme.nvme_dir == str(tmp_path / "state") and len(nvme_files(tmp_path / "state")) == 1
    nvme.close()
    assert nvme_files(tmp_path / "state") == []


def test_momentum_on_nvme_tracks_torch_optim_muon(tmp_path):
    xs, ys = make_data()
    model_peer = make_model()
    model_ours = copy.deepcopy(model_peer)
    peer = torch.optim.Muon(model_peer.parameters(), lr=LR)
    ours = nvme_muon(model_ours.parameters(), tmp_path, lr=LR)
    torch.testing.assert_close(train(model_ours, ours, xs, ys, STEPS), train(model_peer, peer, xs, ys, STEPS),
                               rtol=BF16_LOSS_RTOL, atol=0)
    state = ours.state_dict()["state"]
    for i, (p_ours, p_peer) in enumerate(zip(model_ours.parameters(), model_peer.parameters())):
        assert_close_to(p_ours, p_peer, "param", rtol=BF16_PARAM_TOL)
        # The buffers hold what torch's do, up to the bf16 Newton–Schulz's drift in the gradients.
        assert_close_to(state[i]["momentum_buffer"], peer.state[p_peer]["momentum_buffer"], "momentum_buffer",
                        rtol=BF16_PARAM_TOL)


def test_bf16_parameters_keep_their_fp32_master_in_ram_and_step_as_on_the_cpu(tmp_path):
    (model_cpu, cpu, _), (model_nvme, nvme, _) = run_cpu_and_nvme(tmp_path, {"lr": LR}, 8, torch.bfloat16)
    for p_cpu, p_nvme in zip(model_cpu.parameters(), model_nvme.parameters()):
        assert torch.equal(p_nvme, p_cpu)
        assert set(nvme.state[p_nvme]) == {MASTER_KEY}
        assert torch.equal(nvme.state[p_nvme][MASTER_KEY], cpu.state[p_cpu][MASTER_KEY])
    state_cpu, state_nvme = cpu.state_dict()["state"], nvme.state_dict()["state"]
    for i in state_cpu:
        assert set(state_nvme[i]) == {MASTER_KEY, "momentum_buffer"}
        assert torch.equal(state_nvme[i]["momentum_buffer"], state_cpu[i]["momentum_buffer"])


def test_the_host_tier_stays_within_host_memory_for_buffers_far_larger(tmp_path):
    # 1 MiB of momentum buffers through 64 KiB: 16 KiB chunks, 32 of them per matrix.
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(512, 256)), torch.nn.Parameter(torch.randn(256, 512))]
    peers = [torch.nn.Parameter(p.detach().clone()) for p in params]
    nvme = nvme_muon(params, tmp_path, lr=LR)
    cpu = Muon(peers, lr=LR)
    for _ in range(3):
        for p, q in zip(params, peers):
            p.grad = torch.randn_like(p)
            q.grad = p.grad.clone()
        nvme.step()
        cpu.step()
    for p, q in zip(params, peers):
        assert torch.equal(p, q)
    host = next(t for t in nvme.telemetry()["tiers"] if t["kind"] == "host")
    assert host["budget_bytes"] == nvme.host_memory == MIN_HOST
    # Several chunks in flight at once (the pipeline overlaps), never more than the budget.
    assert 16 << 10 < host["high_water_bytes"] <= MIN_HOST
    assert host["loads"] >= 2 * 2 * 32  # every chunk of both matrices read back at steps 2 and 3


def test_state_dicts_move_between_nvme_cpu_and_torch(tmp_path):
    xs, ys = make_data()
    for source, target in [("nvme", "torch"), ("torch", "nvme"), ("cpu", "nvme"), ("nvme", "cpu")]:
        make = {"torch": lambda ps: torch.optim.Muon(ps, lr=LR),
                "cpu": lambda ps: Muon(ps, lr=LR),
                "nvme": lambda ps: nvme_muon(ps, tmp_path / source / target, lr=LR)}
        model = make_model()
        opt = make[source](model.parameters())
        train(model, opt, xs, ys, 5)
        saved = opt.state_dict()
        assert set(saved["state"]) == {0, 1, 2} and all(set(s) == {"momentum_buffer"} for s in saved["state"].values())
        moved = copy.deepcopy(model)
        loaded = make[target](moved.parameters())
        loaded.load_state_dict(copy.deepcopy(saved))
        after = loaded.state_dict()
        for i in saved["state"]:
            assert torch.equal(after["state"][i]["momentum_buffer"], saved["state"][i]["momentum_buffer"]), (source, target)
        # The next steps are those of the optimizer that went on (the same kind of step).
        if {source, target} <= {"cpu", "nvme"}:
            assert train(moved, loaded, xs[5:], ys[5:], 3) == train(model, opt, xs[5:], ys[5:], 3)


def test_a_state_dict_without_a_buffer_starts_it_from_zeros_and_a_wrong_size_is_refused(tmp_path):
    xs, ys = make_data()
    model = make_model()
    opt = nvme_muon(model.parameters(), tmp_path, lr=LR)
    train(model, opt, xs, ys, 2)
    saved = opt.state_dict()
    bad = copy.deepcopy(saved)
    bad["state"][1]["momentum_buffer"] = torch.zeros(5)
    with pytest.raises(ValueError, match="state 1 momentum_buffer: 5 elements"):
        opt.load_state_dict(bad)
    assert torch.equal(opt.state_dict()["state"][1]["momentum_buffer"], saved["state"][1]["momentum_buffer"])
    del saved["state"][1]
    opt.load_state_dict(saved)
    assert set(opt.state_dict()["state"]) == {0, 2}


def test_save_state_and_load_state_resume_through_the_host_budget(tmp_path):
    xs, ys = make_data()
    model = make_model()
    opt = nvme_muon(model.parameters(), tmp_path / "a", lr=LR)
    train(model, opt, xs, ys, 4)
    opt.save_state(tmp_path / "checkpoint")
    expected_state = opt.state_dict()
    moved = copy.deepcopy(model)
    expected = train(model, opt, xs[4:], ys[4:], 4)

    resumed = nvme_muon(moved.parameters(), tmp_path / "b", lr=LR)
    resumed.load_state(tmp_path / "checkpoint")
    state = resumed.state_dict()
    for i in expected_state["state"]:
        assert torch.equal(state["state"][i]["momentum_buffer"], expected_state["state"][i]["momentum_buffer"])
    assert train(moved, resumed, xs[4:], ys[4:], 4) == expected

    # Another layout (host_memory) is refused, naming it, and nothing changes.
    other = nvme_muon(make_model().parameters(), tmp_path / "c", lr=LR, host_memory=2 * MIN_HOST)
    with pytest.raises(ValueError, match="another layout"):
        other.load_state(tmp_path / "checkpoint")
    assert other.state_dict()["state"] == {}
    with pytest.raises(ValueError, match="offload='cpu'"):
        Muon(make_model().parameters()).save_state(tmp_path / "d")


def test_a_fresh_buffer_is_not_saved_as_state(tmp_path):
    # A parameter that never stepped stays without a buffer through save_state and load_state.
    model = make_model()
    opt = nvme_muon(model.parameters(), tmp_path / "a", lr=LR)
    first = next(model.parameters())
    first.grad = torch.ones_like(first)
    opt.step()
    opt.save_state(tmp_path / "checkpoint")
    resumed = nvme_muon(copy.deepcopy(model).parameters(), tmp_path / "b", lr=LR)
    resumed.load_state(tmp_path / "checkpoint")
    assert set(resumed.state_dict()["state"]) == {0}


def test_a_copy_has_its_own_buffers_and_new_groups_are_registered(tmp_path):
    xs, ys = make_data()
    model = make_model()
    params = list(model.parameters())
    opt = nvme_muon(params[:2], tmp_path, lr=LR)
    opt.add_param_group({"params": params[2:]})
    peer_model = copy.deepcopy(model)
    peer = Muon(peer_model.parameters(), lr=LR)
    assert train(model, opt, xs, ys, 3) == train(peer_model, peer, xs, ys, 3)
    files = nvme_files(tmp_path / "state")
    twin = copy.deepcopy(opt)
    assert twin.nvme_dir == opt.nvme_dir and len(nvme_files(tmp_path / "state")) > len(files)
    for i, s in peer.state_dict()["state"].items():
        assert torch.equal(twin.state_dict()["state"][i]["momentum_buffer"], s["momentum_buffer"])
    twin.close()
    assert nvme_files(tmp_path / "state") == files


@pytest.mark.parametrize("kwargs,message", [
    ({"offload": "nvme"}, "nvme_dir: offload='nvme' needs the directory"),
    ({"offload": "disk", "nvme_dir": "/tmp"}, "Invalid offload: 'disk'"),
    ({"nvme_dir": "/tmp"}, "nvme_dir is used only with offload='nvme'"),
    ({"offload": "nvme", "nvme_dir": "/tmp", "host_memory": 1000}, "Invalid host_memory: 1000"),
    ({"offload": "nvme", "nvme_dir": "/tmp", "host_memory": "8K"}, "host_memory: 8.00 KiB is below"),
    ({"offload": "nvme", "nvme_dir": "/tmp", "state_dtype": "bf16"},
     r"state_dtype='bf16' with offload='nvme'.*float32 only"),
])
def test_bad_offload_arguments_are_value_errors_naming_them(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Muon(make_model().parameters(), **kwargs)


def test_a_missing_directory_is_an_os_error_naming_it(tmp_path):
    missing = tmp_path / "no" / "such"
    with pytest.raises(tierflow.TierflowError) as raised:
        Muon(make_model().parameters(), offload="nvme", nvme_dir=missing)
    e = raised.value
    assert isinstance(e, OSError) and not isinstance(e, ValueError)
    assert e.errno == errno.ENOENT and e.filename == str(missing)


def test_an_unwritable_directory_is_an_os_error_naming_it(tmp_path):
    mount = tmp_path / "ro"
    mount_tmpfs(mount, "ro,size=64k")
    try:
        with pytest.raises(tierflow.TierflowError) as raised:
            Muon(make_model().parameters(), offload="nvme", nvme_dir=mount)
        assert raised.value.errno == errno.EROFS and raised.value.filename == str(mount)
    finally:
        unmount(mount)


def test_a_closed_optimizer_refuses_to_step(tmp_path):
    model = make_model()
    opt = nvme_muon(model.parameters(), tmp_path, lr=LR)
    opt.close()
    opt.close()  # idempotent
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    with pytest.raises(ValueError, match="closed"):
        opt.step()
