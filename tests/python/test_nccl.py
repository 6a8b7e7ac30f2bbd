"""tierflow._nccl: the NCCL communicator over CUDA tensors. Everywhere: the
module runs on the one NCCL the process has (torch's), and refuses bad
options and a machine without a GPU with clear errors. With a GPU: a group
of one — every collective and dtype exact, the stream ordering, the CTA
policy asked for and the fallback counted."""

import pytest
import torch

import tierflow
from tierflow import _nccl, _nccl_group

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: NCCL's collectives need one")
needs_nccl = pytest.mark.skipif(not _nccl.available, reason="tierflow was built without NCCL")

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@needs_nccl
def test_the_module_runs_on_the_nccl_torch_brings():
    major, minor, patch = torch.cuda.nccl.version()
    assert _nccl.version() == major * 10000 + minor * 100 + patch
    with open("/proc/self/maps", encoding="ascii", errors="replace") as maps:
        loaded = {line.split()[-1] for line in maps if "libnccl" in line}
    assert len(loaded) == 1, loaded  # one NCCL in the process, torch's


def test_bad_options_are_refused_before_anything_starts():
    with pytest.raises(ValueError, match="timeout 0.000000 s is not positive"):
        _nccl.NcclCommunicator(0, 1, 0, timeout=0.0)
    with pytest.raises(ValueError, match="policy: 'fast' is not 'standard', 'efficiency' or 'zero'"):
        _nccl.NcclCommunicator(0, 1, 0, policy="fast")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
@needs_nccl
def test_without_a_gpu_a_communicator_says_so():
    with pytest.raises(tierflow.TierflowError, match="cuda"):
        _nccl.NcclCommunicator(0, 1, 0)
    assert not _nccl_group.available()
    assert not _nccl_group.moves(torch.ones(4))  # host tensors are Gloo's


def _values(dtype: torch.dtype, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g).to(dtype).cuda()


@needs_gpu
@needs_nccl
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_group_of_one_is_exact_for_every_collective(dtype):
    comm = _nccl.NcclCommunicator(0, 1, torch.cuda.current_device(), timeout=30.0)
    try:
        assert (comm.rank, comm.size, comm.policy) == (0, 1, "standard")
        x = _values(dtype, 1000, 1)
        out = torch.empty_like(x)
        stream = torch.cuda.ExternalStream(comm.stream)
        stream.wait_stream(torch.cuda.current_stream())  # x was made on torch's stream
        comm.all_gather(x, out, [1000]).wait()
        assert torch.equal(out, x)
        reduced = torch.empty_like(x)
        comm.reduce_scatter(x, reduced, [1000], "sum").wait()
        assert torch.equal(reduced, x)
        y = x.clone()
        torch.cuda.current_stream().synchronize()
        comm.all_reduce(y, "max").wait()
        comm.broadcast(y, 0).wait()
        assert torch.equal(y, x)
        # A chunk into its place (one rank's: from the output's start), the rest left alone.
        full = torch.full((2000,), -1, dtype=dtype, device="cuda")
        stream.wait_stream(torch.cuda.current_stream())
        comm.all_gather_strided(x[:10], full[5:], 1000).wait()
        assert torch.equal(full[5:15], x[:10]) and bool((full[:5] == -1).all()) and bool((full[15:] == -1).all())
        empty = torch.empty(0, dtype=dtype, device="cuda")
        comm.all_gather(empty, torch.empty(0, dtype=dtype, device="cuda"), [0]).wait()
        with pytest.raises(ValueError, match="all_gather: 2 counts for 1 ranks"):
            comm.all_gather(x, out, [500, 500])
        other = torch.bfloat16 if dtype == torch.float32 else torch.float32
        with pytest.raises(ValueError, match="all_gather: the input is"):
            comm.all_gather(x, torch.empty(1000, dtype=other, device="cuda"), [1000])
    finally:
        comm.close()
    with pytest.raises(ValueError, match="NcclCommunicator: closed"):
        comm.all_gather(x, out, [1000])


