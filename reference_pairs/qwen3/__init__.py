"""Qwen3 (dense): from-scratch model, Transformers-format loader, and its pair with ``Qwen3ForCausalLM``."""

from .configs import CONFIGS
from .loader import load_weights_into_qwen3
from .model import Qwen3Model
from .pair import FAMILY, build_pair

__all__ = ["CONFIGS", "FAMILY", "Qwen3Model", "build_pair", "load_weights_into_qwen3"]
