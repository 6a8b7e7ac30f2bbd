"""The collectives a data-parallel ZeRO-3 run needs, over ``torch.distributed``.

With several processes (launched with ``torchrun``, the process group made
with ``torch.distributed.init_process_group`` before the engine), each rank's
store holds one shard of every parameter: ``ceil(numel / world_size)``
elements, the last rank's padded with zeros. A parameter's full values are
the rank-ordered concatenation of the shards (:meth:`Group.gather`); a
gradient becomes each rank's shard of the mean over the ranks
(:meth:`Group.reduce_scatter_mean`). The reductions run in fp32 whatever the
compute dtype, so a gradient averaged over two ranks differs from one
process's only by the order of the additions.

With no process group (or a group of one) every collective is the identity,
and the engine runs exactly as a single process does. All ranks must call the
collectives in the same order: they run the same model on the same code path,
so the forward, the backward and the step do.

This module is the only one in the engine that calls ``torch.distributed``.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["Group", "current_group"]


class Group:
    """The ranks of one data-parallel run (``world_size`` 1 without a process group)."""

    def __init__(self, process_group: Any = None) -> None:
        import torch.distributed as dist

        self._dist = dist
        self.active = dist.is_available() and dist.is_initialized()
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group) if self.active else 1
        self.rank = dist.get_rank(process_group) if self.active else 0
        if self.world_size == 1:
            self.active = False
        # NCCL moves device memory only: host tensors (a checkpoint's values,
        # a parameter being adopted) go through a device copy.
        self._staging = (torch.device("cuda", torch.cuda.current_device())
                         if self.active and dist.get_backend(process_group) == "nccl" else None)

    def _run(self, op: Any, tensor: torch.Tensor, *others: torch.Tensor) -> None:
        """``op(tensor, *others)`` on the backend's device: ``tensor`` (the
        output) gets the result in place."""
        if self._staging is None or tensor.device.type != "cpu":
            op(tensor, *others)
            return
        staged = tensor.to(self._staging)
        op(staged, *(o.to(self._staging) for o in others))
        tensor.copy_(staged)

    def shard_numel(self, numel: int) -> int:
        """Elements of one rank's shard of a tensor of ``numel``."""
        return max(1, -(-numel // self.world_size))

    def shard_of(self, flat: torch.Tensor, shard: int) -> torch.Tensor:
        """This rank's ``shard`` elements of ``flat`` (a 1-D tensor of the full
        values), padded with zeros past the end."""
        begin = self.rank * shard
        piece = flat[begin:begin + shard]
        if piece.numel() == shard:
            return piece
        out = torch.zeros(shard, dtype=flat.dtype, device=flat.device)
        out[:piece.numel()] = piece
        return out

    def gather(self, shard: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Every rank's ``shard`` (1-D, the same size on each), concatenated in
        rank order into ``out`` (``world_size × shard`` elements) or a new tensor."""
        if out is None:
            out = torch.empty(shard.numel() * self.world_size, dtype=shard.dtype, device=shard.device)
        if not self.active:
            out.copy_(shard)
            return out
        self._run(lambda o, s: self._dist.all_gather_into_tensor(o, s, group=self.process_group),
                  out, shard.contiguous())
        return out

    def reduce_scatter_mean(self, flat: torch.Tensor, shard: int) -> torch.Tensor:
        """This rank's ``shard`` elements of the mean over the ranks of ``flat``
        (1-D, each rank's full gradient), reduced in fp32."""
        full = torch.zeros(shard * self.world_size, dtype=torch.float32, device=flat.device)
        full[:flat.numel()] = flat
        if not self.active:
            return full
        out = torch.empty(shard, dtype=torch.float32, device=flat.device)
        self._run(lambda o, f: self._dist.reduce_scatter_tensor(o, f, group=self.process_group), out, full)
        return out.div_(self.world_size)

    def sum(self, *values: float) -> list[float]:
        """Each of ``values`` summed over the ranks (fp64)."""
        if not self.active:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64)
        self._run(lambda x: self._dist.all_reduce(x, group=self.process_group), t)
        return t.tolist()

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """``tensor`` replaced in place by rank ``src``'s values."""
        if self.active:
            staged = tensor if tensor.is_contiguous() else tensor.contiguous()
            self._run(lambda x: self._dist.broadcast(x, src=src, group=self.process_group), staged)
            if staged is not tensor:
                tensor.copy_(staged)
        return tensor

    def barrier(self) -> None:
        if self.active:
            self._dist.barrier(group=self.process_group)

    def agree(self, ok: bool) -> bool:
        """Whether ``ok`` holds on every rank (one all-reduce)."""
        if not self.active:
            return ok
        return self.sum(0.0 if ok else 1.0)[0] == 0.0

    def __repr__(self) -> str:
        return f"Group(rank={self.rank}, world_size={self.world_size})"


def current_group() -> Group:
    """The default process group's ranks (world_size 1 without one)."""
    return Group()
