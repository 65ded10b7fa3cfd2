"""One version number: the installed distribution's (``pyproject.toml``), read from its metadata."""

from importlib import metadata

try:
    VERSION = metadata.version("parity")
except metadata.PackageNotFoundError:  # a source tree on sys.path, never installed
    VERSION = "0+unknown"
