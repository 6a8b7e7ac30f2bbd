"""tierflow.torch.optim.Adam / AdamW with parameters on a CUDA device: the
gradients come down to pinned host buffers, the CPU steps the fp32 masters,
the parameters go back up (tierflow/torch/optim/_device.py).

Two halves:

* On every machine, the device path with CPU tensors standing in for CUDA
  parameters: the optimizer is made to take chosen CPU tensors for device
  ones (the module's two seams, on_device and link_for) and to move them
  through a link that queues every copy and runs it only when a mark is
  waited for or the step ends, as streams would. A step that read a
  gradient before its bucket's mark, or left an image unuploaded, gives
  other values; the link's log checks the order of the protocol. The
  results must be the CPU path's, bit for bit.
* Where CUDA is available, the real thing against torch.optim.AdamW on the
  same device; skipped with the reason otherwise.
"""

import copy

import pytest
import torch

from tierflow.torch.optim import MASTER_KEY, Adam, AdamW, Muon, _device
from test_adam import RTOL, assert_close_to, assert_grad_scaler_steps_as_torch

def make_model(seed=0, device="cpu", dtype=torch.float32):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1, bias=False))
    return model.to(device=device, dtype=dtype)


def make_data(steps, seed=1, device="cpu", dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    xs, ys = torch.randn(steps, 16, 32, generator=g), torch.randn(steps, 16, 1, generator=g)
    return xs.to(device=device, dtype=dtype), ys.to(device=device, dtype=dtype)


def train(model, optimizer, xs, ys, before_step=None):
    losses = []
    for i, (x, y) in enumerate(zip(xs, ys)):
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        if before_step is not None:
            before_step(i, model)
        optimizer.step()
        losses.append(loss.item())
    return losses


# ---- the device path with CPU tensors standing in -------------------------------


class QueuedLink:
    """A link over CPU tensors whose copies wait in two queues, as on two
    streams, and run only when a mark after them is waited for or the step
    ends (the compute stream waits for everything then). Logs each call."""

    pin_memory = False

    def __init__(self):
        self.log = []
        self._queues = {"down": [], "up": []}
        self._done = {"down": 0, "up": 0}

    def _run(self, queue, upto):
        while self._done[queue] < upto:
            dst, src = self._queues[queue][self._done[queue]]
            dst.copy_(src)
            self._done[queue] += 1

    def fetch(self, dst, src):
        self.log.append("fetch")
        dst.copy_(src)

    def begin(self):
        self.log.append("begin")

    def download(self, dst, src):
        assert not dst.is_pinned() and dst.data_ptr() != src.data_ptr()
        self.log.append("download")
        self._queues["down"].append((dst, src))

    def downloaded(self):
        self.log.append("downloaded")
        return ("down", len(self._queues["down"]))

    def upload(self, dst, src):
        self.log.append("upload")
        self._queues["up"].append((dst, src))

    def uploaded(self):
        self.log.append("uploaded")
        return ("up", len(self._queues["up"]))

    def wait(self, mark):
        self.log.append(f"wait {mark[0]}")
        self._run(*mark)

    def end(self):
        self.log.append("end")
        self._run("up", len(self._queues["up"]))
        self._run("down", len(self._queues["down"]))

    def idle(self):
        return all(self._done[q] == len(self._queues[q]) for q in self._queues)


@pytest.fixture
def stand_in(monkeypatch):
    """stand_in(params) makes the optimizer take those CPU tensors for CUDA
    parameters, moved through the QueuedLink it returns."""
    ids, link = set(), QueuedLink()
    monkeypatch.setattr(_device, "on_device", lambda p: id(p) in ids)
    monkeypatch.setattr(_device, "link_for", lambda device: link)

    def take(params):
        ids.update(id(p) for p in params)
        return link
    return take


CASES = [
    ("adamw", {}),
    ("adamw", {"weight_decay": 0.1, "amsgrad": True}),
    ("adam", {"weight_decay": 0.05, "maximize": True}),
    ("adamw", {"state_dtype": "bf16", "lr": 1e-2}),
]
OURS = {"adam": Adam, "adamw": AdamW}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name,kwargs", CASES)
def test_the_device_path_steps_as_the_cpu_path_bit_for_bit(stand_in, name, kwargs, dtype):
    xs, ys = make_data(12, dtype=dtype)
    cpu_model = make_model(dtype=dtype)
    dev_model = copy.deepcopy(cpu_model)
    link = stand_in(dev_model.parameters())
    cpu = OURS[name](cpu_model.parameters(), **kwargs)
    dev = OURS[name](dev_model.parameters(), **kwargs)
    assert train(dev_model, dev, xs, ys) == train(cpu_model, cpu, xs, ys)
    assert link.idle()
    for p, q in zip(dev_model.parameters(), cpu_model.parameters()):
        assert torch.equal(p, q)
        assert torch.equal(dev._device_params.image(p), p)
        for key, value in cpu.state[q].items():
            assert torch.equal(dev.state[p][key], value), key
    assert link.log.count("fetch") == 3  # each parameter read once, at its first step


def test_the_fp32_device_path_tracks_torch_adamw(stand_in):
    xs, ys = make_data(30)
    peer_model = make_model()
    dev_model = copy.deepcopy(peer_model)
    stand_in(dev_model.parameters())
    peer = torch.optim.AdamW(peer_model.parameters(), weight_decay=0.1)
    dev = AdamW(dev_model.parameters(), weight_decay=0.1)
    torch.testing.assert_close(train(dev_model, dev, xs, ys), train(peer_model, peer, xs, ys), rtol=RTOL, atol=0)
    for p, q in zip(dev_model.parameters(), peer_model.parameters()):
        assert_close_to(p, q, "param")


def steps_of(log):
    """The log cut at each 'end', one list per step."""
    steps, current = [], []
    for entry in log:
        current.append(entry)
        if entry == "end":
            steps.append(current)
            current = []
    return steps


def test_buckets_overlap_the_downloads_the_step_and_the_uploads(stand_in, monkeypatch):
    """Buckets of one 4 KiB parameter each: every download is queued before
    the first wait; bucket i's upload is queued before bucket i+1 is waited
    for; the step ends without waiting for the uploads, and the next one
    waits for them before it downloads."""
    monkeypatch.setattr(_device, "BUCKET_BYTES", 4096)
    params = [torch.nn.Parameter(torch.randn(1024)) for _ in range(3)]
    link = stand_in(params)
    opt = AdamW(params)
    for _ in range(2):
        for p in params:
            p.grad = torch.randn(1024)
        opt.step()
    first, second = steps_of(link.log)
    assert first == ["fetch"] * 3 + ["begin"] + ["download", "downloaded"] * 3 + \
        ["wait down", "upload"] * 3 + ["uploaded", "end"]
    assert second[0] == "wait up" and second[1:] == first[3:]


def test_a_bucket_holds_parameters_up_to_its_size_and_of_one_group(stand_in, monkeypatch):
    monkeypatch.setattr(_device, "BUCKET_BYTES", 8192)
    params = [torch.nn.Parameter(torch.randn(n)) for n in (512, 1024, 512, 512, 4096)]
    link = stand_in(params)
    opt = AdamW([{"params": params[:4]}, {"params": params[4:], "lr": 1e-2}])
    for p in params:
        p.grad = torch.ones_like(p)
    buckets = opt._device_side().begin([(0, params[:4]), (1, params[4:])])
    opt._device_side().end()
    assert [(b.group, [p.numel() for p in b.params]) for b in buckets] == \
        [(0, [512, 1024, 512]), (0, [512]), (1, [4096])]
    assert link.idle()


def test_cpu_and_device_parameters_mix_in_one_optimizer_and_one_group(stand_in):
    xs, ys = make_data(8)
    cpu_model = make_model()
    mixed_model = copy.deepcopy(cpu_model)
    stand_in([mixed_model[0].weight, mixed_model[2].weight])  # the bias stays a CPU parameter
    cpu = AdamW(cpu_model.parameters(), amsgrad=True)
    mixed = AdamW(mixed_model.parameters(), amsgrad=True)
    assert train(mixed_model, mixed, xs, ys) == train(cpu_model, cpu, xs, ys)
    for p, q in zip(mixed_model.parameters(), cpu_model.parameters()):
        assert torch.equal(p, q)
    assert set(mixed._device_params._copies) == {mixed_model[0].weight, mixed_model[2].weight}


def test_a_skipped_device_parameter_is_not_uploaded(stand_in):
    params = [torch.nn.Parameter(torch.randn(64)) for _ in range(2)]
    link = stand_in(params)
    opt = AdamW(params, skip_nonfinite=True)
    for p in params:
        p.grad = torch.ones(64)
    opt.step()
    before = [p.detach().clone() for p in params]
    params[0].grad = torch.ones(64)
    params[0].grad[5] = float("nan")
    params[1].grad = torch.ones(64)
    opt.step()
    assert opt.last_step_skipped and opt.skipped_steps == 1
    assert torch.equal(params[0], before[0]) and not torch.equal(params[1], before[1])
    assert steps_of(link.log)[1].count("upload") == 1
    assert [opt.state[p]["step"].item() for p in params] == [1, 2]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_non_contiguous_device_parameters_step_through_contiguous_images(stand_in, dtype):
    torch.manual_seed(3)
    cpu_params = [torch.nn.Parameter(torch.randn(6, 5).to(dtype).t()),
                  torch.nn.Parameter(torch.randn(4, 3, 3, 3).to(dtype).to(memory_format=torch.channels_last))]
    dev_params = [torch.nn.Parameter(p.detach().clone(memory_format=torch.preserve_format)) for p in cpu_params]
    stand_in(dev_params)
    cpu, dev = AdamW(cpu_params, lr=1e-2), AdamW(dev_params, lr=1e-2)
    for step in range(4):
        for params in (cpu_params, dev_params):
            for p in params:
                p.grad = (torch.full_like(p, 0.1 * (step + 1))
                          + torch.arange(p.numel()).view(p.shape).to(dtype) * 1e-3)
        cpu.step()
        dev.step()
    for p, q in zip(dev_params, cpu_params):
        assert p.stride() == q.stride() and torch.equal(p, q)
        assert dev._device_params.image(p).is_contiguous()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_device_path_with_state_on_nvme_steps_as_the_cpu_path(stand_in, tmp_path, dtype):
    xs, ys = make_data(6, dtype=dtype)
    cpu_model = make_model(dtype=dtype)
    dev_model = copy.deepcopy(cpu_model)
    stand_in(dev_model.parameters())
    cpu = AdamW(cpu_model.parameters(), amsgrad=True)
    dev = AdamW(dev_model.parameters(), amsgrad=True, offload="nvme", nvme_dir=tmp_path, host_memory=64 << 10)
    assert train(dev_model, dev, xs, ys) == train(cpu_model, cpu, xs, ys)
    ours, same = dev.state_dict()["state"], cpu.state_dict()["state"]
    for index in same:
        for key in same[index]:
            assert torch.equal(ours[index][key], same[index][key]), (index, key)
    for p, q in zip(dev_model.parameters(), cpu_model.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_device_state_dicts_load_in_host_memory_and_read_the_parameters_again(stand_in, dtype):
    xs, ys = make_data(10, dtype=dtype)
    model = make_model(dtype=dtype)
    stand_in(model.parameters())
    opt = AdamW(model.parameters(), amsgrad=True)
    train(model, opt, xs[:4], ys[:4])
    saved = copy.deepcopy(opt.state_dict())
    keys = {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"} | ({MASTER_KEY} if dtype != torch.float32 else set())
    assert all(set(entry) == keys for entry in saved["state"].values())

    # Into a new optimizer over new "device" parameters: the same next steps as the one that saved.
    resumed_model = copy.deepcopy(model)
    stand_in(resumed_model.parameters())
    resumed = AdamW(resumed_model.parameters(), amsgrad=True)
    resumed.load_state_dict(copy.deepcopy(saved))
    for entry in resumed.state.values():
        for key in keys - {"step"}:
            assert entry[key].device.type == "cpu"
    assert train(resumed_model, resumed, xs[4:], ys[4:]) == train(model, opt, xs[4:], ys[4:])

    # Weights written into the parameters outside a step, then the state loaded: the
    # images are read again, so the next step starts from the weights written.
    with torch.no_grad():
        for p in resumed_model.parameters():
            p.mul_(0.5)
    written = [p.detach().clone() for p in resumed_model.parameters()]
    resumed.load_state_dict(copy.deepcopy(saved))
    for p, w in zip(resumed_model.parameters(), written):
        assert torch.equal(resumed._device_params.image(p), w)
        if dtype != torch.float32:  # a master that does not round to the weights is made from them
            assert torch.equal(resumed.state[p][MASTER_KEY], w.float())
    resumed.param_groups[0]["lr"] = 0.0
    for p in resumed_model.parameters():
        p.grad = torch.ones_like(p)
    resumed.step()
    for p, w in zip(resumed_model.parameters(), written):
        assert torch.equal(p, w)
        if dtype != torch.float32:
            assert torch.equal(resumed.state[p][MASTER_KEY], w.float())

    # torch's state_dict (fp32 moments, no master) loads, and ours into torch.
    peer_model = copy.deepcopy(model).float()
    peer = torch.optim.AdamW(peer_model.parameters(), amsgrad=True)
    peer.load_state_dict(copy.deepcopy(saved))
    back = AdamW(model.parameters(), amsgrad=True)
    back.load_state_dict(peer.state_dict())
    for p in model.parameters():
        assert back.state[p]["exp_avg"].dtype == torch.float32


def test_parameters_on_another_device_are_refused_by_name():
    with pytest.raises(ValueError, match=r"params\[0\] is on meta: parameters on the CPU or on a CUDA device"):
        AdamW([torch.nn.Parameter(torch.ones(3, device="meta"))])
    with pytest.raises(ValueError, match=r"params\[0\] is on meta: Muon steps parameters on the CPU only"):
        Muon([torch.nn.Parameter(torch.ones(3, 3, device="meta"))])


# ---- CUDA -------------------------------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(),
                          reason="no CUDA device: the device path's CUDA half runs where one is")


@cuda
@pytest.mark.parametrize("kwargs", [{}, {"weight_decay": 0.1, "amsgrad": True}, {"maximize": True, "lr": 1e-2}])
def test_cuda_parameters_step_as_torch_adamw_on_the_device(kwargs):
    xs, ys = make_data(30, device="cuda")
    peer_model = make_model(device="cuda")
    ours_model = copy.deepcopy(peer_model)
    peer = torch.optim.AdamW(peer_model.parameters(), foreach=False, **kwargs)
    ours = AdamW(ours_model.parameters(), **kwargs)
    torch.testing.assert_close(train(ours_model, ours, xs, ys), train(peer_model, peer, xs, ys), rtol=RTOL, atol=0)
    for p, q in zip(ours_model.parameters(), peer_model.parameters()):
        assert p.device.type == "cuda"
        assert_close_to(p, q, "param")
        for key, value in peer.state[q].items():
            mine = ours.state[p][key]
            assert mine.device.type == "cpu"
            assert_close_to(mine, value.cpu(), key)


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_cuda_parameters_step_an_fp32_master_on_the_host(dtype):
    """torch's recipe for the peer: a low-precision model on the device and
    its fp32 master stepped by torch.optim.AdamW, the same gradients fed to
    both sides (as test_adam's bf16 test)."""
    xs, ys = make_data(20, device="cuda", dtype=dtype)
    peer_model = make_model(device="cuda", dtype=dtype)
    master_model = copy.deepcopy(peer_model).float()
    ours_model = copy.deepcopy(peer_model)
    peer = torch.optim.AdamW(master_model.parameters(), weight_decay=0.1)
    ours = AdamW(ours_model.parameters(), weight_decay=0.1)
    for x, y in zip(xs, ys):
        peer_model.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(peer_model(x), y).backward()
        for master, low, mine in zip(master_model.parameters(), peer_model.parameters(), ours_model.parameters()):
            master.grad = low.grad.float()
            mine.grad = low.grad.clone()
        peer.step()
        ours.step()
        with torch.no_grad():
            for master, low in zip(master_model.parameters(), peer_model.parameters()):
                low.copy_(master)
    for p, master, low in zip(ours_model.parameters(), master_model.parameters(), peer_model.parameters()):
        assert p.dtype == dtype and p.device.type == "cuda"
        assert ours.state[p][MASTER_KEY].dtype == torch.float32
        assert_close_to(ours.state[p][MASTER_KEY].to("cuda"), master, MASTER_KEY)
        torch.testing.assert_close(p, low, rtol=2 ** -7, atol=0)


@cuda
def test_transfer_bound_cuda_steps_are_ordered_against_the_compute_stream():
    """Large tensors whose gradients a busy compute stream makes late, and a
    copy of the parameters queued right behind each step, on the default
    stream and on a stream of the caller's: a download that did not wait
    would read gradients not yet written, a compute stream that did not wait
    would copy the old parameters."""
    torch.manual_seed(0)
    n = 1 << 23  # 32 MiB per parameter: transfers of milliseconds
    params = [torch.nn.Parameter(torch.randn(n, device="cuda")) for _ in range(3)]
    peers = [torch.nn.Parameter(p.detach().clone()) for p in params]
    ours, peer = AdamW(params, lr=1e-2), torch.optim.AdamW(peers, lr=1e-2, foreach=False)
    default, side = torch.cuda.current_stream(), torch.cuda.Stream()
    for step in range(4):
        stream = side if step % 2 else default
        stream.wait_stream(default)  # the caller's part: the parameters were last written in default's order
        with torch.cuda.stream(stream):
            torch.cuda._sleep(20_000_000)  # ~10 ms of a busy stream: the gradients below come late
            for i, p in enumerate(params):
                p.grad = torch.sin(p.detach() * (step + 1) + i).mul_(1e-2)
            ours.step()
            seen = [p.detach().clone() for p in params]  # queued right behind the step
        default.wait_stream(stream)
        for i, q in enumerate(peers):
            q.grad = torch.sin(q.detach() * (step + 1) + i).mul_(1e-2)
        peer.step()
        torch.cuda.synchronize()
        for s, q in zip(seen, peers):
            assert_close_to(s, q, f"step {step}, read right after it")
    for p, q in zip(params, peers):
        assert_close_to(p, q, "param")


@cuda
def test_cuda_and_cpu_parameters_mix_and_grad_scaler_skips_as_with_torch():
    xs, ys = make_data(10, device="cuda")
    assert_grad_scaler_steps_as_torch(lambda: make_model(device="cuda"), xs, ys, "cuda", 2e-3)

    cpu_param = torch.nn.Parameter(torch.ones(8))
    cuda_param = torch.nn.Parameter(torch.ones(8, device="cuda"))
    mixed = AdamW([cpu_param, cuda_param], lr=0.1)
    cpu_param.grad, cuda_param.grad = torch.ones(8), torch.ones(8, device="cuda")
    mixed.step()
    torch.testing.assert_close(cuda_param.cpu(), cpu_param.detach())


@cuda
def test_cuda_state_is_kept_off_the_device_and_torchs_loads_without_passing_through_it(tmp_path):
    xs, ys = make_data(6, device="cuda")
    peer_model = make_model(device="cuda")
    peer = torch.optim.AdamW(peer_model.parameters(), fused=True)
    train(peer_model, peer, xs[:3], ys[:3])
    model = copy.deepcopy(peer_model)
    ours = AdamW(model.parameters())
    ours.load_state_dict(copy.deepcopy(peer.state_dict()))  # CUDA tensors, and fused's step on the device
    for p in model.parameters():
        assert all(t.device.type == "cpu" for t in ours.state[p].values())
    model.zero_grad(set_to_none=True)
    allocated = torch.cuda.memory_allocated()
    losses = train(model, ours, xs[3:], ys[3:])
    model.zero_grad(set_to_none=True)
    assert torch.cuda.memory_allocated() <= allocated  # no state, no master on the device
    torch.testing.assert_close(losses, train(peer_model, peer, xs[3:], ys[3:]), rtol=RTOL, atol=0)

    nvme_model = copy.deepcopy(model)
    nvme = AdamW(nvme_model.parameters(), offload="nvme", nvme_dir=tmp_path)
    nvme.load_state_dict(ours.state_dict())
    assert train(nvme_model, nvme, xs[3:], ys[3:]) == train(model, ours, xs[3:], ys[3:])


@cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_parameters_on_two_cuda_devices_are_refused():
    with pytest.raises(ValueError, match="params on cuda:0 and cuda:1: one optimizer steps"):
        AdamW([torch.nn.Parameter(torch.ones(2, device="cuda:0")),
               torch.nn.Parameter(torch.ones(2, device="cuda:1"))])


@cuda
def test_muon_refuses_cuda_parameters_by_name():
    with pytest.raises(ValueError, match=r"params\[0\] is on cuda:0: Muon steps parameters on the CPU only"):
        Muon([torch.nn.Parameter(torch.ones(4, 4, device="cuda"))])
