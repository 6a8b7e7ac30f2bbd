"""tierflow's GlooCommunicator from Python, beside torch.distributed: 2 and 3
ranks launched by torchrun, meeting through torchrun's store
(collectives_worker.py); and its one-process errors."""

import json
import os
import subprocess
import sys

import pytest
import torch

import tierflow
from tierflow._core import GlooCommunicator


@pytest.mark.parametrize("ranks", [2, 3])
def test_every_collective_and_dtype_is_exact_and_all_reduce_is_torch_distributeds(tmp_path, ranks):
    worker = os.path.join(os.path.dirname(__file__), "collectives_worker.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([os.path.dirname(os.path.dirname(tierflow.__file__)),
                                          os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                           str(ranks), worker, str(tmp_path / "out")], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    for r in range(ranks):
        assert json.loads((tmp_path / f"out.rank{r}").read_text()) == []


def test_one_rank_over_a_directory_and_its_errors(tmp_path):
    comm = GlooCommunicator(0, 1, store_dir=str(tmp_path), timeout=5.0)
    assert (comm.rank, comm.size) == (0, 1)
    t = torch.arange(5, dtype=torch.bfloat16)
    comm.all_reduce(t, op="sum").wait()
    assert t.tolist() == list(range(5))
    with pytest.raises(ValueError, match="'prod' is not 'sum', 'max' or 'min'"):
        comm.all_reduce(t, op="prod")
    with pytest.raises(ValueError, match="the input is bf16, the output fp32"):
        comm.all_gather(t, torch.empty(5), [5])
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        comm.all_reduce(torch.arange(3))
    # One rank's strided gather: its piece into its place (rank 0's: the start), the rest left alone.
    full = torch.full((8,), -1.0)
    comm.all_gather_strided(torch.tensor([1.0, 2.0]), full[2:], 4).wait()
    assert full.tolist() == [-1, -1, 1, 2, -1, -1, -1, -1]
    with pytest.raises(ValueError, match="the output has 1 elements, 1 ranks' 2 at a stride of 4 need 2"):
        comm.all_gather_strided(torch.tensor([1.0, 2.0]), full[7:], 4)
    comm.close()
    comm.close()
    with pytest.raises(ValueError, match="closed"):
        comm.all_reduce(t)
    with pytest.raises(ValueError, match="exactly one of store"):
        GlooCommunicator(0, 1)
    with pytest.raises(ValueError, match="is not a rank of 2"):
        GlooCommunicator(2, 2, store_dir=str(tmp_path))


def test_a_gather_after_a_read_waits_for_it_and_fails_with_its_error(tmp_path):
    from tierflow import Store, TierflowError

    nvme = tmp_path / "nvme"
    nvme.mkdir()
    store = Store(host_budget=1 << 20, nvme_dir=str(nvme), nvme_budget=1 << 22, checksums=True, file_size=1 << 20)
    block = store.create_block("shard", 8192, home="nvme")
    with store.acquire(block, "host", mode="overwrite") as lease:
        torch.from_dlpack(lease.wait()).copy_(torch.arange(4096, dtype=torch.bfloat16).view(torch.uint8))
        lease.release(dirty=True)
    store.evict(block, "host")
    store.flush()
    (tmp_path / "meet").mkdir()
    comm = GlooCommunicator(0, 1, store_dir=str(tmp_path / "meet"), timeout=5.0)
    raw = torch.empty(8192 + 4096, dtype=torch.uint8)
    skip = -raw.data_ptr() % 4096
    full = raw[skip:skip + 8192].view(torch.bfloat16)
    with store.acquire(block, "nvme") as lease:
        lease.wait()
        read = lease.copy_into(full.view(torch.uint8))
        comm.all_gather(full, full, [4096], after=read).wait()  # issued before the read is done
    assert torch.equal(full, torch.arange(4096, dtype=torch.bfloat16))

    (file,) = nvme.glob("tierflow-*.nvme")
    fd = os.open(file, os.O_WRONLY)
    try:
        os.pwrite(fd, bytes(4096), 0)  # the block sits at the file's start
        os.fsync(fd)
    finally:
        os.close(fd)
    with store.acquire(block, "nvme") as lease:
        lease.wait()
        read = lease.copy_into(full.view(torch.uint8))
        gather = comm.all_gather(full, full, [4096], after=read)
        with pytest.raises(TierflowError, match="checksum mismatch"):
            read.wait()
        with pytest.raises(TierflowError, match="all_gather failed: .*checksum mismatch.*the communicator is broken"):
            gather.wait()
    with pytest.raises(TierflowError, match="checksum mismatch"):
        comm.all_gather(full, full, [4096]).wait()  # broken: every later one fails
    comm.close()
    store.close()  # the read's error was its Work's to report, not the store's
