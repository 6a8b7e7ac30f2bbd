"""The engine's optimizer for ``optimizer.type: "Muon"``: DeepSpeed's
MuonWithAuxAdam as one ``torch.optim.Optimizer`` over tierflow's
:class:`~tierflow.torch.optim.Muon` (the hidden matrices) and
:class:`~tierflow.torch.optim.AdamW` (the rest).

The two optimizers step; :class:`MuonWithAuxAdam` is what the engine, an LR
scheduler and a checkpoint see. Its ``param_groups`` are the two parts'
group dicts themselves, each flagged ``use_muon`` as DeepSpeed's, so a
scheduler that sets ``group["lr"]`` sets the rate the part steps with; its
``state`` reads through to the parts; its ``state_dict()`` is torch's layout
over both groups (Muon's first), with each part's own state keys
(``momentum_buffer``; ``step``, ``exp_avg``, ``exp_avg_sq``).
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping
from typing import Any, Callable, Iterator

import torch
from torch import Tensor
from torch.optim.optimizer import Optimizer

from tierflow import _core, _lifetime
from tierflow.torch.optim import MASTER_KEY, Adam, Muon
from tierflow.torch.optim.adam import (_LOW_PRECISION, _check_offload, _master_of, _restore_fp32_state, _save_file,
                                       _scalar)
from tierflow.torch.optim.muon import _MOMENTUM_KEY, _NS_COEFFICIENTS, _MuonNvmeState, _check_hyper_parameters, muon

__all__ = ["MuonWithAuxAdam", "ShardedMuon", "PART_NAMES"]

# Each part's directory in an NVMe checkpoint (and its state files' directory).
PART_NAMES = {True: "muon", False: "adamw"}


class _JointState(MutableMapping):
    """``optimizer.state`` of a :class:`MuonWithAuxAdam`: each parameter's
    entry in its own part's ``state`` (a missing one made there, as torch's
    defaultdict makes it)."""

    def __init__(self, optimizer: "MuonWithAuxAdam") -> None:
        self._optimizer = optimizer

    def _states(self) -> list[dict]:
        return [part.state for part in self._optimizer.parts]

    def __getitem__(self, p: Tensor) -> dict:
        return self._optimizer.part_of(p).state[p]

    def __setitem__(self, p: Tensor, value: dict) -> None:
        self._optimizer.part_of(p).state[p] = value

    def __delitem__(self, p: Tensor) -> None:
        del self._optimizer.part_of(p).state[p]

    def __contains__(self, p: object) -> bool:
        return any(p in state for state in self._states())

    def get(self, p: Tensor, default: Any = None) -> Any:
        for state in self._states():
            if p in state:
                return state[p]
        return default

    def __iter__(self) -> Iterator[Tensor]:
        for state in self._states():
            yield from state

    def __len__(self) -> int:
        return sum(len(state) for state in self._states())


class MuonWithAuxAdam(Optimizer):
    """One optimizer over ``muon`` (tierflow's Muon, the hidden matrices) and
    ``adamw`` (tierflow's AdamW, everything else); either may be None when
    its share of the model is empty, not both.

    :meth:`step` steps both parts; :meth:`step_parameters` steps the given
    parameters, each by its part (the engine's stage-3 step, batch by batch
    or overlapped with the backward). State in RAM or on NVMe is the parts'
    own, both placed alike (``offload``); with ``offload="nvme"``,
    :meth:`save_state` / :meth:`load_state` checkpoint each part into a
    directory of its own (``muon/``, ``adamw/``) beside an ``optimizer.pt``
    that holds the joint param groups."""

    def __init__(self, muon: Muon | None, adamw: Adam | None) -> None:
        if muon is None and adamw is None:
            raise ValueError("MuonWithAuxAdam: no parameters to step (neither a Muon nor an AdamW part)")
        self._muon, self._adamw = muon, adamw
        offloads = {part.offload for part in self.parts}
        if len(offloads) != 1:
            raise ValueError(f"MuonWithAuxAdam: the parts keep their state in different places ({sorted(offloads)})")
        self.offload = offloads.pop()
        groups = []
        for use_muon, part in self._flagged():
            for group in part.param_groups:
                group["use_muon"] = use_muon
                groups.append(group)
        self._joining = True
        super().__init__(groups, {})  # torch's add_param_group keeps each dict: the parts step what is set here
        self._joining = False
        self._join()

    # ---- the parts ----------------------------------------------------------------------------------

    def _flagged(self) -> list[tuple[bool, Optimizer]]:
        return [(use_muon, part) for use_muon, part in ((True, self._muon), (False, self._adamw)) if part is not None]

    @property
    def parts(self) -> list[Optimizer]:
        """The optimizers that step: Muon's, then AdamW's (those that exist)."""
        return [part for _, part in self._flagged()]

    @property
    def muon(self) -> Muon | None:
        return self._muon

    @property
    def adamw(self) -> Adam | None:
        return self._adamw

    def _join(self) -> None:
        """The joint groups and state over the parts' (again after a part's
        load, which makes its group dicts anew)."""
        self.param_groups = [g for part in self.parts for g in part.param_groups]
        self._part_of = {id(p): part for part in self.parts for g in part.param_groups for p in g["params"]}
        self.state = _JointState(self)

    def part_of(self, p: Tensor) -> Optimizer:
        """The part that steps ``p``; KeyError for a parameter neither holds."""
        try:
            return self._part_of[id(p)]
        except KeyError:
            raise KeyError("MuonWithAuxAdam: a parameter this optimizer does not hold") from None

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Refused after construction: each group belongs to a part, made with it."""
        if not getattr(self, "_joining", False):
            raise ValueError("MuonWithAuxAdam.add_param_group: the groups are Muon's and AdamW's, fixed when the "
                             "engine is made")
        super().add_param_group(param_group)

    # ---- stepping -----------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Both parts' step over the parameters that have a gradient; returns
        the closure's loss when a closure is given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for part in self.parts:
            part.step()
        return loss

    @torch.no_grad()
    def step_parameters(self, params: list[Tensor]) -> set[Tensor]:
        """Steps only ``params`` (host parameters with their gradients), each
        by its part's ``step_parameters``; returns those skipped for a
        non-finite gradient."""
        chosen: dict[int, list[Tensor]] = {}
        for p in params:
            try:
                chosen.setdefault(id(self.part_of(p)), []).append(p)
            except KeyError:
                raise ValueError("step_parameters: a parameter this optimizer does not hold") from None
        skipped: set[Tensor] = set()
        for part in self.parts:
            if id(part) in chosen:
                skipped |= part.step_parameters(chosen[id(part)])
        return skipped

    # ---- state --------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """torch's layout over both groups: the parts' state_dicts (each read
        from NVMe with ``offload="nvme"``), AdamW's indices after Muon's."""
        state: dict[int, Any] = {}
        groups: list[dict[str, Any]] = []
        offset = 0
        for part in self.parts:
            saved = part.state_dict()
            state.update({i + offset: v for i, v in saved["state"].items()})
            groups.extend({**g, "params": [i + offset for i in g["params"]]} for g in saved["param_groups"])
            offset += sum(len(g["params"]) for g in part.param_groups)
        return {"state": state, "param_groups": groups}

    def split_state_dict(self, state_dict: dict[str, Any]) -> list[tuple[Optimizer, dict[str, Any]]]:
        """``state_dict`` (this optimizer's layout) as each part's own;
        ValueError when its groups are not this optimizer's."""
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError("loaded state dict has a different number of parameter groups")
        out, start = [], 0
        for use_muon, part in self._flagged():
            mine = saved_groups[start:start + len(part.param_groups)]
            start += len(part.param_groups)
            for g in mine:
                if g.get("use_muon", use_muon) != use_muon:
                    raise ValueError(f"loaded state dict has a {'Muon' if g['use_muon'] else 'AdamW'} group where "
                                     f"this optimizer has a {'Muon' if use_muon else 'AdamW'} one")
            ids = {i for g in mine for i in g["params"]}
            out.append((part, {"state": {i: v for i, v in state_dict["state"].items() if i in ids},
                               "param_groups": mine}))
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads a :meth:`state_dict` of this layout, each part its share."""
        for part, saved in self.split_state_dict(state_dict):
            part.load_state_dict(saved)
        self._join()

    def rejoin(self) -> None:
        """The joint groups and state again, after a part was loaded directly."""
        self._join()

    def refresh_masters(self) -> None:
        """Each bf16/fp16 parameter's fp32 master starts again from the
        parameter at its next step (after weights were loaded without the
        optimizer's state), in both parts."""
        if self._adamw is not None:
            self._adamw.refresh_masters()
        if self._muon is not None:
            for group in self._muon.param_groups:
                for p in group["params"]:
                    if p.dtype in _LOW_PRECISION and p in self._muon.state:
                        self._muon.state[p].pop(MASTER_KEY, None)

    def master_of(self, p: Tensor) -> Tensor | None:
        """A copy of the fp32 master kept of ``p``, or None."""
        part = self.part_of(p)
        if part is self._adamw and self.offload == "nvme":  # (Adam keeps its masters on NVMe)
            group = next(g for g in part.param_groups if any(q is p for q in g["params"]))
            return part._read_state(p, group).get(MASTER_KEY)
        value = part.state.get(p, {}).get(MASTER_KEY)  # (Muon keeps them in RAM with either offload)
        return None if value is None else value.detach().cpu().clone()

    # ---- NVMe ---------------------------------------------------------------------------------------

    def save_state(self, directory: str | os.PathLike) -> None:
        """With offload="nvme": each part's own checkpoint in
        ``directory/muon`` and ``directory/adamw`` (made 0700), then the
        joint param groups in ``directory/optimizer.pt``."""
        if self.offload != "nvme":
            raise ValueError("save_state: the state is not on NVMe (offload='cpu'); torch.save(state_dict()) saves it")
        directory = os.fspath(directory)
        os.makedirs(directory, mode=0o700, exist_ok=True)
        for use_muon, part in self._flagged():
            part.save_state(os.path.join(directory, PART_NAMES[use_muon]))
        meta = Optimizer.state_dict(self)
        meta["state"] = {}  # (the parts' files hold it)
        meta["tierflow"] = {"parts": [PART_NAMES[use_muon] for use_muon, _ in self._flagged()]}
        _save_file(meta, os.path.join(directory, "optimizer.pt"))

    def checkpoint_files(self, directory: str | os.PathLike) -> list[str]:
        """The files :meth:`load_state` needs in ``directory``."""
        directory = os.fspath(directory)
        return [os.path.join(directory, "optimizer.pt")] + [
            os.path.join(directory, PART_NAMES[use_muon], name)
            for use_muon, _ in self._flagged() for name in ("optimizer.pt", "manifest.json")]

    def load_state(self, directory: str | os.PathLike) -> None:
        """Resumes what :meth:`save_state` saved in ``directory``. Each
        part's masters are set as saved (not remade from the parameter: a
        stage-3 step parameter holds a placeholder outside its step)."""
        if self.offload != "nvme":
            raise ValueError("load_state: the state is not on NVMe (offload='cpu'); use load_state_dict()")
        directory = os.fspath(directory)
        meta = torch.load(os.path.join(directory, "optimizer.pt"), weights_only=True)
        names = [PART_NAMES[use_muon] for use_muon, _ in self._flagged()]
        if meta.get("tierflow", {}).get("parts") != names:
            raise ValueError(f"load_state: {directory} holds the parts {meta.get('tierflow', {}).get('parts')}, "
                             f"this optimizer has {names}")
        self.split_state_dict(meta)  # the groups are this optimizer's
        for name, part in zip(names, self.parts):
            part_dir = os.path.join(directory, name)
            part.load_state(part_dir)
            if part is self._muon:  # (AdamW's masters are in its NVMe store)
                set_masters(part, torch.load(os.path.join(part_dir, "optimizer.pt"), weights_only=True))
        self._join()

    def telemetries(self) -> list[dict]:
        """Each part's NVMe store counters (offload="nvme"), else []."""
        return [t for t in (part.telemetry() for part in self.parts) if t is not None]

    def close(self) -> None:
        """Each part's :meth:`close` (removes the NVMe state's files)."""
        for part in self.parts:
            part.close()


def set_masters(part: Optimizer, saved: dict[str, Any]) -> None:
    """Sets the fp32 masters in ``saved`` (``part``'s state_dict layout)
    into ``part``'s state as they are."""
    params = [p for g in part.param_groups for p in g["params"]]
    ids = [i for g in saved["param_groups"] for i in g["params"]]
    for i, p in zip(ids, params):
        value = saved["state"].get(i, {}).get(MASTER_KEY)
        if torch.is_tensor(value):
            part.state[p][MASTER_KEY] = value.to(device="cpu", dtype=torch.float32,
                                                 memory_format=torch.contiguous_format, copy=True)


class ShardedMuon(_MuonNvmeState, Optimizer):
    """Muon over stage 3's flat shards of several ranks: each parameter is
    this rank's 1-D shard of a matrix of ``shapes[id(p)]``; its state is the
    shard's (``momentum_buffer``, of the shard's size, in RAM or on NVMe;
    ``master_param`` for a bf16/fp16 shard).

    A step of one matrix, every rank at once, in the order given (the
    engine steps the same matrices in the same order on every rank): the
    momentum rule is elementwise, so each rank updates its shard of the
    buffer, B <- B + (1-mu)(g - B), and of the momentum update,
    U = g + mu (B - g) with Nesterov (else B); then ``group`` gathers U and
    the parameter (or its fp32 master) whole, one matrix at a time, and the
    Muon kernel runs Newton–Schulz of the whole U and the update of the whole
    matrix (given U as its gradient with momentum 0, so its buffer is U
    itself), and each rank keeps its shard. Every rank computes the same
    whole matrix; a rank's transient memory is two whole matrices and the
    kernel's workspace. Hyper-parameters and their checks are
    :class:`~tierflow.torch.optim.Muon`'s."""

    def __init__(self, params: list[Tensor], shapes: dict[int, tuple[int, int]], group: Any, *,
                 lr: float = 1e-3, weight_decay: float = 0.1, momentum: float = 0.95, nesterov: bool = True,
                 ns_coefficients: tuple[float, float, float] = _NS_COEFFICIENTS, eps: float = 1e-7,
                 ns_steps: int = 5, adjust_lr_fn: str | None = None, ns_dtype: torch.dtype = torch.bfloat16,
                 threads: int | None = None, offload: str = "cpu", nvme_dir: Any = None,
                 host_memory: int | str | None = None) -> None:
        _check_hyper_parameters(lr, weight_decay, momentum, ns_coefficients, eps, ns_steps, adjust_lr_fn)
        _check_offload(offload, nvme_dir, host_memory)
        for p in params:
            shape = shapes.get(id(p))
            if shape is None or len(shape) != 2:
                raise ValueError(f"ShardedMuon: a parameter of {p.numel()} elements without the 2-D shape of its matrix")
        self._shapes = dict(shapes)
        self.group = group
        self.offload = offload
        self.ns_dtype = ns_dtype
        self.threads = threads if threads is not None else torch.get_num_threads()
        self._executor = _core.Executor(self.threads)
        self._workspace = _core.MuonWorkspace()
        self._nvme: Any = None
        self._slots: dict[Tensor, int] = {}
        _lifetime.track(self)
        defaults = {"lr": lr, "weight_decay": weight_decay, "momentum": momentum, "nesterov": nesterov,
                    "ns_coefficients": ns_coefficients, "eps": eps, "ns_steps": ns_steps,
                    "adjust_lr_fn": adjust_lr_fn}
        super().__init__(params, defaults)
        if offload == "nvme":
            self._open_nvme(os.fspath(nvme_dir), host_memory)

    def save_state(self, directory: str | os.PathLike) -> None:
        """With offload="nvme", as :meth:`Muon.save_state <tierflow.torch.optim.Muon.save_state>`."""
        self._save_nvme(directory)

    def load_state(self, directory: str | os.PathLike) -> None:
        """With offload="nvme", as :meth:`Muon.load_state <tierflow.torch.optim.Muon.load_state>`."""
        self._load_muon_state(directory, check=lambda group: None)

    def state_dict(self) -> dict[str, Any]:
        state_dict = super().state_dict()
        return state_dict if self._nvme is None else self._merge_nvme_state(state_dict)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's load, the fp32 master and momentum shards kept fp32; with
        offload="nvme" the momentum shards are written to NVMe."""
        params = [p for g in self.param_groups for p in g["params"]]
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        for saved_id, p in zip(saved_ids, params):  # refused before anything changes
            value = state_dict["state"].get(saved_id, {}).get(_MOMENTUM_KEY)
            if torch.is_tensor(value) and value.numel() != p.numel():
                raise ValueError(f"state {saved_id} {_MOMENTUM_KEY}: {value.numel()} elements for a shard of "
                                 f"{p.numel()}")
        if self._nvme is None:
            super().load_state_dict(state_dict)
            _restore_fp32_state(self, state_dict, (MASTER_KEY, _MOMENTUM_KEY))
            for p in params:  # (torch's load casts to the parameter's dtype; the buffer stays fp32)
                saved = self.state.get(p, {}).get(_MOMENTUM_KEY)
                if torch.is_tensor(saved) and saved.dtype != torch.float32:
                    self.state[p][_MOMENTUM_KEY] = saved.float()
            return
        stripped = dict(state_dict)
        stripped["state"] = {i: {k: v for k, v in st.items() if k != _MOMENTUM_KEY}
                             for i, st in state_dict["state"].items()}
        super().load_state_dict(stripped)
        _restore_fp32_state(self, stripped, (MASTER_KEY,))
        for saved_id, p in zip(saved_ids, params):
            self._write_state(p, state_dict["state"].get(saved_id, {}))

    # ---- stepping -----------------------------------------------------------------------------------

    def _step_one(self, group: dict[str, Any], p: Tensor) -> None:
        """One matrix's step (see the class docstring); every rank calls it
        for the same matrix at once."""
        rows, cols = self._shapes[id(p)]
        numel = rows * cols
        grad = p.grad.detach().reshape(-1).to(torch.float32)
        state = self.state[p]
        low = p.dtype in _LOW_PRECISION
        if low and MASTER_KEY not in state:
            state[MASTER_KEY] = _master_of(p).reshape(-1)
        target = state[MASTER_KEY] if low else p.detach().reshape(-1)
        if self._nvme is not None:
            buf = self._read_state(p, group).get(_MOMENTUM_KEY)
            buf = torch.zeros(p.numel(), dtype=torch.float32) if buf is None else buf.reshape(-1)
        else:
            buf = state.get(_MOMENTUM_KEY)
            if buf is None:
                buf = state[_MOMENTUM_KEY] = torch.zeros(p.numel(), dtype=torch.float32)
        # The kernel's momentum rule in its own fp32 arithmetic (optim/src/muon.cpp: mu and 1 - mu
        # rounded to fp32, each product rounded before its sum), so the step is one rank's to the bit:
        # B + (1-mu)(g - B), then g + mu (B - g).
        mu = torch.tensor(_scalar(group["momentum"]), dtype=torch.float32)
        buf.add_((1 - mu) * (grad - buf))
        update = grad + mu * (buf - grad) if group["nesterov"] else buf
        whole_update = self.group.gather(update)[:numel].view(rows, cols).contiguous()
        whole = self.group.gather(target.contiguous())[:numel].view(rows, cols).contiguous()
        muon([whole], [whole_update], [torch.zeros_like(whole_update)], [None],
             executor=self._executor, workspace=self._workspace, lr=group["lr"],
             weight_decay=group["weight_decay"], momentum=0.0, nesterov=False,
             ns_coefficients=group["ns_coefficients"], eps=group["eps"], ns_steps=group["ns_steps"],
             adjust_lr_fn=group["adjust_lr_fn"], ns_dtype=self.ns_dtype)
        target.copy_(self.group.shard_of(whole.reshape(-1), p.numel()))
        if low:  # nearest-even, as the kernel writes a parameter from its master
            p.detach().reshape(-1).copy_(target)
        if self._nvme is not None:
            self._write_state(p, {_MOMENTUM_KEY: buf})

    @torch.no_grad()
    def step_parameters(self, params: list[Tensor]) -> set[Tensor]:
        """Steps only ``params`` (shards with their gradients), in the order
        given; returns the parameters skipped: none."""
        index_of = {id(q): i for i, g in enumerate(self.param_groups) for q in g["params"]}
        for p in params:
            if p.grad is None:
                raise ValueError("step_parameters: a parameter without a gradient")
            if id(p) not in index_of:
                raise ValueError("step_parameters: a parameter this optimizer does not hold")
        for p in params:
            self._step_one(self.param_groups[index_of[id(p)]], p)
        return set()

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Every shard that has a gradient, group by group."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._step_one(group, p)
        return loss
