"""Where the two models run: one device (``cpu``, ``cuda``, ``cuda:1``, ``mps``), or spread over the
GPUs by a device map (``auto``, through accelerate) for a model larger than one GPU.

The weights still exist once: the checkpoint-named state dict is moved to its device(s) *before*
either model is built, and both models wrap those tensors. Forward passes run on the device(s);
traces are detached to the CPU (:mod:`parity.record.hooks`), where everything is compared.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from parity.util.errors import ConfigError

DEVICE_MAPS = ("auto",)


def _available(device: torch.device) -> str | None:
    """Why ``device`` cannot be used here, or None."""
    if device.type == "cpu":
        return None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return "this torch has no CUDA device (a CPU-only build, or no GPU visible)"
        if device.index is not None and device.index >= torch.cuda.device_count():
            return f"only {torch.cuda.device_count()} CUDA device(s) are visible"
        return None
    if device.type == "mps":
        return None if torch.backends.mps.is_available() else "MPS is not available on this machine"
    return "parity runs on cpu, cuda or mps"


@dataclass(frozen=True)
class Placement:
    """One device, or a device map (``"auto"``) computed for the reference when the pair is built."""

    device: torch.device = torch.device("cpu")  # noqa: RUF009 (a torch.device is immutable)
    device_map: str | None = None

    @classmethod
    def of(cls, device=None, device_map=None) -> Placement:
        """Validate ``device`` / ``device_map``. Raises ConfigError (one line)."""
        if device is not None and device_map is not None:
            raise ConfigError("give a device or a device map, not both")
        if device_map is not None:
            if device_map not in DEVICE_MAPS:
                raise ConfigError(f"device map must be one of {', '.join(DEVICE_MAPS)}, got {device_map!r}")
            try:
                import accelerate  # noqa: F401
            except ImportError:
                raise ConfigError("a device map needs accelerate: pip install accelerate") from None
            return cls(device_map=device_map)
        try:
            dev = torch.device(device if device is not None else "cpu")
        except (RuntimeError, TypeError):
            raise ConfigError(f"unknown device {device!r}; use cpu, cuda, cuda:N or mps") from None
        problem = _available(dev)
        if problem:
            raise ConfigError(f"device {dev} cannot be used: {problem}")
        return cls(device=dev)

    @property
    def label(self) -> str:
        return f"device_map={self.device_map}" if self.device_map else str(self.device)

    @property
    def is_cpu(self) -> bool:
        return self.device_map is None and self.device.type == "cpu"

    def plan(self, reference_cls, hf_config, dtype: torch.dtype) -> dict[str, str]:
        """``{reference module path: device}`` (one entry, ``""``, for a single device)."""
        if self.device_map is None:
            return {"": str(self.device)}
        from accelerate import infer_auto_device_map
        from accelerate.utils import get_balanced_memory

        with torch.device("meta"):
            model = reference_cls(hf_config)
        no_split = list(getattr(model, "_no_split_modules", None) or [])
        if torch.cuda.is_available() and torch.cuda.device_count() > 0:
            # GPUs only: parity keeps one copy of the weights, never offloaded to the CPU or disk
            max_memory = get_balanced_memory(model, no_split_module_classes=no_split, dtype=dtype)
            max_memory = {k: v for k, v in max_memory.items() if k not in ("cpu", "disk")}
        else:
            max_memory = {"cpu": _host_bytes()}
        device_map = infer_auto_device_map(model, max_memory=max_memory, no_split_module_classes=no_split, dtype=dtype)
        if any(str(d) in ("disk", "meta") for d in device_map.values()) or (
            torch.cuda.is_available() and any(str(d) == "cpu" for d in device_map.values())
        ):
            raise ConfigError(
                f"the weights do not fit on the GPUs (device map {_summary(device_map)}); parity keeps them on "
                "the devices, never offloaded: use fewer layers or more GPUs"
            )
        return {name: _device_name(d) for name, d in device_map.items()}

    def place(self, state_dict: Mapping[str, torch.Tensor], plan: Mapping[str, str]) -> dict[str, torch.Tensor]:
        """``state_dict`` (checkpoint naming) with every tensor on its device; tensors that are one
        tensor (a tie) stay one tensor. Nothing moves when everything is already there."""
        moved: dict[int, torch.Tensor] = {}
        out = {}
        for key, tensor in state_dict.items():
            if id(tensor) not in moved:
                target = torch.device(_device_for(key, plan))
                moved[id(tensor)] = tensor if tensor.device == target else tensor.to(target)
            out[key] = moved[id(tensor)]
        return out

    def dispatch(self, model: nn.Module, plan: Mapping[str, str] | None = None) -> nn.Module:
        """Put ``model``'s remaining tensors (buffers) on the device; under a device map, attach
        accelerate's hooks that carry activations from device to device (``plan``: the reference's
        device map; for ours, a map is read off where its parameters already are)."""
        if self.device_map is None:
            return model if self.is_cpu else model.to(self.device)
        from accelerate import dispatch_model

        device_map = dict(plan) if plan is not None else _map_of(model)
        first = next(iter(device_map.values()))
        # hooks even on one device: the same code path runs on a CPU machine as across GPUs
        return dispatch_model(model, device_map=device_map, main_device=first, force_hooks=True)


def _host_bytes() -> int:
    from parity.util.resources import available_bytes

    return available_bytes() or 1 << 40


def _device_name(device) -> str:
    return f"cuda:{device}" if isinstance(device, int) else str(device)


def _device_for(key: str, plan: Mapping[str, str]) -> str:
    """The device of the longest module path in ``plan`` that holds ``key``."""
    best, device = -1, plan.get("", "cpu")
    for name, dev in plan.items():
        if (name == "" or key == name or key.startswith(name + ".")) and len(name) > best:
            best, device = len(name), dev
    return device


def _map_of(model: nn.Module) -> dict[str, str]:
    """The coarsest ``{module path: device}`` that says where every parameter of ``model`` is."""
    out: dict[str, str] = {}

    def visit(prefix: str, module: nn.Module) -> None:
        devices = {str(p.device) for p in module.parameters()}
        if len(devices) <= 1:
            out[prefix] = devices.pop() if devices else "cpu"
            return
        for name, child in module.named_children():
            visit(f"{prefix}.{name}" if prefix else name, child)
        for name, param in module.named_parameters(recurse=False):
            out[f"{prefix}.{name}" if prefix else name] = str(param.device)

    visit("", model)
    return out


def _summary(device_map: Mapping) -> str:
    counts: dict[str, int] = {}
    for device in device_map.values():
        counts[str(device)] = counts.get(str(device), 0) + 1
    return ", ".join(f"{n} module(s) on {d}" for d, n in counts.items())
