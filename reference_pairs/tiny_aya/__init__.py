"""Tiny Aya: from-scratch model, Transformers-format loader, and its pair with ``Cohere2ForCausalLM``."""

from .configs import CONFIGS
from .family import FAMILY, build_pair
from .loader import load_weights_into_tiny_aya
from .model import TinyAyaModel

__all__ = ["CONFIGS", "FAMILY", "TinyAyaModel", "build_pair", "load_weights_into_tiny_aya"]
