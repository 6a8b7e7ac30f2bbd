"""tierflow.torch.optim.Adam / AdamW with offload="nvme": the state in files of
a real directory (pytest's tmp_path, on this machine's disk), streamed through a
host budget smaller than the state, with torch.optim's numerics and state_dict
layout, and the errors a directory or a disk can cause."""

import copy
import errno
import gc
import pathlib
import subprocess

import pytest
import torch

import tierflow
from tierflow.torch.optim import MASTER_KEY, Adam, AdamW

RTOL = 1e-5
STEPS = 50
MIN_HOST = 64 << 10  # the least host_memory: sub-groups of 16 KiB, chunks of 2048 elements


def assert_close_to(actual, expected, what=""):
    """Element by element within RTOL of each tensor's own scale (as test_adam)."""
    atol = RTOL * float(expected.detach().abs().max()) if expected.numel() else 0.0
    torch.testing.assert_close(actual, expected, rtol=RTOL, atol=atol, msg=lambda m: f"{what}: {m}")


def make_model(seed=0):
    """A weight of 4096 elements: 2 chunks of 2048 through the least host budget."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(32, 128), torch.nn.Tanh(), torch.nn.Linear(128, 1, bias=False))


def make_data(seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(STEPS, 16, 32, generator=g), torch.randn(STEPS, 16, 1, generator=g)


def train(model, optimizer, xs, ys, steps, dtype=torch.float32):
    losses = []
    for x, y in zip(xs[:steps], ys[:steps]):
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x.to(dtype)), y.to(dtype))
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def nvme_files(directory):
    return sorted(p.name for p in pathlib.Path(directory).glob("tierflow-*.nvme"))


def status_kib(field):
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


CASES = [
    ("adamw", {}),
    ("adamw", {"weight_decay": 0.1, "amsgrad": True}),
    ("adamw", {"lr": 1e-2, "betas": (0.8, 0.99), "eps": 1e-6, "maximize": True}),
    ("adam", {"weight_decay": 0.05}),
    ("adam", {"weight_decay": 0.05, "amsgrad": True, "maximize": True}),
]
PEERS = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW}
OURS = {"adam": Adam, "adamw": AdamW}


@pytest.mark.parametrize("name,kwargs", CASES)
def test_state_on_nvme_steps_as_torch_and_as_the_cpu_offload(tmp_path, name, kwargs):
    xs, ys = make_data()
    peer_model, cpu_model, nvme_model = make_model(), make_model(), make_model()
    peer = PEERS[name](peer_model.parameters(), **kwargs)
    cpu = OURS[name](cpu_model.parameters(), **kwargs)
    nvme = OURS[name](nvme_model.parameters(), **kwargs, offload="nvme", nvme_dir=tmp_path,
                      host_memory=MIN_HOST)
    assert nvme_files(tmp_path)  # preallocated at construction
    losses_peer = train(peer_model, peer, xs, ys, STEPS)
    losses_cpu = train(cpu_model, cpu, xs, ys, STEPS)
    losses_nvme = train(nvme_model, nvme, xs, ys, STEPS)

    torch.testing.assert_close(losses_nvme, losses_peer, rtol=RTOL, atol=0)
    assert losses_nvme == losses_cpu  # the same kernel: the same bits
    for ours, theirs, same in zip(nvme_model.parameters(), peer_model.parameters(), cpu_model.parameters()):
        assert_close_to(ours, theirs, "param")
        assert torch.equal(ours, same)
    # The state read back from NVMe: torch's keys, the cpu offload's bits.
    ours, theirs, same = nvme.state_dict()["state"], peer.state_dict()["state"], cpu.state_dict()["state"]
    assert ours.keys() == theirs.keys() == same.keys()
    for index in theirs:
        assert set(ours[index]) == set(theirs[index]) == set(same[index])
        for key in theirs[index]:
            assert torch.equal(ours[index][key], same[index][key]), f"state {index} {key}"
    # The state went through NVMe: what was read back is what the step wrote.
    links = {link["name"]: link for link in nvme.telemetry()["links"]}
    assert links["host->nvme"]["bytes"] > 0 and links["nvme->host"]["bytes"] > 0


def test_bf16_parameters_step_an_fp32_master_on_nvme_as_on_the_cpu(tmp_path):
    xs, ys = make_data()
    cpu_model = make_model().to(torch.bfloat16)
    nvme_model = copy.deepcopy(cpu_model)
    cpu = AdamW(cpu_model.parameters(), weight_decay=0.1)
    nvme = AdamW(nvme_model.parameters(), weight_decay=0.1, offload="nvme", nvme_dir=tmp_path,
                 host_memory=MIN_HOST)
    assert train(nvme_model, nvme, xs, ys, 20, torch.bfloat16) == train(cpu_model, cpu, xs, ys, 20, torch.bfloat16)
    for p, q in zip(nvme_model.parameters(), cpu_model.parameters()):
        assert p.dtype == torch.bfloat16 and torch.equal(p, q)
    state = nvme.state_dict()["state"]
    for index, p in enumerate(cpu_model.parameters()):
        for key in (MASTER_KEY, "exp_avg", "exp_avg_sq"):
            assert state[index][key].dtype == torch.float32
            assert torch.equal(state[index][key], cpu.state[p][key]), key


def test_the_host_memory_used_stays_within_host_memory_for_a_state_eight_times_larger(tmp_path):
    """A 64 MiB state (8M fp32 parameters, two moments) through an 8 MiB budget:
    the host tier's high-water mark and the process' peak RSS growth both stay
    within the budget (plus 6 MiB for threads, rings and Python), far below the state."""
    host_memory = 8 << 20
    params = [torch.nn.Parameter(torch.randn(2048, 2048)) for _ in range(2)]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-2
    state_bytes = sum(p.numel() for p in params) * 4 * 2
    assert state_bytes == 64 << 20
    reference = [p.detach().clone() for p in params]
    cpu_params = [torch.nn.Parameter(r.clone()) for r in reference]
    for p, q in zip(cpu_params, params):
        p.grad = q.grad.clone()

    AdamW([torch.nn.Parameter(torch.zeros(1))]).step()  # torch's lazy imports of its optimizers' first use
    try:
        pathlib.Path("/proc/self/clear_refs").write_text("5")  # the peak RSS starts again from now
        rss_measured = True
    except OSError:
        rss_measured = False
    before = status_kib("VmRSS") << 10
    opt = AdamW(params, lr=1e-3, offload="nvme", nvme_dir=tmp_path, host_memory=host_memory, threads=2)
    for _ in range(2):  # the first makes the state (written only), the second reads and writes it
        opt.step()
    peak_growth = (status_kib("VmHWM") << 10) - before

    (host,) = [t for t in opt.telemetry()["tiers"] if t["kind"] == "host"]
    assert host["budget_bytes"] == host_memory == opt.host_memory
    assert 0 < host["high_water_bytes"] <= host_memory
    links = {link["name"]: link["bytes"] for link in opt.telemetry()["links"]}
    assert links["host->nvme"] >= 2 * state_bytes and links["nvme->host"] >= state_bytes
    if rss_measured:
        assert peak_growth <= host_memory + (6 << 20), f"RSS grew by {peak_growth >> 20} MiB"
    # And it stepped as the state in RAM does.
    cpu = AdamW(cpu_params, lr=1e-3, threads=2)
    for _ in range(2):
        cpu.step()
    for p, q in zip(params, cpu_params):
        assert torch.equal(p, q)
    if not rss_measured:
        pytest.skip("the peak RSS cannot be reset here (/proc/self/clear_refs); the tier's high-water mark was checked")


def test_state_dict_has_torchs_layout_and_is_read_from_nvme(tmp_path):
    model = make_model()
    opt = AdamW(model.parameters(), amsgrad=True, offload="nvme", nvme_dir=tmp_path, host_memory=MIN_HOST)
    xs, ys = make_data()
    train(model, opt, xs, ys, 2)
    assert set(opt.state[next(model.parameters())]) == {"step"}  # the rest lives on NVMe
    sd = opt.state_dict()
    assert set(sd["state"][0]) == {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"}
    assert sd["state"][0]["step"].dtype == torch.float32 and sd["state"][0]["step"].item() == 2
    assert sd["state"][0]["exp_avg"].shape == next(model.parameters()).shape
    assert set(opt.state[next(model.parameters())]) == {"step"}  # state_dict() did not keep them


def losses_after_moving(source, target, tmp_path, kwargs=None):
    """Trains 10 steps with `source` (class, options), moves its state_dict into
    `target` and into `source` again; returns both's next 10 losses."""
    kwargs = kwargs or {"amsgrad": True, "weight_decay": 0.1}
    xs, ys = make_data()
    model = make_model()
    opt = source[0](model.parameters(), **kwargs, **source[1])
    train(model, opt, xs, ys, 10)
    state = copy.deepcopy(opt.state_dict())
    results = []
    for cls, options in (source, target):
        twin = copy.deepcopy(model)
        other = cls(twin.parameters(), **kwargs, **options)
        other.load_state_dict(copy.deepcopy(state))
        results.append(train(twin, other, xs[10:], ys[10:], 10))
    return results


