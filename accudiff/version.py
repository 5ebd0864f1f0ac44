"""accudiff's version, in a module of its own: the package's modules read it without importing the package."""

__version__ = "0.1.0"
