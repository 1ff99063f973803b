"""The replicas' reduction in one process: replica threads, each with its own copy of a module, give the
one-device gradients and BatchNorm statistics bit for bit (the multi-process runs: test_replicas_stages.py)."""

from __future__ import annotations

import copy
import io
import queue
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import lightning_naspipe as lnp
from lightning_naspipe.errors import NASPipeConfigError
from lightning_naspipe.pipeline.exactness import streamed
from lightning_naspipe.pipeline.exactness.replicas import ReplicaUpdates, ordered_sum

CHUNKS = 4


class _Group:
    """A ReplicaGroup of threads: a queue per directed pair, a barrier for gather."""

    def __init__(self, replica: int, world: _World) -> None:
        self._replica, self.world = replica, world

    @property
    def replica(self) -> int:
        return self._replica

    @property
    def replicas(self) -> int:
        return self.world.size

    wait_s = 0.0
    failures = None

    def send_next(self, value: Any) -> None:
        self.world.queues[(self._replica, self._replica + 1)].put(value)

    def recv_previous(self) -> Any:
        return self.world.queues[(self._replica - 1, self._replica)].get(timeout=30)

    def send_previous(self, value: Any) -> None:
        self.world.queues[(self._replica, self._replica - 1)].put(value)

    def recv_next(self) -> Any:
        return self.world.queues[(self._replica + 1, self._replica)].get(timeout=30)

    def from_last(self, value: Any) -> Any:
        last = self.world.size - 1
        if self._replica == last:
            for replica in range(last):
                self.world.queues[(last, replica)].put(value)
            return value
        return self.world.queues[(last, self._replica)].get(timeout=30)

    def gather(self, value: Any) -> list[Any]:
        self.world.parts[self._replica] = value
        self.world.barrier.wait(timeout=30)
        return list(self.world.parts)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


class _World:
    def __init__(self, size: int) -> None:
        self.size = size
        self.queues: dict[tuple[int, int], queue.Queue[Any]] = {
            (a, b): queue.Queue() for a in range(size) for b in range(size) if a != b}
        self.parts: list[Any] = [None] * size
        self.barrier = threading.Barrier(size)

    def run(self, replica_body: Callable[[int], None]) -> None:
        """``replica_body(replica)`` in one thread per replica; the first error any raised, raised here."""
        errors: list[BaseException] = []

        def run(replica: int) -> None:
            try:
                replica_body(replica)
            except BaseException as error:  # noqa: BLE001 - re-raised in the test's thread
                errors.append(error)

        threads = [threading.Thread(target=run, args=(r,)) for r in range(self.size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        if errors:
            raise errors[0]


class _Elastic(nn.Module):
    """An elastic width with BatchNorm over its channels; micro-batch ``c`` runs width ``WIDTHS[c % 3]``, so the
    running statistics of the leading channels get different numbers of updates."""

    WIDTHS = [3, 5, 8]

    def __init__(self, momentum: float | None) -> None:
        super().__init__()
        self.supernet = lnp.Supernet(lnp.ElasticLinear(6, self.WIDTHS, label="w"),
                                     lnp.ElasticBatchNorm1d(self.WIDTHS, label="w", momentum=momentum),
                                     nn.Tanh(), lnp.ElasticLinear(self.WIDTHS, 3, in_label="w"),
                                     nn.BatchNorm1d(3, momentum=momentum))
        self.chunk = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.supernet(x, {"w": self.chunk % len(self.WIDTHS)})


class _Choice(nn.Module):
    """Micro-batches 0-1 and 2-3 run different BatchNorm layers (as the subnets of one training step may), so a
    later replica updates a layer that the replicas before it did not."""

    def __init__(self, momentum: float | None) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 3)
        self.norms = nn.ModuleList([nn.BatchNorm1d(3, momentum=momentum) for _ in range(2)])
        self.chunk = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norms[self.chunk // 2](self.linear(x))


def _model(momentum: float | None, kind: str = "batch_norm") -> nn.Module:
    torch.manual_seed(0)
    if kind != "batch_norm":
        return {"elastic_batch_norm": _Elastic, "per_subnet_batch_norm": _Choice}[kind](momentum)
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8, momentum=momentum), nn.Tanh(), nn.Linear(8, 3),
                         nn.BatchNorm1d(3, momentum=momentum))


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(16, 6, generator=generator) * 3 + 1, torch.randint(0, 3, (16,), generator=generator)


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, c: int) -> torch.Tensor:
    model.chunk = c
    return nn.functional.cross_entropy(model(x.tensor_split(CHUNKS)[c]), y.tensor_split(CHUNKS)[c]) * 0.25


