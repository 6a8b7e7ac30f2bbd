"""The optimizer step and the gradients' way to the store, overlapped with
the backward (stage 3).

Every gradient leaves the autograd thread at once: its hook leases the
gradient's block and hands the copy (a GPU gradient comes down on a copy
stream of its own) and the sum into the block to a thread of its own, which
also takes the block's norm when the step needs the global one (gradient
clipping, an overflow check). The norm is known only once the backward has
ended, so such a step runs after it, as DeepSpeed's does — what the backward
overlaps is the gradients' copies, sums and norms. Without a global figure
to know first, the step itself overlaps the backward, as follows.

At the accumulation boundary, a parameter's gradient is final once the
backward has delivered the last of its contributions: its last
post-accumulate-grad hook of the micro-batch. A micro-batch may fire a
parameter's hook several times — two ``engine.backward`` calls before one
``step()``, reentrant activation checkpointing (each segment's backward is a
backward of its own), a weight shared across such segments — so the step
cannot start at the first hook. The hooks of each micro-batch are counted;
at the boundary a parameter is stepped at the hook whose number is the count
of the micro-batch before, and every earlier one accumulates in the store as
usual. The first micro-batch has no count before it, and a parameter whose
count changed between micro-batches is not overlapped again: both step after
the backward, in :meth:`~tierflow.zero.engine.Engine.step`, with the same
result. A hook after a parameter's overlapped step (a backward that took a
path it never took before) raises, naming the parameter, rather than
stepping twice on parts of one gradient.

When no global figure must be known first — no gradient clipping (the global
norm) and no fp16 loss scale (the overflow check) — a parameter is stepped on
a thread of its own, while the backward goes on with the layers below. The
optimizer's state streams from NVMe meanwhile, and a gradient that one
micro-batch made whole never goes to the store at all. Each step is of its
own parameter alone (``step_parameters``): its cost is the parameter's, not
the model's; the optimizer's ``step()`` runs once after the last, for its
hooks and counters.

One step is in flight at a time: the next gradient's hook waits for it, ends
its leases and starts its own, so the host tier holds one parameter and one
gradient for the step beside what the backward holds, as the synchronous
step does. Every lease is taken and ended on the training thread (the store
is a single-holder store); the thread runs only the gradient's last copy and
sum and the optimizer, whose state is its own. The update is the synchronous
step's, bit for bit: each parameter's AdamW step depends on its own state and
gradient alone, whatever the order.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

import torch

from tierflow.zero.partition import GradLease, ParamStore, Partition, StepLease

__all__ = ["OverlappedStep"]


class OverlappedStep:
    """Adds each gradient into the store on a thread (:meth:`accumulate`)
    and, with ``steps``, steps ``optimizer`` there one parameter at a time,
    fed from the gradient hooks of the boundary micro-batch (:meth:`take`;
    see the module's docstring). ``on_norm(part, sq, finite)`` receives
    each block's squared norm that :meth:`accumulate` was asked for, on the
    training thread."""

    def __init__(self, params: ParamStore, optimizer: torch.optim.Optimizer, *, steps: bool,
                 on_norm: Callable[[Partition, float, bool], None]) -> None:
        self.params = params
        self.optimizer = optimizer
        self.steps = steps
        self._on_norm = on_norm
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tierflow-step")
        # The work in flight: a step (StepLease) or a gradient's add (GradLease, whether its norm counts).
        self._inflight: tuple[StepLease | GradLease, Future, bool] | None = None
        self._hooks: dict[int, int] = {}              # partition -> gradient hooks this micro-batch
        self._expected: dict[int, int] | None = None  # the same, of the micro-batch before
        self._unsteady: set[int] = set()              # partitions whose count changed: never overlapped
        self._stepped: set[int] = set()               # stepped during this boundary's backward
        self.overlapped = 0                           # parameters stepped during a backward, in all

    def take(self, part: Partition, grad: torch.Tensor, boundary: bool) -> bool:
        """Counts a gradient of ``part``; when ``boundary`` and this is its
        last of the micro-batch, starts its step with it and returns True;
        otherwise returns False and the caller accumulates ``grad``."""
        if not self.steps:
            return False
        i = part.index
        n = self._hooks[i] = self._hooks.get(i, 0) + 1
        if i in self._stepped:
            self._unsteady.add(i)
            raise RuntimeError(
                f"tierflow: parameter '{part.name}' got another gradient after its optimizer step in this backward "
                f"(gradient {n}; the micro-batch before gave {n - 1}): the backward took a path it had not taken "
                "before, and the step used part of the gradient. Give tierflow.overlap_step false for a model "
                "whose backward changes from one micro-batch to the next")
        if not boundary or self._expected is None or i in self._unsteady or self._expected.get(i) != n:
            return False
        self._submit(part, grad)
        self._stepped.add(i)
        return True

    def end_micro_batch(self) -> None:
        """At each ``step()``: the counts of the micro-batch that ended are
        the expectation for the next; a partition whose count changed is not
        overlapped again."""
        if self._expected is not None:
            for i in self._expected.keys() | self._hooks.keys():
                if self._expected.get(i) != self._hooks.get(i):
                    self._unsteady.add(i)
        self._expected, self._hooks = self._hooks, {}
        self._stepped.clear()

    def accumulate(self, part: Partition, grad: torch.Tensor, norm: bool) -> None:
        """Waits for the work in flight, then starts adding ``grad`` into
        ``part``'s gradient block (with ``norm``, taking the block's norm)."""
        self.wait()
        lease = self.params.lease_for_accumulate(part, grad)
        self._inflight = (lease, self._pool.submit(lease.add, norm), norm)

    def _submit(self, part: Partition, grad: torch.Tensor) -> None:
        """Waits for the work in flight, then starts ``part``'s step with
        ``grad`` (this micro-batch's gradient)."""
        self.wait()
        lease = self.params.lease_for_step(part, grad)
        self._inflight = (lease, self._pool.submit(self._run, lease), False)
        self.overlapped += 1

    def _run(self, lease: StepLease) -> None:
        p = lease.part.step_param
        p.data = lease.value
        try:
            p.grad = lease.gradient()
            self.optimizer.step_parameters([p])
        finally:
            p.grad = None
            p.data = lease.part.step_placeholder

    def wait(self) -> None:
        """Waits for the work in flight and ends its leases; re-raises its error."""
        if self._inflight is None:
            return
        lease, future, norm = self._inflight
        self._inflight = None
        error = future.exception()
        if isinstance(lease, GradLease):
            self.params.end_accumulate(lease, ok=error is None)
            if error is None and norm:
                self._on_norm(lease.part, *future.result())
        else:
            self.params.end_step(lease, ok=error is None)
        if error is not None:
            raise error

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._pool.shutdown(wait=True)


def overlappable(config: Any, needs_norm: bool, world_size: int = 1) -> bool:
    """Whether a stage-3 run under ``config`` over ``world_size`` ranks may
    step during its backward: no global norm to know first (``needs_norm``:
    gradient clipping, fp16's loss scale, bf16.check_grad_overflow), no
    ZenFlow, ``tierflow.overlap_step`` on, and each step of one parameter's
    own values. Adam/AdamW's is elementwise, so a rank's shard steps alone.
    Muon's needs its whole matrix (Newton–Schulz of the momentum update):
    with one rank the parameter's final gradient is the whole matrix's and
    it steps as Adam's does; over several ranks each matrix's step gathers
    every rank's shard of its update (ShardedMuon), a collective every rank
    must reach in the same order: run on the step's thread it would
    interleave with the backward's reduce-scatters on the training thread,
    so Muon over several ranks steps after the backward."""
    from tierflow.config import MuonConfig

    if isinstance(config.optimizer, MuonConfig) and world_size > 1:
        return False
    return not needs_norm and config.zero.zenflow is None and bool(config.tierflow.overlap_step)
