"""lemonkit's version, in a module of its own: core modules read it without importing the package's API."""

__version__ = "0.1.0"
