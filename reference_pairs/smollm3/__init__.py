"""SmolLM3: from-scratch model, Transformers-format loader, and its pair with ``SmolLM3ForCausalLM``."""

from .configs import CONFIGS
from .family import FAMILY, build_pair
from .loader import load_weights_into_smollm3
from .model import SmolLM3Model

__all__ = ["CONFIGS", "FAMILY", "SmolLM3Model", "build_pair", "load_weights_into_smollm3"]