@needs_gpu
@needs_nccl
def test_the_device_communicator_orders_a_collective_after_torchs_stream():
    comm = _nccl_group.DeviceCommunicator(_nccl.NcclCommunicator(0, 1, torch.cuda.current_device(), timeout=30.0))
    try:
        x = torch.empty(1 << 22, device="cuda")
        torch.cuda._sleep(50_000_000)  # the fill below starts late on torch's stream
        x.fill_(3.0)
        out = torch.empty_like(x)
        comm.all_gather(x, out, [x.numel()]).wait()  # must see the fill, not what came before
        assert torch.equal(out, torch.full_like(x, 3.0))
    finally:
        comm.close()


@needs_gpu
@needs_nccl
def test_a_device_works_wait_orders_torchs_stream_and_leaves_the_host_free():
    import time

    comm = _nccl_group.DeviceCommunicator(_nccl.NcclCommunicator(0, 1, torch.cuda.current_device(), timeout=30.0))
    try:
        x = torch.full((1 << 22,), 2.0, device="cuda")
        out = torch.empty_like(x)
        torch.cuda.synchronize()
        with torch.cuda.stream(comm.stream):
            torch.cuda._sleep(300_000_000)  # the gather runs late: about 0.15 s or more
        work = comm.all_gather(x, out, [x.numel()])
        t0 = time.perf_counter()
        work.wait()
        waited = time.perf_counter() - t0
        assert waited < 0.05 and not work.done  # the host went on; the GPU has not run it yet
        doubled = out * 2  # queued on torch's stream behind the gather
        assert torch.equal(doubled, torch.full_like(x, 4.0))
        assert work.done
        work.host_wait()
        comm.check()
    finally:
        comm.close()


_TIMED_OUT = """
import sys, time, torch
import tierflow
from tierflow import _nccl, _nccl_group
comm = _nccl_group.DeviceCommunicator(_nccl.NcclCommunicator(0, 1, torch.cuda.current_device(), timeout=1.0))
x = torch.ones(1 << 20, device="cuda")
out = torch.empty_like(x)
torch.cuda.synchronize()
with torch.cuda.stream(comm.stream):
    torch.cuda._sleep(6_000_000_000)  # seconds: the gather behind it cannot end within its timeout
work = comm.all_gather(x, out, [x.numel()])
work.wait()  # only torch's stream waits
time.sleep(2.0)
print("done", work.done, flush=True)
for what, call in (("host_wait", work.host_wait), ("check", comm.check),
                   ("later", lambda: comm.all_gather(x, out, [x.numel()]).wait())):
    try:
        call()
        print(what, "ok", flush=True)
    except tierflow.TierflowError as e:
        print(what, "raised", e, flush=True)
torch.cuda.synchronize()  # the sleep ends; nothing hangs
comm.close()
print("closed", flush=True)
"""


@needs_gpu
@needs_nccl
def test_a_collective_only_a_stream_waits_for_still_fails_at_its_timeout():
    # In a process of its own: NCCL is aborted under it.
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _TIMED_OUT], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[0] == "done True", done.stdout  # the watchdog settled it, nobody waiting on the host
    for line in lines[1:4]:
        assert " raised " in line and "all_gather failed: not done after the timeout of 1000 ms" in line, done.stdout
    assert lines[4] == "closed", done.stdout


@needs_gpu
@needs_nccl
def test_the_copy_engine_policy_is_taken_or_its_fallback_counted():
    comm = _nccl.NcclCommunicator(0, 1, torch.cuda.current_device(), timeout=30.0, policy="zero")
    try:
        if _nccl.version() >= 22803:
            assert comm.policy == "zero" and comm.fallbacks["zero_cta_unsupported"] == 0
        else:
            assert comm.policy == "standard" and comm.fallbacks["zero_cta_unsupported"] == 1
    finally:
        comm.close()


def test_fsdp2s_collectives_refuse_what_neither_communicator_moves():
    from tierflow.torch.distributed import AllGather, ReduceScatter

    wide = torch.empty(4, dtype=torch.float64)
    with pytest.raises(NotImplementedError, match=r"tierflow: FSDP2's all-gather of a torch.float64 tensor on cpu"):
        AllGather()(wide, wide[:2], None)
    with pytest.raises(NotImplementedError, match=r"tierflow: FSDP2's reduce-scatter of a torch.float64 tensor on cpu"):
        ReduceScatter()(wide[:2], wide, None)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="fewer than 2 CUDA devices: a group of several needs them")
