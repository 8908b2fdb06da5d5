"""The ``qkv`` command line: thin subcommands over library functions."""

from .main import main

__all__ = ["main"]
