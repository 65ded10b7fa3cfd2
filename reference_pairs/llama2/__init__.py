"""Llama 2: the llama3 family's model and loader with Llama 2's configs (MHA, plain RoPE, untied head)."""

from .configs import CONFIGS
from .family import FAMILY, build_pair

__all__ = ["CONFIGS", "FAMILY", "build_pair"]
