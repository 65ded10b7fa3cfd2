"""Qwen3-MoE: from-scratch model, Transformers-format loader, and its pair with ``Qwen3MoeForCausalLM``."""

from .configs import CONFIGS
from .family import FAMILY, build_pair
from .loader import load_weights_into_qwen3_moe
from .model import Qwen3MoeModel

__all__ = ["CONFIGS", "FAMILY", "Qwen3MoeModel", "build_pair", "load_weights_into_qwen3_moe"]
