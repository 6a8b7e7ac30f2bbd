"""tierflow.Store, Lease and PrefetchScheduler: blocks leased into the tiers a
ZeRO-3 engine uses (a host budget, NVMe files in pytest's tmp_path, the device
tier's host stand-in, and the CUDA pool where a GPU is present), their bytes
seen zero-copy through NumPy and torch, the budgets, the scheduler's
prefetching, the trace, and the errors a misuse or a bad disk causes."""

import errno
import gc
import json
import os
import pathlib
import threading
import time

import numpy as np
import pytest
import torch

import tierflow
from tierflow import BudgetError, Lease, PrefetchScheduler, Store, TierflowError

KIB = 1 << 10
MIB = 1 << 20


def pattern(size, seed):
    """`size` random bytes, different for each seed."""
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


def tiered_store(tmp_path, folder="nvme", **options):
    """Host 1 MiB, NVMe 4 MiB in tmp_path/folder, a device stand-in of 256 KiB."""
    nvme = tmp_path / folder
    nvme.mkdir(exist_ok=True)
    settings = dict(host_budget=1 * MIB, nvme_dir=str(nvme), nvme_budget=4 * MIB,
                    device_budget=256 * KIB, device_backend="stand_in", file_size=1 * MIB)
    settings.update(options)
    return Store(**settings)


def at_home(store, block, data):
    """`data` in `block`, written home to NVMe, no copy left in the host tier."""
    write(store, block, data, tier="host")
    store.evict(block, "host")
    store.flush()


def zero_first_page(directory):
    """Overwrites the first 4 KiB of the one NVMe file in `directory` (where the first block sits)."""
    (file,) = pathlib.Path(directory).glob("tierflow-*.nvme")
    fd = os.open(file, os.O_WRONLY)
    try:
        os.pwrite(fd, bytes(4 * KIB), 0)
        os.fsync(fd)
    finally:
        os.close(fd)
    return file


def write(store, block, data, tier="device"):
    """`data` into `block` through an overwrite lease on `tier`, released dirty."""
    lease = store.acquire(block, tier, mode="overwrite")
    view = torch.from_dlpack(lease.wait())
    view.copy_(torch.from_numpy(data))
    del view
    lease.release(dirty=True)


def read(store, block, tier):
    with store.acquire(block, tier) as lease:
        return np.array(lease.wait())  # a copy, taken before the lease ends


def nvme_file_bytes(directory):
    return b"".join(p.read_bytes() for p in sorted(pathlib.Path(directory).glob("tierflow-*.nvme")))


def test_the_store_reports_its_tiers_and_blocks(tmp_path):
    store = tiered_store(tmp_path)
    assert store.tiers == ["device", "host", "nvme"]
    assert store.device_is_cuda is False
    w = store.create_block("layers.0.w", 12 * KIB + 5, home="nvme")
    b = store.create_block("layers.0.b", 4 * KIB)
    assert (w, b) == (0, 1) and store.block_count == 2
    assert store.find("layers.0.b") == b and store.find("missing") is None
    assert store.describe(w) == {"name": "layers.0.w", "size_bytes": 12 * KIB + 5, "home": "nvme"}
    assert store.state(w, "nvme") == "valid" and store.state(w, "device") == "absent"
    assert Store(host_budget=MIB).tiers == ["host"]
    with pytest.raises(ValueError, match="no block with id 7"):
        store.describe(7)


