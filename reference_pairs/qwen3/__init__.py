"""Qwen3 (dense): from-scratch model, Transformers-format loader, and its pair with ``Qwen3ForCausalLM``."""

from .configs import CONFIGS
from .family import FAMILY, build_pair
from .loader import load_weights_into_qwen3
from .model import Qwen3Model

__all__ = ["CONFIGS", "FAMILY", "Qwen3Model", "build_pair", "load_weights_into_qwen3"]
