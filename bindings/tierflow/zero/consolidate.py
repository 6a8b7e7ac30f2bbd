"""One safetensors file of a model's weights from an engine's checkpoint,
offline: no model, no engine, no process group (DeepSpeed's
``zero_to_fp32.py``).

``python -m tierflow.zero.consolidate CHECKPOINT_DIR OUTPUT_DIR [--tag TAG]
[--dtype fp32|bf16|fp16] [--config CONFIG_JSON]`` writes
``OUTPUT_DIR/model.safetensors``: each trainable parameter's fp32 master,
joined from every rank's shard in the checkpoint's
``[bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt``, and each frozen
parameter and buffer as ``model.safetensors`` in the tag holds it (the
compute copy: there is no master of those). A tied parameter is written once,
under its first name, as ``transformers`` saves one. Tensors are read and
written one at a time: the ranks' files are memory-mapped, and at most one
parameter is ever in RAM.

With a ``config.json`` beside the weights (``--config``, else the one the
engine saved in the tag for a model with a Hugging Face config),
``AutoModelForCausalLM.from_pretrained(OUTPUT_DIR)`` loads the result.
"""

from __future__ import annotations

import argparse
import errno
import math
import os
import pickle
import shutil
import sys
from typing import Any, Iterator

import torch

from tierflow.zero.checkpoint import _ST_TORCH, _read_into, read_safetensors_header, write_safetensors

__all__ = ["consolidate"]

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _missing(path: str, what: str) -> FileNotFoundError:
    return FileNotFoundError(errno.ENOENT, f"{path} is missing ({what})", path)


def _load(path: str, what: str) -> Any:
    """A checkpoint file as plain data, memory-mapped (its tensors are read when sliced)."""
    if not os.path.isfile(path):
        raise _missing(path, what)
    try:
        return torch.load(path, weights_only=True, mmap=True, map_location="cpu")
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()
        raise ValueError(f"{path} ({what}) holds more than tensors, numbers and strings and was not loaded "
                         f"({first[0] if first else 'weights_only'})") from None
    except (RuntimeError, EOFError, OSError, ValueError) as e:
        raise ValueError(f"{path} ({what}) is not a readable torch file ({str(e).splitlines()[0]})") from None


def _tag_dir(checkpoint_dir: str, tag: str | None) -> str:
    if not os.path.isdir(checkpoint_dir):
        raise FileNotFoundError(errno.ENOENT, f"{checkpoint_dir}: no such checkpoint directory", checkpoint_dir)
    if tag is None:
        latest = os.path.join(checkpoint_dir, "latest")
        if not os.path.isfile(latest):
            raise FileNotFoundError(errno.ENOENT, f"{checkpoint_dir} has no 'latest' file; give the tag to "
                                                  "consolidate with --tag", latest)
        with open(latest) as f:
            tag = f.read().strip()
    if not tag or "/" in tag or tag.startswith("."):
        raise ValueError(f"{tag!r} is not a checkpoint tag")
    path = os.path.join(checkpoint_dir, tag)
    if not os.path.isdir(path):
        raise FileNotFoundError(errno.ENOENT, f"no checkpoint '{tag}' in {checkpoint_dir}", path)
    return path


