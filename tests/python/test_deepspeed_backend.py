"""tierflow beneath an unchanged DeepSpeed run: ``tierflow.deepspeed.install()``
puts tierflow's AdamW where DeepSpeed's ZeRO-Offload would load its JIT-built
DeepSpeedCPUAdam, and tierflow's I/O engine behind the aio_handle its NVMe
swappers take (deepspeed_backend_worker.py runs each DeepSpeed run in a
process of its own)."""

import json
import os
import subprocess
import sys

import pytest
import torch

import tierflow

pytest.importorskip("deepspeed")


def _run(tmp_path, stage, kind, width=24):
    out = tmp_path / f"{kind}{stage}.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([os.path.dirname(os.path.dirname(tierflow.__file__)),
                                          os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")])}
    worker = os.path.join(os.path.dirname(__file__), "deepspeed_backend_worker.py")
    done = subprocess.run([sys.executable, worker, str(out), str(stage), kind, str(tmp_path / f"ck-{kind}{stage}"),
                           str(width)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "leaked" not in done.stderr  # DeepSpeed keeps its handles to the end; tierflow lets them go at exit
    return json.loads(out.read_text())


def test_install_makes_deepspeeds_nvme_swappers_move_their_files_with_tierflows_io_engine(tmp_path):
    """DeepSpeed's ZeRO-3 with offload_param and offload_optimizer on NVMe,
    unchanged, after install(): its swappers take tierflow's AioHandle from
    AsyncIOBuilder().load() (no libaio, no JIT build) and move the parameters
    and the optimizer's partitions through their files (blocks of width 512:
    DeepSpeed swaps tensors of 1 MB and more), training as DeepSpeed with
    everything in host memory and torch.optim.AdamW. Measured: 331 requests
    over the run, losses within 1.5e-7 relative of the host-memory run (and,
    where libaio-dev lets DeepSpeed build its own async_io op, within 2.2e-7
    of DeepSpeed's own NVMe run with DeepSpeedCPUAdam, which is itself 2.6e-7
    from torch's). DeepSpeed 0.19.8's resume from an NVMe run's checkpoint
    does not continue the run, with its own op as with this handle (alike to
    the loss): not checked here."""
    ours, theirs = _run(tmp_path, 3, "tierflow_nvme", width=512), _run(tmp_path, 3, "torch", width=512)
    assert ours["optimizer"] == "tierflow.deepspeed.CPUAdam"
    assert ours["aio_requests"] > 100
    torch.testing.assert_close(torch.tensor(ours["losses"]), torch.tensor(theirs["losses"]), rtol=2e-6, atol=0)


@pytest.mark.parametrize("stage", [2, 3])
def test_install_makes_deepspeeds_zero_offload_step_with_tierflows_adamw_and_checkpoint_as_its_own(tmp_path, stage):
    """DeepSpeed's ZeRO-2 and ZeRO-3 with offload_optimizer cpu and the
    config's AdamW, after install(), step with tierflow's CPUAdam, and train
    as DeepSpeed with torch.optim.AdamW as its client optimizer (measured:
    losses within 1.0e-7 relative over 10 steps at both stages; bound 1e-6). DeepSpeed's own
    save_checkpoint / load_checkpoint at step 5 resumes the run bit for bit."""
    ours, theirs = _run(tmp_path, stage, "tierflow"), _run(tmp_path, stage, "torch")
    assert ours["optimizer"] == "tierflow.deepspeed.CPUAdam"
    assert theirs["optimizer"] == "torch.optim.adamw.AdamW"
    torch.testing.assert_close(torch.tensor(ours["losses"]), torch.tensor(theirs["losses"]), rtol=1e-6, atol=0)
    assert ours["resumed"] == ours["losses"]


def test_cpu_adam_takes_deepspeeds_arguments_and_install_is_undone_by_uninstall():
    import deepspeed.ops.adam as ops_adam
    from deepspeed.runtime.zero import utils as zero_utils

    from deepspeed.ops.op_builder import AsyncIOBuilder

    from tierflow.deepspeed import AioHandle, CPUAdam, install, installed, uninstall

    shipped, shipped_load = ops_adam.DeepSpeedCPUAdam, AsyncIOBuilder.load
    p = torch.nn.Parameter(torch.randn(4, 3))
    opt = CPUAdam([p], lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, adamw_mode=False)
    assert opt.param_groups[0]["decoupled_weight_decay"] is False and opt.param_groups[0]["bias_correction"]
    with pytest.raises(RuntimeError, match="does not support the AMSGrad variant"):
        CPUAdam([p], amsgrad=True)
    with pytest.raises(ValueError, match="bias_correction=False"):
        CPUAdam([p], bias_correction=False)
    install()
    install()  # idempotent
    try:
        assert installed() and ops_adam.DeepSpeedCPUAdam is CPUAdam
        assert AsyncIOBuilder().load(verbose=False).aio_handle is AioHandle
        assert type(opt) in zero_utils.ZERO_SUPPORTED_OPTIMIZERS  # what is_zero_supported_optimizer checks
    finally:
        uninstall()
    assert not installed() and ops_adam.DeepSpeedCPUAdam is shipped and CPUAdam not in zero_utils.ZERO_SUPPORTED_OPTIMIZERS
    assert AsyncIOBuilder.load is shipped_load


def test_aio_handle_serves_deepspeeds_swap_utils_and_names_a_short_file_or_a_full_disk(tmp_path, small_tmpfs):
    """DeepSpeed's own swap_out_tensors / swap_in_tensors (which assert
    async_pwrite/async_pread return 0) and its wait() count, over tierflow's
    handle; buffers from new_cpu_locked_tensor, slices of them counted as
    pinned; a read past the end of a swap file and a write to a full disk
    raise TierflowError naming the file, after every request has ended, and
    the data written before is intact."""
    from deepspeed.runtime.swap_tensor.utils import swap_in_tensors, swap_out_tensors

    from tierflow.deepspeed import AioHandle

    handle = AioHandle(block_size=1 << 16, queue_depth=4, single_submit=False, overlap_events=True,
                       intra_op_parallelism=2)
    assert (handle.get_block_size(), handle.get_queue_depth(), handle.get_single_submit(),
            handle.get_overlap_events(), handle.get_intra_op_parallelism()) == (1 << 16, 4, False, True, 2)
    example = torch.empty(0, dtype=torch.bfloat16)
    buffers = [handle.new_cpu_locked_tensor(n, example) for n in (100_000, 4097)]
    assert all(b.dtype == torch.bfloat16 and b.data_ptr() % 4096 == 0 for b in buffers)
    assert handle.is_pinned(buffers[0]) and handle.is_pinned(buffers[0].narrow(0, 10, 1000))
    assert not handle.is_pinned(torch.empty(10))
    for b in buffers:
        b.copy_(torch.randn(b.numel()))
    paths = [str(tmp_path / f"t{i}.swp") for i in range(2)]
    swap_out_tensors(handle, buffers, paths)
    assert handle.wait() == 2
    back = [handle.new_cpu_locked_tensor(b.numel(), example).zero_() for b in buffers]
    swap_in_tensors(handle, back, paths)
    assert handle.wait() == 2
    assert all(torch.equal(a, b) for a, b in zip(buffers, back))
    assert handle.sync_pread(back[1], paths[0], file_offset=2 * 1000) == 1  # a slice of the first file
    assert torch.equal(back[1], buffers[0][1000:1000 + back[1].numel()])

    # A read past the end: an error naming the file, never short data.
    longer = handle.new_cpu_locked_tensor(5000, example)
    handle.async_pread(longer, paths[1])
    handle.async_pread(back[0], paths[0])  # in flight beside it, and ended before the error is raised
    with pytest.raises(tierflow.TierflowError, match=r"read past end of file .*t1\.swp"):
        handle.wait()
    assert handle.wait() == 0

    # A full disk: ENOSPC naming the file; what was written before stays.
    disk = small_tmpfs("256k")
    first = str(disk / "first.swp")
    assert handle.sync_pwrite(buffers[1], first) == 1
    too_big = handle.new_cpu_locked_tensor(200_000, example).zero_()  # 400 kB for a disk of 256 kB
    handle.async_pwrite(too_big, str(disk / "second.swp"))
    with pytest.raises(tierflow.TierflowError, match=r"second\.swp") as failed:
        handle.wait()
    assert failed.value.errno == 28  # ENOSPC
    check = handle.new_cpu_locked_tensor(buffers[1].numel(), example)
    assert handle.sync_pread(check, first) == 1 and torch.equal(check, buffers[1])

    with pytest.raises(ValueError, match="not contiguous"):
        handle.async_pwrite(torch.empty(8, 8).t(), paths[0])
    handle.free_cpu_locked_tensor(check)
    with pytest.raises(ValueError, match="not made by this handle"):
        handle.free_cpu_locked_tensor(check)
