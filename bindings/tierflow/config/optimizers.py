"""The ``optimizer`` section: :class:`AdamConfig` and :class:`MuonConfig`,
with DeepSpeed's defaults, and what builds tierflow's optimizers from them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from tierflow.config.schema import _Auto, _refuse_auto, _shown


@dataclass(frozen=True)
class AdamConfig:
    """``optimizer`` with type Adam or AdamW (DeepSpeed accepts any case).

    As in DeepSpeed, ``"Adam"`` with ``adam_w_mode`` true (its default) is
    AdamW, decoupled weight decay; ``"Adam"`` with ``adam_w_mode`` false is
    Adam with L2 decay; ``"AdamW"`` is AdamW whatever ``adam_w_mode`` says.
    ``torch_adam`` picks torch's implementation in DeepSpeed, whose defaults
    differ (torch.optim.AdamW decays by 0.01 by default, DeepSpeed's fused and
    CPU Adam by 0); tierflow takes the defaults it implies and always steps in
    its own kernel, whose results are torch's.
    """

    type: Literal["Adam", "AdamW"] = "AdamW"
    lr: float | _Auto = 1e-3
    betas: tuple[float, float] | _Auto = (0.9, 0.999)
    eps: float | _Auto = 1e-8
    weight_decay: float | _Auto = 0.0
    amsgrad: bool = False
    adam_w_mode: bool = True
    torch_adam: bool = False

    @property
    def decoupled_weight_decay(self) -> bool:
        """True when the step is AdamW's (DeepSpeed's rule: type AdamW, or adam_w_mode)."""
        return self.type == "AdamW" or self.adam_w_mode

    def heading(self) -> str:
        """What the optimizer section means, for the printout."""
        if self.type == "AdamW":
            return ": AdamW, decoupled weight decay"
        return ": Adam with adam_w_mode, so AdamW (decoupled weight decay)" if self.adam_w_mode else (
            ": Adam with L2 weight decay (adam_w_mode false)")

    def build(self, params: Any, *, threads: int | None = None) -> Any:
        """tierflow's :class:`~tierflow.torch.optim.AdamW` (or
        :class:`~tierflow.torch.optim.Adam` with L2 decay) over ``params`` with
        these values. An unresolved ``"auto"`` raises ValueError naming it."""
        from tierflow.torch.optim import Adam, AdamW

        for name in ("lr", "betas", "eps", "weight_decay"):
            _refuse_auto(f"optimizer.params.{name}", getattr(self, name))
        cls = AdamW if self.decoupled_weight_decay else Adam
        return cls(params, lr=self.lr, betas=self.betas, eps=self.eps, weight_decay=self.weight_decay,
                   amsgrad=self.amsgrad, threads=threads)


@dataclass(frozen=True)
class MuonConfig:
    """``optimizer`` with type Muon: DeepSpeed's MuonWithAuxAdam, Muon for the
    hidden matrices and AdamW for the rest. ``lr`` sets both groups' rate
    unless ``muon_lr`` / ``adam_lr`` override it; with none, DeepSpeed's
    defaults: 0.02 for Muon, 3e-4 for AdamW (:attr:`muon_group_lr`,
    :attr:`adam_group_lr` are the rates in effect). Both groups decay by
    ``weight_decay`` (default 0); the AdamW group has DeepSpeed's betas
    (0.9, 0.95) and eps 1e-10. The update is torch's Muon with Nesterov
    momentum, 5 Newton–Schulz steps and the lr scaled by
    sqrt(max(1, rows/cols)), as DeepSpeed's."""

    type: Literal["Muon"] = "Muon"
    lr: float | _Auto | None = None
    muon_lr: float | None = None
    adam_lr: float | None = None
    momentum: float = 0.95
    weight_decay: float | _Auto = 0.0
    betas: tuple[float, float] | _Auto = (0.9, 0.95)
    eps: float | _Auto = 1e-10

    @property
    def muon_group_lr(self) -> float | _Auto:
        return self.muon_lr if self.muon_lr is not None else (0.02 if self.lr is None else self.lr)

    @property
    def adam_group_lr(self) -> float | _Auto:
        return self.adam_lr if self.adam_lr is not None else (3e-4 if self.lr is None else self.lr)

    def heading(self) -> str:
        """What the optimizer section means, for the printout."""
        return (f": Muon for the hidden matrices at lr {_shown(self.muon_group_lr)}, AdamW for the rest at lr "
                f"{_shown(self.adam_group_lr)}")

    def muon_options(self) -> dict[str, Any]:
        """:class:`~tierflow.torch.optim.Muon`'s keywords for the hidden
        matrices (DeepSpeed's rule: Nesterov, 5 Newton–Schulz steps, torch's
        lr scaling). An unresolved ``"auto"`` raises ValueError naming it."""
        self._refuse_auto()
        return dict(lr=self.muon_group_lr, momentum=self.momentum, weight_decay=self.weight_decay,
                    nesterov=True, ns_steps=5)

    def adamw_options(self) -> dict[str, Any]:
        """:class:`~tierflow.torch.optim.AdamW`'s keywords for the rest."""
        self._refuse_auto()
        return dict(lr=self.adam_group_lr, betas=self.betas, eps=self.eps, weight_decay=self.weight_decay)

    def _refuse_auto(self) -> None:
        _refuse_auto("optimizer.params.lr", self.muon_group_lr)
        _refuse_auto("optimizer.params.lr", self.adam_group_lr)
        for name in ("weight_decay", "betas", "eps"):
            _refuse_auto(f"optimizer.params.{name}", getattr(self, name))

    def build(self, model: Any, *, threads: int | None = None) -> tuple[Any, Any]:
        """``(Muon, AdamW)``: tierflow's optimizers over ``model``'s parameters
        split by :func:`~tierflow.torch.optim.muon_param_groups` (either is
        None when its share is empty), with :meth:`muon_options` and
        :meth:`adamw_options`. An unresolved ``"auto"`` raises ValueError
        naming it."""
        from tierflow.torch.optim import AdamW, Muon, muon_param_groups

        muon_options, adamw_options = self.muon_options(), self.adamw_options()
        hidden, rest = muon_param_groups(model)
        muon = Muon(hidden, threads=threads, **muon_options) if hidden else None
        adamw = AdamW(rest, threads=threads, **adamw_options) if rest else None
        return muon, adamw
