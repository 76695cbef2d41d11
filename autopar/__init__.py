"""autopar: a declarative auto-parallel compiler for PyTorch."""

from autopar._version import __version__

__all__ = ["__version__"]
