"""A small supernet exercising everything the reproducibility contract covers, and a runner."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import lightning.pytorch
import pytorch_lightning
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_naspipe as lnp

FEATURES = 6
CLASSES = 3
#: The step samplers LNP_TEST_RECIPE selects.
RECIPES: dict[str, Any] = {"sandwich": lambda: lnp.Sandwich(1), "sandwich4": lambda: lnp.Sandwich(2),
                           "fairnas": lnp.FairNAS,
                           "constrained": lambda: lnp.Constrained(max_params=200, num_subnets=2)}

#: The Lightning namespace the tests use by default; the subprocess runners (pipeline_run.py) take
#: it from the environment so one test can run them under either.
NAMESPACES = {"lightning.pytorch": lightning.pytorch, "pytorch_lightning": pytorch_lightning}
pl: Any = NAMESPACES[os.environ.get("LNP_TEST_NAMESPACE", "pytorch_lightning")]


class ToyBody(lnp.NASPipeMixin):
    """Adam, a step LR schedule, dropout, BatchNorm, an Identity candidate, a shared label,
    trainable stem and head."""

    def __init__(self, lr: float = 0.05, width: int = 8) -> None:
        super().__init__()
        self.lr = lr
        self.losses: dict[int, torch.Tensor] = {}
        if os.environ.get("LNP_TEST_CHUNKS"):  # micro-batches per subnet, on the plain Trainer too (replicas need 2)
            self.chunks = int(os.environ["LNP_TEST_CHUNKS"])
        # LNP_TEST_CHOICE_STEM=1: a choice of stems, so that the next window's forwards can run early.
        stem = (lnp.ChoiceBlock([nn.Linear(FEATURES, width) for _ in range(4)])
                if os.environ.get("LNP_TEST_CHOICE_STEM") else nn.Linear(FEATURES, width))
        # LNP_TEST_RECIPE: several subnets per step (the sandwich rule with distillation, FairNAS, constrained).
        self.step_sampler = RECIPES[os.environ["LNP_TEST_RECIPE"]]() if os.environ.get("LNP_TEST_RECIPE") else None
        if os.environ.get("LNP_TEST_SPACE") == "elastic":  # candidates are slices of shared weights
            self.supernet = elastic_supernet(width)
            return
        self.supernet = lnp.Supernet(
            stem,  # trainable stem: conflicts with every subnet
            lnp.ChoiceBlock([nn.Sequential(nn.Linear(width, width), nn.ReLU()), nn.Identity(),
                             nn.Sequential(nn.Linear(width, width), nn.Dropout(0.3)),
                             # LNP_TEST_EXTRA_CANDIDATE=1: another space with the same state dict's keys and shapes
                             *([nn.Identity()] if os.environ.get("LNP_TEST_EXTRA_CANDIDATE") else [])]),
            lnp.ChoiceBlock({"bn": nn.BatchNorm1d(width), "tanh": nn.Tanh(), "lin": nn.Linear(width, width)},
                            label="shared"),
            lnp.ChoiceBlock([nn.Sequential(nn.Dropout(0.2), nn.Linear(width, width)), nn.ReLU(),
                             nn.Linear(width, width)], label="shared"),
            nn.Linear(width, CLASSES),  # trainable head
        )

    def compute_loss(self, output: torch.Tensor, batch: Any, teacher: torch.Tensor | None = None) -> torch.Tensor:
        loss = nn.functional.cross_entropy(output, batch[1])
        if teacher is None:  # one subnet per step, or the step's first: no in-place distillation
            return loss
        return loss + nn.functional.kl_div(output.log_softmax(-1), teacher.softmax(-1), reduction="batchmean")

    def on_train_subnet_end(self, index: int, architecture: dict[str, int], loss: torch.Tensor) -> None:
        self.losses[index] = loss.clone()

    def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> torch.Tensor:
        loss = super().validation_step(batch, batch_idx, dataloader_idx)
        # A user's own epoch-level metric, logged without sync_dist: on several stages Lightning
        # advises sync_dist=True, which does not apply under NASPipe (every stage has the value).
        output = self.subnet_output(batch, self.eval_architecture(batch_idx, dataloader_idx))
        self.log("val_acc", (output.argmax(-1) == batch[1]).float().mean(), batch_size=len(batch[1]))
        return loss

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.Adam(self.parameters(), lr=self.lr)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.7)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def elastic_supernet(width: int) -> lnp.Supernet:
    """ToyNet's elastic twin (LNP_TEST_SPACE=elastic): elastic widths, BatchNorm over elastic channels, dropout."""
    half = width // 2
    return lnp.Supernet(
        lnp.ElasticLinear(FEATURES, [half, width], label="w1"),
        nn.Sequential(lnp.ElasticBatchNorm1d([half, width], label="w1"), nn.ReLU()),
        lnp.ElasticLinear([half, width], [half, width], in_label="w1", label="w2"),
        nn.Sequential(nn.Dropout(0.2), lnp.ElasticLinear([half, width], CLASSES, in_label="w2")),
    )


class LightningToyNet(ToyBody, lightning.pytorch.LightningModule):
    """ToyNet on ``lightning.pytorch``."""


