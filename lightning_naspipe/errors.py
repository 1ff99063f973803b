"""The one exception type users see for a misconfigured NASPipe run."""

from lightning_fabric.utilities.exceptions import MisconfigurationException


class NASPipeConfigError(MisconfigurationException, ValueError, TypeError):
    """A NASPipe setting, module or architecture is invalid.

    The message always names the problem and the fix. It subclasses Lightning's
    ``MisconfigurationException`` as well as ``ValueError`` and ``TypeError`` so that
    whichever of those a caller already catches, it catches this too.
    """
