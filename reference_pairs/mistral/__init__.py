"""Mistral: the llama3 family's model and loader with a sliding window on every layer, paired with
``MistralForCausalLM``."""

from .configs import CONFIGS
from .family import FAMILY, build_pair

__all__ = ["CONFIGS", "FAMILY", "build_pair"]
