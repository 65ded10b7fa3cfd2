"""Qwen3.5 (text): from-scratch hybrid model, Transformers-format loader, and its pair with ``Qwen3_5ForCausalLM``."""

from .configs import CONFIGS
from .family import FAMILY, build_pair
from .loader import load_weights_into_qwen3_5
from .model import Qwen3_5Model

__all__ = ["CONFIGS", "FAMILY", "Qwen3_5Model", "build_pair", "load_weights_into_qwen3_5"]
