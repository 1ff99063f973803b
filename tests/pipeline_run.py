"""Runs ToyNet under NASPipeStrategy in several stage processes; used by test_pipeline.py.

Lightning's subprocess launcher re-runs this script (same arguments) for the other stages.
Rank 0 writes a normal checkpoint (collective save) plus the per-subnet losses; every rank
writes its module's state dict, to check that all ranks hold the full weights after fit.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

torch.set_num_threads(1)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import lightning_naspipe as lnp  # noqa: E402
from helpers import FEATURES, ToyNet, pl, toy_loader, trainer_kwargs  # noqa: E402  # pl: $LNP_TEST_NAMESPACE

EarlyStopping, ModelCheckpoint = pl.callbacks.EarlyStopping, pl.callbacks.ModelCheckpoint
CSVLogger = pl.loggers.CSVLogger


class Killer(pl.Callback):
    """Sends ``signum`` to this process (9: as if it crashed hard; 15: preemption; 0: raise an error
    instead, as a bug in user code would) once its stage (or every stage, for stage -2) reaches a given step."""

    def __init__(self, stage: int, step: int, signum: int) -> None:
        self.stage, self.step, self.signum, self.sent = stage, step, signum, False

    def on_train_batch_start(self, trainer: object, *args: object) -> None:
        if self.stage in (-2, trainer.global_rank) and trainer.global_step >= self.step and not self.sent:
            self.sent = True
            if self.signum == 0:
                raise ValueError(f"injected failure on rank {trainer.global_rank}")
            os.kill(os.getpid(), self.signum)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--num-nodes", type=int, default=1)
    parser.add_argument("--window", type=int, default=8)
    parser.add_argument("--chunks", type=int, default=None, help="NASPipeStrategy(chunks=...)")
    parser.add_argument("--module-chunks", type=int, default=None, help="set on the module; the strategy follows")
    parser.add_argument("--num-stages", type=lambda v: v if v == "auto" else int(v), default=None,
                        help="NASPipeStrategy(num_stages=...), 'auto' too")
    parser.add_argument("--force-layout", type=int, default=None,
                        help="with --num-stages auto: the stages the choice returns (instead of the planner's)")
    parser.add_argument("--max-epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=8, help="the training loader's")
    parser.add_argument("--max-steps", type=int, default=-1)
    parser.add_argument("--resume", default=None)
    parser.add_argument("--out", required=True)
    parser.add_argument("--kill-stage", type=int, default=-1)
    parser.add_argument("--kill-step", type=int, default=0)
    parser.add_argument("--kill-signal", type=int, default=9)
    parser.add_argument("--timeout", type=float, default=180, help="NASPipeStrategy(timeout=...) in seconds")
    parser.add_argument("--exception-checkpoint", default=None, help="OnExceptionCheckpoint into this folder")
    parser.add_argument("--offload", action="store_true")
    parser.add_argument("--schedule", default="csp")
    parser.add_argument("--transport", default="auto", help="NASPipeStrategy(transport=...)")
    parser.add_argument("--search", action="store_true", help="after fit: lnp.search, history to OUT.search{rank}")
    parser.add_argument("--search-measured", action="store_true",
                        help="with --search: under measured latency, logged to OUT.search.jsonl; then a search "
                        "under a table whose best is checked (faked), to OUT.checked{rank}")
    parser.add_argument("--validate-after", action="store_true",
                        help="after fit: trainer.validate, then a checkpoint to OUT.after_validate, and last a "
                             "save_checkpoint on rank 0 only (OUT.rank0only, its error to OUT.rank0only.error)")
    parser.add_argument("--log-dir", default=None, help="validate each epoch and log to a CSVLogger here")
    parser.add_argument("--csv-logger", default=None, help="a CSVLogger here, and nothing else added")
    parser.add_argument("--example-input", action="store_true", help="set supernet_example_input (timed split)")
    parser.add_argument("--fake-block-costs", type=float, nargs="+", default=None,
                        help="what timing the first batch's blocks measures (records what it was timed on)")
    parser.add_argument("--every-n-steps", type=int, default=0,
                        help="also ModelCheckpoint(every_n_train_steps=N) into OUT.steps/, every checkpoint kept")
    parser.add_argument("--clip-val", type=float, default=None, help="Trainer(gradient_clip_val=...)")
    parser.add_argument("--clip-algorithm", default=None, help="Trainer(gradient_clip_algorithm=...)")
    parser.add_argument("--rebalance-every", type=int, default=16, help="NASPipeStrategy(rebalance_every=...), 0: None")
    parser.add_argument("--force-rebalance", action="store_true",
                        help="check the balance every window and move the first movable stage cut there and back")
    args = parser.parse_args()
    if args.force_rebalance:
        import lightning_naspipe.integration.stage_placement as placement_module

        def alternate(ranges: list[range], busy: object, weights: object, forbidden: object) -> list[range] | None:
            # The first cut that can move, there and back: the timed split may give the first stages one
            # block each, where the first cut alone could not move.
            for i, (left, right) in enumerate(zip(ranges, ranges[1:])):
                grow = len(right) > 1 and (len(left) == 1 or left.stop % 2 == 1)
                if grow or len(left) > 1:
                    cut = left.stop + (1 if grow else -1)
                    with open(args.out + ".moves", "a") as moves:
                        moves.write(f"{os.getpid()} {cut}\n")
                    return [*ranges[:i], range(left.start, cut), range(cut, right.stop), *ranges[i + 2:]]
            return None

        placement_module.rebalanced = alternate  # type: ignore[assignment]
    if args.force_layout is not None:
        import lightning_naspipe.integration.pipeline_build as pipeline_build

        from lightning_naspipe.integration.auto_layout import LayoutChoice, layout_hparams

        def forced(*args_: object, **kwargs: object) -> LayoutChoice:
            return LayoutChoice(args.force_layout, f"forced layout: {args.force_layout} stages",
                                layout_hparams(args.force_layout, args.devices // args.force_layout, "forced"))

        pipeline_build.chosen_stages = forced  # type: ignore[assignment]
    if args.fake_block_costs:
        import lightning_naspipe.planning.block_timing as block_timing
        from lightning_naspipe.planning.block_cost import PathTimes

        def fake_timing(supernet: object, example: torch.Tensor, **kwargs: object) -> PathTimes:
            if os.environ.get("LOCAL_RANK", "0") == "0":  # every rank times its share; one records it
                torch.save({"input": example.clone(), "device": str(kwargs.get("device"))}, args.out + ".timed_on")
            return PathTimes([[[cost]] for cost in args.fake_block_costs], [[[0.0]] for _ in args.fake_block_costs])

        block_timing.timed_share = fake_timing  # type: ignore[assignment]

    pl.seed_everything(7, verbose=False)
    model = ToyNet()
    if args.module_chunks is not None:
        model.chunks = args.module_chunks
    if args.example_input:
        model.supernet_example_input = torch.ones(8, FEATURES)  # not randn: the global RNG drives the shuffle
    callbacks = [Killer(args.kill_stage, args.kill_step, args.kill_signal)] if args.kill_stage != -1 else []
    if args.exception_checkpoint:
        callbacks.append(pl.callbacks.OnExceptionCheckpoint(args.exception_checkpoint))
    logging: dict = {}
    if args.log_dir:
        # Monitoring callbacks must see the same val_loss on every rank (collective saves, stop votes).
        callbacks += [ModelCheckpoint(dirpath=args.log_dir, monitor="val_loss", filename="best"),
                      EarlyStopping(monitor="val_loss", patience=5)]
        logging = {"logger": CSVLogger(args.log_dir, name="", version=""), "log_every_n_steps": 1,
                   "enable_checkpointing": True}
    if args.csv_logger:
        logging["logger"] = CSVLogger(args.csv_logger, name="", version="")
    if args.every_n_steps:
        callbacks.append(ModelCheckpoint(dirpath=args.out + ".steps", every_n_train_steps=args.every_n_steps,
                                         save_top_k=-1, filename="{step}"))
    if args.exception_checkpoint or args.every_n_steps:
        logging["enable_checkpointing"] = True
    trainer = pl.Trainer(**trainer_kwargs(
        strategy=lnp.NASPipeStrategy(window=args.window, chunks=args.chunks, num_stages=args.num_stages,
                                    offload=args.offload,
                                    schedule=args.schedule, timeout=args.timeout, transport=args.transport,
                                    rebalance_every=1 if args.force_rebalance else args.rebalance_every or None),
        devices=args.devices,
        num_nodes=args.num_nodes, max_epochs=args.max_epochs, max_steps=args.max_steps, callbacks=callbacks,
        gradient_clip_val=args.clip_val, gradient_clip_algorithm=args.clip_algorithm, **logging,
    ))
    with open(f"{args.out}.pid{os.environ.get('LOCAL_RANK', '0')}", "w") as pid:
        pid.write(str(os.getpid()))
    if args.resume and os.path.exists(args.resume + ".losses"):
        previous = torch.load(args.resume + ".losses", weights_only=False)
        model.losses.update(previous)
    val = toy_loader(samples=40, shuffle=False) if args.log_dir else None
    trainer.fit(model, toy_loader(batch_size=args.batch_size), val, ckpt_path=args.resume)
    trainer.save_checkpoint(args.out)
    torch.save(model.state_dict(), f"{args.out}.rank{trainer.global_rank}")
    torch.save(trainer.strategy.stage_ranges, f"{args.out}.ranges{trainer.global_rank}")
    torch.save(trainer.strategy.engine.forwards_ahead, f"{args.out}.ahead{trainer.global_rank}")
    shards = trainer.strategy.eval_shards
    torch.save({"forwards": trainer.strategy.engine.evaluations, "groups": shards.groups,
                "sharded": shards.sharded_calls, "unsharded": shards.unsharded_calls},
               f"{args.out}.evals{trainer.global_rank}")
    if trainer.global_rank == 0:
        torch.save(model.losses, args.out + ".losses")
    if args.validate_after:
        trainer.validate(model, toy_loader(samples=16, shuffle=False), verbose=False)
        trainer.save_checkpoint(args.out + ".after_validate")
    if args.search:
        measured = dict(constraints=lnp.Constraints(latency="measured", max_latency_ms=1e6, repeats=1),
                        log_path=f"{args.out}.search.jsonl") if args.search_measured else {}
        result = lnp.search(trainer, model, SEARCHER, toy_loader(samples=40, shuffle=False),
                            calibration=toy_loader(samples=16, shuffle=False), **measured)
        torch.save(result.history, f"{args.out}.search{trainer.global_rank}")
        if args.search_measured:
            torch.save(checked_search(trainer, model), f"{args.out}.checked{trainer.global_rank}")
    if args.validate_after and trainer.is_global_zero:  # a habit: the other stage process has exited by now
        try:
            trainer.save_checkpoint(args.out + ".rank0only")
        except lnp.NASPipeConfigError as error:
            with open(args.out + ".rank0only.error", "w") as file:
                file.write(str(error))


#: The search the multi-stage search test runs, here and on one device.
SEARCHER = lnp.EvolutionSearch(population=4, sample_size=2, cycles=5, seed=3)


def checked_search(trainer: object, model: object) -> tuple[list[tuple[lnp.Record, float | None, bool]], dict]:
    """A search under a table and a 1 ms budget whose best-scored architecture measures over it end to end (a fake
    timing on rank 0: the first measurement 9 ms, later ones 0.5 ms; every prediction 0.01 ms per block): each
    record with its check (``measured_latency_ms``, ``over_budget``: not compared by ``==``), and the best."""
    from lightning_naspipe.searching import latency as latency_module

    supernet = model.supernet  # type: ignore[attr-defined]
    labels = tuple(block.label if isinstance(block, lnp.ChoiceBlock) else None for block in supernet.blocks)
    table = lnp.LatencyTable(tuple((0.01,) * (supernet.labels[label] if label else 1) for label in labels), labels,
                             "cpu", 8)
    measured: list[float] = []

    def fake(*args: object, **kwargs: object) -> float:
        measured.append(9.0 if not measured else 0.5)
        return measured[-1]

    real, latency_module.measure_latency = latency_module.measure_latency, fake
    try:
        result = lnp.search(trainer, model, SEARCHER, toy_loader(samples=40, shuffle=False),
                            calibration=toy_loader(samples=16, shuffle=False),
                            constraints=lnp.Constraints(latency=table, max_latency_ms=1.0))
    finally:
        latency_module.measure_latency = real
    return [(r, r.measured_latency_ms, r.over_budget) for r in result.history], result.best


if __name__ == "__main__":
    main()
