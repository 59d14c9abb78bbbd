"""parallelvars: one logical variable held as one component buffer per device."""

from parallelvars.errors import ParallelVarsError

__version__ = "0.1.0"

__all__ = ["ParallelVarsError", "__version__"]
