"""The training text: the Python standard library's own source, as bytes.

Every machine that runs Python has it, so the example needs no download and
no tokenizer training: the tokens are the bytes (a vocabulary of 256). The
``*.py`` files under ``sysconfig.get_paths()["stdlib"]`` (installed packages in
``site-packages`` left out) are read in sorted order until ``cap_bytes``;
every tenth file goes to the validation split. The corpus therefore depends on
the Python version only, and :attr:`Corpus.digest` names it exactly.
"""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["Corpus", "load_stdlib", "Batches"]

# Files are joined with a blank line, as they would read one after another.
_SEPARATOR = b"\n\n"


@dataclass(frozen=True)
class Corpus:
    """The two splits as uint8 tensors, and where they came from."""

    train: torch.Tensor
    val: torch.Tensor
    root: Path
    files: int
    digest: str  # sha256 of the files' paths and bytes, in order: the corpus's identity

    def describe(self) -> str:
        mib = 1 << 20
        return (f"{self.files} files of {self.root} ({self.digest[:12]}): "
                f"{self.train.numel() / mib:.1f} MiB train, {self.val.numel() / mib:.1f} MiB val")

    def fine_tune(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The validation split as a fine-tune's text, (train, validation):
        its first three quarters and its last quarter (cut by bytes). A
        model pretrained on :attr:`train` has seen neither."""
        cut = self.val.numel() * 3 // 4
        return self.val[:cut], self.val[cut:]


def load_stdlib(cap_bytes: int = 32 << 20, val_every: int = 10) -> Corpus:
    """The standard library's ``*.py`` files, sorted by path, up to ``cap_bytes``
    in all; file ``i`` (0-based) goes to ``val`` when ``i % val_every ==
    val_every - 1``, to ``train`` otherwise."""
    if cap_bytes < 1:
        raise ValueError(f"cap_bytes: {cap_bytes} is not ≥ 1")
    if val_every < 2:
        raise ValueError(f"val_every: {val_every} is not ≥ 2 (every file would be validation)")
    root = Path(sysconfig.get_paths()["stdlib"])
    paths = sorted(p for p in root.rglob("*.py")
                   if not {"site-packages", "dist-packages"} & set(p.relative_to(root).parts))
    if not paths:
        raise FileNotFoundError(f"no *.py files under {root}, the standard library's directory")
    splits: tuple[list[bytes], list[bytes]] = ([], [])
    digest = hashlib.sha256()
    total = files = 0
    for i, path in enumerate(paths):
        if total >= cap_bytes:
            break
        data = path.read_bytes()[: cap_bytes - total]
        digest.update(str(path.relative_to(root)).encode() + b"\0" + data)
        splits[i % val_every == val_every - 1].append(data)
        total += len(data)
        files += 1
    train, val = (_tensor(_SEPARATOR.join(s)) for s in splits)
    return Corpus(train=train, val=val, root=root, files=files, digest=digest.hexdigest())


def _tensor(data: bytes) -> torch.Tensor:
    """``data`` as a uint8 tensor that owns its memory (frombuffer refuses an empty buffer)."""
    if not data:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


class Batches:
    """Random windows of a split: ``next()`` gives ``(x, y)`` of shape
    ``(batch, context)`` (int64, on ``device``), ``y`` being ``x`` shifted by
    one token. The windows' offsets come from a generator seeded with
    ``seed``, so two samplers with the same seed give the same batches."""

    def __init__(self, data: torch.Tensor, *, batch: int, context: int, seed: int,
                 device: torch.device | str = "cpu") -> None:
        if data.numel() < context + 2:
            raise ValueError(f"data: {data.numel()} tokens is too short for windows of {context} + 1")
        self.data = data
        self.batch = batch
        self.context = context
        self.device = torch.device(device)
        self.generator = torch.Generator().manual_seed(seed)
        # Offsets of every window of context + 1 tokens, as index arithmetic.
        self._span = torch.arange(context + 1)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.randint(0, self.data.numel() - self.context, (self.batch, 1), generator=self.generator)
        window = self.data[starts + self._span].long()
        x, y = window[:, :-1], window[:, 1:]
        if self.device.type == "cuda":
            return x.pin_memory().to(self.device, non_blocking=True), y.pin_memory().to(self.device, non_blocking=True)
        return x.contiguous(), y.contiguous()
