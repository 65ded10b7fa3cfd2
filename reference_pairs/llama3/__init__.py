"""Llama 3.2: from-scratch model, Transformers-format loader, and its pair with ``LlamaForCausalLM``."""

from .configs import CONFIGS
from .family import FAMILY, build_pair
from .loader import load_weights_into_llama3
from .model import Llama3Model

__all__ = ["CONFIGS", "FAMILY", "Llama3Model", "build_pair", "load_weights_into_llama3"]
