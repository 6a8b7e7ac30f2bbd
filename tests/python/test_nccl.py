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
