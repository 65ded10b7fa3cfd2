"""GPT-2: from-scratch model, Transformers-format loader (Conv1D weights transposed), and its pair
with ``GPT2LMHeadModel``."""

from .configs import CONFIGS
from .loader import load_weights_into_gpt
from .model import GPTModel
from .pair import FAMILY, build_pair

__all__ = ["CONFIGS", "FAMILY", "GPTModel", "build_pair", "load_weights_into_gpt"]
