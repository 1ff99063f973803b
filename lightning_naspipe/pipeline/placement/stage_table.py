"""The table of stages the strategy logs once the first window has run::

    stage | blocks | labels          | parameters | cost          | sends to the next stage
    0     | 0-4    | e01, e02, e12   | 1,234      | 48% (ms)      | tuple(float32[32, 4, 8, 8] x3)
    1     | 5-18   | e03, e13, e23   | 5,678      | 52% (ms)      | -

``cost`` is each stage's share of the block costs the split balanced: measured time (``ms``) or,
without a measurement, expected parameters per subnet (``params``). With data-parallel replicas a
``ranks`` column names each stage's processes (``2, 3``: stage 1's two replicas).
"""

from __future__ import annotations

from collections.abc import Sequence


from lightning_naspipe.space.supernet import Supernet


def stage_table(supernet: Supernet, ranges: Sequence[range], weights: Sequence[float], unit: str,
                sends: Sequence[str | None], ranks: Sequence[Sequence[int]] | None = None) -> str:
    """The table (see the module docstring); ``sends[s]`` describes what stage ``s`` sends on; ``ranks[s]``:
    stage ``s``'s processes, shown when a stage has several (data-parallel replicas)."""
    total = sum(weights) or 1.0
    replicated = ranks is not None and any(len(r) > 1 for r in ranks)
    rows = [("stage", *(("ranks",) if replicated else ()), "blocks", "labels", "parameters", "cost",
             "sends to the next stage")]
    for s, blocks in enumerate(ranges):
        labels = sorted({label for i in blocks for scope in supernet.block_scopes(i).walk()
                         for label, _, _ in scope.choices}, key=list(supernet.labels).index)
        shown = ", ".join(labels[:6]) + (f", ... ({len(labels)})" if len(labels) > 6 else "")
        params = {id(p): p.numel() for i in blocks for p in supernet.blocks[i].parameters()}
        share = sum(weights[i] for i in blocks) / total
        named = (", ".join(map(str, ranks[s])),) if replicated and ranks is not None else ()
        rows.append((str(s), *named, f"{blocks.start}-{blocks.stop - 1}", shown or "-", f"{sum(params.values()):,}",
                     f"{share:.0%} ({unit})", sends[s] or "-"))
    widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
    return "\n".join(" | ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)


def serialising_blocks(supernet: Supernet, blocks: Sequence[int]) -> list[int]:
    """The blocks among ``blocks`` whose own (fixed) parameters or buffers every subnet uses: a stem,
    a head, a norm. CSP never overlaps two subnets on a stage that holds one."""
    roots = {i: supernet.block_scopes(i) for i in blocks}
    return [i for i, root in roots.items() if root.path[-1:] == (-1,) and (root.params or root.buffers)]


def chunks_hint(supernet: Supernet, ranges: Sequence[range], chunks: int) -> str | None:
    """Advice when every stage serialises subnets and nothing else can overlap them (``chunks == 1``)."""
    shared = [serialising_blocks(supernet, blocks) for blocks in ranges]
    if chunks > 1 or len(ranges) < 2 or not all(shared):
        return None
    where = "; ".join(f"stage {s}: block(s) {', '.join(map(str, b))}" for s, b in enumerate(shared))
    return (f"Every subnet trains the fixed blocks of each stage ({where}), so no two subnets can be in flight on "
            "one stage and with chunks=1 the stages take turns. Set the module's chunks=4 to pipeline each "
            "subnet's micro-batches (the plain Trainer splits alike, so every layout still equals it).")
