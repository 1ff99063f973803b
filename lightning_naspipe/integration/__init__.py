"""The Lightning glue: the strategy, its stage processes, callback, mixin, CLI and loop state.

Layer: integration, the top. The only subpackage that imports a Lightning namespace
(``lightning``, ``pytorch_lightning``, ``lightning_fabric``; besides ``compat.lightning``, its private names, which
only this layer and the entry import). May import every other layer;
nothing else in the package imports it (the top-level ``lightning_naspipe/__init__.py`` excepted).
"""

__all__: list[str] = []
