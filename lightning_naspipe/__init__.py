"""NASPipe for PyTorch Lightning: pipeline-parallel supernet training, bitwise reproducible.

Importing the package registers ``strategy="naspipe"`` with every installed Lightning namespace
(``lightning.pytorch`` and ``pytorch_lightning``).
"""

from lightning_naspipe.integration.callback import NASPipeCallback
from lightning_naspipe.space.cells import Cell, Zero
from lightning_naspipe.space.choice import Architecture, Elastic, InputChoice, When
from lightning_naspipe.space.elastic import ElasticBatchNorm1d, ElasticBatchNorm2d, ElasticConv2d, ElasticLinear
from lightning_naspipe.space.elastic_blocks import ElasticAttention, ElasticDepth, ElasticMLP
from lightning_naspipe.space.elastic_transformer import ElasticEmbedding, ElasticLayerNorm, ElasticPatchEmbed
from lightning_naspipe.errors import NASPipeConfigError
from lightning_naspipe.searching.export import load_subnet, save_subnet
from lightning_naspipe.searching.constraints import Constraints, LatencyPenalty
from lightning_naspipe.searching.latency import LatencyTable, measure_latency
from lightning_naspipe.searching.latency_report import LatencyReport
from lightning_naspipe.space.freezing import recalibrate_batchnorm
from lightning_naspipe.integration.mixin import NASPipeMixin
from lightning_naspipe.searching.search_loop import SearchResult, search
from lightning_naspipe.integration.cli import naspipe_cli
from lightning_naspipe.searching.searchers import (EvolutionSearch, GridSearch, RandomSearch, Record, Searcher,
                                                    SPOSSearch)
from lightning_naspipe.integration.strategy import NASPipeStrategy
from lightning_naspipe.integration.verify import verify
from lightning_naspipe.integration.verify_report import Difference, VerifyReport
from lightning_naspipe.pipeline.sampling.step_sampling import Constrained, FairNAS, Sandwich
from lightning_naspipe.space.choice import ChoiceBlock
from lightning_naspipe.space.supernet import Supernet
from lightning_naspipe.transport.p2p import StageFailure

__all__ = ["Architecture", "Cell", "ChoiceBlock", "Constrained", "Constraints", "Difference", "Elastic",
           "ElasticAttention", "ElasticBatchNorm1d", "ElasticBatchNorm2d", "ElasticConv2d", "ElasticDepth",
           "ElasticEmbedding", "ElasticLayerNorm", "ElasticLinear", "ElasticMLP", "ElasticPatchEmbed",
           "EvolutionSearch", "FairNAS", "GridSearch", "InputChoice", "LatencyPenalty",
           "LatencyReport", "LatencyTable", "NASPipeCallback", "NASPipeConfigError", "NASPipeMixin", "NASPipeStrategy",
           "RandomSearch", "Record", "SPOSSearch", "Sandwich", "SearchResult", "Searcher", "StageFailure", "Supernet",
           "VerifyReport", "When", "Zero", "__version__", "load_subnet", "measure_latency", "naspipe_cli",
           "recalibrate_batchnorm", "save_subnet", "search", "verify"]
__version__ = "0.2.0"