@needs_nccl
def test_the_engines_device_collectives_run_on_tierflows_nccl(tmp_path):
    import json
    import os
    import subprocess
    import sys

    ranks = min(torch.cuda.device_count(), 4)
    worker = os.path.join(os.path.dirname(__file__), "nccl_group_worker.py")
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                           str(ranks), worker, str(tmp_path / "out")], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    for r in range(ranks):
        result = json.loads((tmp_path / f"out.rank{r}").read_text())
        assert result["device_collectives"] and result["mismatches"] == [], result
        assert result["counts"]["tierflow"] == 3 * 3 and result["counts"]["torch"] == 0, result["counts"]


class _StreamOrdered:
    """A stand-in for a device collective's work (DeviceWork): wait() only
    orders a stream, host_wait() blocks the host; each call logged."""

    def __init__(self, log: list, name: str = "work", error: BaseException | None = None) -> None:
        self.log, self.name, self.error, self.done = log, name, error, False

    def wait(self) -> None:
        self.log.append(f"{self.name}: stream")

    def host_wait(self) -> None:
        self.log.append(f"{self.name}: host")
        self.done = True
        if self.error is not None:
            raise self.error


def test_a_pending_device_collectives_wait_orders_a_stream_and_its_host_wait_blocks_too():
    from tierflow.zero.comm import Chunks, Pending

    log: list = []
    out = torch.zeros(2)
    p = Pending(_StreamOrdered(log), out, then=lambda o: log.append("then"), finally_=lambda: log.append("end"))
    assert p.wait() is out
    assert log == ["work: stream", "then", "end"]  # the host was not blocked
    assert p.host_wait() is out
    assert log == ["work: stream", "then", "end", "work: host"]

    log.clear()  # host_wait alone: the stream's order, then the host
    Pending(_StreamOrdered(log), out).host_wait()
    assert log == ["work: stream", "work: host"]

    log.clear()  # chunks: each one's stream wait, then each one's host wait; the first error raised
    failed = TimeoutError("chunk 1: not done after the timeout")
    chunks = Chunks([Pending(_StreamOrdered(log, "c0"), out), Pending(_StreamOrdered(log, "c1", failed), out),
                     Pending(_StreamOrdered(log, "c2"), out)])
    whole = Pending(chunks, out, finally_=lambda: log.append("end"))
    whole.wait()
    assert log == ["c0: stream", "c1: stream", "c2: stream", "end"]
    with pytest.raises(TimeoutError, match="chunk 1"):
        whole.host_wait()
    assert log[4:] == ["c0: host", "c1: host", "c2: host"]

    # A host collective's work has no host_wait: its wait blocks already, once.
    class Blocking:
        calls = 0

        def wait(self) -> None:
            Blocking.calls += 1
    Pending(Blocking(), out).host_wait()
    assert Blocking.calls == 2  # (its wait again: done, returns at once)


def test_a_reduced_device_gradient_is_ready_only_once_its_reduction_ran_on_the_host():
    from tierflow.zero.comm import Pending
    from tierflow.zero.partition import _Downloaded

    log: list = []

    class Copied:
        def synchronize(self) -> None:
            log.append("copy")

    reduced = Pending(_StreamOrdered(log), torch.zeros(2))
    reduced.wait()  # as _own_gradient does, before the copy down is queued
    _Downloaded(reduced, Copied()).synchronize()
    assert log == ["work: stream", "work: host", "copy"]

    log.clear()
    gone = Pending(_StreamOrdered(log, error=RuntimeError("nccl communicator (rank 0 of 2): reduce_scatter failed")),
                   torch.zeros(2))
    gone.wait()
    with pytest.raises(RuntimeError, match="reduce_scatter failed"):  # never the garbage it left
        _Downloaded(gone, Copied()).synchronize()
    assert "copy" not in log


def test_the_torch_backends_work_waits_as_torchs_nccl_work_does():
    from tierflow.torch.distributed import _Work

    log: list = []
    first, second = _StreamOrdered(log, "a"), _StreamOrdered(log, "b")
    work = _Work([first, second], lambda: log.append("then"), [torch.zeros(1)])
    assert not work.is_completed()
    assert work.wait()
    assert log == ["a: stream", "b: stream", "then"]
    assert not work.is_completed()  # ordered, not yet run
    work.host_wait()
    assert log[3:] == ["a: host", "b: host"] and work.is_completed()
