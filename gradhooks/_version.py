"""The version of gradhooks (read by setup.cfg without importing the package)."""
__version__ = "0.1.0"
