"""OLMo 3: from-scratch model, Transformers-format loader, and its pair with ``Olmo3ForCausalLM``."""

from .configs import CONFIGS
from .family import FAMILY, build_pair
from .loader import load_weights_into_olmo3
from .model import Olmo3Model

__all__ = ["CONFIGS", "FAMILY", "Olmo3Model", "build_pair", "load_weights_into_olmo3"]
