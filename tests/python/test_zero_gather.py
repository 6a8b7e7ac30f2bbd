"""The ZeRO-3 gather pipeline through the tiers over tierflow's Gloo
communicator (zero_gather_worker.py, 2 and 3 ranks under torchrun): shards
homed on NVMe, read into host memory, copied into their slot and gathered in
place, ahead of use — byte for byte what a plain gather of the same bytes
gives; and a rank that dies with gathers in flight."""

import json
import os
import subprocess
import sys

import pytest

import tierflow
from tierflow.zero.sharing import device_of, ranks_sharing, share_of

WORKER = os.path.join(os.path.dirname(__file__), "zero_gather_worker.py")


def run(tmp_path, ranks: int, mode: str = "check") -> list[dict]:
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([os.path.dirname(os.path.dirname(tierflow.__file__)),
                                          os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                           str(ranks), WORKER, str(tmp_path / "out"), str(tmp_path / "nvme"), mode],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads((tmp_path / f"out.rank{r}").read_text()) for r in range(ranks)
            if (tmp_path / f"out.rank{r}").exists()]


@pytest.mark.parametrize("ranks", [2, 3])
def test_gathers_through_the_tiers_are_a_plain_gathers_bytes(tmp_path, ranks):
    results = run(tmp_path, ranks)
    assert len(results) == ranks
    for r in results:
        assert r["mismatches"] == [] and r["errors"] == []
        # the first iteration records the order; the next three gather 15 of
        # their 16 fetches ahead; the last departs from the order at once
        assert r["ahead_after_second"] == 15 and r["ahead"] == 45 and r["dropped"] == 0
        assert r["direct"] > 0  # the shards of whole pages, read straight into their slot
        assert r["departures"] == 2
        # torch.distributed's one: the ranks telling each other their NVMe device
        assert r["counts"]["torch"] == 1 and r["counts"]["tierflow"] > 0
        assert r["read"] > 0 and r["files_left"] == []
        assert r["sharing"] == ranks and r["queue_depth"] == 6 // ranks  # one device's depth, split
        assert 0 < r["high_water"] <= r["gather_budget"]


def test_shards_gathered_a_chunk_at_a_time_are_a_plain_gathers_bytes(tmp_path):
    # Three ranks, chunks of one page: the direct reads into the slot and the
    # copies from host memory, each chunk gathered into its place behind its own.
    for r in run(tmp_path, 3, "chunks"):
        assert r["mismatches"] == [] and r["errors"] == []
        assert r["direct"] > 0 and r["ahead"] == 45 and r["dropped"] == 0
        # Shards of 2048 bf16 elements a chunk: 12_345, 65_537, 20_000 and 12_288 elements
        # (3, 11, 4 and 2 chunks of a rank's third), each fetched twice an iteration: 40 in each
        # of the first four; the last fetches the first three (36). The others are one chunk: whole.
        assert r["chunks"] == 4 * 40 + 36 and r["files_left"] == []


def test_gathers_ahead_stay_within_the_device_budget_and_the_prefetch_bucket(tmp_path):
    # A budget that holds fewer gathers ahead than the order offers: the one
    # being fetched counts beside them.
    (tmp_path / "tight").mkdir()
    (tmp_path / "off").mkdir()
    for r in run(tmp_path / "tight", 2, "tight"):
        assert r["mismatches"] == [] and r["errors"] == []
        assert r["ahead"] > 0 and r["high_water"] <= r["gather_budget"] < 1 << 20, r
    # stage3_prefetch_bucket_size 0: every gather on demand
    for r in run(tmp_path / "off", 2, "no_prefetch"):
        assert r["mismatches"] == [] and r["errors"] == []
        assert r["ahead"] == 0 and r["dropped"] == 0 and r["direct"] > 0, r


def test_a_rank_dying_with_gathers_in_flight_fails_the_others_at_once(tmp_path):
    results = run(tmp_path, 2, "kill")
    assert len(results) == 1  # rank 1 exited without a word
    r = results[0]
    assert r["mismatches"] == [] and len(r["errors"]) == 2, r
    first, again = r["errors"]
    assert first.startswith("TierflowError: gloo communicator (rank 0 of 2): all_gather failed"), first
    assert "the communicator is broken" in first
    assert "the communicator is broken" in again and r["after_seconds"] < 1.0  # the next fetch: at once
    assert r["files_left"] == []


class _Ranks:
    """A group whose other ranks answered ``theirs`` to gather_ints."""

    def __init__(self, *theirs: tuple[int, int]) -> None:
        self.theirs = theirs

    def gather_ints(self, *mine: int) -> list[tuple[int, ...]]:
        return [tuple(mine), *self.theirs]


def test_the_ranks_whose_directories_share_a_device_split_its_queue_depth(tmp_path):
    node, device = device_of(tmp_path)
    other_dir = tmp_path / "rank1"
    other_dir.mkdir()
    assert device_of(other_dir) == (node, device)  # one file system
    # Two more ranks on this device, one on another device of this node, one
    # on the same device number of another machine: three share it.
    group = _Ranks((node, device), (node, device), (node, device + 1), (node + 1, device))
    assert ranks_sharing(group, tmp_path) == 3
    assert share_of({"queue_depth": 8, "block_size": 1 << 20}, 3) == {"queue_depth": 2, "block_size": 1 << 20}
    assert share_of({"queue_depth": 2}, 3) == {"queue_depth": 1}  # never below one chunk
    default = tierflow._core.aio_config({})["queue_depth"]
    assert share_of(None, 2) == {"queue_depth": default // 2}  # the engine's default depth, split
    assert share_of({"queue_depth": 8}, 1) == {"queue_depth": 8} and share_of(None, 1) is None
