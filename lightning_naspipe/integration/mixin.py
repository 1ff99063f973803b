"""The mixin users add to their LightningModule: ``class Net(lnp.NASPipeMixin, L.LightningModule)``.

It works with the LightningModule of either namespace (``lightning.pytorch`` or ``pytorch_lightning``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from functools import cache
from typing import TYPE_CHECKING, Any, cast

from torch import Tensor

from lightning_naspipe.compat import lightning
from lightning_naspipe.integration.callback import (NASPipeCallback, PipelineRunner, check_checkpoint_space,
                                                    keep_scheduler_monitors, validate_run)
from lightning_naspipe.integration.precision_clipping import lightning_clipping
from lightning_naspipe.pipeline.runtime.engine import Engine
from lightning_naspipe.errors import NASPipeConfigError
from lightning_naspipe.pipeline.runtime.executor import loss_context
from lightning_naspipe.pipeline.runtime.window import Window
from lightning_naspipe.pipeline.runtime.microbatch import Batch
from lightning_naspipe.integration.batch_hooks import recorded_logs, recording_log
from lightning_naspipe.integration.loss_log import BatchStartPoints, log_window_losses, refuse_stage_hook_logging
from lightning_naspipe.namespaces import installed, namespace_of
from lightning_naspipe.pipeline.sampling.keyed import EVAL_DOMAIN, mix, uniform_architecture
from lightning_naspipe.space.choice import Architecture
from lightning_naspipe.space.supernet import BlockValue, Supernet, supernet_of

if TYPE_CHECKING:
    from lightning_naspipe.pipeline.runtime.engine import EngineModule


class NASPipeMixin:
    """Supernet training with one sampled subnet per step, exactly reproducible.

    Set ``self.supernet = lnp.Supernet(...)`` in ``__init__`` and implement :meth:`compute_loss`.
    Under a plain ``pl.Trainer()`` every batch trains one subnet (the sequential reference);
    under ``Trainer(strategy="naspipe")`` every Lightning batch is a window of subnets run by
    the pipeline engine. Both paths run the same engine and give bitwise identical results.

    Optimization is manual (one optimizer step per subnet, touching only that subnet's
    parameters), so ``global_step`` counts subnets. ``configure_optimizers`` is the usual one;
    LR schedulers with ``interval="step"`` step once per subnet, ``"epoch"`` once per epoch.

    Attributes:
        naspipe_seed: keys subnet sampling and in-block randomness. Defaults to the seed given
            to ``pl.seed_everything`` (``PL_GLOBAL_SEED``), else 0. Set it in ``__init__`` to fix it.
        supernet_example_input: optional; what the first block receives for one subnet batch
            (``pipeline_input(batch)``), e.g. ``torch.zeros(32, 3, 32, 32)``. When set, the pipeline
            stages are balanced by each block's measured time on it (before the run) instead of on
            the first training batch.
        naspipe_allow_nonfinite_loss: by default a NaN or infinite training loss stops the run with a
            ``FloatingPointError`` naming the subnet and its architecture; set True to train on.
        chunks: micro-batches each subnet's batch is split into (along dim 0), their gradients accumulated in
            order; default 1. Like the batch size it is part of what the module trains (another value changes
            the summation order), so it belongs here: the plain Trainer splits alike, and every layout of
            ``NASPipeStrategy`` (which follows it) equals the plain run. Pipelined stages overlap micro-batches
            and replicas share them, so raise it for a pipeline whose stages take turns.
    """

    supernet: Supernet
    supernet_example_input: Any = None
    #: Several subnets per training step: ``step_sampler(supernet, seed, step)`` gives their architectures
    #: (``lnp.Sandwich``, ``lnp.FairNAS``, ``lnp.Constrained``); ``None``: one subnet per step (``sample_subnet``).
    step_sampler: Any = None
    naspipe_allow_nonfinite_loss: bool = False
    chunks: int = 1

    # -- what users implement or override ------------------------------------------------

    def compute_loss(self, output: BlockValue, batch: Batch) -> Tensor:
        """The scalar training loss of the supernet's ``output`` for ``batch``. Must be implemented."""
        raise NotImplementedError(
            f"{type(self).__name__} must implement compute_loss(self, output, batch) returning a scalar loss tensor."
        )

    def pipeline_input(self, batch: Batch) -> BlockValue:
        """What the first block receives for ``batch``; defaults to ``batch[0]``."""
        return batch[0]

    def sample_subnet(self, index: int) -> Architecture:
        """Architecture of subnet ``index``: a uniform candidate per label from ``(naspipe_seed, index)``.

        Override it to change the sampler, but keep it a pure function of ``index`` (never draw
        from the global RNG): every stage evaluates it on its own and resume relies on it.
        """
        return uniform_architecture(self._supernet().labels, self.naspipe_seed, index)

    def sample_step(self, step: int) -> Sequence[Architecture]:
        """The architectures trained in training step ``step``, on its batch, in the order their gradients
        accumulate before the step's one optimizer update.

        Default: ``self.step_sampler(self.supernet, self.naspipe_seed, step)`` when the module sets one
        (e.g. ``self.step_sampler = lnp.Sandwich(2)`` in ``__init__``), else ``[self.sample_subnet(step)]``. Like
        ``sample_subnet``, keep it a pure function of ``step``. When ``compute_loss`` has a parameter named
        ``teacher``, every subnet of a step after the first gets the first one's detached output for the same
        batch there (in-place distillation); the first gets ``None``.
        """
        sampler = self.step_sampler
        if sampler is None:
            return [self.sample_subnet(step)]
        return list(sampler(self._supernet(), self.naspipe_seed, step))

    def on_train_subnet_end(self, index: int, architecture: Architecture, loss: Tensor) -> None:
        """Called after subnet ``index`` is trained and updated, with its (detached) loss."""

    def eval_architecture(self, batch_idx: int, dataloader_idx: int = 0) -> Architecture:
        """The subnet the default ``validation_step``/``test_step`` evaluate on batch ``batch_idx``.

        Default: a uniform random subnet drawn from ``(naspipe_seed, batch_idx)`` in a stream apart
        from training's, so every epoch evaluates the same subnets and curves are comparable.
        Override it to evaluate, e.g., one fixed architecture.
        """
        return uniform_architecture(self._supernet().labels, mix(EVAL_DOMAIN, self.naspipe_seed), batch_idx)

    def subnet_output(self, batch: Batch, architecture: Architecture) -> BlockValue:
        """Run subnet ``architecture`` on ``batch`` (no backward) and return its output.

        Under ``strategy="naspipe"`` with several stages the batch flows through the pipeline and
        the output is returned on every stage, so validation code runs unchanged on every rank. With data-parallel
        replicas, a call with the step's ``batch`` from an evaluation step is sharded: each replica runs its share of
        consecutive batches (under ``eval_architecture`` of each, or the same architecture on each) and the outputs
        are exchanged, bit for bit the same (see :mod:`lightning_naspipe.integration.eval_shards` for the rule).
        """
        module: Any = self
        strategy = module.trainer.strategy if lightning.is_attached(module) else None
        engine = strategy.engine if isinstance(strategy, PipelineRunner) and strategy.engine else None
        if engine is not None and engine.replicas is not None:  # sharded over the replicas where exact (.eval_shards)
            assert isinstance(strategy, PipelineRunner)
            sharded = strategy.eval_shards.output(cast("EngineModule", self), engine, batch, architecture)
            if sharded is not None:
                return sharded[0]
        return (engine or self._sequential_engine()).evaluate(cast("EngineModule", self), batch, architecture)

    def validation_step(self, batch: Batch, batch_idx: int, dataloader_idx: int = 0) -> Tensor:
        """Logs ``val_loss`` of subnet :meth:`eval_architecture` on the batch; override for metrics."""
        return self._evaluation_step("val_loss", batch, batch_idx, dataloader_idx)

    def test_step(self, batch: Batch, batch_idx: int, dataloader_idx: int = 0) -> Tensor:
        """Logs ``test_loss`` of subnet :meth:`eval_architecture` on the batch; override for metrics."""
        return self._evaluation_step("test_loss", batch, batch_idx, dataloader_idx)

    def predict_step(self, batch: Batch, batch_idx: int, dataloader_idx: int = 0) -> BlockValue:
        """The output of subnet :meth:`eval_architecture` for the batch (``trainer.predict``); override to
        predict with another architecture."""
        return self.subnet_output(batch, self.eval_architecture(batch_idx, dataloader_idx))

    def _evaluation_step(self, name: str, batch: Any, batch_idx: int, dataloader_idx: int) -> Tensor:
        output = self.subnet_output(batch, self.eval_architecture(batch_idx, dataloader_idx))
        loss = self.compute_loss(output, batch)
        module: Any = self
        module.log(name, loss, prog_bar=True, batch_size=self._batch_size(batch))
        return loss

    # -- the training step shared by both paths ---------------------------------------------

    def log(self, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        """Lightning's ``self.log``; called from ``compute_loss`` while a window trains, it is recorded and
        logged in that subnet's turn after the window, on every stage, as a plain run logs it in the
        subnet's own step (see :mod:`.loss_log`)."""
        hook_calls, in_window = recording_log(self), self.__dict__.get("_naspipe_records_logs")
        context = loss_context() if in_window else None
        if context is None and hook_calls is None:
            if in_window:
                refuse_stage_hook_logging(name, lightning.current_fx_name(self))
            super().log(name, value, *args, **kwargs)  # type: ignore[misc]  # LightningModule.log
            return
        if not isinstance(value, (Tensor, int, float)):
            where = "compute_loss" if hook_calls is None else "on_train_batch_start"
            raise NASPipeConfigError(
                f"self.log({name!r}, <{type(value).__name__}>) in {where} during training: NASPipe logs what "
                f"{where} logs for a window's subnets in each subnet's turn, and can carry tensors and numbers only. "
                f"Log the value instead, e.g. self.log({name!r}, metric(preds, target)) rather than the metric object."
            )
        value = value.detach().clone() if isinstance(value, Tensor) else value
        if hook_calls is not None:
            hook_calls.append((name, value, args, kwargs))
        elif context is not None:
            index, records = context
            records.append((index, name, value, args, kwargs))

    @property
    def naspipe_seed(self) -> int:
        seed = self.__dict__.get("_naspipe_seed")
        if seed is None:
            seed = int(os.environ.get("PL_GLOBAL_SEED", 0))
        return seed

    @naspipe_seed.setter
    def naspipe_seed(self, seed: int) -> None:
        self.__dict__["_naspipe_seed"] = int(seed)

    @property
    def automatic_optimization(self) -> bool:
        return False

    @automatic_optimization.setter
    def automatic_optimization(self, value: bool) -> None:
        if value:
            raise NASPipeConfigError(
                "NASPipe modules use manual optimization (one optimizer step per subnet, on that subnet's "
                "parameters only); do not set automatic_optimization = True. Schedulers and steps are handled "
                "for you."
            )

    def configure_callbacks(self) -> Any:
        """Adds :class:`NASPipeCallback`; call ``super().configure_callbacks()`` when overriding."""
        module: Any = self
        if type(self).training_step is not NASPipeMixin.training_step:
            raise NASPipeConfigError(
                f"{type(self).__name__} overrides training_step; NASPipe's own trains one subnet per batch (a window "
                "of subnets per batch under strategy=\"naspipe\") and steps the optimizer per subnet. Remove it: put "
                "the loss in compute_loss(output, batch), per-subnet work in on_train_subnet_end(index, architecture, "
                "loss), and what the first block receives in pipeline_input(batch)."
            )
        if lightning.is_attached(module):
            validate_run(module.trainer, self)  # before Lightning's own, less fitting, advice
            if module.trainer.state.fn == "fit":  # the callback checked before a finder can swap the callbacks
                trainer = module.trainer
                keep_scheduler_monitors(self, check=lambda: self._check_callback(trainer))
        return [NASPipeCallback()]

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Refuses a checkpoint of another search space before the Trainer loads its weights (``fit``, ``validate``,
        ``test``, ``predict`` with ``ckpt_path``); call ``super().on_load_checkpoint(checkpoint)`` when overriding.
        ``load_from_checkpoint`` (no Trainer) loads as its ``strict`` says."""
        module: Any = self
        if lightning.is_attached(module):
            check_checkpoint_space(module.trainer, self, checkpoint)
        super().on_load_checkpoint(checkpoint)  # type: ignore[misc]  # LightningModule's hook

    def training_step(self, batch: Any, batch_idx: int) -> Tensor | None:
        """Train one subnet (plain Trainer) or one window of subnets (``strategy="naspipe"``)."""
        module: Any = self
        trainer = module.trainer
        self._check_callback(trainer)
        pipeline = trainer.strategy if isinstance(trainer.strategy, PipelineRunner) else None
        if pipeline is not None:
            assert pipeline.engine is not None, "set up by NASPipeStrategy.setup"
            engine, batches = pipeline.engine, list(batch)
        else:
            engine, batches = self._sequential_engine(), [batch]
        first = trainer.global_step
        if trainer.max_steps >= 0:
            batches = batches[: max(0, trainer.max_steps - first)]
        upcoming = pipeline.upcoming_batches(first + len(batches)) if pipeline is not None and batches else None
        self.__dict__["_naspipe_records_logs"] = pipeline is not None  # see log
        # Only windows need LearningRateMonitor's per-subnet points (a plain batch is one subnet).
        tracker = getattr(pipeline, "data_tracker", None)  # the window's place in the epoch, as plain batch_idx
        batch_starts = (BatchStartPoints(trainer, first, first + len(batches) - 1,
                                         tracker.position() if tracker is not None else batch_idx)
                        if pipeline is not None else None)
        engine.after_update = batch_starts if batch_starts is not None and batch_starts.monitors else None
        try:
            window = engine.train_window(cast("EngineModule", self), batches, first, upcoming)
        finally:
            self.__dict__["_naspipe_records_logs"], engine.after_update = False, None
        if pipeline is not None:
            pipeline.window_trained()
            pipeline.report_stages()
            for name, value in pipeline.stage_metrics().items():
                module.log(name, value, on_step=True, on_epoch=False)
        return self._report(window, batches, batch_starts)

    def _report(self, window: Window, batches: list[Any], batch_starts: BatchStartPoints | None) -> Tensor | None:
        log_window_losses(self, window.first_index, window.losses, batches, [self._batch_size(b) for b in batches],
                          window.records, batch_starts, recorded_logs(self))
        reported = []
        for k, loss in enumerate(window.losses):
            if loss is not None:
                if not self.naspipe_allow_nonfinite_loss and not bool(loss.isfinite().all()):
                    # Every stage has the same loss, so every stage stops at this same subnet.
                    raise FloatingPointError(
                        f"Subnet {window.first_index + k} (architecture {window.architectures[k]}) has a non-finite "
                        f"training loss ({loss.item()}); the run stops rather than train on. Lower the learning rate "
                        "or clip in on_before_optimizer_step, or set self.naspipe_allow_nonfinite_loss = True in "
                        "__init__ to train on regardless."
                    )
                reported.append(loss)
                self.on_train_subnet_end(window.first_index + k, window.architectures[k], loss)
        return reported[-1] if reported else None

    def _batch_size(self, batch: Any) -> int:
        """Lightning's inference of ``batch``'s size, from this module's own namespace."""
        return int(_extract_batch_size(type(self))(batch))  # type: ignore[arg-type]  # classes hash

    def _check_callback(self, trainer: Any) -> None:
        if self.__dict__.get("_naspipe_checked_trainer") == id(trainer):
            return
        if not any(isinstance(c, NASPipeCallback) for c in trainer.callbacks):
            raise NASPipeConfigError(
                f"{type(self).__name__}.configure_callbacks() does not return NASPipe's callback, which keeps LR "
                "schedules and resume exact: return super().configure_callbacks() plus your own callbacks."
            )
        self.__dict__["_naspipe_checked_trainer"] = id(trainer)

    def _sequential_engine(self) -> Engine:
        engine = self.__dict__.get("_naspipe_engine")
        chunks = module_chunks(self)
        if engine is None or engine.chunks != chunks:
            engine = Engine([range(len(self._supernet()))], chunks=chunks, clipping_hook=lightning_clipping)
            self.__dict__["_naspipe_engine"] = engine
        return engine

    def _supernet(self) -> Supernet:
        return supernet_of(self)


def module_chunks(module: object) -> int:
    """``module.chunks``, checked: a positive int (:attr:`NASPipeMixin.chunks`)."""
    value = getattr(module, "chunks", 1)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise NASPipeConfigError(f"{type(module).__name__}.chunks is {value!r}: the micro-batches per subnet must be "
                                 "a positive int, e.g. chunks = 2 in the class body or self.chunks = 2 in __init__.")
    return value


def sets_chunks(module: object) -> bool:
    """Whether ``module`` (its class or the instance) sets ``chunks``, rather than keep the mixin's default."""
    if "chunks" in vars(module):
        return True
    for cls in type(module).__mro__:
        if cls is NASPipeMixin:
            return False
        if "chunks" in vars(cls):
            return True
    return False


def resolve_chunks(module: object, setting: int | None) -> tuple[int, str | None]:
    """The micro-batches per subnet of a ``NASPipeStrategy(chunks=setting)`` run of ``module``, and a log line
    for a setting that the plain Trainer reproduces only with the module changed.

    Raises:
        NASPipeConfigError: ``setting`` differs from the ``chunks`` the module sets.
    """
    own, name = module_chunks(module), type(module).__name__
    if setting is None or setting == own:
        return own, None
    if sets_chunks(module):
        raise NASPipeConfigError(
            f"NASPipeStrategy(chunks={setting}) differs from {name}.chunks = {own}. The micro-batch count is part of "
            f"what the module trains (the plain Trainer splits each batch into {own}), so the run would equal no "
            f"plain run. Leave NASPipeStrategy's chunks unset: it follows the module."
        )
    return setting, (f"NASPipe: chunks={setting} comes from NASPipeStrategy; this run equals the plain Trainer with "
                     f"{name}.chunks = {setting} (set it on the module, and leave the strategy's unset, so that the "
                     "plain Trainer reproduces every layout as is).")


@cache
def _extract_batch_size(module_class: type) -> Callable[[Any], int]:
    # Once per class: the namespace lookup walks the MRO, and this runs for every subnet.
    namespace = namespace_of(module_class) or installed()[0]
    return namespace.pytorch_module("utilities.data").extract_batch_size  # type: ignore[no-any-return]