def test_bytes_written_on_the_device_reach_nvme_and_read_back_through_every_path(tmp_path):
    store = tiered_store(tmp_path)
    size = 64 * KIB + 100  # not whole pages: the array is the block's size, not its storage's
    block = store.create_block("w", size, home="nvme")
    data = pattern(size, 1)

    write(store, block, data)
    assert store.state(block, "device") == "dirty" and store.state(block, "nvme") == "absent"
    store.evict(block, "device")  # written back home first
    store.flush()
    assert store.state(block, "device") == "absent" and store.state(block, "nvme") == "valid"
    assert data.tobytes() in nvme_file_bytes(tmp_path / "nvme")  # on disk, not only cached

    np.testing.assert_array_equal(read(store, block, "host"), data)  # nvme -> host
    store.evict(block, "host")
    assert store.state(block, "host") == "absent"
    np.testing.assert_array_equal(read(store, block, "device"), data)  # nvme -> device, staged
    store.evict(block, "device")
    np.testing.assert_array_equal(read(store, block, "host"), data)
    np.testing.assert_array_equal(read(store, block, "device"), data)  # host -> device
    with store.acquire(block, "nvme") as home:
        assert home.wait() is None  # a file tier's copy has no address

    # A host-homed block written in place on the host and read on the device.
    h = store.create_block("h", 8 * KIB)
    write(store, h, pattern(8 * KIB, 2), tier="host")
    np.testing.assert_array_equal(read(store, h, "device"), pattern(8 * KIB, 2))


def test_a_lease_gives_the_copy_itself_zero_copy(tmp_path):
    store = tiered_store(tmp_path)
    block = store.create_block("w", 16 * KIB)
    with store.acquire(block, "device", mode="write") as lease:
        first = lease.wait()
        assert isinstance(first, np.ndarray) and first.dtype == np.uint8 and first.shape == (16 * KIB,)
        address = first.ctypes.data
        assert lease.wait().ctypes.data == address and lease.data.ctypes.data == address
        tensor = torch.from_dlpack(first)
        assert tensor.data_ptr() == address and tensor.device.type == "cpu"
        tensor.fill_(0xAB)
        assert lease.data[123] == 0xAB  # one memory seen through every view
        assert address % 4096 == 0  # copies start on a page
        del tensor, first
        lease.release(dirty=True)
    assert (read(store, block, "host") == 0xAB).all()


def test_budgets_bound_every_tier(tmp_path):
    store = tiered_store(tmp_path)
    big = store.create_block("big", 512 * KIB)
    with pytest.raises(BudgetError) as raised:
        store.acquire(big, "device")
    e = raised.value
    assert isinstance(e, MemoryError) and e.tier.startswith("device") and e.block == "big"
    assert e.budget == 256 * KIB and e.request == 512 * KIB

    # More blocks than the device holds, each leased in turn: older copies make room.
    blocks = [store.create_block(f"b{i}", 48 * KIB) for i in range(8)]
    for i, b in enumerate(blocks):
        write(store, b, pattern(48 * KIB, 10 + i))
    for i, b in enumerate(blocks):
        np.testing.assert_array_equal(read(store, b, "device"), pattern(48 * KIB, 10 + i))
    tiers = {t["kind"]: t for t in store.telemetry()["tiers"]}
    assert tiers["device"]["evictions"] > 0
    assert tiers["device"]["high_water_bytes"] > 0 and tiers["host"]["high_water_bytes"] > 0
    for t in tiers.values():
        assert t["high_water_bytes"] <= t["budget_bytes"]


def test_prefetch_starts_the_load_and_acquire_finds_it(tmp_path):
    store = tiered_store(tmp_path)
    block = store.create_block("w", 128 * KIB, home="nvme")
    write(store, block, pattern(128 * KIB, 3), tier="host")
    store.evict(block, "host")
    store.flush()
    assert store.state(block, "device") == "absent"
    store.prefetch(block, "device")
    assert store.state(block, "device") in ("loading", "valid")
    lease = store.acquire(block, "device")
    np.testing.assert_array_equal(lease.wait(), pattern(128 * KIB, 3))
    assert lease.ready
    lease.release()
    assert store.state(block, "device") == "valid"  # stays cached until evicted
    assert store.telemetry()["prefetches"] == 1


def run_iteration(scheduler, blocks, order, seen):
    scheduler.begin_iteration()
    for i in order:
        lease = scheduler.acquire(blocks[i], "device")
        seen.append(bool((lease.wait() == i).all()))
        scheduler.release(lease)
    scheduler.end_iteration()


def twelve_layers_on_nvme(store):
    """12 blocks of 32 KiB homed on NVMe, block i holding the byte i, none cached."""
    blocks = [store.create_block(f"layers.{i}", 32 * KIB, home="nvme") for i in range(12)]
    for i, b in enumerate(blocks):
        write(store, b, np.full(32 * KIB, i, dtype=np.uint8), tier="host")
        store.evict(b, "host")
    store.flush()
    return blocks


