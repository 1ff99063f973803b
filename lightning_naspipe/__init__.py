"""NASPipe for PyTorch Lightning: pipeline-parallel supernet training, bitwise reproducible."""

from pytorch_lightning.strategies import StrategyRegistry

from lightning_naspipe.callback import NASPipeCallback
from lightning_naspipe.cells import Cell, Zero
from lightning_naspipe.choice import InputChoice, When
from lightning_naspipe.errors import NASPipeConfigError
from lightning_naspipe.mixin import NASPipeMixin
from lightning_naspipe.strategy import NASPipeStrategy
from lightning_naspipe.supernet import ChoiceBlock, Supernet

__all__ = ["Cell", "ChoiceBlock", "InputChoice", "NASPipeCallback", "NASPipeConfigError", "NASPipeMixin",
           "NASPipeStrategy", "Supernet", "When", "Zero"]
__version__ = "0.1.0"

# Strategy names resolve before any plugin loads, so importing the package registers "naspipe".
NASPipeStrategy.register_strategies(StrategyRegistry)
