"""The version of anarchon (the one in pyproject.toml)."""

__version__ = "0.1.0"
