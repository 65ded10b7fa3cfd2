"""Both models in float64, really: the semantic run, and the reference's own noise for calibration.

Rounding in float64 sits near 1e-15, while a difference of formula (an eps, a scale, a window, a
cast that changes what is computed) stays at its own size, so in float64 the two separate for any
pair, bit-exact or not. :func:`float64_models` gives float64 copies of ours and the reference that
share one float64 copy of the shared weights (every view, split and tie kept: each storage is copied
once and every tensor re-made on it with its own size, strides and offset); the models themselves
are left as they are. :class:`Float64Mode` keeps the run float64 where code asks for float32 or
lower (Transformers' norms and RoPE call ``x.float()``, ``.to(torch.float32)``, ``softmax(...,
dtype=torch.float32)``): without it those casts would round back to float32 and the "float64"
reference would carry float32 noise.
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from parity.util.errors import ParityError
from parity.util.resources import require
from parity.util.rounding import ROUNDING

LOW = (torch.float32, torch.float16, torch.bfloat16)
#: tensor methods that cast to a low float dtype by name
CASTS = {torch.Tensor.float, torch.Tensor.half, torch.Tensor.bfloat16}


def _high(value):
    """``value`` with every low float dtype (as a dtype, anywhere among arguments) made float64."""
    if isinstance(value, torch.dtype) and value in LOW:
        return torch.float64
    if isinstance(value, (tuple, list)):
        return type(value)(_high(v) for v in value)
    return value


class Float64Mode(TorchFunctionMode):
    """Inside it, a cast to float32, float16 or bfloat16 stays float64 (``x.float()``,
    ``x.to(torch.float32)``, ``x.type(torch.bfloat16)``, ``softmax(x, dtype=torch.float32)``, a new
    tensor ``dtype=torch.float32``), and a tensor made without a dtype (``torch.tensor(0.5)``, a new
    Parameter) is float64: the default dtype is float64 while the mode is on."""

    def __enter__(self):
        self._default = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)
        return super().__enter__()

    def __exit__(self, exc_type, exc_val, exc_tb):
        try:
            return super().__exit__(exc_type, exc_val, exc_tb)
        finally:
            torch.set_default_dtype(self._default)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if ROUNDING.get():
            return func(*args, **kwargs)
        if func in CASTS:
            # an integer or bool tensor's .float() too (torch.arange(0, d, 2).float() / d: RoPE frequencies)
            return func(*args, **kwargs) if args[0].is_complex() else args[0].double()
        if func in (torch.Tensor.to, torch.Tensor.type):
            args = tuple(_high(a) for a in args)
        if "dtype" in kwargs:
            kwargs = {**kwargs, "dtype": _high(kwargs["dtype"])}
        elif func in (torch.softmax, torch.nn.functional.softmax, torch.log_softmax) and len(args) > 2:
            args = (*args[:2], _high(args[2]), *args[3:])
        return func(*args, **kwargs)


def _tensors(model: nn.Module):
    for module in model.modules():
        for p in module._parameters.values():
            if p is not None:
                yield p
        for b in module._buffers.values():
            if b is not None:
                yield b


def _storage_id(t: torch.Tensor) -> tuple:
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes(), t.device


def float64_state_dict(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state_dict`` with every floating tensor in float64, a storage its tensors share (a tie, the
    views of a fused tensor) copied once and shared again; integer tensors kept as they are."""
    storages: dict[tuple, torch.Tensor] = {}
    out = {}
    for key, t in state_dict.items():
        if not t.is_floating_point() or t.is_meta:
            out[key] = t
            continue
        sid = _storage_id(t)
        base = storages.get(sid)
        if base is None:
            base = torch.empty(0, dtype=t.dtype, device=t.device).set_(t.untyped_storage()).to(torch.float64)
            storages[sid] = base
        out[key] = base.as_strided(t.shape, t.stride(), t.storage_offset())
    return out


def all_float64(model: nn.Module) -> str | None:
    """None when every floating parameter and buffer of ``model`` is float64, else the first that is not."""
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if t.is_floating_point() and t.dtype != torch.float64:
            return f"{name} is {str(t.dtype).replace('torch.', '')}"
    return None


def float64_models(*models: nn.Module, what: str = "the float64 semantic run") -> list[nn.Module]:
    """Float64 copies of ``models`` (structure copied, the originals untouched) in which a tensor the
    originals share is shared again: every storage is copied to float64 once and each parameter or
    buffer re-made on it with its own size, strides and offset. Integer buffers are kept. Raises
    ParityError when the copy would not fit in memory."""
    storages: dict[tuple, torch.Tensor] = {}
    floats = [t for m in models for t in _tensors(m) if t.is_floating_point()]
    need = sum(
        s[1] // torch.empty((), dtype=t.dtype).element_size() * 8
        for s, t in {_storage_id(t): t for t in floats}.items()
    )
    require(need, f"a float64 copy of the weights ({what})", "use a smaller config or drop the semantic run")
    memo: dict[int, torch.Tensor] = {}
    for t in floats:
        if id(t) in memo or t.is_meta:
            continue
        key = _storage_id(t)
        base = storages.get(key)
        if base is None:
            flat = torch.empty(0, dtype=t.dtype, device=t.device).set_(t.untyped_storage())
            base = flat.to(torch.float64)
            storages[key] = base
        data = base.as_strided(t.shape, t.stride(), t.storage_offset())
        memo[id(t)] = nn.Parameter(data, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else data
    try:
        return [copy.deepcopy(m, memo) for m in models]
    except Exception as e:  # a model deepcopy cannot copy (a lock, a generator): say so, not a traceback
        raise ParityError(
            f"the float64 run needs a copy of the model and {type(models[0]).__name__} cannot be copied: "
            f"{type(e).__name__}: {e}"
        ) from None
