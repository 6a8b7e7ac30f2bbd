"""The engine's checkpoints: a directory per tag, and a ``latest`` file, as
DeepSpeed lays them out.

``save_dir/<tag>/`` holds

* ``model.safetensors``: every parameter's compute copy (stage 3: streamed
  from the store one parameter at a time, so saving never needs the model in
  RAM) and the model's persistent buffers;
* ``optimizer/`` (state on NVMe: the optimizer's own crash-safe checkpoint,
  streamed through its host budget; with ZenFlow, and the fp32 masters of a
  bf16/fp16 run in ``masters.pt``) or ``optimizer.pt`` (state in memory;
  stage 3 with ZenFlow: ZenFlow's state_dict, and the fp32 masters of a
  bf16/fp16 run);
* ``engine.pt``: the step counters, the loss scale, the lr scheduler's state
  and the client state;
* ``config.json``, for a model with a Hugging Face config (``module.config``
  with ``to_json_string``): that config, so that the weights
  ``python -m tierflow.zero.consolidate`` joins load with ``from_pretrained``;
* the files DeepSpeed's ``zero_to_fp32.py`` reads
  (``get_fp32_state_dict_from_zero_checkpoint(save_dir)`` gives the fp32
  masters): ``zero_pp_rank_<r>_mp_rank_00_model_states.pt`` (stage 3, one a
  rank; ``mp_rank_00_model_states.pt`` at stages 0–2: the buffers, the
  parameters' names and shapes, the tied ones, the frozen ones' values) and
  ``[bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt`` (this rank's fp32
  masters of the trainable parameters, flat, DeepSpeed's partitions of
  ``ceil(numel / world_size)`` each). They cost 4 bytes a trainable parameter
  on disk; they are written streamed — the file's layout first
  (``torch.serialization.skip_data``), then each parameter's values into it,
  one at a time — so that no more than one parameter is ever in RAM, as for
  ``model.safetensors``. tierflow's own load does not read them.

Every file is written with plain tensors, numbers, strings and containers,
and read with ``torch.load(weights_only=True)``: a checkpoint cannot run code
when it is loaded, and one that holds anything else is refused, naming the
file. A save refuses a ``client_state`` (or an lr scheduler state) that such
a load could not read back, before it writes anything.

:func:`load` checks everything it can before it changes anything — the tag,
every file it needs present and readable, the parameters' names, shapes and
dtypes, the world size and the optimizer's placement and parameter groups —
and only then writes the model, the optimizer and the counters.

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
import io
import json
import math
import os
import pickle
import shutil
import struct
import warnings
import zipfile
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch

from tierflow.torch.optim.adam import _save_file
from tierflow.zero import placements

if TYPE_CHECKING:
    from tierflow.zero.engine import Engine

__all__ = ["save", "load", "export", "write_safetensors", "read_safetensors_header"]

_ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
              torch.int64: "I64", torch.int32: "I32", torch.uint8: "U8", torch.bool: "BOOL"}
_ST_TORCH = {v: k for k, v in _ST_DTYPES.items()}

# engine.pt's "format": 2 saves the buffers, the optimizer's placement and
# DeepSpeed's zero_to_fp32 files; 1 (no "format" key) had none of them.
_FORMAT = 2


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
    """(name, item) for every distinct parameter, in the model's order (a
    tied one under its first name): :meth:`Runtime.entries`."""
    return engine.runtime.entries()


def _shape(item: Any) -> tuple[int, ...]:
    return tuple(item.shape)


def _numel(item: Any) -> int:
    return math.prod(item.shape)


def _trainable(item: Any) -> bool:
    """Whether the optimizer owns ``item``: trainable, with at least one
    element (DeepSpeed's ``is_optimized_parameter``)."""
    return bool(item.requires_grad) and _numel(item) > 0


def _buffer_entries(engine: "Engine") -> list[tuple[str, torch.Tensor]]:
    """(state_dict name, buffer) for every persistent buffer of the model."""
    out, seen = [], set()
    for prefix, module in engine.module.named_modules():
        for name, buffer in module.named_buffers(recurse=False):
            if buffer is None or name in module._non_persistent_buffers_set:
                continue
            key = f"{prefix}.{name}" if prefix else name
            if key not in seen:
                seen.add(key)
                out.append((key, buffer))
    return out


def _aliases(engine: "Engine") -> dict[str, str]:
    """A tied parameter's other names → the name it is saved under
    (DeepSpeed's ``shared_params``)."""
    first: dict[int, str] = {}
    out = {}
    for name, p in engine.module.named_parameters(remove_duplicate=False):
        if id(p) in first:
            out[name] = first[id(p)]
        else:
            first[id(p)] = name
    return out


def _values(engine: "Engine", entries: list[tuple[str, Any]], dtype_of: Any) -> Iterator[torch.Tensor]:
    for name, item in entries:
        yield dtype_of(item, engine.runtime.read(item))


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


def _save_model(engine: "Engine", path: str, entries: list[tuple[str, Any]]) -> None:
    buffers = _buffer_entries(engine)
    shapes = [(n, _shape(x), x.dtype) for n, x in entries] + [(n, tuple(b.shape), b.dtype) for n, b in buffers]

    def values() -> Iterator[torch.Tensor]:
        yield from _values(engine, entries, lambda item, t: t)
        for _, b in buffers:
            yield b.detach().cpu()

    _write_on_rank0(engine, path, shapes, values())


def _check_model_file(path: str, want: list[tuple[str, tuple[int, ...], torch.dtype]], strict: bool,
                      what: str) -> tuple[dict[str, Any], int, set[str]]:
    """Checks ``path`` (a safetensors file) against ``want`` (name, shape,
    dtype): with ``strict`` it holds exactly those names, else those it holds
    are loaded and the rest kept; every one it holds has the model's shape
    and dtype, and its bytes are all there. Returns its header, where its
    data starts and the names to load."""
    if not os.path.isfile(path):
        raise FileNotFoundError(errno.ENOENT, f"load_checkpoint: {path} is missing (every checkpoint holds the "
                                              "model's values there)", path)
    header, base = read_safetensors_header(path)
    names = {n for n, _, _ in want}
    if strict:
        missing = [n for n, _, _ in want if n not in header]
        unexpected = [n for n in header if n not in names]
        if missing or unexpected:
            parts = []
            if missing:
                parts.append(f"missing {_listed(missing)}")
            if unexpected:
                parts.append(f"unexpected {_listed(unexpected)}")
            raise ValueError(f"load_checkpoint: {path} does not hold {what}: {'; '.join(parts)} "
                             "(load_module_strict=False loads the ones both have)")
    size = os.path.getsize(path)
    for name, shape, dtype in want:
        entry = header.get(name)
        if entry is None:
            continue
        if _ST_TORCH.get(entry.get("dtype")) != dtype or list(entry.get("shape", ())) != list(shape):
            raise ValueError(f"load_checkpoint: {path} holds '{name}' as {entry.get('shape')} {entry.get('dtype')}, "
                             f"the model's is {list(shape)} {_ST_DTYPES.get(dtype, dtype)}")
        if base + entry["data_offsets"][1] > size:
            raise ValueError(f"load_checkpoint: {path} is truncated ('{name}' ends past its {size} bytes)")
    return header, base, names & set(header)


def _listed(names: list[str]) -> str:
    shown = ", ".join(f"'{n}'" for n in names[:3])
    return shown + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def _load_model(engine: "Engine", path: str, header: dict, base: int, names: set[str]) -> None:
    """Writes the checked ``names`` of ``path`` into the model, one
    parameter at a time (one in the store straight into its host copy)."""
    with open(path, "rb") as f:
        for name, item in _model_entries(engine):
            if name in names:
                engine.runtime.write(item, lambda view, name=name: _read_into(f, base, header[name], view, path, name))
        for name, buffer in _buffer_entries(engine):
            if name not in names:
                continue
            target = torch.empty(buffer.shape, dtype=buffer.dtype)
            _read_into(f, base, header[name], target, path, name)
            with torch.no_grad():
                buffer.copy_(target)


# ---- files loaded as plain data ---------------------------------------------------------------

def _load_plain(path: str, what: str, **kwargs: Any) -> Any:
    """``torch.load(path, weights_only=True)``: a file that holds anything
    but tensors, numbers, strings and containers is refused, naming it,
    without running any of it."""
    try:
        return torch.load(path, weights_only=True, **kwargs)
    except FileNotFoundError:
        raise FileNotFoundError(errno.ENOENT, f"load_checkpoint: {path} is missing ({what})", path) from None
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()
        reason = next((line.strip() for line in first if "Unsupported" in line or "global" in line.lower()),
                      first[0] if first else "")
        raise ValueError(f"load_checkpoint: {path} ({what}) holds more than tensors, numbers and strings and was "
                         f"not loaded (torch.load weights_only=True: {reason})") from None
    except (RuntimeError, EOFError) as e:
        raise ValueError(f"load_checkpoint: {path} ({what}) is not a readable torch file ({e})") from None


def _check_plain(obj: Any, what: str) -> None:
    """Refuses ``obj`` when a ``weights_only=True`` load could not read it back."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    try:
        torch.load(buf, weights_only=True)
    except pickle.UnpicklingError as e:
        lines = str(e).strip().splitlines()
        reason = next((line.strip() for line in lines if "Unsupported" in line), lines[0] if lines else "")
        raise ValueError(f"{what}: holds an object a checkpoint cannot keep ({reason}); a checkpoint is "
                         "loaded with torch.load(weights_only=True), so give plain dicts, lists, numbers, "
                         "strings and tensors") from None


# ---- DeepSpeed's zero_to_fp32 files --------------------------------------------------------------

def _fake(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A tensor with a shape and a dtype and no memory (torch's FakeTensor),
    for a file's layout written before its values."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        return torch.empty(shape, dtype=dtype)


def _tensors_in_order(obj: Any, out: list[torch.Tensor], seen: set[int]) -> None:
    """The tensors of ``obj`` in the order pickle meets them (dicts in
    insertion order, depth first): the order torch.save numbers their
    storages in."""
    if isinstance(obj, torch.Tensor):
        if id(obj) not in seen:
            seen.add(id(obj))
            out.append(obj)
    elif isinstance(obj, dict):
        for key, value in obj.items():
            _tensors_in_order(key, out, seen)
            _tensors_in_order(value, out, seen)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            _tensors_in_order(value, out, seen)


def _save_streamed(path: str, obj: Any, fill: dict[int, Callable[[], Iterator[torch.Tensor]]]) -> None:
    """torch.save of ``obj``, whose tensors are fakes (:func:`_fake`), with
    each one's values written afterwards from ``fill[id(fake)]()`` — the
    pieces that make it up, in order — into the room the file keeps for
    them: a tensor of the whole model is written without ever being in RAM.
    The file is a torch zip whose storages are stored uncompressed; each
    record's offset is read from the zip's own headers."""
    fakes: list[torch.Tensor] = []
    _tensors_in_order(obj, fakes, set())
    with torch.serialization.skip_data(materialize_fake_tensors=True):
        torch.save(obj, path)
    with zipfile.ZipFile(path) as z:
        records = {}
        for info in z.infolist():
            folder, _, key = info.filename.rpartition("/")
            if folder.endswith("/data") and key.isdigit():
                records[int(key)] = info
    if sorted(records) != list(range(len(fakes))):
        raise RuntimeError(f"{path}: torch.save wrote {len(records)} storages for {len(fakes)} tensors")
    with open(path, "r+b") as f:
        for key, fake in enumerate(fakes):
            info = records[key]
            nbytes = fake.numel() * fake.element_size()
            if info.compress_type != zipfile.ZIP_STORED or info.file_size != nbytes:
                raise RuntimeError(f"{path}: storage {key} is {info.file_size} bytes, its tensor {nbytes}")
            f.seek(info.header_offset)
            local = f.read(30)
            name_len, extra_len = struct.unpack("<HH", local[26:30])
            f.seek(info.header_offset + 30 + name_len + extra_len)
            written = 0
            for piece in fill[id(fake)]():
                data = piece.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
                f.write(memoryview(data))
                written += data.nbytes
            if written != nbytes:
                raise RuntimeError(f"{path}: {written} bytes written for a tensor of {nbytes}")
        f.flush()
        os.fsync(f.fileno())


def _local_master(engine: "Engine", item: Any, local: torch.Tensor) -> torch.Tensor:
    """This rank's fp32 master of ``item`` (a partition or a parameter),
    given its compute values ``local`` (:meth:`Runtime.read_local`): the
    optimizer's (or ZenFlow's) master of a bf16/fp16 parameter, made from
    the values when it has not stepped yet; an fp32 parameter's values."""
    if local.dtype == torch.float32 or not item.requires_grad:
        return local.to(torch.float32)
    kept = engine.runtime.master(item, local)
    return kept if kept is not None else local.to(torch.float32)