def test_the_scheduler_records_an_iteration_and_prefetches_the_next(tmp_path):
    store = tiered_store(tmp_path)
    # 12 blocks of 32 KiB: 1.5 times the device's budget, so copies must be evicted.
    blocks = twelve_layers_on_nvme(store)
    scheduler = PrefetchScheduler(store, max_lookahead=8)
    order = list(range(12))
    seen = []

    run_iteration(scheduler, blocks, order, seen)  # recorded: served on demand
    assert scheduler.schedule == [(b, "device", "read") for b in blocks]
    assert scheduler.stats["iterations"] == 1 and scheduler.stats["accesses"] == 12

    run_iteration(scheduler, blocks, order, seen)  # prefetched from the recording
    stats = scheduler.stats
    assert stats["iterations"] == 2 and stats["accesses"] == 24 and stats["rerecords"] == 0
    assert stats["lookahead"] >= 1
    assert len(stats["per_access_stall_seconds"]) == 12
    assert stats["stalled_accesses"] <= stats["accesses"] and stats["stall_seconds"] >= 0
    assert store.telemetry()["prefetches"] > 0

    run_iteration(scheduler, blocks, order[::-1], seen)  # the backward's order: re-recorded
    assert scheduler.stats["rerecords"] == 1
    assert scheduler.schedule == [(b, "device", "read") for b in blocks[::-1]]
    assert all(seen) and len(seen) == 36
    (device,) = [t for t in store.telemetry()["tiers"] if t["kind"] == "device"]
    assert device["high_water_bytes"] <= device["budget_bytes"]


def test_a_scheduler_with_no_budget_share_serves_every_access_on_demand(tmp_path):
    store = tiered_store(tmp_path)
    blocks = twelve_layers_on_nvme(store)
    scheduler = PrefetchScheduler(store, budget_share=0)
    seen = []
    for _ in range(3):
        run_iteration(scheduler, blocks, list(range(12)), seen)
    assert all(seen) and scheduler.stats["iterations"] == 3
    assert store.telemetry()["prefetches"] == 0


def test_the_scheduler_takes_a_given_schedule_and_refuses_misuse(tmp_path):
    store = tiered_store(tmp_path)
    a, b = store.create_block("a", 4 * KIB), store.create_block("b", 4 * KIB)
    scheduler = PrefetchScheduler(store)
    scheduler.set_schedule([(a, "device", "write"), (b, "host", "read")])
    assert scheduler.schedule == [(a, "device", "write"), (b, "host", "read")]
    with pytest.raises(ValueError, match="tier: unknown tier 'gpu'"):
        scheduler.set_schedule([(a, "gpu", "read")])
    with pytest.raises(ValueError, match="mode: unknown mode 'append'"):
        scheduler.set_schedule([(a, "host", "append")])
    with pytest.raises(ValueError, match="unknown block 9"):
        scheduler.set_schedule([(9, "host", "read")])
    with pytest.raises(ValueError, match="outside begin_iteration"):
        scheduler.acquire(a)
    with pytest.raises(ValueError, match="without begin_iteration"):
        scheduler.end_iteration()
    with pytest.raises(ValueError, match="budget_share"):
        PrefetchScheduler(store, budget_share=1.5)
    with pytest.raises(ValueError, match="min_lookahead"):
        PrefetchScheduler(store, min_lookahead=5, max_lookahead=2)

    scheduler.begin_iteration()
    with pytest.raises(ValueError, match="called twice"):
        scheduler.begin_iteration()
    with pytest.raises(ValueError, match="inside an iteration"):
        scheduler.set_schedule([])
    written = scheduler.acquire(a, "device", mode="write")
    assert written.ready and written.wait().shape == (4 * KIB,)
    with pytest.raises(ValueError, match='block "a" in tier device was granted by PrefetchScheduler'):
        store.release(written)
    plain = store.acquire(b, "host")
    with pytest.raises(ValueError, match="was taken with Store.acquire"):
        scheduler.release(plain)
    plain.release()
    with pytest.raises(ValueError, match="another PrefetchScheduler"):
        PrefetchScheduler(store).release(written)
    written.wait()[:] = 5
    scheduler.release(written, dirty=True)
    with scheduler.acquire(b, "host") as read_lease:  # a `with` ends it through the scheduler
        assert read_lease.wait().shape == (4 * KIB,)
    assert read_lease.released
    scheduler.end_iteration()
    assert scheduler.stats["accesses"] == 2 and scheduler.stats["rerecords"] == 0
    assert (read(store, a, "host") == 5).all()


