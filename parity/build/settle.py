"""A reference whose own forward rewrites some of its weights in place the first time it runs (Transformers'
``RwkvModel`` divides each block's output weights by ``2 ** (block // rescale_every)`` on its first forward in
eval mode, and multiplies them back in train mode): run once before the pair is built, so every check sees the
reference as it stays, and ours is built from the tensors as the checkpoint holds them.

Without this, the reference changes tensors both models may share during the check, and parity would refuse the
pair as if ours had edited them (:func:`parity.run.stages.refuse_changed_weights`).
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class _FirstWrites(TorchDispatchMode):
    """Keeps a copy of each state-dict tensor as it was before the first op writing into its storage."""

    def __init__(self, state_dict: dict[str, torch.Tensor]):
        super().__init__()
        self.state_dict = state_dict
        self.keys: dict[int, list[str]] = {}
        for key, tensor in state_dict.items():
            if isinstance(tensor, torch.Tensor) and tensor.device.type != "meta":
                self.keys.setdefault(tensor.untyped_storage().data_ptr(), []).append(key)
        self.originals: dict[str, torch.Tensor] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        schema = func._schema
        if schema.is_mutable:
            for i, argument in enumerate(schema.arguments):
                if argument.alias_info is None or not argument.alias_info.is_write:
                    continue
                value = args[i] if i < len(args) else kwargs.get(argument.name)
                if isinstance(value, torch.Tensor):
                    for key in self.keys.get(value.untyped_storage().data_ptr(), ()):
                        if key not in self.originals:
                            self.originals[key] = self.state_dict[key].detach().clone()
        return func(*args, **kwargs)


def settle(model: torch.nn.Module, state_dict: dict[str, torch.Tensor], vocab_size: int) -> dict[str, torch.Tensor]:
    """Run ``model`` (the reference, eval mode) once on two tokens, without gradients or a cache, and return
    ``{key: the tensor as it was}`` for each tensor of ``state_dict`` its forward wrote into (empty for nearly
    every model). ``model`` keeps what its forward wrote. A forward that raises returns ``{}``: the check's own
    run of the reference then reports it."""
    device = next((p.device for p in model.parameters() if p.device.type != "meta"), torch.device("cpu"))
    ids = (torch.arange(2) % max(int(vocab_size), 1))[None].to(device)
    writes = _FirstWrites(state_dict)
    try:
        with torch.no_grad(), writes:
            model(input_ids=ids, use_cache=False)
    except Exception:  # the reference cannot run: its own run in the check says why
        return {}
    return writes.originals