@pytest.mark.parametrize("source,target", [("nvme", "cpu"), ("cpu", "nvme"), ("nvme", "torch"),
                                           ("torch", "nvme"), ("nvme", "nvme")])
def test_state_dicts_move_between_nvme_cpu_and_torch_with_the_same_next_losses(tmp_path, source, target):
    def spec(kind, sub):
        if kind == "torch":
            return torch.optim.AdamW, {}
        if kind == "cpu":
            return AdamW, {}
        directory = tmp_path / sub
        directory.mkdir()
        return AdamW, {"offload": "nvme", "nvme_dir": directory, "host_memory": MIN_HOST}

    a, b = losses_after_moving(spec(source, "a"), spec(target, "b"), tmp_path)
    torch.testing.assert_close(b, a, rtol=RTOL, atol=0)


def test_resuming_after_the_optimizer_is_gone_continues_as_if_never_stopped(tmp_path):
    xs, ys = make_data()
    model = make_model()
    straight = copy.deepcopy(model)
    kwargs = {"weight_decay": 0.1, "offload": "nvme", "host_memory": MIN_HOST}
    opt = AdamW(model.parameters(), nvme_dir=tmp_path / "run", **kwargs)
    train(model, opt, xs, ys, 10)
    saved = opt.state_dict()
    del opt
    gc.collect()
    assert nvme_files(tmp_path / "run") == []  # the scratch files go with the optimizer
    assert (tmp_path / "run").is_dir()  # the directory stays
    resumed = AdamW(model.parameters(), nvme_dir=tmp_path / "run", **kwargs)
    resumed.load_state_dict(saved)
    losses = train(model, resumed, xs[10:], ys[10:], 10)

    uninterrupted = AdamW(straight.parameters(), nvme_dir=tmp_path / "straight", **kwargs)
    expected = train(straight, uninterrupted, xs, ys, 20)[10:]
    assert losses == expected
    resumed.close()
    assert nvme_files(tmp_path / "run") == []
    with pytest.raises(ValueError, match="closed"):
        resumed.step()


