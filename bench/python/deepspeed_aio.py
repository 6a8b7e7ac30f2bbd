#!/usr/bin/env python3
"""DeepSpeed's NVMe I/O, as its ``ds_io`` sweep measures it: whole-file
writes and reads of pinned CPU buffers through an ``aio_handle``, tierflow's
(``tierflow.deepspeed.AioHandle``, what ``tierflow.deepspeed.install()`` gives
DeepSpeed's swappers) beside DeepSpeed's own libaio op
(``AsyncIOBuilder().load().aio_handle``, JIT-built; it needs Debian's
libaio-dev, which ``scripts/setup.sh --bench`` installs), in the same run.

    bench/python/deepspeed_aio.py --dir DIR [--size 256M] [--files 4] [--block-size 1M]
        [--queue-depth 32] [--threads 1] [--repeat 3] [--json FILE]

Each round writes ``--files`` files of ``--size`` bytes each under ``--dir``
(all queued, then one ``wait()``), then reads them back into other buffers,
with every contender in turn (who goes first alternates by round); the figure is the median over ``--repeat``
rounds of the bytes over the time from the first request to ``wait()``'s
return. The data read back is compared with what was written. Both handles
take the same ``block_size``, ``queue_depth`` and ``intra_op_parallelism``
(``--threads``); DeepSpeed's with ``single_submit`` false and
``overlap_events`` true, its fastest. Prints each contender's write and read
GB/s and tierflow's over DeepSpeed's (the target is ≥ 1.0).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch


def size_of(text: str) -> int:
    from tierflow import _core

    return int(_core.parse_size(text, "--size"))


def handles(args) -> tuple[dict, dict]:
    from tierflow.deepspeed import AioHandle

    kwargs = dict(block_size=args.block_size, queue_depth=args.queue_depth, single_submit=False,
                  overlap_events=True, intra_op_parallelism=args.threads)
    made, errors = {"tierflow": AioHandle(**kwargs)}, {}
    try:
        from deepspeed.ops.op_builder import AsyncIOBuilder

        made["deepspeed (libaio)"] = AsyncIOBuilder().load(verbose=False).aio_handle(**kwargs)
    except Exception as e:  # no libaio-dev, no compiler: said, and tierflow's figures stand alone
        errors["deepspeed (libaio)"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
    return made, errors


def round_trip(handle, directory: str, size: int, files: int) -> tuple[float, float]:
    example = torch.empty(0, dtype=torch.uint8)
    out = [handle.new_cpu_locked_tensor(size, example) for _ in range(files)]
    back = [handle.new_cpu_locked_tensor(size, example) for _ in range(files)]
    for i, t in enumerate(out):
        t.copy_(torch.randint(0, 256, (size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(i)))
    paths = [os.path.join(directory, f"f{i}.swp") for i in range(files)]
    t0 = time.perf_counter()
    for t, p in zip(out, paths):
        assert handle.async_pwrite(t, p, 0) == 0
    assert handle.wait() == files
    write = time.perf_counter() - t0
    t0 = time.perf_counter()
    for t, p in zip(back, paths):
        assert handle.async_pread(t, p, 0) == 0
    assert handle.wait() == files
    read = time.perf_counter() - t0
    if not all(torch.equal(a, b) for a, b in zip(out, back)):
        raise RuntimeError(f"{type(handle).__name__}: the data read back is not what was written")
    for t in out + back:
        handle.free_cpu_locked_tensor(t)
    return write, read


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", required=True, help="the directory the files go in (on the device measured)")
    p.add_argument("--size", default="256M", help="bytes of each file (default 256M)")
    p.add_argument("--files", type=int, default=4)
    p.add_argument("--block-size", type=int, default=1 << 20)
    p.add_argument("--queue-depth", type=int, default=32)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--json", type=str)
    args = p.parse_args(argv)
    if not os.path.isdir(args.dir):
        p.error(f"--dir: {args.dir} is not a directory")
    for name in ("files", "queue_depth", "threads", "repeat"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}: {getattr(args, name)} is not ≥ 1")
    size = size_of(args.size)
    made, errors = handles(args)
    scratch = tempfile.mkdtemp(prefix="deepspeed_aio-", dir=args.dir)
    figures: dict[str, dict[str, list[float]]] = {name: {"write": [], "read": []} for name in made}
    try:
        order = list(made.items())
        for round_ in range(args.repeat):
            for name, handle in (order if round_ % 2 == 0 else order[::-1]):  # who goes first alternates
                write, read = round_trip(handle, scratch, size, args.files)
                figures[name]["write"].append(size * args.files / write / 1e9)
                figures[name]["read"].append(size * args.files / read / 1e9)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(f"{args.files} files of {size / 1e6:.0f} MB in {args.dir}: block_size {args.block_size}, queue_depth "
          f"{args.queue_depth}, {args.threads} thread(s); median of {args.repeat} rounds")
    summary = {"size": size, "files": args.files, "block_size": args.block_size, "queue_depth": args.queue_depth,
               "threads": args.threads, "gb_per_s": {}, "errors": errors}
    for name, f in figures.items():
        w, r = statistics.median(f["write"]), statistics.median(f["read"])
        summary["gb_per_s"][name] = {"write": w, "read": r}
        print(f"  {name:<20} write {w:6.2f} GB/s   read {r:6.2f} GB/s")
    for name, error in errors.items():
        print(f"  {name:<20} does not load: {error}")
    if "deepspeed (libaio)" in summary["gb_per_s"]:
        ours, theirs = summary["gb_per_s"]["tierflow"], summary["gb_per_s"]["deepspeed (libaio)"]
        for kind in ("write", "read"):
            ratio = ours[kind] / theirs[kind]
            summary[f"{kind}_ratio"] = ratio
            print(f"tierflow over DeepSpeed's libaio op, {kind}: {ratio:.2f}× "
                  f"({'meets' if ratio >= 1.0 else 'misses'} the target ≥ 1.0)")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(summary, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
