"""The global gradient norm across stages (lightning_naspipe.pipeline.exactness.grad_norm) is torch's one-device norm,
bit for
bit."""

from __future__ import annotations

import math
import queue
import threading
from typing import Any

import pytest
import torch

from lightning_naspipe.errors import NASPipeConfigError
from lightning_naspipe.pipeline.exactness.grad_norm import NormExchange, StageNorms, combine, local_norms, total_norm

DTYPES = {"float32": [torch.float32], "mixed": [torch.float32, torch.float64, torch.bfloat16, torch.float16]}


def _parameters(seed: int, dtypes: list[torch.dtype], count: int = 12) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    found = []
    for n in range(count):
        shape = [int(d) for d in torch.randint(1, 40, (int(torch.randint(1, 3, (1,), generator=g)),), generator=g)]
        p = torch.nn.Parameter(torch.zeros(shape, dtype=dtypes[n % len(dtypes)]))
        p.grad = (torch.randn(shape, generator=g) * 10 ** float(torch.randn((), generator=g))).to(p.dtype)
        found.append(p)
    return found


def _split(params: list[torch.nn.Parameter], stages: int, seed: int) -> list[list[int]]:
    """Positions of each stage's parameters: contiguous blocks, as a pipeline holds them."""
    g = torch.Generator().manual_seed(seed)
    cuts = sorted(torch.randperm(len(params) - 1, generator=g)[:stages - 1].add(1).tolist())
    edges = [0, *cuts, len(params)]
    return [list(range(a, b)) for a, b in zip(edges, edges[1:])]


@pytest.mark.parametrize("dtypes", DTYPES)
@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf, 3.0])
@pytest.mark.parametrize("foreach", [None, False, True])
def test_per_stage_norms_give_torchs_one_device_total_and_clipped_gradients(
        dtypes: str, norm_type: float, foreach: bool | None) -> None:
    for seed in range(4):
        one_device, staged = _parameters(seed, DTYPES[dtypes]), _parameters(seed, DTYPES[dtypes])
        staged[seed % len(staged)].grad = None  # a parameter the subnet did not reach
        one_device[seed % len(staged)].grad = None
        # Odd seeds: the optimizer holds the parameters in reverse order, so the stages' norms are reordered.
        reverse = seed % 2 == 1
        expected = torch.nn.utils.clip_grad_norm_(one_device[::-1] if reverse else one_device, 0.5, norm_type,
                                                  foreach=foreach)
        records = []
        for stage, positions in enumerate(_split(staged, 3, seed)):
            mine = [i for i in positions if staged[i].grad is not None]
            norms = local_norms([staged[i].grad for i in mine], norm_type, foreach)  # type: ignore[misc]
            keys = [(len(staged) - 1 - i if reverse else i, -1) for i in mine]
            record = StageNorms.local(stage, keys, norms, by_optimizer=True, length=len(positions), max_norm=0.5,
                                      norm_type=norm_type, foreach=foreach)
            records.append(StageNorms.unpack(*record.pack(), torch.device("cpu")))  # as the wire carries it
        total = combine(records, 0)
        assert total is not None and total.dtype == expected.dtype and torch.equal(total, expected)
        torch.nn.utils.clip_grads_with_norm_(staged, 0.5, total, foreach)
        for a, b in zip(one_device, staged):
            assert (a.grad is None and b.grad is None) or torch.equal(a.grad, b.grad)  # type: ignore[arg-type]


def test_a_tensors_norm_does_not_depend_on_the_other_tensors_of_the_call() -> None:
    """What makes per-stage norms exact: torch._foreach_norm's result for one tensor is that tensor's alone."""
    grads = [p.grad for p in _parameters(5, [torch.float32], 20)]
    together = local_norms(grads, 2.0, None)  # type: ignore[arg-type]
    for g, norm in zip(grads, together):
        assert torch.equal(local_norms([g], 2.0, None)[0], norm)  # type: ignore[list-item]


def test_no_gradients_give_torchs_zero_total() -> None:
    assert torch.equal(total_norm(torch.zeros(0, dtype=torch.float64), [], 2.0), torch.nn.utils.get_total_norm([], 2.0))


def _record(stage: int, keys: list[tuple[int, int]] | None = None, **fields: Any) -> StageNorms:
    call: dict[str, Any] = {"length": 3, "max_norm": 1.0, **fields}
    return StageNorms.local(stage, keys or [(stage, stage)], [torch.tensor(float(stage + 1))], **call)


def test_stages_that_clip_differently_are_named() -> None:
    assert combine([StageNorms(0), StageNorms(1)], 4) is None
    with pytest.raises(NASPipeConfigError, match=r"ran on stage\(s\) \[1\] but not on \[0\] in subnet 4"):
        combine([StageNorms(0), _record(1)], 4)
    with pytest.raises(NASPipeConfigError, match="other arguments"):
        combine([_record(0), _record(1, max_norm=2.0)], 4)
    with pytest.raises(NASPipeConfigError, match="different lengths"):
        combine([_record(0), _record(1, length=4)], 4)
    with pytest.raises(NASPipeConfigError, match="two stages"):
        combine([_record(0), _record(1, keys=[(0, 0)])], 4)
    by_optimizer = combine([_record(0, by_optimizer=True, length=1), _record(1, by_optimizer=True, length=9)], 4)
    assert by_optimizer is not None and torch.equal(by_optimizer, torch.linalg.vector_norm(torch.tensor([1.0, 2.0])))
    by_list = combine([_record(0, keys=[(5, 0)]), _record(1, keys=[(2, 1)], by_optimizer=True)], 4)
    assert by_list is not None and torch.equal(by_list, torch.linalg.vector_norm(torch.tensor([1.0, 2.0])))


class _Links:
    """Neighbour links between stage threads: one FIFO per directed pair."""

    def __init__(self, stages: int) -> None:
        self.queues = {(a, b): queue.Queue[Any]() for a in range(stages) for b in range(stages) if abs(a - b) == 1}

    def at(self, stage: int) -> Any:
        links = self

        class Stage:
            def send_norms(self, subnet: int, to: int, value: Any) -> None:
                links.queues[(stage, to)].put((subnet, value))

            def recv_norms(self, subnet: int, frm: int) -> Any:
                got, value = links.queues[(frm, stage)].get(timeout=30)
                assert got == subnet
                return value
        return Stage()


def _exchange(records: list[StageNorms]) -> list[Any]:
    links, results = _Links(len(records)), [None] * len(records)

    def run(stage: int) -> None:
        try:
            results[stage] = NormExchange(links.at(stage), stage, len(records), 9, torch.device("cpu")).agree(
                records[stage])
        except Exception as error:
            results[stage] = error

    threads = [threading.Thread(target=run, args=(s,)) for s in range(len(records))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results


def test_exchange_gives_every_stage_the_total_or_the_same_error() -> None:
    results = _exchange([_record(s) for s in range(3)])
    expected = torch.linalg.vector_norm(torch.tensor([1.0, 2.0, 3.0]))
    assert all(torch.equal(r, expected) for r in results)
    assert _exchange([StageNorms(s) for s in range(4)]) == [None] * 4
    errors = _exchange([_record(0), StageNorms(1), _record(2)])
    assert all(isinstance(e, NASPipeConfigError) and "but not on [1] in subnet 9" in str(e) for e in errors)