def _save_deepspeed_files(engine: "Engine", tag_dir: str, entries: list[tuple[str, Any]],
                          exclude_frozen: bool) -> None:
    """This rank's model-states and optim-states files, as DeepSpeed's
    engine writes them for ``zero_to_fp32.py``."""
    from tierflow import __version__

    world, rank = engine.group.world_size, engine.group.rank
    stage3 = engine.runtime.partitioned
    version = f"tierflow {__version__}"
    trainable = [(n, x) for n, x in entries if _trainable(x)]
    frozen = [] if exclude_frozen else [(n, x) for n, x in entries if not _trainable(x)]
    # DeepSpeed's partition of a parameter: ceil(numel / world) elements,
    # the last rank's padded (tierflow's shards are those).
    partition = [-(-_numel(x) // world) for _, x in trainable]

    def local_of(item: Any) -> torch.Tensor:
        return engine.runtime.read_local(item).reshape(-1)

    def masters() -> Iterator[torch.Tensor]:
        for (_, item), n in zip(trainable, partition):
            yield _local_master(engine, item, local_of(item))[:n]

    flat = _fake((sum(partition),), torch.float32)
    fill: dict[int, Callable[[], Iterator[torch.Tensor]]] = {id(flat): masters}
    groups_key = "fp32_flat_groups" if stage3 else "single_partition_of_fp32_groups"
    optim_states = {
        "optimizer_state_dict": {"zero_stage": engine.stage, "partition_count": world, groups_key: [flat]},
        "ds_version": version,
    }
    prefix = "bf16_" if engine.precision == "bf16" else ""
    _save_streamed(os.path.join(tag_dir, f"{prefix}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"),
                   optim_states, fill)

    buffers = OrderedDict()
    fill = {}
    for name, b in _buffer_entries(engine):
        buffers[name] = _fake(tuple(b.shape), b.dtype)
        fill[id(buffers[name])] = (lambda b=b: iter([b.detach().cpu()]))
    fragments = OrderedDict()
    for name, item in frozen:
        # Stage 3: this rank's shard, flat (zero_to_fp32 joins the ranks'
        # and cuts the padding); stages 0-2: the parameter.
        n = -(-_numel(item) // world) if stage3 else _numel(item)
        fragments[name] = _fake((n,) if stage3 else _shape(item), item.dtype)
        fill[id(fragments[name])] = (lambda item=item, n=n: iter([local_of(item)[:n]]))
    model_states = {
        "module": buffers,
        "buffer_names": list(buffers),
        "param_shapes": [OrderedDict((n, torch.Size(_shape(x))) for n, x in trainable)],
        "frozen_param_shapes": None if exclude_frozen else OrderedDict((n, torch.Size(_shape(x))) for n, x in frozen),
        "frozen_param_fragments": None if exclude_frozen else fragments,
        "shared_params": _aliases(engine),
        "global_steps": engine.global_steps,
        "skipped_steps": engine.skipped_steps,
        "dp_world_size": world,
        "mp_world_size": 1,
        "ds_version": version,
    }
    name = f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt" if stage3 else "mp_rank_00_model_states.pt"
    if stage3 or rank == 0:
        _save_streamed(os.path.join(tag_dir, name), model_states, fill)


# ---- checkpoints ----------------------------------------------------------------------------------

def _optimizer_path(engine: "Engine", tag_dir: str, on_nvme: bool | None = None) -> str:
    """This rank's optimizer file (or directory, state on NVMe) in ``tag_dir``."""
    name = "optimizer" if engine.group.world_size == 1 else f"optimizer.rank{engine.group.rank}"
    on_nvme = engine.runtime.state.on_nvme if on_nvme is None else on_nvme
    return os.path.join(tag_dir, name if on_nvme else name + ".pt")


def _agree(engine: "Engine", error: BaseException | None, what: str, path: str) -> None:
    """Raises on every rank when any rank failed: its own error, or one naming ``path``."""
    if engine.group.agree(error is None):
        return
    if error is not None:
        raise error
    raise OSError(errno.EIO, f"{what}: another rank failed writing {path}", path)


def _check_tag(tag: str, where: str) -> None:
    if not tag or "/" in tag or tag.startswith("."):
        raise ValueError(f"{where}: {tag!r} is not a directory name")


def save(engine: "Engine", save_dir: str, tag: str | None, client_state: dict, save_latest: bool,
         exclude_frozen: bool = False) -> str:
    tag = tag or f"global_step{engine.global_steps}"
    _check_tag(tag, "tag")
    # What a weights_only load could not read back is refused before any file is made.
    _check_plain(client_state, "client_state")
    if engine.lr_scheduler is not None:
        _check_plain(engine.lr_scheduler.state_dict(), "lr_scheduler.state_dict()")
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
        _save_into(engine, partial, client_state, exclude_frozen)
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


def _save_into(engine: "Engine", partial: str, client_state: dict, exclude_frozen: bool) -> None:
    engine.runtime.finish()  # the model and the store get ZenFlow's newest values first
    engine.runtime.flush()
    entries = _model_entries(engine)
    if exclude_frozen:
        entries = [(n, x) for n, x in entries if x.requires_grad]
    _save_model(engine, os.path.join(partial, "model.safetensors"), entries)
    owner = engine.runtime.state.owner  # ZenFlow's masters with its state
    on_nvme = engine.runtime.state.on_nvme
    if on_nvme:
        owner.save_state(_optimizer_path(engine, partial))
    else:
        _save_file(owner.state_dict(), _optimizer_path(engine, partial))
    _save_deepspeed_files(engine, partial, entries, exclude_frozen)
    if engine.group.rank != 0:
        return
    hf_config = getattr(engine.module, "config", None)
    if callable(getattr(hf_config, "to_json_string", None)):  # a transformers model's, for from_pretrained
        _write_atomic(os.path.join(partial, "config.json"), hf_config.to_json_string().encode())
    state = {
        "format": _FORMAT,
        "global_steps": engine.global_steps,
        "micro_steps": engine.micro_steps,
        "skipped_steps": engine.skipped_steps,
        "loss_scaler": engine.scaler.state_dict() if engine.scaler is not None else None,
        "lr_scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None,
        "client_state": client_state,
        "parameters": [(n, list(_shape(x)), str(x.dtype)) for n, x in entries],
        "buffers": [(n, list(b.shape), str(b.dtype)) for n, b in _buffer_entries(engine)],
        "world_size": engine.group.world_size,
        "optimizer_on_nvme": on_nvme,
        "stage": engine.stage,
        "precision": engine.precision,
    }
    _save_file(state, os.path.join(partial, "engine.pt"))


def _resolve_tag(load_dir: str, tag: str | None) -> str | None:
    if tag is not None:
        return tag
    latest = os.path.join(load_dir, "latest")
    if not os.path.isfile(latest):
        warnings.warn(f"load_checkpoint: no 'latest' file in {load_dir}, so no checkpoint was loaded; give the tag "
                      "to load one", RuntimeWarning, stacklevel=4)
        return None
    with open(latest) as f:
        tag = f.read().strip()
    _check_tag(tag, f"load_checkpoint: {latest} names")
    return tag


def _check_optimizer_dir(engine: "Engine", directory: str) -> None:
    """Checks the optimizer's own NVMe checkpoint in ``directory`` is there
    and for parameters grouped as this run's (its layout is checked by the
    optimizer's load, before it changes anything)."""
    files = getattr(engine.runtime.state.owner, "checkpoint_files", None)  # (MuonWithAuxAdam: one per part)
    needed = files(directory) if callable(files) else [os.path.join(directory, n) for n in ("optimizer.pt",
                                                                                           "manifest.json")]
    for path in needed:
        if not os.path.isfile(path):
            raise FileNotFoundError(errno.ENOENT, f"load_checkpoint: {path} is missing "
                                                  "(the optimizer's NVMe checkpoint)", path)
    meta = _load_plain(os.path.join(directory, "optimizer.pt"), "the optimizer's state")
    engine.runtime.state.check_directory(meta, directory, engine.precision)


def load(engine: "Engine", load_dir: str, tag: str | None, *, strict: bool = True, load_optimizer: bool = True,
         load_scheduler: bool = True, module_only: bool = False) -> tuple[str | None, dict | None]:
    """DeepSpeed's ``load_checkpoint``: the model (only the names both hold,
    unless ``strict``), then — unless ``module_only`` — the optimizer's
    state and the fp16 loss scale (``load_optimizer``; else the fp32
    masters start again from the loaded weights), the lr scheduler's
    (``load_scheduler``) and the counters. Every check runs first, on every
    rank; a failed one, on any rank, leaves every rank's engine as it was."""
    tag = _resolve_tag(load_dir, tag)
    if tag is None:
        return None, None
    path = os.path.join(load_dir, tag)
    error: BaseException | None = None
    try:
        checked = _check_load(engine, path, load_dir, tag, strict, load_optimizer, load_scheduler, module_only)
    except Exception as e:  # every rank hears of it, so that none writes while another refused
        error = e
    if not engine.group.agree(error is None):
        if error is not None:
            raise error
        raise ValueError(f"load_checkpoint: another rank's checks of {path} failed; nothing was loaded")
    state, header, base, names, saved_optimizer, take_optimizer, take_scheduler = checked

    # ---- writes ------------------------------------------------------------------------------------------
    engine.runtime.finish()  # an update in flight lands before the new values, never over them
    _load_model(engine, os.path.join(path, "model.safetensors"), header, base, names)
    if take_optimizer:
        side = engine.runtime.state
        if saved_optimizer is None:  # the store's own checkpoint, into the store
            side.owner.load_state(_optimizer_path(engine, path))
        else:
            side.load(saved_optimizer)
        if engine.scaler is not None and state.get("loss_scaler") is not None:  # (DeepSpeed's is the optimizer's)
            engine.scaler.load_state_dict(state["loss_scaler"])
    else:
        engine.runtime.state.refresh()
    if take_scheduler:
        engine.lr_scheduler.load_state_dict(state["lr_scheduler"])
    if not module_only:
        engine.global_steps = state["global_steps"]
        engine.micro_steps = state["micro_steps"]
        engine.skipped_steps = state["skipped_steps"]
    engine.zero_grad()
    return path, state["client_state"]


def _check_load(engine: "Engine", path: str, load_dir: str, tag: str, strict: bool, load_optimizer: bool,
                load_scheduler: bool, module_only: bool) -> tuple:
    """:func:`load`'s checks, which change nothing: what it will write."""
    if not os.path.isdir(path):
        raise FileNotFoundError(errno.ENOENT, f"load_checkpoint: no checkpoint '{tag}' in {load_dir}", path)
    state = _load_plain(os.path.join(path, "engine.pt"), "the engine's counters and client state")
    if not isinstance(state, dict) or "global_steps" not in state:
        raise ValueError(f"load_checkpoint: {os.path.join(path, 'engine.pt')} is not a tierflow engine state")
    want = [(n, _shape(x), x.dtype) for n, x in _model_entries(engine)]
    if state.get("buffers") is not None:  # (a checkpoint of format 1 saved no buffers)
        want += [(n, tuple(b.shape), b.dtype) for n, b in _buffer_entries(engine)]
    model_path = os.path.join(path, "model.safetensors")
    header, base, names = _check_model_file(model_path, want, strict, "this model's parameters and buffers")
    take_optimizer = load_optimizer and not module_only
    saved_optimizer = None
    if take_optimizer:
        saved_world = state.get("world_size", 1)
        if saved_world != engine.group.world_size:
            raise ValueError(f"load_checkpoint: {path} holds the optimizer state of {saved_world} ranks, this run has "
                             f"{engine.group.world_size}; load it with load_optimizer_states=False (the model only) "
                             "or with as many ranks")
        on_nvme = engine.runtime.state.on_nvme
        saved_on_nvme = state.get("optimizer_on_nvme")
        if saved_on_nvme is None:  # format 1: the path tells
            saved_on_nvme = os.path.isdir(_optimizer_path(engine, path, on_nvme=True))
        opt_path = _optimizer_path(engine, path, on_nvme=saved_on_nvme)
        if saved_on_nvme != on_nvme:  # another placement's: read into this one's form (placements.py)
            placements.check_movable(engine.runtime.state, path, saved_on_nvme)
            saved_optimizer = (placements.state_saved_on_nvme(engine.runtime.state, opt_path, _load_plain)
                               if saved_on_nvme else placements.state_saved_in_memory(opt_path, _load_plain))
        elif on_nvme:
            _check_optimizer_dir(engine, opt_path)
        else:
            saved_optimizer = _load_plain(opt_path, "the optimizer's state")
        if saved_optimizer is not None:
            engine.runtime.state.check_saved(saved_optimizer, opt_path, engine.runtime.local_numel())
    take_scheduler = load_scheduler and not module_only and engine.lr_scheduler is not None
    if take_scheduler and state.get("lr_scheduler") is None:
        raise ValueError(f"load_checkpoint: {path} holds no lr scheduler state and this engine has a scheduler; "
                         "give load_lr_scheduler_states=False to start its schedule afresh")
    if take_optimizer and engine.scaler is not None and state.get("loss_scaler") is not None:
        keys = {"scale", "good", "hysteresis_left", "overflows"}
        if not keys <= set(state["loss_scaler"]):
            raise ValueError(f"load_checkpoint: {os.path.join(path, 'engine.pt')} holds a loss scaler state without "
                             f"{sorted(keys - set(state['loss_scaler']))}")
    return state, header, base, names, saved_optimizer, take_optimizer, take_scheduler


# ---- exports ----------------------------------------------------------------------------------------

def export(engine: "Engine", save_dir: str, filename: str, fp32: bool, exclude_frozen: bool = False) -> str:
    """The model's weights as one safetensors file: the compute copies, or
    (``fp32``) the fp32 masters — a bf16/fp16 parameter's from the optimizer's
    state, made from the parameter when it has not stepped yet. With
    ``exclude_frozen``, the trainable parameters only."""
    if not filename.endswith(".safetensors"):
        raise ValueError(f"save_filename: {filename!r}; tierflow writes the weights as safetensors, streamed "
                         "(name the file *.safetensors)")
    path = os.path.join(save_dir, filename)
    engine.runtime.finish()
    entries = _model_entries(engine)
    if exclude_frozen:
        entries = [(n, x) for n, x in entries if x.requires_grad]
    dtype = torch.float32 if fp32 else None
    shapes = [(n, _shape(x), dtype or x.dtype) for n, x in entries]

    def master(item: Any, values: torch.Tensor) -> torch.Tensor:
        if not fp32 or values.dtype == torch.float32:
            return values
        runtime = engine.runtime
        return runtime.whole_of(item, _local_master(engine, item, runtime.local_of(item, values)))

    tmp = f"{path}.partial"
    if engine.group.rank == 0:
        os.makedirs(save_dir, exist_ok=True)
    _write_on_rank0(engine, tmp, shapes, _values(engine, entries, master))
    if engine.group.rank == 0:
        os.replace(tmp, path)
    engine.group.barrier()
    return path