def _one_device(momentum: float | None, kind: str) -> nn.Module:
    model = _model(momentum, kind)
    x, y = _batch()
    for c in range(CHUNKS):  # as the sequential engine: forward and backward micro-batch by micro-batch
        _loss(model, x, y, c).backward()
    return model


def _replicated(replicas: int, momentum: float | None, kind: str) -> list[nn.Module]:
    world, models = _World(replicas), [_model(momentum, kind) for _ in range(replicas)]
    x, y = _batch()

    def run(replica: int) -> None:
        model = models[replica]
        updates = ReplicaUpdates(_Group(replica, world), model)
        params = list(model.parameters())
        updates.params[7] = params
        share = range(replica * CHUNKS // replicas, (replica + 1) * CHUNKS // replicas)
        for c in share:
            with updates.forward(7, c):
                loss = _loss(model, x, y, c)
            with updates.backward(7, c):
                loss.backward()
        updates.reduce(7, share, params)
        updates.close()

    world.run(run)
    return models


@pytest.mark.parametrize("replicas", [2, 4])
@pytest.mark.parametrize("momentum", [0.1, None])
@pytest.mark.parametrize("kind", ["batch_norm", "elastic_batch_norm", "per_subnet_batch_norm"])
def test_replicas_give_every_replica_the_one_device_gradients_and_statistics(replicas: int, momentum: float | None,
                                                                             kind: str) -> None:
    reference = _one_device(momentum, kind)
    for model in _replicated(replicas, momentum, kind):
        for (name, p), q in zip(reference.named_parameters(), model.parameters()):
            assert q.grad is not None and torch.equal(p.grad, q.grad), name  # type: ignore[arg-type]
        for (name, b), c in zip(reference.named_buffers(), model.buffers()):
            assert torch.equal(b, c), name


@pytest.mark.parametrize("replicas", [3, 4])
def test_gradients_streamed_in_many_pieces_are_the_one_device_ones(replicas: int,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(streamed, "PIECE_BALANCE_BYTES", 1)
    monkeypatch.setattr(streamed, "MIN_PIECE_BYTES", 20)  # 5 float32 elements: no parameter fits one piece
    assert len(streamed._cuts(list(_model(0.1).parameters()), replicas)) > 10
    reference = _one_device(0.1, "batch_norm")
    for model in _replicated(replicas, 0.1, "batch_norm"):
        for (name, p), q in zip(reference.named_parameters(), model.parameters()):
            assert q.grad is not None and torch.equal(p.grad, q.grad), name  # type: ignore[arg-type]
        for (name, b), c in zip(reference.named_buffers(), model.buffers()):
            assert torch.equal(b, c), name


def test_summing_each_replicas_share_first_would_differ() -> None:
    """The reference is sensitive to the order: (g0 + g1) + (g2 + g3) differs from the one-device sum."""
    grads = []
    model = _model(0.1)
    x, y = _batch()
    for c in range(CHUNKS):
        model.zero_grad(set_to_none=True)
        _loss(model, x, y, c).backward()
        grads.append([p.grad for p in model.parameters()])
    one_device = [ordered_sum(parts) for parts in zip(*grads)]
    pairwise = [ordered_sum((ordered_sum(g[:2]), ordered_sum(g[2:]))) for g in zip(*grads)]
    assert not all(torch.equal(a, b) for a, b in zip(one_device, pairwise))  # type: ignore[arg-type]


def test_ordered_sum_skips_missing_parts_as_autograd_does() -> None:
    a, b = torch.tensor([1.0]), torch.tensor([2.0])
    assert ordered_sum([None, None]) is None
    assert ordered_sum([None, a]) is a
    assert torch.equal(ordered_sum([a, None, b]), torch.tensor([3.0]))  # type: ignore[arg-type]


class _Counter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen += 1  # a buffer whose order across replicas is not reproduced
        return x


def test_another_buffer_changed_in_a_training_forward_is_refused_naming_it() -> None:
    model = nn.Sequential(nn.Linear(2, 2), _Counter())
    updates = ReplicaUpdates(_Group(1, _World(2)), model)
    with pytest.raises(NASPipeConfigError, match=r"buffer '1\.seen' changed in a training forward"):
        with updates.forward(0, 2):
            model(torch.ones(1, 2))
    updates.close()
    model(torch.ones(1, 2))  # outside a training forward nothing is checked


def test_a_copy_or_pickle_of_the_module_is_not_watched() -> None:
    model = _model(0.1)
    updates = ReplicaUpdates(_Group(1, _World(2)), model)
    other = copy.deepcopy(model)
    buffer = io.BytesIO()
    torch.save(model, buffer)  # a module holding the hooks pickles (e.g. a callback saving it whole)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    with updates.forward(3, 2):
        loaded(torch.ones(4, 6))
    with updates.forward(3, 2):
        other(torch.ones(4, 6))
    assert not updates._touched  # hooks belong to the watched module only
    with updates.forward(3, 2):
        model(torch.ones(4, 6))
    assert len(updates._touched[3]) == 2 and len(updates._inputs[(3, 2)]) == 2
    updates.drop_from(3)
    assert not updates._touched and not updates._inputs
    updates.close()


@pytest.mark.parametrize("momentum", [0.1, None])
@pytest.mark.parametrize("make", [lambda: nn.BatchNorm1d(6), lambda: nn.BatchNorm2d(6),
                                  lambda: lnp.ElasticBatchNorm2d([3, 6], label="w")],
                         ids=["bn1d", "bn2d", "elastic"])
def test_the_replay_updates_running_statistics_as_the_training_forward_does(make: Callable[[], nn.Module],
                                                                            momentum: float | None) -> None:
    """``replay_statistics`` is the forward's own ``F.batch_norm`` call: the same statistics and count, bit for bit
    (an elastic layer's on the leading channels its input has, the others left alone)."""
    from lightning_naspipe.pipeline.exactness.replicas import replay_statistics
    from lightning_naspipe.space.choice import active_architecture

    torch.manual_seed(0)
    layer = make()
    layer.momentum = momentum
    elastic = isinstance(layer, lnp.ElasticBatchNorm2d)
    batches = [torch.randn(5, 3 if elastic else 6, *(() if isinstance(layer, nn.BatchNorm1d) else (4, 4)))
               for _ in range(3)]
    replayed = copy.deepcopy(layer)
    for batch in batches:
        if elastic:
            with active_architecture({"w": 0}):
                layer(batch)
        else:
            layer(batch)
        replay_statistics(replayed, batch)
    for name, buffer in layer.named_buffers():
        assert torch.equal(buffer, dict(replayed.named_buffers())[name]), name
    assert int(layer.num_batches_tracked) == 3
    if elastic:
        assert torch.equal(layer.running_mean[3:], torch.zeros(3))  # the channels no batch had


def test_a_buffer_outside_the_supernet_changed_in_a_training_forward_is_refused_naming_it() -> None:
    """A BatchNorm in the loss's code (outside the supernet) would count only each replica's share."""

    class Owner(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.supernet = nn.Sequential(nn.Linear(2, 2))
            self.head_norm = nn.BatchNorm1d(2)

    owner = Owner()
    updates = ReplicaUpdates(_Group(0, _World(2)), owner.supernet, owner)
    with updates.forward(0, 0):
        owner.supernet(torch.ones(3, 2))  # the supernet's own forward changes nothing outside it
    with pytest.raises(NASPipeConfigError, match=r"buffer 'head_norm\.\w+' of Owner, outside the supernet"):
        with updates.forward(0, 1):
            owner.head_norm(owner.supernet(torch.randn(3, 2)))
    updates.close()


def test_sparse_gradients_are_refused_on_every_replica() -> None:
    world = _World(2)
    messages: list[str] = []

    def run(replica: int) -> None:
        torch.manual_seed(0)
        embedding = nn.Embedding(5, 3, sparse=True)
        updates = ReplicaUpdates(_Group(replica, world), embedding)
        params = list(embedding.parameters())
        updates.params[0] = params
        with updates.backward(0, replica):
            embedding(torch.tensor([replica, 2])).sum().backward()
        with pytest.raises(NASPipeConfigError, match="sparse gradient") as refused:
            updates.reduce(0, range(replica, replica + 1), params)
        messages.append(str(refused.value))
        updates.close()

    world.run(run)
    assert len(messages) == 2 and "sparse=False" in messages[0]
