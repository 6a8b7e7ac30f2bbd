"""tierflow beneath FSDP2 (``torch.distributed.fsdp.fully_shard``).

tierflow's optimizers (:mod:`tierflow.torch.optim`) step a ``fully_shard``
model's DTensor parameters over their local shards as they are. This module
holds what FSDP2's own tools do not do for a sharded model whose shards live
in host memory:

* :func:`clip_grad_norm_`: ``torch.nn.utils.clip_grad_norm_`` over DTensor
  gradients without DTensor dispatch, its one reduction on the device of the
  mesh's process group. torch's own, under ``CPUOffloadPolicy``, reduces the
  CPU gradients' partial norms with the mesh's collective, which NCCL
  cannot run on CPU tensors (pytorch#148532).
"""

from __future__ import annotations

import math
from typing import Iterable

import torch
from torch import Tensor

from tierflow.torch.optim.adam import _DTensor, _local

__all__ = ["clip_grad_norm_"]


def clip_grad_norm_(parameters: Tensor | Iterable[Tensor], max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False, foreach: bool | None = None) -> Tensor:
    """Clips the gradients of ``parameters`` by their total norm, as
    ``torch.nn.utils.clip_grad_norm_`` does, and returns that norm (a
    0-dim fp32 tensor on the CPU, the same on every rank).

    A DTensor gradient (FSDP2's, sharded over a mesh) counts by its local
    shard: each rank sums its shards' ``norm_type``-th powers (or takes their
    maximum for ``inf``), the sums are all-reduced once per mesh over each
    mesh dimension the gradient is sharded over (not a replicated one, as
    HSDP's), on the mesh's device (a CUDA mesh's NCCL gets a CUDA scalar even
    when the gradients are in host memory), and every local shard
    is scaled in place by ``max_norm / (total + 1e-6)`` when that is below 1.
    A plain tensor gradient counts once, as it is on every rank. ``foreach``
    is accepted as torch's (the norms are computed per tensor either way).
    Raises RuntimeError, as torch does, when ``error_if_nonfinite`` and the
    total norm is nan or inf."""
    if isinstance(parameters, Tensor):
        parameters = [parameters]
    grads = [p.grad for p in parameters if p.grad is not None]
    max_norm, norm_type = float(max_norm), float(norm_type)
    if not grads:
        return torch.tensor(0.0)
    inf = math.isinf(norm_type)
    # Per mesh and placements: the dimensions a gradient is sharded over are
    # the ones its norm is summed over (a replicated one, HSDP's, holds the
    # same shard on every rank and is not).
    local_by_mesh: dict[tuple, tuple[object, list[int], list[Tensor]]] = {}
    plain: list[Tensor] = []
    for g in grads:
        if _DTensor is not None and isinstance(g, _DTensor):
            dims = [d for d, placement in enumerate(g.placements) if placement.is_shard()]
            key = (id(g.device_mesh), tuple(dims))
            local_by_mesh.setdefault(key, (g.device_mesh, dims, []))[2].append(_local(g))
        else:
            plain.append(g)

    def part(tensors: list[Tensor]) -> Tensor:
        """Their max |g| (inf) or sum of |g|^p, fp32 on the CPU."""
        norms = [torch.linalg.vector_norm(t.detach(), norm_type, dtype=torch.float32).cpu() for t in tensors
                 if t.numel() > 0]
        if not norms:
            return torch.tensor(0.0)
        stacked = torch.stack(norms)
        return stacked.max() if inf else (stacked ** norm_type).sum()

    import torch.distributed as dist

    total = part(plain)
    for mesh, dims, locals_ in local_by_mesh.values():
        value = part(locals_)
        device = torch.device(mesh.device_type, torch.cuda.current_device()) if mesh.device_type == "cuda" \
            else torch.device(mesh.device_type)
        reduced = value.to(device)
        for dim in dims:
            dist.all_reduce(reduced, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM,
                            group=mesh.get_group(dim))
        value = reduced.cpu()
        total = torch.maximum(total, value) if inf else total + value
    total = total if inf else total ** (1.0 / norm_type)
    if error_if_nonfinite and not math.isfinite(total.item()):
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, so it cannot be "
            "clipped. To disable this error and scale the gradients by the non-finite norm anyway, set "
            "`error_if_nonfinite=False`")
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    with torch.no_grad():
        for g in grads:
            target = _local(g)
            target.mul_(coef.to(device=target.device, dtype=target.dtype))
    return total
