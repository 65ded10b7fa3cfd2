"""GPT-2: from-scratch model, Transformers-format loader (Conv1D weights transposed), and its pair
with ``GPT2LMHeadModel``."""

from .configs import CONFIGS
from .family import FAMILY, build_pair
from .loader import load_weights_into_gpt
from .model import GPTModel

__all__ = ["CONFIGS", "FAMILY", "GPTModel", "build_pair", "load_weights_into_gpt"]