class _Masters:
    """The fp32 masters of a checkpoint's trainable parameters: each rank's
    flat partitions (``ceil(numel / world)`` elements a parameter, in the
    order of ``param_shapes``), memory-mapped."""

    def __init__(self, tag_dir: str) -> None:
        stage3 = os.path.join(tag_dir, "zero_pp_rank_0_mp_rank_00_model_states.pt")
        states_path = stage3 if os.path.isfile(stage3) else os.path.join(tag_dir, "mp_rank_00_model_states.pt")
        states = _load(states_path, "the parameters' names and shapes")
        try:
            self.world = int(states["dp_world_size"])
            shapes = [(n, tuple(s)) for group in states["param_shapes"] for n, s in group.items()]
        except (KeyError, TypeError, ValueError, AttributeError):
            raise ValueError(f"{states_path} is not a ZeRO model-states file (no dp_world_size or "
                             "param_shapes)") from None
        self.flats = []
        for rank in range(self.world):
            name = f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"
            path = os.path.join(tag_dir, name)
            if not os.path.isfile(path):
                path = os.path.join(tag_dir, "bf16_" + name)
            optim = _load(path, f"rank {rank}'s fp32 masters")
            try:
                osd = optim["optimizer_state_dict"]
                groups = osd.get("fp32_flat_groups", osd.get("single_partition_of_fp32_groups"))
                flat = torch.cat([g.reshape(-1) for g in groups]) if len(groups) > 1 else groups[0].reshape(-1)
            except (KeyError, TypeError, IndexError, AttributeError):
                raise ValueError(f"{path} is not a ZeRO optim-states file (no fp32_flat_groups)") from None
            if flat.dtype != torch.float32:
                raise ValueError(f"{path}: its masters are {flat.dtype}, not float32")
            self.flats.append((path, flat))
        self.where: dict[str, tuple[tuple[int, ...], int, int]] = {}
        offset = 0
        for name, shape in shapes:
            part = -(-math.prod(shape) // self.world)
            self.where[name] = (shape, offset, part)
            offset += part
        for path, flat in self.flats:
            if flat.numel() != offset:
                raise ValueError(f"{path} holds {flat.numel()} fp32 values, its model-states file's parameters "
                                 f"take {offset}: the file is truncated or of another checkpoint")

    def read(self, name: str) -> torch.Tensor:
        shape, offset, part = self.where[name]
        pieces = [flat[offset:offset + part] for _, flat in self.flats]
        whole = pieces[0].clone() if len(pieces) == 1 else torch.cat(pieces)
        return whole[:math.prod(shape)].reshape(shape)


def consolidate(checkpoint_dir: str | os.PathLike, output_dir: str | os.PathLike, tag: str | None = None,
                dtype: str = "fp32", config: str | os.PathLike | None = None) -> dict[str, Any]:
    """Writes ``output_dir/model.safetensors`` from the checkpoint's tag
    ``tag`` (default: the one ``latest`` names) in ``dtype`` (floating point
    tensors; others as they are), and ``output_dir/config.json`` from
    ``config`` or the tag's own. Returns what it wrote: the path, how many
    tensors came from fp32 masters and how many from the compute copy, and
    where the config came from (None: none was written)."""
    if dtype not in _DTYPES:
        raise ValueError(f"dtype: {dtype!r}; give fp32, bf16 or fp16")
    checkpoint_dir, output_dir = os.fspath(checkpoint_dir), os.fspath(output_dir)
    if config is not None and not os.path.isfile(config):
        raise FileNotFoundError(errno.ENOENT, f"{config}: no such config file", os.fspath(config))
    tag_dir = _tag_dir(checkpoint_dir, tag)
    model_path = os.path.join(tag_dir, "model.safetensors")
    if not os.path.isfile(model_path):
        raise _missing(model_path, "the model's values")
    header, base = read_safetensors_header(model_path)
    size = os.path.getsize(model_path)
    for name, entry in header.items():
        if not isinstance(entry, dict) or _ST_TORCH.get(entry.get("dtype")) is None or "data_offsets" not in entry:
            raise ValueError(f"{model_path}: corrupt safetensors entry '{name}'")
        if base + entry["data_offsets"][1] > size:
            raise ValueError(f"{model_path} is truncated ('{name}' ends past its {size} bytes)")
    masters = _Masters(tag_dir)
    for name, (shape, _, _) in masters.where.items():
        if name not in header or tuple(header[name]["shape"]) != shape:
            raise ValueError(f"{tag_dir}: the masters' '{name}' {list(shape)} is not in {model_path} as that shape")
    target = _DTYPES[dtype]
    names = sorted(header, key=lambda n: header[n]["data_offsets"][0])  # the order the engine wrote them

    def out_dtype(stored: torch.dtype) -> torch.dtype:
        return target if stored.is_floating_point else stored

    entries = [(n, tuple(header[n]["shape"]), out_dtype(_ST_TORCH[header[n]["dtype"]])) for n in names]

    def values() -> Iterator[torch.Tensor]:
        with open(model_path, "rb") as f:
            for name, _, want in entries:
                if name in masters.where:
                    t = masters.read(name)
                else:
                    entry = header[name]
                    t = torch.empty(entry["shape"], dtype=_ST_TORCH[entry["dtype"]])
                    _read_into(f, base, entry, t, model_path, name)
                yield t.to(want)

    os.makedirs(output_dir, exist_ok=True)
    out = os.path.join(output_dir, "model.safetensors")
    tmp = f"{out}.partial"
    try:
        write_safetensors(tmp, entries, values(), {"format": "pt", "producer": "tierflow.zero.consolidate"})
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    source = os.fspath(config) if config is not None else os.path.join(tag_dir, "config.json")
    if os.path.isfile(source):
        shutil.copyfile(source, os.path.join(output_dir, "config.json"))
    else:
        source = None
    from_masters = sum(1 for n in names if n in masters.where)
    return {"path": out, "from_masters": from_masters, "from_compute_copy": len(names) - from_masters,
            "config": source}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tierflow.zero.consolidate",
        description="Writes OUTPUT_DIR/model.safetensors from a tierflow ZeRO checkpoint, without the model: the "
                    "fp32 masters of the trainable parameters (joined from every rank's shard), the frozen "
                    "parameters and buffers as the checkpoint holds them. Streamed, one tensor at a time.")
    parser.add_argument("checkpoint_dir", help="the directory save_checkpoint wrote (its tags and 'latest')")
    parser.add_argument("output_dir", help="where model.safetensors (and config.json) go")
    parser.add_argument("--tag", help="the tag to read (default: the one 'latest' names)")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="fp32",
                        help="the floating point tensors' dtype in the output (default fp32)")
    parser.add_argument("--config", help="a config.json to copy beside the weights (for from_pretrained); "
                                         "default: the tag's config.json, which the engine saves for a model "
                                         "with a Hugging Face config")
    args = parser.parse_args(argv)
    try:
        done = consolidate(args.checkpoint_dir, args.output_dir, tag=args.tag, dtype=args.dtype, config=args.config)
    except (OSError, ValueError) as e:
        print(f"{parser.prog}: error: {e.strerror if isinstance(e, OSError) and e.strerror else e}", file=sys.stderr)
        return 1
    config = f"config.json from {done['config']}" if done["config"] else \
        "no config.json (give one with --config for from_pretrained)"
    print(f"wrote {done['path']}: {done['from_masters']} tensors from fp32 masters, {done['from_compute_copy']} "
          f"from the compute copy; {config}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