def test_save_state_and_load_state_resume_through_the_host_budget(tmp_path):
    xs, ys = make_data()
    model = make_model().to(torch.bfloat16)  # a master and three keys per parameter
    kwargs = {"amsgrad": True, "offload": "nvme", "host_memory": MIN_HOST}
    opt = AdamW(model.parameters(), nvme_dir=tmp_path / "a", **kwargs)
    train(model, opt, xs, ys, 5, torch.bfloat16)
    opt.save_state(tmp_path / "ckpt")
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["blocks-1.bin", "manifest.json", "optimizer.pt"]
    saved_model = copy.deepcopy(model)
    expected = train(model, opt, xs[5:], ys[5:], 5, torch.bfloat16)

    resumed = AdamW(saved_model.parameters(), nvme_dir=tmp_path / "b", **kwargs)
    resumed.load_state(tmp_path / "ckpt")
    assert resumed.state[next(saved_model.parameters())]["step"].item() == 5
    assert train(saved_model, resumed, xs[5:], ys[5:], 5, torch.bfloat16) == expected

    other = AdamW(copy.deepcopy(saved_model).parameters(), nvme_dir=tmp_path / "c",
                  **{**kwargs, "host_memory": 2 * MIN_HOST})
    with pytest.raises(ValueError, match="another layout"):
        other.load_state(tmp_path / "ckpt")
    with pytest.raises(ValueError, match="offload='cpu'"):
        AdamW(make_model().parameters()).save_state(tmp_path / "cpu")