def test_the_scheduler_keeps_its_store_alive(tmp_path):
    store = tiered_store(tmp_path)
    block = store.create_block("w", 4 * KIB)
    scheduler = PrefetchScheduler(store)
    del store
    gc.collect()
    scheduler.begin_iteration()
    with scheduler.acquire(block, "host") as lease:
        assert lease.wait().shape == (4 * KIB,)
    scheduler.end_iteration()


def test_write_trace_writes_chrome_trace_json(tmp_path):
    store = tiered_store(tmp_path, trace=True)
    block = store.create_block("w", 32 * KIB, home="nvme")
    write(store, block, pattern(32 * KIB, 4))
    store.flush()
    read(store, block, "host")
    path = tmp_path / "trace.json"
    store.write_trace(str(path))
    doc = json.loads(path.read_text())
    events = [e for e in doc["traceEvents"] if e.get("ph") == "X"]
    assert all({"name", "ts", "dur", "pid", "tid"} <= e.keys() for e in events)
    moves = {(e["name"], e["args"]["link"], e["args"]["class"], e["args"]["bytes"])
             for e in events if e["cat"] == "transfer"}
    assert moves == {("w", "device->nvme", "writeback", str(32 * KIB)),  # flush()
                     ("w", "device->host", "demand", str(32 * KIB))}     # read(): the nearest copy

    untraced = tiered_store(tmp_path, folder="untraced")
    untraced.write_trace(str(tmp_path / "empty.json"))
    assert [e for e in json.loads((tmp_path / "empty.json").read_text())["traceEvents"]
            if e.get("ph") == "X"] == []
    missing = tmp_path / "no" / "trace.json"
    with pytest.raises(TierflowError) as raised:
        store.write_trace(str(missing))
    assert raised.value.errno == errno.ENOENT and raised.value.filename == str(missing)


def test_a_corrupt_nvme_block_fails_its_load_with_the_errno_and_the_store_recovers(tmp_path):
    store = tiered_store(tmp_path, checksums=True)
    block = store.create_block("state.exp_avg", 16 * KIB, home="nvme")
    at_home(store, block, pattern(16 * KIB, 5))
    file = zero_first_page(tmp_path / "nvme")

    for _ in range(2):  # a failed load leaves the copy absent; the next acquire tries again
        lease = store.acquire(block, "host", mode="write")  # loads the bytes first
        with pytest.raises(TierflowError) as raised:
            lease.wait()
        e = raised.value
        assert e.errno == errno.EBADMSG and "checksum mismatch" in str(e)
        assert e.block == "state.exp_avg" and e.filename == str(file) and e.offset == 0
        assert lease.ready and store.state(block, "host") == "absent"
        with pytest.raises(ValueError, match="never granted"):
            lease.release(dirty=True)
        lease.release()
    with pytest.raises(TierflowError, match="checksum mismatch"):
        store.flush()  # the first error since the last flush, reported once
    write(store, block, pattern(16 * KIB, 6), tier="host")  # overwritten: nothing to load
    store.evict(block, "host")
    store.flush()
    np.testing.assert_array_equal(read(store, block, "host"), pattern(16 * KIB, 6))


def page_aligned(nbytes):
    """A uint8 tensor of `nbytes` starting on a 4 KiB boundary."""
    raw = torch.empty(nbytes + 4 * KIB, dtype=torch.uint8)
    skip = -raw.data_ptr() % (4 * KIB)
    return raw[skip:skip + nbytes]