class PLToyNet(ToyBody, pytorch_lightning.LightningModule):
    """ToyNet on ``pytorch_lightning``."""


TOY_NETS: dict[Any, type] = {lightning.pytorch: LightningToyNet, pytorch_lightning: PLToyNet}
ToyNet: Any = TOY_NETS[pl]


def toy_loader(samples: int = 96, batch_size: int = 8, shuffle: bool = True) -> DataLoader:
    generator = torch.Generator().manual_seed(123)
    x = torch.randn(samples, FEATURES, generator=generator)
    y = torch.randint(0, CLASSES, (samples,), generator=generator)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=shuffle)


def trainer_kwargs(**overrides: Any) -> dict[str, Any]:
    kwargs: dict[str, Any] = dict(
        accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, max_epochs=2,
    )
    kwargs.update(overrides)
    return kwargs


def full_state(model: Any, trainer: Any) -> dict[str, Any]:
    """Every parameter, buffer and optimizer-state tensor, plus per-subnet losses."""
    optimizer_state = trainer.optimizers[0].state_dict()
    return {
        "model": {k: v.clone() for k, v in model.state_dict().items()},
        "optimizer": optimizer_state,
        "losses": dict(getattr(model, "losses", {})),
        "global_step": trainer.global_step,
    }


def assert_same_state(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["global_step"] == b["global_step"]
    assert a["model"].keys() == b["model"].keys()
    for name in a["model"]:
        assert torch.equal(a["model"][name], b["model"][name]), f"parameter/buffer {name} differs"
    _assert_equal_nested(a["optimizer"], b["optimizer"], "optimizer")
    assert a["losses"].keys() == b["losses"].keys()
    for index in a["losses"]:
        assert torch.equal(a["losses"][index], b["losses"][index]), f"loss of subnet {index} differs"


def _assert_equal_nested(a: Any, b: Any, where: str) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), f"{where} differs"
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), f"{where} keys differ: {sorted(a)} vs {sorted(b)}"
        for key in a:
            _assert_equal_nested(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{where} lengths differ"
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_equal_nested(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def train(strategy: Any = None, seed: int = 7, model_cls: type | None = None, loader: DataLoader | None = None,
          val_loader: DataLoader | None = None, namespace: Any = None, **trainer_overrides: Any) -> tuple[Any, Any]:
    """Fit ``model_cls`` (default: the namespace's ToyNet) with a Trainer of ``namespace`` (default ``pl``)."""
    torch.set_num_threads(1)
    namespace = namespace or pl
    namespace.seed_everything(seed, verbose=False)
    model = (model_cls or TOY_NETS[namespace])()
    kwargs = trainer_kwargs(**trainer_overrides)
    if strategy is not None:
        kwargs["strategy"] = strategy
    trainer = namespace.Trainer(**kwargs)
    trainer.fit(model, loader if loader is not None else toy_loader(), val_loader)
    return model, trainer


def spawn_gloo_pair(worker: Any) -> dict[str, Any]:
    """Run ``worker(rank, init_method, results)`` in two processes; what they put in ``results``.

    The worker joins a gloo process group with ``init_method`` (a file rendezvous: no port to race for). The
    processes are forked from forked.py's server, which imported torch and Lightning once.
    """
    import tempfile

    import torch.multiprocessing as mp

    import forked  # noqa: F401  (sets the forkserver's preloaded modules before its first use)

    with tempfile.TemporaryDirectory() as folder, mp.Manager() as manager:
        results = manager.dict()
        mp.start_processes(worker, args=(f"file://{folder}/rendezvous", results), nprocs=2, join=True,
                           start_method="forkserver")
        return dict(results)


EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
#: LightningCLI flags that keep the example runs short and their output out of the way.
QUIET = ["--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false", "--trainer.logger=false"]


def load_example(name: str) -> Any:
    """``examples/<name>.py`` imported as module ``name`` (examples/ is no package)."""
    import importlib.util
    import sys

    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # before exec: jsonargparse and pickling resolve classes by module name
        spec.loader.exec_module(module)
    return sys.modules[name]


def nb201_trainer_kwargs(**overrides: Any) -> dict[str, Any]:
    """64 subnets of the NB201 space, no validation: the exactness runs of test_pipeline.py."""
    return trainer_kwargs(max_steps=64, max_epochs=-1, limit_val_batches=0, **overrides)


def fake_latency_timing(monkeypatch: Any, cost: Any) -> None:
    """Every latency timing (a table's in place, in every pass, and an end-to-end one) takes ``cost(module)`` ms,
    after running the module once on its input (which must fit it): deterministic tables."""
    from lightning_naspipe.searching import latency, table_passes

    def fake(module: nn.Module, example_input: Any, *args: Any, **kwargs: Any) -> float:
        module(example_input)
        return float(cost(module))

    monkeypatch.setattr(latency, "time_module", fake)
    monkeypatch.setattr(latency, "time_modules", lambda runs, *a, **k: [fake(m, x) for m, x in runs])
    monkeypatch.setattr(table_passes, "interleaved_times",
                        lambda runs, repeats, *a, **k: [[fake(m, x)] * repeats for m, x in runs])
