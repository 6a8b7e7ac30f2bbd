"""tierflow.torch._homed.HomedTensor, the stand-in tierflow.torch.fsdp.offload
leaves for an NVMe-homed shard's parameter and gradient: every op reads its
home, in-place ops (through views, through _foreach_ ops) write it, and no
tensor over the home's bytes outlives the op."""

import contextlib

import pytest
import torch

from tierflow.torch._homed import Home, HomedTensor, Layout


class Backing:
    """A home in ordinary memory that counts its opens and hands out a copy,
    as the store's lease is: what an op keeps of it past the op is not the home."""

    def __init__(self, values: torch.Tensor) -> None:
        self.values = values.clone()
        self.reads = self.writes = 0
        self.open_now = 0

    @contextlib.contextmanager
    def open(self, write: bool):
        self.open_now += 1
        assert self.open_now == 1, "one home's bytes in at a time"
        copy = self.values.clone()
        try:
            yield copy
            if write:
                self.values.copy_(copy)
        finally:
            self.open_now -= 1
            if write:
                self.writes += 1
            else:
                self.reads += 1


def homed(values: torch.Tensor) -> tuple[HomedTensor, Backing]:
    backing = Backing(values)
    return HomedTensor(Home("w", Layout.of(values), backing.open)), backing


def test_reads_see_the_home_and_write_nothing():
    values = torch.arange(12.0).reshape(3, 4)
    t, b = homed(values)
    assert t.shape == (3, 4) and t.dtype == torch.float32
    assert float(t.sum()) == 66.0
    assert torch.equal(t + 1, values + 1) and type(t + 1) is torch.Tensor
    assert torch.equal(t.clone(), values) and type(t.clone()) is torch.Tensor
    assert float(torch.linalg.vector_norm(t)) == pytest.approx(float(torch.linalg.vector_norm(values)))
    assert (b.reads, b.writes) == (6, 0)  # one read an op
    assert "HomedTensor(w" in repr(t)


def test_in_place_ops_and_views_write_the_home():
    values = torch.arange(12.0).reshape(3, 4)
    t, b = homed(values)
    assert t.mul_(2) is t
    assert torch.equal(b.values, values * 2)
    v = t.view(-1)
    assert isinstance(v, HomedTensor)
    v[1:3].zero_()  # a view of a view
    assert b.values.view(-1)[1:3].tolist() == [0.0, 0.0]
    top, bottom = t.split(2)
    bottom.fill_(7)
    assert b.values[2].tolist() == [7.0] * 4 and b.values[0, 0] == 0
    t += torch.ones(3, 4)  # FSDP2's accumulation, as `grad._local_tensor += new`
    assert isinstance(t, HomedTensor) and b.values[2].tolist() == [8.0] * 4
    d = t.detach()
    d.zero_()
    assert float(b.values.abs().sum()) == 0


def test_foreach_ops_run_one_home_at_a_time():
    a, ba = homed(torch.ones(4))
    c, bc = homed(torch.full((2,), 3.0))
    plain = torch.ones(3)
    torch._foreach_mul_([a, plain, c], 2.0)  # Backing asserts one home open at a time
    assert ba.values.tolist() == [2.0] * 4 and bc.values.tolist() == [6.0] * 2 and plain.tolist() == [2.0] * 3
    norms = torch._foreach_norm([a, c])
    assert [float(n) for n in norms] == pytest.approx([4.0, 6.0 * 2 ** 0.5])
    torch._foreach_zero_([a, c])
    assert float(ba.values.sum()) == 0 and float(bc.values.sum()) == 0


def test_a_failed_in_place_op_leaves_the_home_as_it_was():
    values = torch.arange(4.0)
    t, b = homed(values)
    with pytest.raises(RuntimeError):
        t.add_(torch.ones(5))  # shapes do not broadcast
    assert torch.equal(b.values, values)