def test_a_copy_has_its_own_state_files(tmp_path):
    xs, ys = make_data()
    model = make_model()
    opt = AdamW(model.parameters(), offload="nvme", nvme_dir=tmp_path, host_memory=MIN_HOST)
    train(model, opt, xs, ys, 3)
    files = nvme_files(tmp_path)
    twin = copy.deepcopy(opt)  # its own parameters and its own files in the same directory
    assert len(nvme_files(tmp_path)) == 2 * len(files)
    twin_params = [p for g in twin.param_groups for p in g["params"]]
    for p, q in zip(twin_params, model.parameters()):
        assert p is not q and torch.equal(p, q)
        p.grad = q.grad.clone()
    opt.step()
    twin.step()
    for p, q in zip(twin_params, model.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_skip_nonfinite_skips_a_whole_parameter_before_any_chunk_streams(tmp_path, dtype):
    """The bad element sits in the weight's second chunk: a chunk-by-chunk
    check would have stepped the first one. The NVMe state skips as the cpu
    offload does, bit for bit."""
    xs, ys = make_data()
    cpu_model = make_model().to(dtype)
    nvme_model = copy.deepcopy(cpu_model)
    cpu = AdamW(cpu_model.parameters(), amsgrad=True, skip_nonfinite=True)
    nvme = AdamW(nvme_model.parameters(), amsgrad=True, skip_nonfinite=True, offload="nvme",
                 nvme_dir=tmp_path, host_memory=MIN_HOST)
    weight = next(nvme_model.parameters())
    assert weight.numel() == 4096  # two chunks of 2048 elements through the least budget
    for step, (x, y) in enumerate(zip(xs[:8], ys[:8])):
        for model, opt in ((cpu_model, cpu), (nvme_model, nvme)):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x.to(dtype)), y.to(dtype)).backward()
            if step in (0, 3):
                next(model.parameters()).grad.view(-1)[3000] = float("nan" if step else "inf")
        before = (weight.detach().clone(), nvme.state_dict()["state"].get(0))
        cpu.step()
        nvme.step()
        assert nvme.last_step_skipped is cpu.last_step_skipped is (step in (0, 3))
        if step in (0, 3):
            assert torch.equal(weight, before[0])
            if before[1] is not None:
                for key, value in before[1].items():
                    assert torch.equal(nvme.state_dict()["state"][0][key], value), key
    assert nvme.skipped_steps == cpu.skipped_steps == 2
    for p, q in zip(nvme_model.parameters(), cpu_model.parameters()):
        assert torch.equal(p, q)
    ours, same = nvme.state_dict()["state"], cpu.state_dict()["state"]
    assert ours[0]["step"].item() == 6 and ours[1]["step"].item() == 8
    for index in same:
        for key in same[index]:
            assert torch.equal(ours[index][key], same[index][key]), (index, key)


def test_parameters_without_gradients_zero_size_and_non_contiguous_ones(tmp_path):
    frozen = torch.nn.Parameter(torch.ones(4))
    empty = torch.nn.Parameter(torch.zeros(0))
    transposed = torch.nn.Parameter(torch.randn(60, 50).t())
    peer_transposed = torch.nn.Parameter(transposed.detach().clone())
    opt = AdamW([frozen, empty, transposed], lr=0.1, offload="nvme", nvme_dir=tmp_path, host_memory=MIN_HOST)
    peer = torch.optim.AdamW([peer_transposed], lr=0.1)
    for step in range(3):
        for p in (transposed, peer_transposed):
            p.grad = (torch.arange(p.numel(), dtype=torch.float32).view(60, 50).t() - 1000) * 1e-3 * (step + 1)
        empty.grad = torch.zeros(0)
        opt.step()
        peer.step()
    assert torch.equal(frozen, torch.ones(4)) and frozen not in opt.state
    assert opt.state[empty]["step"].item() == 3
    assert transposed.stride() == peer_transposed.stride()
    assert_close_to(transposed, peer_transposed, "param")


