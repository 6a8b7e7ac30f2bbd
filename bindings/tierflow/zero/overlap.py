"""The optimizer step overlapped with the backward (stage 3).

At the accumulation boundary, a parameter's gradient is final as soon as its
post-accumulate-grad hook fires: nothing later in the backward changes it.
When no global figure must be known first — no gradient clipping (the global
norm) and no fp16 loss scale (the overflow check) — the parameter can be
stepped right then, on a thread of its own, while the backward goes on with
the layers below. The optimizer's state streams from NVMe meanwhile, and a
gradient that one micro-batch made whole never goes to the store at all.

One step is in flight at a time: the next gradient's hook waits for it, ends
its leases and starts its own, so the host tier holds one parameter and one
gradient for the step beside what the backward holds, as the synchronous
step does. Every lease is taken and ended on the training thread (the store
is a single-holder store); the thread runs only the optimizer, whose state is
its own. The update is the synchronous step's, bit for bit: each parameter's
AdamW step depends on its own state and gradient alone, whatever the order.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from tierflow.zero.partition import ParamStore, Partition, StepLease

__all__ = ["OverlappedStep"]


class OverlappedStep:
    """Steps ``optimizer`` one parameter at a time on a thread, fed from the
    gradient hooks of the boundary micro-batch."""

    def __init__(self, params: ParamStore, optimizer: torch.optim.Optimizer) -> None:
        self.params = params
        self.optimizer = optimizer
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tierflow-step")
        self._inflight: tuple[StepLease, Future] | None = None

    def submit(self, part: Partition, grad: torch.Tensor) -> None:
        """Waits for the step in flight, then starts ``part``'s with ``grad``
        (this micro-batch's gradient)."""
        self.wait()
        lease = self.params.lease_for_step(part, grad)
        self._inflight = (lease, self._pool.submit(self._run, lease))

    def _run(self, lease: StepLease) -> None:
        p = lease.part.step_param
        p.data = lease.value
        p.grad = lease.grad
        try:
            with torch.no_grad():
                self.optimizer.step()
        finally:
            p.grad = None
            p.data = lease.part.step_placeholder

    def wait(self) -> None:
        """Waits for the step in flight and ends its leases; re-raises its error."""
        if self._inflight is None:
            return
        lease, future = self._inflight
        self._inflight = None
        error = future.exception()
        self.params.end_step(lease, ok=error is None)
        if error is not None:
            raise error

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._pool.shutdown(wait=True)


def overlappable(engine: Any) -> bool:
    """Whether ``engine``'s boundary step may run during its backward: stage 3,
    no gradient clipping, no fp16 loss scale, the plain Adam/AdamW step, and
    ``tierflow.overlap_step`` on."""
    return (engine.params is not None and engine.gradient_clipping == 0 and engine.scaler is None
            and engine.config.zero.zenflow is None and engine.config.tierflow.overlap_step)
