"""Gemma 4 (dense text: E2B, E4B): from-scratch model, Transformers-format loader, and its pair with
``Gemma4ForCausalLM``."""

from .configs import CONFIGS
from .family import FAMILY, build_pair
from .loader import load_weights_into_gemma4
from .model import Gemma4Model

__all__ = ["CONFIGS", "FAMILY", "Gemma4Model", "build_pair", "load_weights_into_gemma4"]