def test_copy_into_reads_an_nvme_block_straight_into_the_callers_memory(tmp_path):
    store = tiered_store(tmp_path, checksums=True)
    block = store.create_block("shard", 12 * KIB, home="nvme")
    at_home(store, block, pattern(12 * KIB, 7))
    before = {l["name"]: l["bytes"] for l in store.telemetry()["links"]}["nvme->host"]
    lease = store.acquire(block, "nvme")
    assert lease.wait() is None
    out = page_aligned(12 * KIB)
    work = lease.copy_into(out, traffic="prefetch")
    work.wait()
    assert work.done
    np.testing.assert_array_equal(out.numpy(), pattern(12 * KIB, 7))
    assert store.state(block, "host") == "absent"  # no copy in the host tier
    links = {l["name"]: l for l in store.telemetry()["links"]}
    assert links["nvme->host"]["bytes"] - before == 12 * KIB
    assert links["nvme->host"]["classes"]["prefetch"]["bytes"] == 12 * KIB

    with pytest.raises(ValueError, match="does not start on a 4096-byte boundary"):
        lease.copy_into(page_aligned(16 * KIB)[1:12 * KIB + 1])
    with pytest.raises(ValueError, match="8192 bytes given for its 12288"):
        lease.copy_into(out[:8 * KIB])
    pending = lease.copy_into(page_aligned(12 * KIB))
    lease.release()  # waits for the copy: it reads the leased copy
    assert pending.done
    with pytest.raises(ValueError, match="released already"):
        lease.copy_into(out)
    with store.acquire(block, "host") as host:
        host.wait()
        with pytest.raises(ValueError, match="in the host tier already"):
            host.copy_into(out)
    store.evict(block, "host")
    not_yet = store.acquire(block, "nvme")
    with pytest.raises(ValueError, match="not been granted yet"):
        not_yet.copy_into(out)
    not_yet.release()

    store.flush()
    zero_first_page(tmp_path / "nvme")
    with store.acquire(block, "nvme") as lease:
        lease.wait()
        with pytest.raises(TierflowError, match="checksum mismatch") as raised:
            lease.copy_into(out).wait()
        assert raised.value.block == "shard"
    store.close()


def test_copy_into_a_part_reads_those_pages_alone_and_is_refused_where_checksums_cover_whole_blocks(tmp_path):
    store = tiered_store(tmp_path)
    block = store.create_block("shard", 20 * KIB, home="nvme")  # five pages
    at_home(store, block, pattern(20 * KIB, 3))
    with store.acquire(block, "nvme") as lease:
        lease.wait()
        out = page_aligned(20 * KIB)
        out.fill_(0xAB)
        # The middle three pages, then the first and the last page, each into its place.
        lease.copy_into(out[4 * KIB:16 * KIB], offset=4 * KIB).wait()
        assert (out[:4 * KIB] == 0xAB).all() and (out[16 * KIB:] == 0xAB).all()  # nothing past the part
        np.testing.assert_array_equal(out[4 * KIB:16 * KIB].numpy(), pattern(20 * KIB, 3)[4 * KIB:16 * KIB])
        lease.copy_into(out[:4 * KIB], offset=0).wait()
        lease.copy_into(out[16 * KIB:], offset=16 * KIB).wait()
        np.testing.assert_array_equal(out.numpy(), pattern(20 * KIB, 3))
        with pytest.raises(ValueError, match="runs past its 20480"):
            lease.copy_into(out[:8 * KIB], offset=16 * KIB)
        with pytest.raises(ValueError, match="not in whole 4096-byte pages"):
            lease.copy_into(out[:4 * KIB], offset=100)
        with pytest.raises(ValueError, match="not in whole 4096-byte pages"):
            lease.copy_into(out[:100], offset=0)
    store.close()

    checked = tiered_store(tmp_path, "checked", checksums=True)
    block = checked.create_block("shard", 8 * KIB, home="nvme")
    at_home(checked, block, pattern(8 * KIB, 4))
    with checked.acquire(block, "nvme") as lease:
        lease.wait()
        out = page_aligned(8 * KIB)
        with pytest.raises(ValueError, match="a part could not be checked"):
            lease.copy_into(out[:4 * KIB], offset=0)
        lease.copy_into(out, offset=0).wait()  # the whole block as a part: checked, and allowed
        np.testing.assert_array_equal(out.numpy(), pattern(8 * KIB, 4))
    checked.close()


