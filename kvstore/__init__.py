"""The sharded key-value store on the conditional-publish WAL (see README.md)."""

from importlib import metadata

try:
    __version__ = metadata.version("kvstore")  # one source: [project].version in pyproject.toml
except metadata.PackageNotFoundError:  # a source tree on PYTHONPATH that was never installed
    __version__ = "0+unknown"
