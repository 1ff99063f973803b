"""Impossible asks refused up front: a parameter or FLOP range outside the space's bounds (counted from the space,
exact for independent labels, sound for shared ones) is refused before anything is drawn or evaluated, naming the
bound; a latency table's predictions refuse architectures and supernets of another space clearly."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
from torch import nn

import lightning_naspipe as lnp
from lightning_naspipe.searching.bounds import refuse_impossible, space_bounds
from test_latency import _Net, _supernet

#: The toy space's architectures and parameter counts: a0b0 67, a0b1 139, a1b0 139, a1b1 211, a2b0 4427, a2b1 4499.
EVERY = [{"a": a, "b": b} for a, b in itertools.product(range(3), range(2))]


def _data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(3)
    return [(torch.randn(8, 4, generator=generator), torch.randint(0, 3, (8,), generator=generator))]


class _Counting(lnp.GridSearch):
    """A grid search that counts its proposals (draws)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def propose(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return super().propose(*args, **kwargs)


def _sizes(supernet: lnp.Supernet, architecture: dict[str, int]) -> tuple[int, int]:
    return lnp.searching.constraints.sizes_of(supernet.freeze(architecture).eval(), _data()[0][0])


def test_independent_labels_give_the_exact_extremes_of_parameters_and_flops() -> None:
    supernet = _supernet()
    bounds = space_bounds(supernet, _data()[0][0])
    sizes = [_sizes(supernet, a) for a in EVERY]
    assert bounds.exact and (bounds.min_params, bounds.max_params) == (67, 4499)
    assert (bounds.min_flops, bounds.max_flops) == (min(f for _, f in sizes), max(f for _, f in sizes))
    assert bounds.smallest == {"a": 0, "b": 0} and bounds.largest == {"a": 2, "b": 1}


@pytest.mark.parametrize("ask, refused", [(dict(max_params=66), r"max_params=66\): no architecture of this space has "
                                                                r"at most 66 parameters: the smallest has 67 \(\{'a': "
                                                                r"0, 'b': 0\}\)"),
                                          (dict(max_params=67), None),
                                          (dict(min_params=4500), r"min_params=4,500\).*the largest has 4,499"),
                                          (dict(min_params=4499), None)])
def test_a_range_past_the_bound_is_refused_before_any_draw_and_one_at_the_bound_is_searched(
        ask: dict[str, int], refused: str | None) -> None:
    model, searcher = _Net(), _Counting()
    evaluated: list[int] = []
    loss = model.compute_loss
    model.compute_loss = lambda output, batch: evaluated.append(1) or loss(output, batch)  # type: ignore
    if refused is None:
        result = lnp.search(None, model, searcher, _data(), constraints=lnp.Constraints(**ask))  # type: ignore
        assert len(result.history) == 1 and evaluated
    else:
        with pytest.raises(lnp.NASPipeConfigError, match=refused):
            lnp.search(None, model, searcher, _data(), constraints=lnp.Constraints(**ask))  # type: ignore
        assert searcher.calls == 0 and evaluated == []


def test_an_impossible_flop_range_is_refused_naming_the_fewest_flops() -> None:
    fewest = min(_sizes(_supernet(), a)[1] for a in EVERY)
    with pytest.raises(lnp.NASPipeConfigError, match=f"max_flops={fewest - 1:,}\\).*the smallest has {fewest:,}"):
        lnp.search(None, _Net(), lnp.GridSearch(), _data(), max_flops=fewest - 1)
    assert len(lnp.search(None, _Net(), lnp.GridSearch(), _data(), max_flops=fewest).history) >= 1


def test_shared_labels_give_sound_bounds_that_never_refuse_a_feasible_ask() -> None:
    # Label "s" is read by two blocks in opposite ways: either way they hold one Linear(4, 4) (20 parameters), but per
    # block the fewest is 0 and the most 20: the bounds [15, 75] hold every architecture (35 or 55).
    class Shared(_Net):
        def __init__(self) -> None:
            super().__init__()
            self.supernet = lnp.Supernet(
                lnp.ChoiceBlock([nn.Identity(), nn.Linear(4, 4)], label="s"),
                lnp.ChoiceBlock([nn.Linear(4, 4), nn.Identity()], label="s"),
                lnp.ChoiceBlock([nn.Linear(4, 4), nn.Tanh()], label="t"), nn.Linear(4, 3))

    bounds = space_bounds(Shared().supernet)
    assert not bounds.exact and bounds.smallest is None and (bounds.min_params, bounds.max_params) == (15, 75)
    true = {sum(p.numel() for p in Shared().supernet.freeze({"s": s, "t": t}).parameters())
            for s in range(2) for t in range(2)}
    assert true == {35, 55}  # the feasible ask max_params=40 is not refused up front
    assert {r.params for r in lnp.search(None, Shared(), lnp.GridSearch(), _data(), max_params=40).history} == {35}
    with pytest.raises(lnp.NASPipeConfigError, match="the smallest has at least 15"):
        lnp.search(None, Shared(), lnp.GridSearch(), _data(), max_params=14)


def test_tied_weights_are_counted_once_in_the_lower_bound() -> None:
    # The first block's Linear(4, 4) is tied into the last block's candidate 0: a subnet holds it once.
    class Tied(_Net):
        def __init__(self) -> None:
            super().__init__()
            tied = nn.Linear(4, 4)
            self.supernet = lnp.Supernet(tied, lnp.ChoiceBlock([nn.Identity(), nn.Linear(4, 4)], label="a"),
                                         lnp.ChoiceBlock([tied, nn.Linear(4, 4)], label="h"), nn.Linear(4, 3))

    supernet = Tied().supernet
    bounds = space_bounds(supernet)
    true = [sum(p.numel() for p in supernet.freeze({"a": a, "h": h}).parameters()) for a in range(2) for h in range(2)]
    assert not bounds.exact and (bounds.min_params, bounds.max_params) == (35, 75)
    assert min(true) == 35 and max(true) <= 75  # the lower bound is met; per block, the upper one is not tight
    assert refuse_impossible(lnp.Constraints(max_params=35), supernet) == bounds
    with pytest.raises(lnp.NASPipeConfigError, match="the smallest has at least 35"):
        refuse_impossible(lnp.Constraints(max_params=34), supernet)


def test_predict_refuses_an_architecture_or_a_supernet_of_another_space_naming_the_fix() -> None:
    table = lnp.LatencyTable(((1.0,), (0.5, 2.0, 9.0), (0.25, 1.0), (1.0,)), (None, "a", "b", None), "cpu", 8)
    with pytest.raises(lnp.NASPipeConfigError, match=r"label 'a' is 5, but this table has 3 candidates there.*"
                                                     r"table.predict\(architecture, model.supernet\)"):
        table.predict({"a": 5, "b": 0})
    with pytest.raises(lnp.NASPipeConfigError, match="label 'b' is missing"):
        table.predict({"a": 1})
    other = lnp.Supernet(nn.Linear(4, 8), lnp.ChoiceBlock([nn.Identity(), nn.Tanh()], label="a"), nn.Linear(8, 3))
    with pytest.raises(lnp.NASPipeConfigError, match="measured on another supernet.*LatencyTable.measure"):
        table.predict({"a": 1}, other)
    assert table.predict({"a": 1, "b": 1}, _supernet()) == table.predict({"a": 1, "b": 1}) == 5.0