def test_close_with_a_held_lease_names_the_block_and_the_store_stays_usable(tmp_path):
    store = tiered_store(tmp_path)
    a = store.create_block("layers.3.w", 8 * KIB)
    b = store.create_block("layers.4.w", 8 * KIB)
    held = store.acquire(a, "device", mode="overwrite")
    held.wait()[:] = 9
    with pytest.raises(ValueError, match='lease of block "layers.3.w" is held'):
        store.close()
    held.release(dirty=True)
    assert read(store, b, "device").shape == (8 * KIB,)
    store.close()
    store.close()  # once closed, again does nothing
    with pytest.raises(ValueError, match=r"acquire\(\) after close\(\)"):
        store.acquire(a, "host")
    assert store.state(a, "host") == "valid"  # close() flushed the device's dirty copy home


def test_misuse_of_a_lease_is_a_clear_error(tmp_path):
    store = tiered_store(tmp_path)
    block = store.create_block("w", 4 * KIB)
    lease = store.acquire(block, "host")
    lease.wait()
    lease.release()
    assert lease.released and not lease.ready
    for again in (lease.release, lambda: store.release(lease), lease.wait):
        with pytest.raises(ValueError, match='block "w" in tier host was released already'):
            again()
    with pytest.raises(ValueError, match="released already"):
        lease.data
    with store.acquire(block, "host") as reader:
        with pytest.raises(ValueError, match="a read lease"):
            reader.release(dirty=True)
        reader.wait()
    writer = store.acquire(block, "host", mode="write")
    writer.wait()
    pending = store.acquire(block, "host")  # waits for the writer
    assert not pending.ready
    with pytest.raises(ValueError, match="not been granted yet"):
        pending.data
    pending.release()  # withdrawn
    writer.release()
    other = tiered_store(tmp_path, folder="other")
    other.create_block("w", 4 * KIB)
    foreign = other.acquire(0, "host")
    with pytest.raises(ValueError, match="another Store"):
        store.release(foreign)
    foreign.release()
    for bad, match in ((dict(tier="gpu"), "tier: unknown tier 'gpu'"),
                       (dict(mode="append"), "mode: unknown mode 'append'"),
                       (dict(traffic="urgent"), "traffic: unknown traffic class 'urgent'")):
        with pytest.raises(ValueError, match=match):
            store.acquire(block, **bad)
    on_nvme = store.create_block("on_nvme", 4 * KIB, home="nvme")
    with pytest.raises(ValueError, match="cannot be leased for writing"):
        store.acquire(on_nvme, "nvme", mode="write")
    assert "Lease of block 0" in repr(store.acquire(block, "host"))


def test_bad_store_options_are_value_errors_naming_them(tmp_path):
    for options, match in ((dict(nvme_budget=MIB), "nvme_budget: given without nvme_dir"),
                           (dict(checksums=True), "checksums: given without nvme_dir"),
                           (dict(file_size=MIB), "file_size: given without nvme_dir"),
                           (dict(device_backend="stand_in"), "device_backend: 'stand_in' given without"),
                           (dict(device_budget=MIB, device_backend="tpu"), "device_backend: unknown backend 'tpu'"),
                           (dict(nvme_dir=str(tmp_path)), "nvme tier: the budget is zero")):
        with pytest.raises(ValueError, match=match):
            Store(host_budget=MIB, **options)