def test_a_refused_step_changes_neither_parameters_nor_state(tmp_path):
    xs, ys = make_data()
    model = make_model()
    opt = AdamW(model.parameters(), offload="nvme", nvme_dir=tmp_path, host_memory=MIN_HOST)
    train(model, opt, xs, ys, 2)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    before = [p.detach().clone() for p in model.parameters()]
    state = copy.deepcopy(opt.state_dict())

    opt.param_groups[0]["lr"] = -1.0  # caught by the C++ kernel's own check
    with pytest.raises(ValueError, match="lr"):
        opt.step()
    opt.param_groups[0]["lr"] = 1e-3
    last = list(model.parameters())[-1]
    fp32 = last.data
    last.data = fp32.to(torch.bfloat16)  # not what its state was made for
    last.grad = torch.ones_like(last)
    with pytest.raises(ValueError, match="param is bf16, registered as fp32"):
        opt.step()
    last.data = fp32
    for p, old in zip(model.parameters(), before):
        assert torch.equal(p, old)
    after = opt.state_dict()["state"]
    for index in state["state"]:
        for key, value in state["state"][index].items():
            assert torch.equal(after[index][key], value), (index, key)


def test_param_groups_an_lr_scheduler_and_a_grad_scaler_work_as_with_torch(tmp_path):
    xs, ys = make_data()
    results = []
    for kind in ("torch", "nvme"):
        model = make_model()
        groups = [{"params": model[0].parameters(), "lr": 3e-3},
                  {"params": model[2].parameters(), "weight_decay": 0.0}]
        opt = (torch.optim.AdamW(groups, lr=torch.tensor(1e-3)) if kind == "torch" else
               AdamW(groups, lr=torch.tensor(1e-3), offload="nvme", nvme_dir=tmp_path, host_memory=MIN_HOST))
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
        losses = []
        for i, (x, y) in enumerate(zip(xs[:12], ys[:12])):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            scaler.scale(loss).backward()
            if i == 3:  # an overflowed step: the scaler skips it
                next(model.parameters()).grad[0, 0] = float("inf")
            scaler.step(opt)
            scaler.update()
            sched.step()
            losses.append(loss.item())
        results.append(losses)
    torch.testing.assert_close(results[1], results[0], rtol=RTOL, atol=0)


def test_the_step_releases_the_gil_while_it_streams(tmp_path):
    """Another Python thread runs in the middle of a step whose state streams
    from NVMe (16 MiB through 4 MiB): the GIL is released for the whole call."""
    import threading
    import time

    param = torch.nn.Parameter(torch.zeros(1 << 21))
    param.grad = torch.ones(1 << 21)
    opt = AdamW([param], offload="nvme", nvme_dir=tmp_path, host_memory=4 << 20, threads=1)
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


@pytest.mark.parametrize("kwargs,message", [
    ({"offload": "disk"}, "Invalid offload: 'disk'"),
    ({"offload": "nvme"}, "nvme_dir: offload='nvme' needs"),
    ({"nvme_dir": "/tmp"}, "nvme_dir is used only with offload='nvme'"),
    ({"host_memory": "1G"}, "host_memory is used only with offload='nvme'"),
    ({"offload": "nvme", "nvme_dir": "/tmp", "host_memory": 1000}, "Invalid host_memory: 1000"),
    ({"offload": "nvme", "nvme_dir": "/tmp", "host_memory": True}, "Invalid host_memory: True"),
    ({"offload": "nvme", "nvme_dir": "/tmp", "host_memory": "lots"}, "host_memory: 'lots'"),
    ({"offload": "nvme", "nvme_dir": "/tmp", "host_memory": "8K"}, "host_memory: 8.00 KiB is below"),
])
def test_bad_offload_arguments_are_value_errors_naming_them(kwargs, message):
    with pytest.raises(ValueError, match=message):
        AdamW(make_model().parameters(), **kwargs)


