"""The build toolchain: recipe -> traced graph IR -> passes -> engine artifact."""

__version__ = "0.1.0"
