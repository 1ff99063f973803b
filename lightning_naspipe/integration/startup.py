"""What a run measures at its start, paid once: the profile of one micro-batch that ``num_stages="auto"`` plans
from, and the block weights of the timed stage split.

Rank 0 looks each up in the disk cache (:mod:`.profile_cache`) and tells every rank what it found. Otherwise every
rank measures at once, each a share of the paths through the supernet (:func:`~.profile.profile_share`,
:func:`~.block_timing.agreed_timed_weights`), and the shares are gathered and joined in rank order, so every rank
holds the same numbers (and decides alike); rank 0 stores them. A profile measured or loaded once in a run also
gives the split its weights (the same reduction, :func:`~.block_timing.spec_weights`). Each part's seconds are
kept for the log line :meth:`StartupMeasures.report` writes once.
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Callable
from typing import Any

import torch

from lightning_naspipe.errors import NASPipeConfigError
from lightning_naspipe.integration import profile_cache
from lightning_naspipe.planning.block_cost import BlockFailure
from lightning_naspipe.planning.block_timing import agreed_timed_weights, spec_weights
from lightning_naspipe.planning.profile import ProfileShare, profile_share, spec_of
from lightning_naspipe.planning.space_spec import SpaceSpec
from lightning_naspipe.space.choice import candidates_of
from lightning_naspipe.space.supernet import BlockValue, Supernet

__all__ = ["ENGINE_SECONDS", "StartupMeasures"]

#: How long each rank's profile share also trains subnets with the one-stage engine (at least 4): the planner's
#: rates are then the engine's, not those of blocks timed one at a time (up to 50% faster on CPU), at about this
#: much more start-up.
ENGINE_SECONDS = 0.25


class StartupMeasures:
    """One run's start-up measurements of ``supernet`` on ``device`` (this rank's), made by ``processes`` ranks.

    Args:
        supernet: the space (never modified: measured on copies).
        device: this rank's compute device.
        rank: this rank (global).
        processes: every rank of the run.
        gather: every rank's value in rank order (collective).
        broadcast: rank 0's value on every rank (collective).
    """

    def __init__(self, supernet: Supernet, device: torch.device, rank: int, processes: int,
                 gather: Callable[[Any], list[Any]], broadcast: Callable[[Any], Any]) -> None:
        self.supernet, self.device, self.rank, self.processes = supernet, device, rank, processes
        self.gather, self.broadcast = gather, broadcast
        #: Part ("profile", "timed split", "layout rebuild") -> (seconds, where the numbers came from).
        self.costs: dict[str, tuple[float, str]] = {}
        self._profiles: dict[str, SpaceSpec] = {}  # this run's, by their cache key
        self._reported = False

    @functools.cached_property
    def _space(self) -> str:
        return profile_cache.structure_digest(self.supernet)

    def _key(self, kind: str, micro: BlockValue) -> dict[str, Any]:
        return profile_cache.measurement_key(kind, self._space, micro, self.device, self.processes)

    def profile(self, micro: BlockValue, deferred: bool) -> SpaceSpec:
        """The profile of one micro-batch ``micro`` (what the first block receives), with the deferred backward's
        two passes if ``deferred``: this run's, the cache's, or measured (collective unless already held)."""
        start, key = time.perf_counter(), self._key("profile", micro)
        name = json.dumps(key, sort_keys=True)
        held = self._profiles.get(name)
        if held is not None and _has_passes(held, deferred):
            return held

        def parse(value: Any) -> SpaceSpec | None:
            spec = self._parsed(value)
            return spec if _has_passes(spec, deferred) else None  # measured again, with the passes

        spec: SpaceSpec | None = self.broadcast(profile_cache.load(key, parse) if self.rank == 0 else None)
        how = "from the cache"
        if spec is None:
            spec, how = self._measured_profile(micro, deferred), "measured"
            if self.rank == 0:
                profile_cache.store(key, json.loads(spec.to_json()))
        self._profiles[name] = spec
        self.costs["profile"] = (time.perf_counter() - start, how)
        return spec

    def _measured_profile(self, micro: BlockValue, deferred: bool) -> SpaceSpec:
        last = self.rank == self.processes - 1  # deals the paths from rank 0 on: the last also times the engine
        mine: tuple[ProfileShare | None, str]
        try:
            mine = (profile_share(self.supernet, micro, repeats=1, deferred=deferred, share=(self.rank, self.processes),
                                  engine_overhead=last, device=self.device, engine_seconds=ENGINE_SECONDS), "")
        except BlockFailure as error:
            mine = (None, f"Profiling {error} of the supernet on the first batch's first micro-batch "
                          "(pipeline_input(batch)) for num_stages='auto'. Fix the module, or pass num_stages=<int>.")
        parts = self.gather(mine)
        failed = next((message for _, message in parts if message), "")
        if failed:
            raise NASPipeConfigError(failed)
        return spec_of(self.supernet, [share for share, _ in parts])

    def split_weights(self, micro: BlockValue) -> list[float]:
        """Each block's seconds on one micro-batch ``micro``, for the stage split: from this run's profile, else the
        cache's profile or split, else timed by every rank at once, a share each (collective unless held)."""
        start = time.perf_counter()
        held = self._profiles.get(json.dumps(self._key("profile", micro), sort_keys=True))
        weights: list[float] | None = spec_weights(held) if held is not None else None
        how = "from the profile"
        if weights is None:
            split_key = self._key("split", micro)
            found = None
            if self.rank == 0:
                spec = profile_cache.load(self._key("profile", micro), self._parsed)
                found = spec_weights(spec) if spec is not None else profile_cache.load(split_key, self._parsed_weights)
            weights, how = self.broadcast(found), "from the cache"
            if weights is None:
                weights, how = agreed_timed_weights(self.supernet, micro, self.gather, self.device,
                                                    share=(self.rank, self.processes), repeats=1), "measured"
                if self.rank == 0:
                    profile_cache.store(split_key, weights)
        self.costs["timed split"] = (time.perf_counter() - start, how)
        return weights

    def _parsed(self, value: Any) -> SpaceSpec:
        """A cached profile, checked against the supernet (``ValueError`` on one of another space)."""
        spec = SpaceSpec.from_json(json.dumps(value))
        if [len(block.candidates) for block in spec.blocks] != [len(candidates_of(b)) for b in self.supernet.blocks]:
            raise ValueError("its blocks or candidates are not the supernet's")
        return spec

    def _parsed_weights(self, value: Any) -> list[float]:
        weights = [float(w) for w in value]
        if len(weights) != len(self.supernet.blocks) or not all(w >= 0 for w in weights):
            raise ValueError("its weights are not one per block")
        return weights

    def record(self, part: str, seconds: float, how: str = "") -> None:
        """Count ``seconds`` spent on ``part`` (e.g. ``"layout rebuild"``) for the log."""
        self.costs[part] = (seconds, how)

    def report(self) -> str | None:
        """The log line of what the start cost, e.g. ``"NASPipe: setup took 1.3 s (profile 0.9 s, measured;
        layout rebuild 0.3 s; timed split 0.1 s, from the profile)"``; once, and ``None`` if nothing was measured."""
        if self._reported or not self.costs:
            return None
        self._reported = True
        parts = "; ".join(f"{part} {seconds:.1f} s" + (f", {how}" if how else "")
                          for part, (seconds, how) in self.costs.items())
        total = sum(seconds for seconds, _ in self.costs.values())
        return f"NASPipe: setup took {total:.1f} s ({parts}; cache: {profile_cache.cache_dir() or 'off'})"


def _has_passes(spec: SpaceSpec, deferred: bool) -> bool:
    """Whether ``spec`` serves a plan that needs the deferred backward's passes (or does not need them)."""
    return not deferred or all(c.deferred_ms is not None for b in spec.blocks for c in b.candidates)