def test_a_single_holder_waiting_for_room_only_its_own_leases_hold_gets_edeadlk():
    # Pages 0, 1, 2 of a 4-page device tier leased, page 1 released: a 2-page
    # block fits neither free page, and only the holder's own leases could
    # make room, so its wait raises at once instead of waiting for ever.
    store = Store(host_budget=MIB, device_budget=16 * KIB, device_backend="stand_in",
                  single_holder=True)
    pages = [store.create_block(f"layers.{k}.w", 4 * KIB) for k in range(3)]
    wide = store.create_block("layers.3.w", 8 * KIB)
    held = [store.acquire(block, "device") for block in pages]
    for lease in held:
        lease.wait()
    held[1].release()
    pending = store.acquire(wide, "device")
    start = time.monotonic()
    with pytest.raises(TierflowError) as raised:
        pending.wait()
    assert time.monotonic() - start < 1
    error = raised.value
    assert isinstance(error, OSError) and not isinstance(error, BudgetError)
    assert error.errno == errno.EDEADLK
    assert (error.block, error.tier, error.length) == ("layers.3.w", "device", 8 * KIB)
    message = str(error)
    assert 'block "layers.3.w" (8.00 KiB) can never get room in tier device' in message
    assert "budget 16.00 KiB, 8.00 KiB in use, largest free piece 4.00 KiB" in message
    assert 'held by the leases of "layers.0.w" (4.00 KiB), "layers.2.w" (4.00 KiB);' in message
    assert "\n" not in message
    # The request failed, not the store: once one of the leases ends, it fits.
    pending.release()
    held[2].release()
    with store.acquire(wide, "device") as lease:
        assert lease.wait().shape == (8 * KIB,)
    held[0].release()
    store.close()


def test_a_lease_outlives_its_store(tmp_path):
    store = tiered_store(tmp_path)
    block = store.create_block("w", 8 * KIB)
    write(store, block, pattern(8 * KIB, 7), tier="host")
    lease = store.acquire(block, "device")
    view = lease.wait()
    del store
    gc.collect()
    np.testing.assert_array_equal(view, pattern(8 * KIB, 7))  # the lease keeps the store's memory
    np.testing.assert_array_equal(lease.wait(), pattern(8 * KIB, 7))
    lease.release()


def test_wait_releases_the_gil(tmp_path):
    store = tiered_store(tmp_path)
    block = store.create_block("w", 4 * KIB)
    writer = store.acquire(block, "host", mode="write")
    writer.wait()
    reader = store.acquire(block, "host")  # granted once the writer is released
    got, started = [], threading.Event()

    def wait_for_the_writer():
        started.set()
        got.append(int(reader.wait()[0]))

    waiter = threading.Thread(target=wait_for_the_writer)
    waiter.start()
    started.wait()
    time.sleep(0.2)  # this thread runs Python meanwhile: the waiter does not hold the GIL
    assert waiter.is_alive() and not reader.ready
    with pytest.raises(ValueError, match="being waited on by another thread"):
        reader.release()
    writer.wait()[0] = 42
    writer.release(dirty=True)
    waiter.join(timeout=10)
    assert not waiter.is_alive() and got == [42]
    reader.release()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the CUDA device tier needs one")
def test_the_cuda_device_tier_leases_device_memory(tmp_path):
    store = tiered_store(tmp_path, device_backend="cuda")
    assert store.device_is_cuda
    block = store.create_block("w", 64 * KIB + 100, home="nvme")
    lease = store.acquire(block, "device", mode="overwrite")
    view = torch.from_dlpack(lease.wait())
    assert view.device == torch.device("cuda", 0) and view.shape == (64 * KIB + 100,)
    assert torch.from_dlpack(lease.data).data_ptr() == view.data_ptr()
    view.copy_(torch.from_numpy(pattern(64 * KIB + 100, 8)).cuda())
    torch.cuda.synchronize()  # the store's copy engines do not order after torch's stream
    del view
    lease.release(dirty=True)
    store.evict(block, "device")
    store.flush()
    np.testing.assert_array_equal(read(store, block, "host"), pattern(64 * KIB + 100, 8))
    with store.acquire(block, "device") as again:
        np.testing.assert_array_equal(torch.from_dlpack(again.wait()).cpu().numpy(),
                                      pattern(64 * KIB + 100, 8))


def test_the_cuda_backend_without_a_device_is_a_value_error(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    with pytest.raises(ValueError, match="cuda"):
        tiered_store(tmp_path, device_backend="cuda")


def test_the_package_exports_the_store_api():
    assert tierflow.Store is Store and tierflow.Lease is Lease
    assert tierflow.PrefetchScheduler is PrefetchScheduler
    assert {"Store", "Lease", "PrefetchScheduler"} <= set(tierflow.__all__)
