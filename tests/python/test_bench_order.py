"""The order bench/python/zero_gather.py runs its stages in: every kept run
follows each other stage equally often, and each stage runs as often as
asked (cases whose answer is known)."""

import collections
import importlib.util
import os

import pytest

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "python", "zero_gather.py")


def bench():
    spec = importlib.util.spec_from_file_location("zero_gather", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("count", [2, 3, 4, 5, 6])
@pytest.mark.parametrize("circuits", [1, 2, 3])
def test_each_kept_run_follows_each_other_stage_equally_often(count, circuits):
    order = bench().balanced_order(count, circuits)
    first, kept = order[:count], order[count:]
    assert sorted(first) == list(range(count))  # each once, not kept
    assert collections.Counter(kept) == {stage: circuits * (count - 1) for stage in range(count)}
    after = collections.Counter(zip(order[count - 1:], kept))  # (the run before, the kept run)
    assert after == {(a, b): circuits for a in range(count) for b in range(count) if a != b}


def test_the_rounds_asked_for_are_whole_circuits():
    module = bench()

    class Args:
        iterations = 10

    # 5 stages: a circuit gives each 4 runs, so 10 runs take 3 circuits (12 each)
    assert module.circuits(Args, 5) == 3
    assert module.circuits(Args, 4) == 4  # 3 runs a circuit: 12 each
    Args.iterations = 12
    assert module.circuits(Args, 5) == 3 and module.circuits(Args, 4) == 4


def test_one_stage_has_no_order():
    with pytest.raises(ValueError, match="not 1"):
        bench().balanced_order(1, 1)
