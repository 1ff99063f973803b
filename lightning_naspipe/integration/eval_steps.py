"""The evaluation half of ``NASPipeStrategy``: validation, test and predict steps sharded over the replicas where
exact (:mod:`.eval_shards`), each step noted where it stands in its dataloader so a group of the replicas' forwards
can be formed."""

from __future__ import annotations

from typing import Any

from typing_extensions import override

from lightning_naspipe.integration.data import transfer_hooks_overridden
from lightning_naspipe.integration.eval_shards import EvalShards, step_position
from lightning_naspipe.integration.pipeline_build import PipelineBuilding

__all__ = ["ShardedEvaluation"]


class ShardedEvaluation(PipelineBuilding):
    """Evaluation steps for ``NASPipeStrategy``, whose ``__init__`` calls :meth:`_init_evaluation`."""

    def _trainer(self) -> Any:
        assert self.lightning_module is not None, "the strategy is connected to a module"
        return self.lightning_module.trainer

    def _init_evaluation(self) -> None:
        #: Validation, test and predict sharded over the replicas where exact (:mod:`.eval_shards`).
        self.eval_shards = EvalShards(self._prepare_eval_batch, self._eval_batch_limit, lambda: self.root_device,
                                      lambda: transfer_hooks_overridden(self._trainer(), self.lightning_module))

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.eval_shards.step(self._step_position("validation_step", args)):
            return super().validation_step(*args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.eval_shards.step(self._step_position("test_step", args)):
            return super().test_step(*args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.eval_shards.step(self._step_position("predict_step", args)):
            return super().predict_step(*args, **kwargs)

    def _step_position(self, hook: str, args: tuple[Any, ...]) -> tuple[Any, int, int] | None:
        """Where the evaluation step called with ``args`` stands (:func:`.eval_shards.step_position`)."""
        if self.engine is None or self.engine.replicas is None or self._namespace is None:
            return None
        signatures = self._namespace.pytorch_module("utilities.signature_utils")
        takes = signatures.is_param_in_hook_signature(getattr(self.lightning_module, hook), "batch_idx", min_args=2)
        return step_position(args, bool(takes))

    def _prepare_eval_batch(self, batch: Any, dataloader_idx: int) -> Any:
        """What Lightning's evaluation loop does to ``batch`` before the step (with no batch-transfer hook of the
        module's own: those turn sharding off)."""
        return self.batch_to_device(self.precision_plugin.convert_input(batch), dataloader_idx=dataloader_idx)

    def _eval_batch_limit(self, dataloader_idx: int) -> int | float:
        """The batches Lightning reads from evaluation dataloader ``dataloader_idx`` in the running pass."""
        trainer = self._trainer()
        limits = (trainer.num_sanity_val_batches if trainer.sanity_checking else trainer.num_val_batches
                  if trainer.validating else trainer.num_test_batches if trainer.testing
                  else trainer.num_predict_batches if trainer.predicting else [])
        return limits[dataloader_idx] if dataloader_idx < len(limits) else 0
