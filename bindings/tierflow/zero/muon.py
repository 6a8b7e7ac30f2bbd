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

from tierflow.torch.optim import MASTER_KEY, Adam, Muon
from tierflow.torch.optim.adam import _LOW_PRECISION, _save_file

__all__ = ["MuonWithAuxAdam", "PART_NAMES"]

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
