"""Gemma 3 (text): from-scratch model, Transformers-format loader, and its pair with ``Gemma3ForCausalLM``."""

from .configs import CONFIGS
from .family import FAMILY, build_pair
from .loader import load_weights_into_gemma3
from .model import Gemma3Model

__all__ = ["CONFIGS", "FAMILY", "Gemma3Model", "build_pair", "load_weights_into_gemma3"]
