"""Qwen3-MoE: from-scratch model, Transformers-format loader, and its pair with ``Qwen3MoeForCausalLM``."""

from .configs import CONFIGS
from .loader import load_weights_into_qwen3_moe
from .model import Qwen3MoeModel
from .pair import FAMILY, build_pair

__all__ = ["CONFIGS", "FAMILY", "Qwen3MoeModel", "build_pair", "load_weights_into_qwen3_moe"]