def test_a_missing_directory_is_an_os_error_naming_it(tmp_path):
    missing = tmp_path / "no" / "such"
    with pytest.raises(tierflow.TierflowError) as raised:
        AdamW(make_model().parameters(), offload="nvme", nvme_dir=missing)
    e = raised.value
    assert isinstance(e, OSError) and not isinstance(e, ValueError)
    assert e.errno == errno.ENOENT and e.filename == str(missing)
    assert str(missing) in str(e)
    # Its parent there: the directory is made (0700).
    AdamW(make_model().parameters(), offload="nvme", nvme_dir=tmp_path / "made").close()
    assert (tmp_path / "made").stat().st_mode & 0o777 == 0o700


def mount_tmpfs(mount, options):
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(mount)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs ({options}) here: {done.stderr.strip()}")


def unmount(mount):
    if subprocess.run(["umount", str(mount)]).returncode != 0:
        subprocess.run(["umount", "--lazy", str(mount)], check=True)  # never leave it mounted


@pytest.fixture
def read_only_dir(tmp_path):
    """A read-only tmpfs: it refuses root too (a chmod would not)."""
    mount = tmp_path / "ro"
    mount_tmpfs(mount, "ro,size=64k")
    yield mount
    unmount(mount)


@pytest.fixture
def full_disk(tmp_path):
    """A 1 MiB tmpfs."""
    mount = tmp_path / "full"
    mount_tmpfs(mount, "size=1M")
    yield mount
    unmount(mount)


def test_a_read_only_directory_is_an_os_error_naming_it(read_only_dir):
    with pytest.raises(tierflow.TierflowError) as raised:
        AdamW(make_model().parameters(), offload="nvme", nvme_dir=read_only_dir)
    e = raised.value
    assert e.errno == errno.EROFS and e.filename == str(read_only_dir)
    assert "cannot be written" in str(e)


def test_a_full_disk_is_enospc_and_leaves_the_state_before_it_intact(full_disk):
    # A state larger than the disk: refused at construction.
    big = [torch.nn.Parameter(torch.zeros(256 << 10))]  # 2 MiB of moments
    with pytest.raises(tierflow.TierflowError) as raised:
        AdamW(big, offload="nvme", nvme_dir=full_disk, host_memory=MIN_HOST)
    assert raised.value.errno == errno.ENOSPC
    assert raised.value.filename.startswith(str(full_disk))
    assert nvme_files(full_disk) == []  # nothing half-made is left

    # One that fits, stepped; then a group that does not fit is refused
    # whole, and the optimizer goes on as before.
    xs, ys = make_data()
    model, peer_model = make_model(), make_model()
    opt = AdamW(model.parameters(), offload="nvme", nvme_dir=full_disk, host_memory=MIN_HOST)
    peer = AdamW(peer_model.parameters())
    train(model, opt, xs, ys, 3)
    train(peer_model, peer, xs, ys, 3)
    saved = copy.deepcopy(opt.state_dict())
    extra = torch.nn.Parameter(torch.zeros(256 << 10))
    with pytest.raises(tierflow.TierflowError) as raised:
        opt.add_param_group({"params": [extra]})
    assert raised.value.errno == errno.ENOSPC and str(full_disk) in str(raised.value)
    assert len(opt.param_groups) == 1
    after = opt.state_dict()
    for index, state in saved["state"].items():
        for key, value in state.items():
            assert torch.equal(after["state"][index][key], value), (index, key)
    assert train(model, opt, xs[3:], ys[3:], 3) == train(peer_model, peer, xs[3:], ys[3:], 3)
    opt.close()  # its files go before the tmpfs is unmounted
    assert nvme_files(full_disk) == []


def test_bf16_state_with_nvme_is_refused_naming_both(tmp_path):
    with pytest.raises(ValueError, match=r"state_dtype='bf16' with offload='nvme'.*float32 only"):
        AdamW(make_model().parameters(), offload="nvme", nvme_dir=tmp_path, state_dtype="bf16")
    assert not nvme_files(tmp_path)
    opt = AdamW(make_model().parameters(), offload="nvme", nvme_dir=tmp_path, state_dtype=torch.float32)
    assert opt.state_dtype == torch.float32
