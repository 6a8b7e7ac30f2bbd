"""The engine's checkpoints: a directory per tag, and a ``latest`` file, as
DeepSpeed lays them out.

``save_dir/<tag>/`` holds

* ``model.safetensors``: every parameter's compute copy (stage 3: streamed
  from the store one parameter at a time, so saving never needs the model in
  RAM);
* ``optimizer/`` (state on NVMe: the optimizer's own crash-safe checkpoint,
  streamed through its host budget; with ZenFlow, and the fp32 masters of a
  bf16/fp16 run in ``masters.pt``) or ``optimizer.pt`` (state in memory;
  stage 3 with ZenFlow: ZenFlow's state_dict, and the fp32 masters of a
  bf16/fp16 run);
* ``engine.pt``: the step counters, the loss scale, the lr scheduler's state
  and the client state.

A save is written into a hidden sibling directory, synced, and renamed into
place; ``latest`` is replaced the same way after it. A save killed at any
point leaves the previous tag and ``latest`` as they were.

With several data-parallel ranks every rank calls :func:`save` and
:func:`load` (as in DeepSpeed): ``model.safetensors`` holds the full
parameters, gathered from the ranks' shards and written by rank 0 (so any
number of ranks, or a plain torch model, can load it), each rank writes its
optimizer shard as ``optimizer.rank<r>.pt`` (or ``optimizer.rank<r>/``), and
rank 0 moves the tag into place once every rank has written its part. A rank
that fails makes every rank raise.

The safetensors files are written here rather than by the ``safetensors``
package: its writer takes every tensor in memory at once, and a parameter
that lives on NVMe must be streamed.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import struct
from typing import TYPE_CHECKING, Any, Iterator

import torch

from tierflow.torch.optim.adam import _save_file

if TYPE_CHECKING:
    from tierflow.zero.engine import Engine

__all__ = ["save", "load", "export", "write_safetensors", "read_safetensors_header"]

_ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
              torch.int64: "I64", torch.int32: "I32", torch.uint8: "U8", torch.bool: "BOOL"}
_ST_TORCH = {v: k for k, v in _ST_DTYPES.items()}


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: str, data: bytes) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(path) or ".")


def write_safetensors(path: str, entries: list[tuple[str, tuple[int, ...], torch.dtype]],
                      tensors: Iterator[torch.Tensor], metadata: dict[str, str] | None = None) -> None:
    """Writes a safetensors file of ``entries`` (name, shape, dtype), taking
    each tensor's values from ``tensors`` in the same order, one at a time."""
    header: dict[str, Any] = {}
    offset = 0
    for name, shape, dtype in entries:
        n = 1
        for s in shape:
            n *= s
        size = n * torch.empty((), dtype=dtype).element_size()
        header[name] = {"dtype": _ST_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    if metadata:
        header["__metadata__"] = metadata
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the format's alignment of the data that follows
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for (name, shape, dtype), t in zip(entries, tensors):
            if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
                raise ValueError(f"{path}: '{name}' is {list(t.shape)} {t.dtype}, expected {list(shape)} {dtype}")
            f.write(t.detach().contiguous().cpu().view(torch.uint8).reshape(-1).numpy().tobytes()
                    if t.numel() else b"")
        f.flush()
        os.fsync(f.fileno())


def read_safetensors_header(path: str) -> tuple[dict[str, Any], int]:
    """The header of a safetensors file and where its data starts."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError(f"{path}: not a safetensors file (shorter than its header)")
        (n,) = struct.unpack("<Q", head)
        if n > 100 << 20:
            raise ValueError(f"{path}: not a safetensors file (header of {n} bytes)")
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except ValueError as e:
        raise ValueError(f"{path}: corrupt safetensors header ({e})") from None
    header.pop("__metadata__", None)
    return header, 8 + n


def _read_into(f: Any, base: int, entry: dict, out: torch.Tensor, path: str, name: str) -> None:
    begin, end = entry["data_offsets"]
    if _ST_TORCH.get(entry["dtype"]) != out.dtype or list(entry["shape"]) != list(out.shape):
        raise ValueError(f"{path}: '{name}' is {entry['shape']} {entry['dtype']}, "
                         f"the model's is {list(out.shape)} {out.dtype}")
    f.seek(base + begin)
    buf = out.view(torch.uint8).reshape(-1).numpy() if out.numel() else None
    if buf is not None:
        got = f.readinto(memoryview(buf))
        if got != end - begin:
            raise ValueError(f"{path}: '{name}' is truncated ({got} of {end - begin} bytes)")


# ---- the model's values --------------------------------------------------------------------------

def _model_entries(engine: "Engine") -> list[tuple[str, Any]]:
    """(name, parameter or partition) for every distinct parameter."""
    if engine.params is not None:
        return [(part.name, part) for part in engine.params.parts]
    seen, out = set(), []
    for name, p in engine.module.named_parameters():
        if id(p) not in seen:
            seen.add(id(p))
            out.append((name, p))
    return out


def _values(engine: "Engine", entries: list[tuple[str, Any]], dtype_of: Any) -> Iterator[torch.Tensor]:
    for name, item in entries:
        if engine.params is not None:
            yield dtype_of(item, engine.params.read(item))
        else:
            yield dtype_of(item, item.detach().cpu())


def _write_on_rank0(engine: "Engine", path: str, shapes: list, values: Iterator[torch.Tensor]) -> None:
    """Rank 0 writes the safetensors file; every rank draws ``values`` to the
    end, since drawing a sharded parameter gathers it from all of them (a
    write that fails still draws the rest, so no rank waits for ever)."""
    try:
        if engine.group.rank == 0:
            write_safetensors(path, shapes, values, {"format": "pt", "producer": "tierflow"})
    finally:
        for _ in values:  # what is left to draw: all of it off rank 0, the rest after a failed write
            pass


def _save_model(engine: "Engine", path: str) -> None:
    entries = _model_entries(engine)
    shapes = [(n, tuple(x.shape), x.dtype) for n, x in entries]
    _write_on_rank0(engine, path, shapes, _values(engine, entries, lambda item, t: t))


def _load_model(engine: "Engine", path: str) -> None:
    header, base = read_safetensors_header(path)
    entries = _model_entries(engine)
    missing = [n for n, _ in entries if n not in header]
    if missing:
        raise ValueError(f"{path}: has no '{missing[0]}' (and {len(missing) - 1} more parameters of the model)"
                         if len(missing) > 1 else f"{path}: has no '{missing[0]}'")
    with open(path, "rb") as f:
        for name, item in entries:
            if engine.params is not None:
                engine.params.release(item)  # a resident copy would be stale once this lands
                lease, view = engine.params.host_view(item, "overwrite")
                try:
                    _read_into(f, base, header[name], view, path, name)
                except BaseException:
                    engine.params.end_host(lease, dirty=False)
                    raise
                engine.params.end_host(lease, dirty=True)
            else:
                target = torch.empty(item.shape, dtype=item.dtype)
                _read_into(f, base, header[name], target, path, name)
                with torch.no_grad():
                    item.copy_(target)


# ---- checkpoints ----------------------------------------------------------------------------------

def _optimizer_on_nvme(engine: "Engine") -> bool:
    """Whether the optimizer's state is saved as its NVMe store's own
    checkpoint (Adam/AdamW or ZenFlow with their state on NVMe)."""
    return getattr(engine.optimizer, "offload", "cpu") == "nvme" and hasattr(engine.optimizer, "save_state")


def _optimizer_path(engine: "Engine", tag_dir: str) -> str:
    """This rank's optimizer file (or directory, state on NVMe) in ``tag_dir``."""
    name = "optimizer" if engine.group.world_size == 1 else f"optimizer.rank{engine.group.rank}"
    return os.path.join(tag_dir, name if _optimizer_on_nvme(engine) else name + ".pt")


def _agree(engine: "Engine", error: BaseException | None, what: str, path: str) -> None:
    """Raises on every rank when any rank failed: its own error, or one naming ``path``."""
    if engine.group.agree(error is None):
        return
    if error is not None:
        raise error
    raise OSError(errno.EIO, f"{what}: another rank failed writing {path}", path)


def save(engine: "Engine", save_dir: str, tag: str | None, client_state: dict, save_latest: bool) -> str:
    tag = tag or f"global_step{engine.global_steps}"
    if not tag or "/" in tag or tag.startswith("."):
        raise ValueError(f"tag: {tag!r} is not a directory name")
    final = os.path.join(save_dir, tag)
    partial = os.path.join(save_dir, f".{tag}.partial")
    rank0 = engine.group.rank == 0
    error: BaseException | None = None
    if rank0:
        try:
            os.makedirs(save_dir, exist_ok=True)
            shutil.rmtree(partial, ignore_errors=True)  # what an earlier interrupted save left
            os.makedirs(partial)
        except OSError as e:
            error = e
    _agree(engine, error, "save_checkpoint", partial)
    try:
        _save_into(engine, partial, client_state)
    except OSError as e:
        error = e if e.filename is not None else OSError(e.errno, f"save_checkpoint: {e.strerror} writing {partial}",
                                                          partial)
    except Exception as e:  # any failure, so that the other ranks hear of it rather than wait
        error = e
    try:
        _agree(engine, error, "save_checkpoint", partial)
    except Exception:
        if rank0:
            shutil.rmtree(partial, ignore_errors=True)  # the space it took goes back
        raise
    if rank0:
        # Into place: an older save of the same tag moves aside first, and
        # goes only once the new one is there.
        _fsync_dir(partial)
        aside = os.path.join(save_dir, f".{tag}.old")
        shutil.rmtree(aside, ignore_errors=True)
        if os.path.exists(final):
            os.rename(final, aside)
        os.rename(partial, final)
        _fsync_dir(save_dir)
        shutil.rmtree(aside, ignore_errors=True)
        if save_latest:
            _write_atomic(os.path.join(save_dir, "latest"), tag.encode())
    engine.group.barrier()  # no rank goes on (or loads) before the tag is in place
    return final


def _save_into(engine: "Engine", partial: str, client_state: dict) -> None:
    engine._finish_optimizer()  # the model and the store get ZenFlow's newest values first
    if engine.params is not None:
        engine.params.flush()
    _save_model(engine, os.path.join(partial, "model.safetensors"))
    owner = engine.zenflow or engine.optimizer  # ZenFlow's masters with its state
    if _optimizer_on_nvme(engine):
        owner.save_state(_optimizer_path(engine, partial))
    else:
        _save_file(owner.state_dict(), _optimizer_path(engine, partial))
    if engine.group.rank != 0:
        return
    state = {
        "global_steps": engine.global_steps,
        "micro_steps": engine.micro_steps,
        "skipped_steps": engine.skipped_steps,
        "loss_scaler": engine.scaler.state_dict() if engine.scaler is not None else None,
        "lr_scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None,
        "client_state": client_state,
        "parameters": [(n, list(x.shape), str(x.dtype)) for n, x in _model_entries(engine)],
        "world_size": engine.group.world_size,
    }
    _save_file(state, os.path.join(partial, "engine.pt"))


def load(engine: "Engine", load_dir: str, tag: str | None, load_optimizer: bool,
         load_scheduler: bool) -> tuple[str | None, dict | None]:
    if tag is None:
        latest = os.path.join(load_dir, "latest")
        if not os.path.exists(latest):
            return None, None
        with open(latest) as f:
            tag = f.read().strip()
    path = os.path.join(load_dir, tag)
    if not os.path.isdir(path):
        raise FileNotFoundError(2, f"load_checkpoint: no checkpoint '{tag}' in {load_dir}", path)
    state = torch.load(os.path.join(path, "engine.pt"), weights_only=False)
    saved = [(n, tuple(s), d) for n, s, d in state["parameters"]]
    ours = [(n, tuple(x.shape), str(x.dtype)) for n, x in _model_entries(engine)]
    if saved != ours:
        diff = next(((a, b) for a, b in zip(saved, ours) if a != b), (saved[len(ours):] or [None])[0])
        raise ValueError(f"load_checkpoint: {path} holds another model's parameters (first difference: {diff})")
    _load_model(engine, os.path.join(path, "model.safetensors"))
    if load_optimizer:
        saved_world = state.get("world_size", 1)
        if saved_world != engine.group.world_size:
            raise ValueError(f"load_checkpoint: {path} holds the optimizer state of {saved_world} ranks, this run has "
                             f"{engine.group.world_size}; load it with load_optimizer_states=False (the model only) "
                             "or with as many ranks")
    if engine.zenflow is not None and not load_optimizer:
        engine.zenflow.reload()  # its masters follow the loaded values
    elif load_optimizer:  # ZenFlow's masters too
        owner = engine.zenflow or engine.optimizer
        if _optimizer_on_nvme(engine):
            owner.load_state(_optimizer_path(engine, path))
        else:
            owner.load_state_dict(torch.load(_optimizer_path(engine, path), weights_only=False))
    if load_scheduler and engine.lr_scheduler is not None and state["lr_scheduler"] is not None:
        engine.lr_scheduler.load_state_dict(state["lr_scheduler"])
    if engine.scaler is not None and state["loss_scaler"] is not None:
        engine.scaler.load_state_dict(state["loss_scaler"])
    engine.global_steps = state["global_steps"]
    engine.micro_steps = state["micro_steps"]
    engine.skipped_steps = state["skipped_steps"]
    engine.zero_grad()
    return path, state["client_state"]


# ---- exports ----------------------------------------------------------------------------------------

def export(engine: "Engine", save_dir: str, filename: str, fp32: bool) -> str:
    """The model's weights as one safetensors file: the compute copies, or
    (``fp32``) the fp32 masters — a bf16/fp16 parameter's from the optimizer's
    state, made from the parameter when it has not stepped yet."""
    path = os.path.join(save_dir, filename)
    engine._finish_optimizer()
    entries = _model_entries(engine)
    dtype = torch.float32 if fp32 else None
    shapes = [(n, tuple(x.shape), dtype or x.dtype) for n, x in entries]

    def master(item: Any, values: torch.Tensor) -> torch.Tensor:
        if not fp32 or values.dtype == torch.float32:
            return values
        if engine.zenflow is not None:
            kept = engine.zenflow.master_of(item)
            return kept if kept is not None else values.to(torch.float32)
        if engine.params is None:
            kept = _master_from_optimizer(engine.optimizer, item)
            return kept if kept is not None else values.to(torch.float32)
        # The optimizer steps this rank's values (the parameter, or its
        # shard), and reads one it never stepped from them.
        params, p = engine.params, item.step_param
        local = params.group.shard_of(values.reshape(-1), item.shard_numel) if item.sharded else values
        p.data = local
        try:
            kept = _master_from_optimizer(engine.optimizer, p)
        finally:
            p.data = item.step_placeholder
        kept = kept if kept is not None else local.to(torch.float32)
        return params.group.gather(kept.reshape(-1))[: item.numel].view(item.shape) if item.sharded else kept

    tmp = f"{path}.partial"
    if engine.group.rank == 0:
        os.makedirs(save_dir, exist_ok=True)
    _write_on_rank0(engine, tmp, shapes, _values(engine, entries, master))
    if engine.group.rank == 0:
        os.replace(tmp, path)
    engine.group.barrier()
    return path


def _master_from_optimizer(optimizer: Any, p: torch.Tensor) -> torch.Tensor | None:
    from tierflow.torch.optim.adam import MASTER_KEY

    read = getattr(optimizer, "_read_state", None)
    if getattr(optimizer, "offload", "cpu") == "nvme" and callable(read):
        group = next(g for g in optimizer.param_groups if any(q is p for q in g["params"]))
        return read(p, group).get(MASTER_KEY)
    value = optimizer.state.get(p, {}).get(MASTER_KEY)
    return None if value is None else value.detach().cpu().clone()
