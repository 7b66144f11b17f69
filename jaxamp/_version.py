"""The single source of jaxamp's version (read by pyproject.toml too)."""

__version__ = "0.4.0"
