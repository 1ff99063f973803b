"""The streamed chain of :mod:`lightning_naspipe.pipeline.exactness.streamed`, in one process (replica threads linked as
the replicas of a stage, :class:`inprocess_grid.BatonGroup`): bit for bit the whole-message chain's sums, cut into
many pieces whatever the sizes, dtypes and missing gradients."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import pytest
import torch
from torch import Tensor

from inprocess_grid import BatonGroup, _Links
from lightning_naspipe.pipeline.exactness import streamed
from lightning_naspipe.pipeline.exactness.replicas import ordered_sum
from lightning_naspipe.pipeline.exactness.streamed import stream_pieces, streamed_sum

# Sizes that no piece size divides, three dtypes (two interleaved), an empty parameter.
SHAPES: list[tuple[tuple[int, ...], torch.dtype]] = [
    ((37,), torch.float32), ((5, 7), torch.float64), ((0,), torch.float32), ((101,), torch.float32),
    ((13,), torch.float16), ((3, 3, 3), torch.float64), ((1,), torch.float32), ((29,), torch.float32)]


def _addends(replicas: int) -> list[list[list[Tensor]]]:
    """Per replica, per parameter, its addends: replica 0 at most one (its ``.grad``), later ones 0 to 3; parameter
    6 has none anywhere (its gradient is ``None``), parameter 1 none on replica 0 (no prefix), parameter 7 one
    negative zero on the last replica only (copied, not added to a zero)."""
    generator = torch.Generator().manual_seed(replicas)
    addends: list[list[list[Tensor]]] = []
    for r in range(replicas):
        mine = []
        for p, (shape, dtype) in enumerate(SHAPES):
            count = 1 if r == 0 else int(torch.randint(0, 4, (), generator=generator))
            if p == 6 or (p == 1 and r == 0) or p == 7:
                count = 0
            scales = [10.0 ** int(torch.randint(-3, 4, (), generator=generator)) for _ in range(count)]
            mine.append([(torch.randn(shape, generator=generator, dtype=torch.float64) * s).to(dtype) for s in scales])
        addends.append(mine)
    addends[-1][7] = [torch.full(SHAPES[7][0], -0.0)]
    return addends


def _whole_message_chain(addends: Sequence[Sequence[Sequence[Tensor]]]) -> list[Tensor | None]:
    """The unstreamed chain: per parameter, replica 0's prefix, then each later replica's addends, in order."""
    return [ordered_sum([part for mine in addends for part in mine[p]]) for p in range(len(SHAPES))]


def _streamed(addends: Sequence[Sequence[Sequence[Tensor]]]) -> list[list[Tensor | None]]:
    replicas = len(addends)
    templates = [torch.empty(shape, dtype=dtype) for shape, dtype in SHAPES]
    baton = threading.Condition()
    links = _Links(baton)
    results: list[list[Tensor | None]] = [[] for _ in range(replicas)]
    errors: list[BaseException] = []

    def run(r: int) -> None:
        with baton:
            try:
                results[r] = streamed_sum(BatonGroup(links, 0, r, replicas), addends[r], templates)
            except BaseException as error:  # noqa: BLE001 - raised in the test's thread
                errors.append(error)
                baton.notify_all()

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(replicas)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    if errors:
        raise errors[0]
    assert not any(links.queues.values()), "a message was sent that nobody received"
    return results


def _bits(t: Tensor) -> Tensor:
    return t.contiguous().view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


@pytest.mark.parametrize("replicas", [2, 3, 4])
def test_the_streamed_sum_is_the_whole_message_chains_bit_for_bit(replicas: int,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(streamed, "PIECE_BALANCE_BYTES", 1)
    monkeypatch.setattr(streamed, "MIN_PIECE_BYTES", 24)  # pieces of 3 float64 or 6 float32 elements, or so
    templates = [torch.empty(shape, dtype=dtype) for shape, dtype in SHAPES]
    assert len(streamed._cuts(templates, replicas)) > 10  # many pieces, some straddling parameters
    addends = _addends(replicas)
    expected = _whole_message_chain(addends)
    assert expected[6] is None and expected[1] is not None
    for got in _streamed(addends):
        for p, (want, have) in enumerate(zip(expected, got)):
            if want is None:
                assert have is None, p
            else:
                assert have is not None and have.dtype == want.dtype and have.shape == want.shape, p
                assert torch.equal(_bits(have), _bits(want)), p


def test_the_addends_are_sensitive_to_the_order() -> None:
    """So the test above can tell: the sums in the reverse replica order differ."""
    addends = _addends(4)
    forward, backward = _whole_message_chain(addends), _whole_message_chain(addends[::-1])
    assert not all(a is None or b is None or torch.equal(a, b) for a, b in zip(forward, backward))


def test_one_piece_for_small_gradients_more_as_bytes_and_replicas_grow() -> None:
    assert stream_pieces(0, 4) == 0
    assert stream_pieces(streamed.MIN_PIECE_BYTES - 1, 4) == 1
    assert stream_pieces(64 << 20, 2) < stream_pieces(64 << 20, 4) < stream_pieces(64 << 20, 64)
    for nbytes in (1 << 20, 32 << 20, 1 << 30):
        for replicas in (2, 8, 1024):
            assert 1 <= stream_pieces(nbytes, replicas) <= max(1, nbytes // streamed.MIN_PIECE_BYTES)
