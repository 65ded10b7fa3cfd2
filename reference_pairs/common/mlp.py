"""Feed-forward networks: the gated MLP (SwiGLU / GeGLU) and the plain two-layer MLP.

Activations are named as Transformers configs name them (``hidden_act`` / ``activation_function``),
so a family passes its config value through; each is written in the reference's operation order.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F


def gelu_tanh_formula(x: torch.Tensor) -> torch.Tensor:
    """``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))``, the tanh approximation of GELU
    (Hendrycks & Gimpel 2016, arXiv:1606.08415) evaluated op by op as GPT-2's ``gelu_new``
    (``NewGELUActivation``) does; torch's fused ``gelu(approximate="tanh")`` rounds differently."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


#: Transformers activation name -> function
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,  # SwiGLU: Llama, OLMo, Qwen, Mistral, Cohere
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),  # GeGLU: Gemma 2/3/4
    "gelu_new": gelu_tanh_formula,  # GPT-2
    "gelu": F.gelu,  # exact (erf) GELU
}


def get_activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The activation function for a Transformers activation name; ValueError for any other."""
    if name not in ACTIVATIONS:
        raise ValueError(f"activation {name!r} is not supported ({', '.join(ACTIVATIONS)})")
    return ACTIVATIONS[name]


class GatedMLP(nn.Module):
    """Gated feed-forward: ``fc3(act(fc1(x)) * fc2(x))``.

    Shazeer 2020 ("GLU Variants Improve Transformer", arXiv:2002.05202): SwiGLU with ``silu``
    (``LlamaMLP``), GeGLU with ``gelu_pytorch_tanh`` (``Gemma3MLP``). ``fc1`` is the gate
    (Transformers ``gate_proj``), ``fc2`` the up projection (``up_proj``), ``fc3`` the down
    projection (``down_proj``). Shapes: ``(batch, seq, emb_dim)`` -> ``(batch, seq, emb_dim)``,
    ``hidden_dim`` wide inside.

    ``fused_gate_up``: gate and up in one matrix product over ``[fc1; fc2]`` (the weights stacked),
    then split, as Transformers' fused MoE experts compute it (``Qwen3MoeExperts``: one ``F.linear``
    with ``gate_up_proj[e]``, then ``chunk``); the same values as two products, but in bfloat16 the
    CPU's GEMM may round a column block differently from the whole (seen from 128 tokens at real
    widths), so a bit-exact port rounds as the reference does. ``fc1``/``fc2`` stay the book's two
    Linears (their forward hooks do not fire then).
    """

    def __init__(
        self,
        emb_dim: int,
        hidden_dim: int,
        *,
        activation: str = "silu",
        bias: bool = False,
        fused_gate_up: bool = False,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        self.act_name, self.act = activation, get_activation(activation)
        self.fused_gate_up = fused_gate_up
        self.fc1 = nn.Linear(emb_dim, hidden_dim, bias=bias, dtype=dtype)
        self.fc2 = nn.Linear(emb_dim, hidden_dim, bias=bias, dtype=dtype)
        self.fc3 = nn.Linear(hidden_dim, emb_dim, bias=bias, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.fused_gate_up:
            return self.fc3(self.act(self.fc1(x)) * self.fc2(x))
        weight = torch.cat([self.fc1.weight, self.fc2.weight])
        bias = None if self.fc1.bias is None else torch.cat([self.fc1.bias, self.fc2.bias])
        gate, up = F.linear(x, weight, bias).chunk(2, dim=-1)
        return self.fc3(self.act(gate) * up)

    def extra_repr(self) -> str:
        return f"activation={self.act_name}" + (", fused_gate_up" if self.fused_gate_up else "")


class MLP(nn.Module):
    """Plain two-layer feed-forward: ``fc2(act(fc1(x)))``, with biases.

    Vaswani et al. 2017 (position-wise FFN), with GELU as in GPT-2 (``GPT2MLP``: ``c_fc``, then
    ``gelu_new``, then ``c_proj``; Transformers stores those as transposed ``Conv1D`` weights, a
    loader's business). Shapes: ``(batch, seq, emb_dim)`` -> ``(batch, seq, emb_dim)``.
    """

    def __init__(
        self,
        emb_dim: int,
        hidden_dim: int,
        *,
        activation: str = "gelu_new",
        bias: bool = True,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        self.act_name, self.act = activation, get_activation(activation)
        self.fc1 = nn.Linear(emb_dim, hidden_dim, bias=bias, dtype=dtype)
        self.fc2 = nn.Linear(hidden_dim, emb_dim, bias=bias, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))

    def extra_repr(self) -> str:
        return f"activation={self.act_name}"
