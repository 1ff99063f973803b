"""The one exception type users see for a misconfigured NASPipe run."""

from lightning_naspipe.namespaces import installed

_MISCONFIGURATION = tuple(ns.fabric_module("utilities.exceptions").MisconfigurationException for ns in installed())


class NASPipeConfigError(*_MISCONFIGURATION, ValueError, TypeError):  # type: ignore[misc]
    """A NASPipe setting, module or architecture is invalid.

    The message always names the problem and the fix. It subclasses Lightning's
    ``MisconfigurationException`` (of ``lightning.fabric`` and of
    ``lightning_fabric``, whichever are installed) as well as ``ValueError`` and ``TypeError`` so that
    whichever of those a caller already catches, it catches this too.
    """
