"""Ready adapters for runtimes that are not PyTorch (floor 6, beside :mod:`parity.golden`: they read a
trace's inputs and write a dump that ``parity compare`` judges).

* :mod:`parity.runtimes.mlx`: mlx-lm (``pip install 'parity[mlx]'``), ``parity dump mlx``;
* :mod:`parity.runtimes.llama_cpp`: llama.cpp through llama-cpp-python's eval callback
  (``pip install 'parity[llama-cpp]'``), ``parity dump llama-cpp``; its name maps per GGUF
  architecture are data (``parity/runtimes/llama_cpp_names.json``).

Neither runtime is imported until an adapter runs; a missing one is :class:`RuntimeMissing` (one line
naming the extra that installs it).
"""

from parity.runtimes.common import RuntimeMissing, write_dump

#: the adapters ``parity dump`` knows, by the name its command line takes
ADAPTERS = ("mlx", "llama-cpp")

__all__ = ["ADAPTERS", "RuntimeMissing", "write_dump"]
