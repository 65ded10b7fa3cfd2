"""One change to the reference's code that makes it agree with ours: a failing node after a block whose
internals ours computes where nothing taps them (a Gated DeltaNet, a Mamba mixer, an attention with sinks) is
read by re-running the reference with one operation inside that block changed at a time, and the change
after which the reference agrees with ours (at that node, or at the block's layer output) is named, with the
line of the reference's source it sits on.

The changes are the porting mistakes one operation can hold: an activation left out or another in its place
(SiLU, sigmoid, GELU, ReLU, softplus), an ``abs`` left out, an ``exp`` left out (a log-parameterised rate used as it is), a
normalisation's reciprocal root left out (an L2 or RMS norm skipped), a scalar factor, divisor or offset left
out, a parameter added or multiplied left out, a clamp left out, a softmax replaced by a sigmoid or left out, a
slice taken from the other end of its axis (a causal conv's output kept from the wrong side), heads repeated as
whole blocks instead of interleaved (``repeat_interleave`` against ``repeat``: which value head reads which key
head), a scalar factor applied twice (folded into a weight at load and applied again), a minus sign left out, two
parts of one shape of a split swapped (gate and up, B and C, a head's k and v), two neighbouring parts of
unequal sizes read in the other order from the fused tensor (Mamba-2's z and xBC), a triangular mask's diagonal moved
by one, a grouped mean taken over every group together or over another axis, a gated norm's gate applied on the other side of its
normalisation, a conv's kernel read in reverse, the weights of two projections of one input swapped, a gain read
as ``1 + w``, a softmax-style scale ``1 / sqrt(d)`` taken from another of the config's sizes, a per-head fused
output (each head's q, k and v together) read as whole blocks, a top-k keeping every entry, a square weight read
transposed (two on nearby lines together), the parameters of two products of one input swapped (their views too),
an activation of the negated input, a negative factor's size left out with its sign kept, a square matrix's transpose left out, heads split strided, a bias added twice, a
config float read as its class's default, a gate moved across a norm (both ways), a weightless norm left out (Gemma's
value norm), a weightless norm or an activation moved across the product reading it (``norm(x @ W)``, ``relu(w @
s)``), a mask filled after the softmax
(its probabilities zeroed), a clamp's infinite bound (no clamp) taken as 0, a product reading a norm's input in place
of its output, a dilated conv run undilated, a delta-rule, selective or WKV scan run with its steps in
another order (:mod:`parity.diagnose.scan_order`), RoPE's pairs in the other convention (per calling line too:
:mod:`parity.diagnose.rope_pairs`), a top-k ranking an activation of the scores; an in-place op (``a /= s``) is changed from
its input's value before it; then, in a second
pass, a term of a sum left out (a skip connection), a broadcast factor that is no parameter left out (a padding
mask) and a parameter added to an activation's input added to its output instead (``softplus(dt) + dt_bias``);
then a projection, an activation, a softmax or a log-sum-exp reading another variable (of its shape, or a
``(batch, heads, seq, dim)`` one with its heads merged); a module beside the failing node that no node records left
out (its input handed on). Every call of one source line is changed together (a loop over chunks), a
helper called from several lines also per caller, and the same change on two adjacent lines together (q and k).

First of all, a tensor argument of the layer's call (not its hidden states) given the value an earlier layer's call
received or returned for it, where that differs: a value handed between layers taken from another layer (a shared
indexer layer reading the first full layer's top-k instead of the latest).

The search runs only where no detector named a cause, each pass re-running the failing node's decoder layer
alone on the inputs it had and stopping once the last node read is produced, at most :data:`MAX_RUNS` passes.
A change names which operation differs, not which side is wrong: the fault may sit in the reference (a patched
or older Transformers) as well as in ours.
"""

from __future__ import annotations

import inspect
import itertools
import linecache
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from types import FrameType
from typing import cast

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from parity.diagnose import rope_pairs, scan_order
from parity.diagnose.hints import Hint

#: forward passes one search may take (the dry run included): the limit that decides what a search tries;
#: the wall-clock budget in seconds only guards against a model far larger than a check's usual config
MAX_RUNS = 500
MAX_SECONDS = 60.0

#: ops that hand on a norm's output unchanged but for its shape
_RESHAPES = frozenset({"reshape", "view", "flatten", "contiguous"})
#: ops that hand on a skipped norm's or activation's input to the product that reads it (its axes or dtype changed)
_HANDS_ON = _RESHAPES | {"transpose", "permute", "to", "float", "type_as", "unsqueeze", "squeeze"}
#: products a norm or an activation moved across them applies to their output
_PRODUCTS = ("linear", "matmul", "__matmul__", "bmm")
#: the activations one may stand in place of another; tanh (a soft cap's) and abs (a rate kept positive) may only be
#: left out
_LEFT_OUT = ("tanh", "abs")
_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "sigmoid": torch.sigmoid,
    "gelu": F.gelu,
    "relu": torch.relu,
    "softplus": F.softplus,
}
#: operations returning parts of their input, two of which may be swapped
_SPLITS = ("split", "chunk", "unbind", "tensor_split", "split_with_sizes")
#: what a scalar operand of a product or quotient is called (any other is an offset)
_VERBS = {"mul": "factor", "truediv": "divisor", "div": "divisor"}
_SCALAR_OPS = {"mul", "truediv", "div", "add", "sub"}
#: the end of a change's words: a square weight read transposed
_TRANSPOSED = " read transposed (a square weight's last two axes swapped at load)"
#: frames of these files are not the reference's own lines: torch's, and parity's (its recording wrappers)
_SKIP_FILES = (str(Path(torch.__file__).parent), str(Path(__file__).parent.parent))


@dataclass(frozen=True)
class Site:
    """A source line of the reference's code and the operation it calls (its function's name); with a caller,
    only the calls made from that line of the code calling it (a helper such as an activation's module or an
    L2 norm called for q and for k)."""

    op: str
    file: str
    line: int
    caller: tuple[str, int] | None = None
    #: "scalar" for a call with a Python number among its operands, "parameter" for one reading a parameter: ``h *
    #: up * 1.5`` and ``w * (x * r)`` each hold two sites
    operand: str = ""

    @property
    def where(self) -> str:
        text = _line(self.file, self.line)
        if self.caller is not None:
            text += f" called from {_line(*self.caller)}"
        return text


def _line(file: str, line: int) -> str:
    code = " ".join(linecache.getline(file, line).split())
    code = code if len(code) <= 90 else code[:87] + "..."
    return f"{Path(file).name}:{line}" + (f" (`{code}`)" if code else "")


@dataclass(frozen=True)
class Change:
    """One change at a site: its words and how it rewrites the call's output from (args, kwargs, out); ``also``:
    the same call on an adjacent line changed alike (q and k repeated, normalised, scaled the same way)."""

    site: Site
    words: str
    #: ``(args, kwargs, out)`` -> the call's new output; for a module's change ``(module, args, kwargs, out)``
    rewrite: Callable[..., object]
    also: Site | None = None
    #: further sites changed alike (q, k and v each split into heads on three lines)
    more: tuple[Site, ...] = ()
    #: the site whose latest output the call reads in place of its first input (a variable mixed up with
    #: another); :data:`LAYER_INPUT` for the input of the layer the block sits in
    source: Site | None = None
    #: the source is read as ``(batch, heads, seq, dim)`` with its heads merged: ``(batch, seq, heads * dim)``
    heads_merged: bool = False
    #: a module path of the model whose whole call the change rewrites (a gated norm's gate moved to the
    #: other side of its normalisation), with ``rewrite(module, args, kwargs, out)``; None for one operation
    module: str | None = None
    #: a function of the reference's modeling code replaced for the pass: ``(module name, global name,
    #: replacement)`` (a delta-rule scan run in another step order); ``rewrite`` is unused then
    patch: tuple[str, str, Callable] | None = None
    #: a gate moved across a norm: "before" (a product of a norm's output and a gate rewritten as the norm of the
    #: gated input, ``rewrite(args, kwargs, out, mode)``), "after" (a norm module's gated input rewritten as the
    #: norm of the input times the gate, ``rewrite(module, args, kwargs, out, mode)``); "moved" (a weightless norm
    #: module's call or an activation skipped, the product reading its input normalised or activated:
    #: :func:`_norms_moved`, :func:`_activation_skipped`); "left_out" (a weightless norm module's call left out:
    #: :func:`_norm_left_out`); "read_before" (one operand of a product reading a norm's input in place of its
    #: output: :func:`_read_before_norm`); "after_softmax" (a mask's fill skipped, the next softmax's
    #: probabilities zeroed there: :func:`_fill_after_softmax`); "" for none
    norm_gate: str = ""
    #: the layer's call re-run with one argument (a keyword or a position) given the value another layer's call
    #: received for it: ``(argument, value)`` (a value handed from layer to layer taken from another layer)
    argument: tuple[str | int, torch.Tensor] | None = None
    #: a boolean flag of a module the block holds (set from its config: Bailing-hybrid's ``safe_gate``) flipped for
    #: the pass: ``(module path, attribute)``; the branch the other value takes is code the trace never ran
    attribute: tuple[str, str] | None = None

    @property
    def where(self) -> str:
        others = [s.where for s in (self.also, *self.more) if s is not None]
        return ", ".join([self.site.where, *others[:-1]]) + (f" and {others[-1]}" if others else "")


#: the source of a mix-up that is the layer's own input (the residual stream before its norm)
LAYER_INPUT = Site("input", "the layer's input", 0)
#: operations whose first input a mix-up may replace: a projection, a product, a gather
_READS = ("linear", "matmul", "__matmul__", "bmm", "gather", "conv1d")
#: a softmax's or a log-sum-exp's input may be mixed up too (a sink's log-sum-exp read from the scores before
#: their mask, a softmax reading the scores before a cap)
_NORMALISERS = ("logsumexp", "softmax", "log_softmax")


class _Stop(Exception):
    """Raised by the node's hook once its output is kept: the rest of the forward is not needed."""


class _Changing(TorchFunctionMode):
    """Sees every torch call while the block runs: lists its sites (the dry run) or applies one change."""

    def __init__(
        self,
        change: Change | None = None,
        layer_input: torch.Tensor | None = None,
        params: frozenset[int] = frozenset(),
    ):
        super().__init__()
        self.inside = 0
        self.change = change
        #: ids of the model's parameters: a call reading one is a site of its own (``w * (x * r)``: two sites)
        self.params = params
        #: site -> its callers' sites -> (func, args, kwargs) of the first call from each
        self.sites: dict[Site, dict[Site, tuple]] = {}
        #: per site called from one line of a module's forward, its first call per line calling that module
        self.outer: dict[Site, dict[Site, tuple]] = {}
        #: each caller's site -> the output of its first call
        self.outs: dict[Site, torch.Tensor] = {}
        self.applied = 0
        #: the latest output of the change's source (a mix-up), and the input of the layer the block sits in
        self.held: torch.Tensor | None = None
        self.layer_input = layer_input
        #: norm modules' outputs in this pass (by id) -> (module, its input); products of two tensors of one shape
        #: (by id of the output) -> their operands, while a gate moved before a norm is tried
        self.normed: dict[int, tuple[torch.nn.Module, torch.Tensor]] = {}
        self.products: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        #: a skipped norm's (or activation's) input as the pass hands it on (by id) -> what the product reading it
        #: applies to its output instead, ``(output, axis of the features it makes) -> new output``, while a norm or
        #: an activation moved across a product is tried
        self.skipped: dict[int, Callable[[torch.Tensor, int], torch.Tensor]] = {}
        #: whether a skipped norm or activation was applied to a product's output (else it was only skipped)
        self.moved = False
        #: a boolean mask whose fill was skipped, zeroing the probabilities of the next softmax instead
        self.after_softmax: torch.Tensor | None = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # an in-place op's input, kept while a change runs: its rewrite reads the value before the op
        before = args[0].clone() if self.inside and self.change is not None and _in_place(func, args) else None
        out = func(*args, **kwargs)
        if self.normed and args and isinstance(out, torch.Tensor) and _name(func) in _RESHAPES:
            source = self.normed.get(id(args[0]))
            if source is not None and out.numel() == args[0].numel():  # a norm's output reshaped (heads merged)
                self.normed[id(out)] = source
        if not self.inside or not (isinstance(out, torch.Tensor) or _parts(out)):
            return out
        if self.skipped and isinstance(out, torch.Tensor):
            out = self._moved_across(func, args, out)
        if self.after_softmax is not None and isinstance(out, torch.Tensor) and _name(func) == "softmax":
            mask, self.after_softmax = self.after_softmax, None
            self.applied += 1
            out = out.masked_fill(mask, 0.0)
        found = _sites(func, args, self.params)
        if found is None:
            return out
        site, called, outer = found
        change = self.change
        if change is None:
            self.sites.setdefault(site, {}).setdefault(called, (func, args, kwargs))
            if outer is not None:
                self.outer.setdefault(site, {}).setdefault(outer, (func, args, kwargs))
            if isinstance(out, torch.Tensor):  # a split's parts are no source of a mix-up
                self.outs.setdefault(called, out)
            return out
        if change.norm_gate == "after" and site.op in ("mul", "__mul__", "__rmul__") and _same_shape(args, out):
            self.products[id(out)] = (args[0], args[1])
        if change.source is not None and change.source in (site, called):
            self.held = out
        here = (site, called, outer)
        if change.site in here or any(s in here for s in (change.also, *change.more) if s):
            if change.source is None:
                self.applied += 1
                if change.norm_gate:
                    return change.rewrite(args, kwargs, out, self)
                if before is not None:  # ``a /= s``: rewritten from a's value before, written back into a
                    new = cast(torch.Tensor, change.rewrite((before, *args[1:]), kwargs, out))
                    return args[0].copy_(new) if new is not args[0] and new.shape == args[0].shape else new
                return change.rewrite(args, kwargs, out)
            held = self.layer_input if change.source == LAYER_INPUT else self.held
            if held is not None and change.heads_merged and held.dim() == 4:  # (batch, heads, seq, dim) as ours reads
                held = held.transpose(1, 2).flatten(2)
            if held is not None and args and isinstance(args[0], torch.Tensor) and held.shape == args[0].shape:
                self.applied += 1
                return func(held.to(args[0].dtype), *args[1:], **kwargs)
        return out

    def _moved_across(self, func, args: tuple, out: torch.Tensor) -> torch.Tensor:
        """A skipped norm's or activation's input handed on (``x.transpose(1, 2)``, ``x.float()``), or the first
        product reading it with the norm or activation applied to its output instead (a norm over the features
        the product makes: ``x @ W`` and ``linear(x, W)`` the last axis, ``W @ x`` the one before)."""
        name = _name(func)
        held = [k for k, a in enumerate(args[:2]) if isinstance(a, torch.Tensor) and id(a) in self.skipped]
        if not held:
            return out
        applied = self.skipped[id(args[held[0]])]
        if name in _HANDS_ON:
            if held[0] == 0 and out.numel() == args[0].numel():
                self.skipped[id(out)] = applied
            return out
        if name not in _PRODUCTS:
            return out
        self.skipped.clear()
        self.applied += 1
        self.moved = True
        return applied(out, -2 if name != "linear" and held[0] == 1 else -1)

    def mix_ups(self, sites: list[tuple[Site, tuple]], layer_input: torch.Tensor | None) -> list[Change]:
        """Each projection, product or gather reading, in place of its own first input, the output of one of the
        two latest calls before it of that shape (or the layer's input): a variable mixed up with another."""
        order = list(self.outs)  # first calls in execution order
        position = {s: i for i, s in enumerate(order)}
        found = []
        for site, (_func, args, _kwargs) in sites:
            # (an activation too: a SwiGLU's sigmoid reading the soft-capped gate, the raw one meant)
            if (
                (site.op not in _READS and site.op not in _ACTIVATIONS and site.op not in _NORMALISERS)
                or not args
                or not isinstance(args[0], torch.Tensor)
            ):
                continue
            own, at = args[0], position.get(self._first_call(site))
            if at is None:
                continue  # a call no output was kept of (a parameter's site): nothing read before it to mix up
            before = order[:at]
            same = [s for s in before if self.outs[s].shape == own.shape and self.outs[s] is not own][-2:]
            for source in reversed(same):
                words = f"{site.op} reading the output of {_line(source.file, source.line)} in place of its own input"
                found.append(Change(site, words, _operand(0), source=source))
            # a (batch, heads, seq, dim) value read with its heads merged, as a projection reads (q, k and v alike)
            merged = [s for s in before if own.dim() == 3 and _merges_to(self.outs[s], own)][-2:]
            for source in reversed(merged):
                words = (
                    f"{site.op} reading the output of {_line(source.file, source.line)} (its heads merged) in place "
                    "of its own input"
                )
                found.append(Change(site, words, _operand(0), source=source, heads_merged=True))
            if layer_input is not None and layer_input.shape == own.shape and layer_input is not own:
                words = f"{site.op} reading the layer's input (the residual stream before its norm) in place of its own"
                found.append(Change(site, words, _operand(0), source=LAYER_INPUT))
        return found

    def weight_swaps(self, sites: list[tuple[Site, tuple]], params: dict[int, str]) -> list[Change]:
        """Two projections of one input whose weights have one shape, each given the other's weight (two
        checkpoint tensors swapped at load: a Gated DeltaNet's in_proj_a and in_proj_b)."""
        linear = [
            (site, args)
            for site, (_func, args, _kwargs) in sites
            if site.op == "linear" and len(args) > 1 and isinstance(args[1], torch.Tensor) and id(args[1]) in params
        ]
        found = []
        for (a, x), (b, y) in itertools.combinations(linear, 2):
            if x[0] is not y[0] or x[1].shape != y[1].shape or a == b:
                continue
            words = f"the weights of {params[id(x[1])]} and {params[id(y[1])]} swapped (two projections of one input)"
            found.append(Change(a, words, _weights_swapped(x[1], y[1]), also=b))
            bx, by = (t[2] if len(t) > 2 and isinstance(t[2], torch.Tensor) else None for t in (x, y))
            if bx is not None and by is not None and bx.shape == by.shape:  # a fused weight and bias cut otherwise
                words = (
                    f"the weights and biases of {params[id(x[1])]} and {params[id(y[1])]} swapped (two projections "
                    "of one input)"
                )
                found.append(Change(a, words, _weights_swapped(x[1], y[1], (bx, by)), also=b))
        # a product with a bias and a weight (``baddbmm(b, x, W)``: RecurrentGemma's gates), both swapped
        fused = [
            (site, func, args)
            for site, (func, args, _kwargs) in sites
            if site.op in ("baddbmm", "addmm") and len(args) == 3 and all(isinstance(t, torch.Tensor) for t in args)
        ]
        for (a, f, x), (b, _g, y) in itertools.combinations(fused, 2):
            # a parameter or a view of one (``bias[:, None, :]``)
            held = [
                i for i in (0, 2) if _param_of(x[i], params) and _param_of(y[i], params) and x[i].shape == y[i].shape
            ]
            if x[1] is not y[1] or a == b or not held:
                continue
            names = " and ".join(f"{_param_of(x[i], params)} / {_param_of(y[i], params)}" for i in held)
            words = f"the parameters {names} swapped (two products of one input)"
            base = {i: (_base(x[i]), _base(y[i])) for i in held}  # the parameters (a view's base)
            partners = {id(u): v for u, v in base.values()} | {id(v): u for u, v in base.values()}
            found.append(Change(a, words, _operands_swapped(f, partners), also=b))
        return found

    def outputs(self, sites: list[tuple[Site, tuple]]) -> list[tuple[Site, tuple]]:
        """``sites`` (from :meth:`candidates`) with each first call's output added to its call."""
        return [(site, (*call, self.outs.get(self._first_call(site)))) for site, call in sites]

    def _first_call(self, site: Site) -> Site:
        """The site of ``site``'s first call with its caller (``site`` itself when it names one)."""
        return site if site.caller is not None else next(iter(self.sites[site]))

    def candidates(self, home: str | None) -> list[tuple[Site, tuple]]:
        """Each site with its first call, in execution order; a site called from several lines also once per
        caller (one of them may hold the difference). ``home``: the block's source file; a site outside it
        (an activation's module) called from one line of it is named with that line."""
        out: list[tuple[Site, tuple]] = []
        for site, callers in self.sites.items():
            first = next(iter(callers.items()))
            if len(callers) == 1:
                caller = first[0].caller
                out.append(
                    first if site.file != home and caller is not None and caller[0] == home else (site, first[1])
                )
                outer = self.outer.get(site, {})
                if len(outer) > 1:  # one module's forward line, its instances called from several lines
                    out += list(outer.items())
                continue
            out.append((site, first[1]))
            out += list(callers.items())
        return out


def _name(func) -> str:
    return getattr(func, "__name__", "")


def _in_place(func, args: tuple) -> bool:
    """Whether ``func`` writes its first input in place (``__itruediv__``, ``div_``)."""
    name = _name(func)
    dunder = name.startswith("__i") and name[3:-2] in ("add", "sub", "mul", "truediv", "div", "floordiv", "pow")
    inplace = dunder or (name.endswith("_") and not name.endswith("__"))
    return inplace and bool(args) and isinstance(args[0], torch.Tensor)


def _arithmetic(op: str) -> str:
    """An arithmetic op's plain name: ``__rmul__``, ``__imul__`` and ``mul_`` are ``mul``."""
    op = op.strip("_")
    return op[1:] if op[:1] in ("r", "i") and op[1:] in ("add", "sub", "mul", "truediv", "div") else op


def _sites(func, args: tuple = (), params: frozenset[int] = frozenset()) -> tuple[Site, Site, Site | None] | None:
    """The innermost frame outside torch and parity (the reference's line that made this call), the same with the
    line that called it, and, where that line is a module's ``forward`` (one line for every instance: a weightless
    RMS norm's), the same with the line that called that module (which instance: B's norm or C's)."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_SKIP_FILES):
        frame = frame.f_back
    if frame is None:
        return None
    scalar = any(isinstance(a, int | float) and not isinstance(a, bool) for a in args[:2])
    operand = "scalar" if scalar else "parameter" if any(id(a) in params for a in args[:2]) else ""
    site = Site(getattr(func, "__name__", str(func)), frame.f_code.co_filename, frame.f_lineno, None, operand)
    up = _outside(frame.f_back)
    called = replace(site, caller=(up.f_code.co_filename, up.f_lineno) if up is not None else None)
    owner = up.f_locals.get("self") if up is not None and up.f_code.co_name == "forward" else None
    if up is None or not isinstance(owner, torch.nn.Module):
        return site, called, None
    outer = _outside(up.f_back)
    while outer is not None and outer.f_locals.get("self") is owner:
        outer = _outside(outer.f_back)
    return site, called, replace(site, caller=(outer.f_code.co_filename, outer.f_lineno)) if outer is not None else None


def _outside(frame: FrameType | None) -> FrameType | None:
    """``frame`` or the first frame above it outside torch and parity."""
    while frame is not None and frame.f_code.co_filename.startswith(_SKIP_FILES):
        frame = frame.f_back
    return frame


def changes(site: Site, func, args: tuple, kwargs: dict, params: dict[int, str]) -> list[Change]:
    """The changes one call can hold (see the module's docstring), none for an operation outside them."""
    op = site.op.lstrip("_").rstrip("_") if site.op.startswith("__") else site.op
    x = args[0] if args and isinstance(args[0], torch.Tensor) else None
    found: list[Change] = []
    if op in _ACTIVATIONS and x is not None:
        found.append(Change(site, f"{op} left out", _operand(0)))
        if op in ("softplus", "sigmoid"):  # a sign error in a parameterisation (softplus(-L) for softplus(L))
            found.append(Change(site, f"{op} of the negated input", _applied(_negated(_ACTIVATIONS[op]))))
        for name, act in _ACTIVATIONS.items():
            if name != op:
                found.append(Change(site, f"{name} in place of {op}", _applied(act)))
        if op == "sigmoid" and x.dim() >= 1:  # a router's scores: a softmax over the experts in its place
            found.append(Change(site, "softmax over the last axis in place of sigmoid", _applied(_softmax_last)))
        words = (
            f"{op} applied to the output of the product reading its result, not before it (act(x @ W) for act(x) @ W)"
        )
        found.append(Change(site, words, _activation_skipped(_ACTIVATIONS[op]), norm_gate="moved"))
    elif op == "masked_fill" and x is not None and len(args) > 2 and _filled_out(args[1], args[2]):
        words = "the mask filled here applied after the softmax instead (its probabilities zeroed, the rest not renormalised)"
        found.append(Change(site, words, _fill_after_softmax, norm_gate="after_softmax"))
    elif op in _LEFT_OUT and x is not None:
        found.append(Change(site, f"{op} left out", _operand(0)))
    elif op in ("exp", "rsqrt", "reciprocal") and x is not None:
        what = {"exp": "exp left out", "rsqrt": "the reciprocal square root left out (a normalisation skipped)"}
        found.append(Change(site, what.get(op, f"{op} left out"), _operand(0) if op == "exp" else _ones))
    elif op == "normalize" and x is not None:
        found.append(Change(site, "F.normalize left out", _operand(0)))
    elif op == "softmax" and x is not None:
        found.append(Change(site, "softmax left out (the raw logits)", _operand(0)))
        found.append(Change(site, "sigmoid in place of softmax", _applied(torch.sigmoid)))
    elif op == "repeat_interleave" and x is not None:
        repeats = kwargs.get("repeats", args[1] if len(args) > 1 else None)
        dim = kwargs.get("dim", args[2] if len(args) > 2 else None)
        if isinstance(repeats, int) and isinstance(dim, int):
            found.append(
                Change(
                    site,
                    f"repeat_interleave by {repeats} replaced by whole-block repeats (tiled: item j reads j % n, "
                    "not j // repeats)",
                    _tiled(repeats, dim),
                )
            )
    elif op == "getitem" and x is not None and len(args) > 1:
        found += _other_end(site, x, args[1])
    elif _arithmetic(site.op) in _SCALAR_OPS and len(args) == 2:
        found += _operand_left_out(site, args, params)
        found += _applied_twice(site, args)
        if _arithmetic(site.op) == "add":
            found += _mask_changes(site, args)
    elif op == "neg" and x is not None:
        found.append(Change(site, "the minus sign left out", _operand(0)))
    elif op in _SPLITS and x is not None:
        found += _parts_swapped(site, func, args, kwargs)
    elif op in ("triu", "tril") and x is not None:
        found += _diagonal_moved(site, func, args, kwargs)
    elif (
        op == "conv1d"
        and x is not None
        and isinstance(args[1] if len(args) > 1 else kwargs.get("weight"), torch.Tensor)
    ):
        found.append(Change(site, "the conv's kernel read in reverse (its taps flipped)", _flipped_kernel))
        dilation = kwargs.get("dilation", args[5] if len(args) > 5 else 1)
        dilation = dilation[0] if isinstance(dilation, (tuple, list)) and dilation else dilation
        if isinstance(dilation, int) and dilation > 1:
            words = f"the conv's dilation 1 in place of {dilation} (each output reads its nearest steps)"
            found.append(Change(site, words, _undilated(func)))
    elif op == "mean" and x is not None and x.dim() >= 3:
        dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
        keepdim = kwargs.get("keepdim", args[2] if len(args) > 2 else False)
        if dim in (-1, x.dim() - 1, [-1], (-1,)) and keepdim is True:
            words = (
                "the mean over the last two axes together in place of the last (a grouped statistic over every group)"
            )
            found.append(Change(site, words, _mean_last_two))
            for axis in range(1, x.dim() - 1):  # another axis than the features (a (batch, dim, seq) layout's seq)
                if x.shape[axis] > 1:
                    words = f"the mean over axis {axis} (of {x.shape[axis]}) in place of the last (of {x.shape[-1]})"
                    found.append(Change(site, words, _mean_over(axis)))
    elif op in ("clamp", "clamp_min", "clamp_max", "clip") and x is not None:
        found.append(Change(site, f"{op} left out", _operand(0)))
        bounds = [*args[1:3], kwargs.get("min"), kwargs.get("max")]
        if any(isinstance(b, float) and math.isinf(b) for b in bounds):  # a bound meaning "no clamp"
            words = f"{op}'s infinite bound (no clamp) taken as 0 (a config's 0 meaning \"no limit\" read as the bound)"
            found.append(Change(site, words, _infinite_bounds_zero(func)))
    elif op == "topk" and x is not None:
        dim = kwargs.get("dim", args[2] if len(args) > 2 else -1)
        if isinstance(dim, int) and x.dim() >= 1:
            words = f"topk over every one of the {x.shape[dim]} entries (no selection: every expert kept)"
            found.append(Change(site, words, _every(func, dim)))
    elif op in ("transpose", "swapaxes", "swapdims") and x is not None and len(args) > 2:
        a, b = (d % x.dim() if isinstance(d, int) else d for d in args[1:3])
        if isinstance(a, int) and isinstance(b, int) and a != b and x.shape[a] == x.shape[b] > 1:
            # a square matrix (a mixing matrix: hyper-connections' comb) used as it is where its transpose is meant
            found.append(Change(site, "the transpose of a square matrix left out (used as it is)", _operand(0)))
    elif op in ("matmul", "bmm", "linear", "baddbmm", "addmm") and len(args) > 1:
        for k in range(len(args)):
            w = args[k]
            if isinstance(w, torch.Tensor) and id(w) in params and w.dim() >= 2 and w.shape[-1] == w.shape[-2] > 1:
                words = f"{params[id(w)]}{_TRANSPOSED}"
                found.append(Change(site, words, _transposed_operand(func, k)))
            elif isinstance(w, torch.Tensor) and w.dim() >= 3 and 1 < w.shape[-1] == w.shape[-2] <= _SMALL_SQUARE:
                # a small square matrix computed per token (hyper-connections' comb) used transposed
                words = "a square matrix computed in the forward read transposed (its transpose where it is meant)"
                found.append(Change(site, words, _transposed_operand(func, k)))
    elif op in ("view", "reshape") and x is not None and x.dim() >= 2:
        for k in (2, 3):
            words = (
                f"this fused output read as {k} whole blocks (every head's part j together) in place of {k} parts "
                "within each head's slice (a per-head layout read as flat blocks)"
            )
            found.append(Change(site, words, _blocked(k)))
        words = (
            "the last axis split with the heads strided (head h at every n-th feature: the head index fastest) in "
            "place of contiguous blocks per head"
        )
        found.append(Change(site, words, _strided_split))
        out = func(*args, **kwargs) if isinstance(x, torch.Tensor) else None
        split = _split_axis(x, out) if isinstance(out, torch.Tensor) else None
        if split is not None and 2 <= out.shape[split + 1] <= 3:
            k = out.shape[split + 1]
            words = (
                f"axis {split}'s rows read as {k} contiguous blocks in place of interleaved ({k} parts of each row "
                f"group side by side: row {k}c + j is part j of c)"
            )
            found.append(Change(site, words, _contiguous_parts(split, k)))
    return found


def _split_axis(x: torch.Tensor, out: torch.Tensor) -> int | None:
    """The axis of ``x`` that ``out`` (a view of it) splits into two, the others kept; None for any other view."""
    if out.dim() != x.dim() + 1:
        return None
    for a in range(x.dim()):
        if (
            out.shape[:a] == x.shape[:a]
            and out.shape[a + 2 :] == x.shape[a + 1 :]
            and out.shape[a] * out.shape[a + 1] == x.shape[a]
        ):
            return a
    return None


def _infinite_bounds_zero(func) -> Callable[[tuple, dict, torch.Tensor], torch.Tensor]:
    """A rewrite of a clamp whose infinite bounds become 0 (``clamp(x, max=inf)`` read as ``clamp(x, max=0)``)."""

    def zero(b):
        return 0.0 if isinstance(b, float) and math.isinf(b) else b

    def rewrite(args: tuple, kwargs: dict, out: torch.Tensor) -> torch.Tensor:
        return func(args[0], *(zero(a) for a in args[1:]), **{k: zero(v) for k, v in kwargs.items()})

    return rewrite


def _contiguous_parts(axis: int, k: int) -> Callable[[tuple, dict, torch.Tensor], torch.Tensor]:
    """A rewrite of a view splitting ``axis`` into ``(m, k)`` (interleaved parts: Zamba's in_proj rows) into the
    view of the axis laid out as ``k`` contiguous blocks of ``m``: part j of group c read from row ``j m + c``."""

    def rewrite(args: tuple, kwargs: dict, out: torch.Tensor) -> torch.Tensor:
        x = args[0]
        if _split_axis(x, out) != axis or out.shape[axis + 1] != k:
            return out
        m = out.shape[axis]
        return x.reshape(*x.shape[:axis], k, m, *x.shape[axis + 1 :]).transpose(axis, axis + 1).reshape(out.shape)

    return rewrite


def _strided_split(args: tuple, kwargs: dict, out: torch.Tensor) -> torch.Tensor:
    """A rewrite of ``x.view(..., heads, width)`` (the last axis split into contiguous blocks per head) into the
    split with the head index fastest (``x.view(..., width, heads)`` transposed), and of the merge back
    (``(..., heads, width)`` viewed as ``(..., heads * width)``) into its inverse, the features of each head strided
    (a port splitting and merging both ways alike). Any other view is left as it is."""
    x = args[0]
    if (
        out.dim() == x.dim() - 1
        and out.shape[:-1] == x.shape[:-2]
        and out.shape[-1] == x.shape[-2] * x.shape[-1]
        and min(x.shape[-2:]) >= 2
    ):
        return x.transpose(-1, -2).reshape(out.shape)
    if out.dim() != x.dim() + 1 or out.shape[:-2] != x.shape[:-1] or out.shape[-2] * out.shape[-1] != x.shape[-1]:
        return out
    heads, width = out.shape[-2:]
    if heads < 2 or width < 2:
        return out
    return x.reshape(*x.shape[:-1], width, heads).transpose(-1, -2)


def _negated(act: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    """``act`` of the negated input."""

    def negated(t: torch.Tensor) -> torch.Tensor:
        return act(-t)

    return negated


def _scaled(c: float) -> Callable[[tuple, dict, torch.Tensor], torch.Tensor]:
    """A rewrite multiplying the call's output by ``c``."""

    def rewrite(args: tuple, kwargs: dict, out: torch.Tensor) -> torch.Tensor:
        return out * c

    return rewrite


def _every(func, dim: int) -> Callable[[tuple, dict, object], object]:
    """A rewrite of ``topk`` keeping every entry along ``dim`` (sorted, as topk returns them)."""

    def rewrite(args: tuple, kwargs: dict, out):
        rest = {key: v for key, v in kwargs.items() if key not in ("k", "dim")}
        return func(args[0], args[0].shape[dim], dim, *args[3:], **rest)

    return rewrite


#: the largest square operand (computed, not a parameter) the search reads transposed: a per-token mixing matrix
#: (hyper-connections' streams), not a sequence's attention probabilities
_SMALL_SQUARE = 8


def _transposed_operand(func, k: int) -> Callable[[tuple, dict, torch.Tensor], torch.Tensor]:
    """A rewrite running the product with its ``k``-th operand's last two axes swapped."""

    def rewrite(args: tuple, kwargs: dict, out: torch.Tensor) -> torch.Tensor:
        return func(*(a.transpose(-1, -2) if i == k else a for i, a in enumerate(args)), **kwargs)

    return rewrite


def _blocked(k: int) -> Callable[[tuple, dict, torch.Tensor], torch.Tensor]:
    """A rewrite of ``x.view(..., heads, m)`` (the last axis split per head, each head's slice holding ``k``
    parts: q, k and v of one head) into the view of ``x`` laid out as ``k`` whole blocks: head h's part j read
    from block j (``[q of every head | k of every head | v ...]``). Any other view is left as it is."""

    def rewrite(args: tuple, kwargs: dict, out: torch.Tensor) -> torch.Tensor:
        x = args[0]
        if (
            out.dim() != x.dim() + 1
            or out.shape[:-2] != x.shape[:-1]
            or out.shape[-2] < 2
            or out.shape[-1] % k
            or out.shape[-2] * out.shape[-1] != x.shape[-1]
        ):
            return out
        heads, width = out.shape[-2:]
        return x.reshape(*x.shape[:-1], k, heads, width // k).transpose(-3, -2).reshape(out.shape)

    return rewrite


def term_changes(site: Site, args: tuple, out: torch.Tensor | None, params: dict[int, str]) -> list[Change]:
    """The second pass's changes, tried after every site's first ones: a term of a sum of two tensors left out
    (a skip connection, D's ``x * D``), a broadcast factor that is no parameter left out (a padding mask)."""
    op = _arithmetic(site.op)
    if len(args) != 2 or not all(isinstance(a, torch.Tensor) for a in args) or out is None:
        return []
    if any(id(a) in params for a in args):
        return []  # a parameter left out is a first-pass change
    found = []
    if op in ("add", "sub"):
        for k in (0, 1):
            if args[k].shape == out.shape:
                which = "first" if k == 1 else "second"
                found.append(Change(site, f"the {which} term of this {op} left out", _operand(k)))
    elif op == "mul":
        for k, d in ((0, 1), (1, 0)):
            if args[k].shape == out.shape and args[d].numel() < out.numel():
                words = f"the broadcast factor of shape {tuple(args[d].shape)} left out (a mask or a scale)"
                found.append(Change(site, words, _operand(k)))
            elif args[k].shape != out.shape and args[d].shape != out.shape and args[k].dim() == out.dim():
                # an outer product of two broadcast operands (Mamba's dt[..., None] * B[:, None]): one left out
                words = (
                    f"the factor of shape {tuple(args[d].shape)} left out of this broadcast product (the one of shape "
                    f"{tuple(args[k].shape)} alone)"
                )
                found.append(Change(site, words, _expanded(k)))
    elif op in ("div", "truediv") and args[0].shape == out.shape and args[1].numel() < out.numel():
        words = f"the broadcast divisor of shape {tuple(args[1].shape)} left out (a normalisation: a norm, a sum to 1)"
        found.append(Change(site, words, _operand(0)))
    return found


def _additive_mask(t) -> bool:
    """Whether ``t`` is an additive attention mask ``(..., queries, keys)``: zeros where a key is read, a very large
    negative number (or -inf) where it is not, both present, as many keys as queries or more."""
    if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.dim() < 2 or t.shape[-1] < t.shape[-2] < 2:
        return False
    hidden = t < -1e4
    return bool(hidden.any()) and bool(((t == 0) | hidden).all()) and bool((t == 0).any())


def _mask_changes(site: Site, args: tuple) -> list[Change]:
    """An additive mask added to scores (an indexer's, an attention's built in functions) changed as a port may
    build it: its diagonal masked too (a query kept from its own key: ``triu(0)`` for ``triu(1)``), the next key
    unmasked (a query reads one key ahead), or the padding left out (the causal part alone)."""
    k = next((i for i in (0, 1) if _additive_mask(args[i]) and isinstance(args[1 - i], torch.Tensor)), None)
    if k is None:
        return []
    beyond, hidden = _beyond_causal(args[k])
    return [
        Change(site, "the mask's diagonal masked as well (a query kept from its own key: triu(0) for triu(1))",
               _mask_rewrite(k, 0)),
        Change(site, "the mask's next key unmasked (a query reads one key ahead: the diagonal moved by one)",
               _mask_rewrite(k, 2)),
        Change(site, f"the mask's {beyond} left out (the causal part alone: {hidden} read)", _mask_rewrite(k, 1)),
    ]  # fmt: skip


def _beyond_causal(mask: torch.Tensor) -> tuple[str, str]:
    """What an additive mask hides besides the future keys, and those keys, named: whole key columns (padding), or
    keys chosen per query (a sparse selection: an indexer's top-k, a window)."""
    q, t = mask.shape[-2], mask.shape[-1]
    future = torch.ones(q, t, dtype=torch.bool, device=mask.device).triu(t - q + 1)
    past = (mask < -1e4) & ~future  # hidden, though not in the future
    # padding hides a key from every query that could see it: each hidden key hidden from every later query
    seen = ~future
    per_key = (past | ~seen).all(dim=-2, keepdim=True) & past.any(dim=-2, keepdim=True)
    if not bool(past.any()) or bool((past == (per_key & seen)).all()):
        return "padding", "padding keys"
    return "selection (a sparse top-k or window)", "keys it does not select"


def _mask_rewrite(k: int, mode: int) -> Callable[[tuple, dict, torch.Tensor], torch.Tensor]:
    """A rewrite of ``scores + mask`` (the mask the ``k``-th operand) with the mask remade: the causal part's
    diagonal at ``mode - 1`` keys from the query's own (0: its own key hidden too; 2: the next one read), or
    (``mode`` 1) the causal part alone."""

    def rewrite(args: tuple, kwargs: dict, out: torch.Tensor) -> torch.Tensor:
        mask, other = args[k], args[1 - k]
        q, t = mask.shape[-2], mask.shape[-1]
        low = torch.finfo(mask.dtype).min
        offset = t - q  # keys before the first query (a cache)
        causal = torch.ones(q, t, dtype=torch.bool, device=mask.device).triu(offset + (1 if mode == 1 else mode))
        if mode == 1:
            new = torch.zeros_like(mask).masked_fill(causal, low)
        elif mode == 0:
            new = mask.masked_fill(causal, low)
        else:  # the next key read where the mask hid it only for being in the future
            ahead = torch.ones(q, t, dtype=torch.bool, device=mask.device).triu(offset + 1) & ~causal
            new = torch.where(ahead, torch.zeros_like(mask), mask)
        return other + new if k == 1 else new + other

    return rewrite


def _expanded(k: int) -> Callable[[tuple, dict, torch.Tensor], torch.Tensor]:
    """A rewrite giving the call's ``k``-th operand alone, broadcast to the output's shape."""

    def rewrite(args: tuple, kwargs: dict, out: torch.Tensor) -> torch.Tensor:
        return args[k].expand_as(out).to(out.dtype)

    return rewrite


def _operand_left_out(site: Site, args: tuple, params: dict[int, str]) -> list[Change]:
    """A scalar, or a parameter, that one side multiplies, divides, adds or subtracts and the other does not."""
    verb = _VERBS.get(_arithmetic(site.op), "offset")
    found = []
    identity = (0,) if verb == "offset" else (0, 1)
    for k, d in ((0, 1), (1, 0)):
        keep, drop = args[k], args[d]
        if not isinstance(keep, torch.Tensor):
            continue
        if isinstance(drop, int | float) and drop not in identity and not isinstance(drop, bool):
            found.append(Change(site, f"the {verb} {drop:.6g} left out", _operand(k)))
            if verb == "factor" and drop < 0 and drop != -1:  # ``-8.0 * x`` written ``-x``: the constant's size
                found.append(
                    Change(site, f"the factor {drop:.6g} left out, its sign kept (-1)", _scaled(1 / abs(drop)))
                )
        elif isinstance(drop, torch.Tensor) and (name := _param_of(drop, params)) is not None:  # or a view of one
            found.append(Change(site, f"{name} ({verb}) left out", _operand(k)))
            if verb == "factor":  # a gain stored as an offset from one (Gemma's, Qwen3.5's norms) read as is
                words = f"1 + {name} in place of {name} (a gain read as an offset from one)"
                found.append(Change(site, words, _plus_operand(k)))
            if _arithmetic(site.op) == "add":  # a bias added in a projection and again where the reference adds it
                found.append(Change(site, f"{name} (offset) added twice", _plus_operand(d)))
    return found


def _plus_operand(k: int) -> Callable[[tuple, dict, torch.Tensor], torch.Tensor]:
    """A rewrite adding the call's ``k``-th operand to its product (``x * w`` made ``x * (1 + w)``)."""

    def rewrite(args: tuple, kwargs: dict, out: torch.Tensor) -> torch.Tensor:
        return out + args[k].to(out.dtype)

    return rewrite


def _applied_twice(site: Site, args: tuple) -> list[Change]:
    """A scalar factor or divisor applied twice (a multiplier folded into a weight at load and applied again)."""
    verb = _VERBS.get(_arithmetic(site.op))
    k = 1 if isinstance(args[0], torch.Tensor) else 0
    scalar = args[k]
    if verb is None or not isinstance(scalar, int | float) or isinstance(scalar, bool) or scalar in (0, 1, -1):
        return []
    again = scalar if verb == "factor" else 1 / scalar

    def rewrite(args: tuple, kwargs: dict, out: torch.Tensor) -> torch.Tensor:
        return out * again

    return [Change(site, f"the {verb} {scalar:.6g} applied twice", rewrite)]


#: the config's width fields a softmax scale may be taken from beside its ``*dim*`` ones (a port scaling by the model's
#: width where a head's was meant: BERT's, RoFormer's, GPT-2's)
_WIDTHS = ("hidden_size", "embedding_size", "n_embd", "d_model")


def _config_dims(model: torch.nn.Module) -> dict[str, int]:
    """The reference's config's head and width sizes by field (``head_dim``, ``qk_rope_head_dim``, ``hidden_size``,
    ...): the sizes a softmax scale ``1 / sqrt(d)`` may have been taken from."""
    config = getattr(model, "config", None)
    fields: dict = getattr(config, "to_dict", dict)() if config is not None else {}
    return {
        k: v
        for k, v in fields.items()
        if ("dim" in k or k in _WIDTHS) and isinstance(v, int) and not isinstance(v, bool) and v > 1
    }


def _scale_from_a_dim(site: Site, args: tuple, dims: dict[str, int]) -> list[Change]:
    """A softmax-style scale ``1 / sqrt(d)`` (a factor, or ``sqrt(d)`` as a divisor) taken from another of the
    config's sizes (``config.head_dim`` where the attention's q k width was meant)."""
    verb = _VERBS.get(_arithmetic(site.op))
    if verb is None or len(args) != 2:
        return []
    k = 1 if isinstance(args[0], torch.Tensor) else 0
    scalar = args[k]
    if not isinstance(scalar, float) or scalar <= 0:
        return []
    own = 1 / scalar**2 if verb == "factor" else scalar**2  # the d this scale is 1 / sqrt(d) of
    if own < 2 or abs(own - round(own)) > 1e-4 * own:
        return []  # not 1 / sqrt of a size
    found: list[Change] = []
    for name, d in sorted(dims.items(), key=lambda item: item[1]):
        new = d**-0.5 if verb == "factor" else d**0.5
        if abs(new / scalar - 1) < 1e-6 or any(c.words.endswith(f"= {new:.6g}") for c in found):
            continue
        ratio = new / scalar if verb == "factor" else scalar / new

        def rewrite(args: tuple, kwargs: dict, out: torch.Tensor, ratio: float = ratio) -> torch.Tensor:
            return out * ratio

        what = f"1 / sqrt({name} = {d})" if verb == "factor" else f"sqrt({name} = {d})"
        found.append(Change(site, f"the {verb} {scalar:.6g} taken as {what} = {new:.6g}", rewrite))
    return found


def _config_defaults(model: torch.nn.Module) -> dict[float, list[tuple[str, float]]]:
    """What a port may hold in place of each of the reference's config floats, by value: the field's class default
    where the config sets another (a port that hard-codes a constant, or never reads the field), and the value of
    another eps field (``mixer_rms_eps`` read as ``layer_norm_epsilon``): ``{-3.0: [("config.kda_lower_bound (-3)
    read as its default -5", -5.0)]}``; empty when the config's class cannot be built bare."""
    config: object = getattr(model, "config", None)
    try:
        fields, defaults = config.to_dict(), type(config)().to_dict()  # type: ignore[attr-defined]
    except Exception:  # no config, or a class that needs arguments: nothing to compare with
        return {}
    found: dict[float, list[tuple[str, float]]] = {}
    floats = {name: v for name, v in fields.items() if isinstance(v, float) and not isinstance(v, bool)}
    eps = {name: v for name, v in floats.items() if "eps" in name and v > 0}
    for name, value in floats.items():
        default = defaults.get(name)
        if isinstance(default, float) and value != default and value != 0:
            found.setdefault(value, []).append((f"config.{name} ({value:g}) read as its default {default:g}", default))
        for other, theirs in eps.items() if name in eps else ():
            if theirs != value:
                found.setdefault(value, []).append(
                    (f"config.{other} ({theirs:g}) used in place of config.{name} ({value:g})", theirs)
                )
    return found


def _default_read(site: Site, func, args: tuple, defaults: dict[float, list[tuple[str, float]]]) -> list[Change]:
    """A scalar operand that is one of the config's values replaced by what a port may hold instead
    (:func:`_config_defaults`): the field never read (its default hard-coded, ``-5.0`` for ``kda_lower_bound``),
    or another eps field of the config read for it."""
    if _arithmetic(site.op) not in _SCALAR_OPS or len(args) != 2:
        return []
    found = []
    for k in (0, 1):
        scalar = args[k]
        if not isinstance(scalar, float) or isinstance(args[1 - k], float):
            continue
        for words, default in defaults.get(scalar, []):

            def rewrite(a: tuple, kwargs: dict, out: torch.Tensor, k: int = k, default: float = default):
                return func(*(default if i == k else v for i, v in enumerate(a)), **kwargs)

            found.append(Change(site, words, rewrite))
    return found


def _parts(out) -> bool:
    """Whether ``out`` is a split's output: a tuple or list of two or more tensors."""
    return isinstance(out, tuple | list) and len(out) > 1 and all(isinstance(t, torch.Tensor) for t in out)


def _parts_swapped(site: Site, func, args: tuple, kwargs: dict) -> list[Change]:
    """Two parts of one shape of a split or chunk swapped (a fused gate and up read as [up | gate], B and C,
    a per-head [k | v] read as [v | k])."""
    with torch.no_grad():
        parts = func(*args, **kwargs)
    if not _parts(parts):
        return []
    found = []
    for i, j in itertools.combinations(range(len(parts)), 2):
        if parts[i].shape != parts[j].shape:
            continue

        def rewrite(args: tuple, kwargs: dict, out, i: int = i, j: int = j):
            swapped = list(out)
            swapped[i], swapped[j] = out[j], out[i]
            return type(out)(swapped) if isinstance(out, list) else tuple(swapped)

        words = f"parts {i} and {j} of this {site.op.strip('_')} (of {len(parts)}) swapped"
        found.append(Change(site, words, rewrite))
    return found + _unequal_parts_reordered(site, args, kwargs, parts)


def _unequal_parts_reordered(site: Site, args: tuple, kwargs: dict, parts) -> list[Change]:
    """Two neighbouring parts of a split of unequal sizes read in the other order from the fused tensor (Mamba-2's
    in_proj output cut as [xBC | z | dt] where it is [z | xBC | dt]): the first takes the features after the
    second's, each keeping its size."""
    x = args[0] if args and isinstance(args[0], torch.Tensor) else None
    dim = kwargs.get("dim", args[2] if len(args) > 2 else 0)
    if x is None or not isinstance(dim, int) or site.op not in ("split", "split_with_sizes", "tensor_split"):
        return []
    dim = dim % x.dim()
    sizes = [p.shape[dim] for p in parts]
    if sum(sizes) != x.shape[dim]:
        return []
    found = []
    nonempty = [i for i, n in enumerate(sizes) if n]
    for i, k in itertools.pairwise(nonempty):
        if sizes[i] == sizes[k]:
            continue  # equal parts: the plain swap above
        start = sum(sizes[:i])

        def rewrite(args: tuple, kwargs: dict, out, i: int = i, k: int = k, start: int = start):
            x, a, b = args[0], sizes[i], sizes[k]
            moved = list(out)
            moved[i], moved[k] = x.narrow(dim, start + b, a), x.narrow(dim, start, b)
            return type(out)(moved) if isinstance(out, list) else tuple(moved)

        words = (
            f"parts {i} and {k} of this {site.op} (sizes {sizes[i]} and {sizes[k]}) read in the other order from the "
            f"fused tensor (part {k}'s {sizes[k]} features first, each part keeping its size)"
        )
        found.append(Change(site, words, rewrite))
    return found


def _diagonal_moved(site: Site, func, args: tuple, kwargs: dict) -> list[Change]:
    """A triangular mask's diagonal moved by one (the diagonal itself kept or masked: an off-by-one mask)."""
    diagonal = kwargs.get("diagonal", args[1] if len(args) > 1 else 0)
    if not isinstance(diagonal, int):
        return []
    found = []
    for moved in (diagonal - 1, diagonal + 1):

        def rewrite(args: tuple, kwargs: dict, out: torch.Tensor, moved: int = moved) -> torch.Tensor:
            return func(args[0], diagonal=moved)

        found.append(Change(site, f"{site.op.strip('_')} with diagonal={moved} in place of {diagonal}", rewrite))
    return found


def _activation_skipped(act: Callable[[torch.Tensor], torch.Tensor]) -> Callable:
    """An activation's call skipped: its input handed on, marked for the product that reads it (which applies
    ``act`` to its output)."""

    def rewrite(args: tuple, kwargs: dict, out: torch.Tensor, mode: _Changing) -> torch.Tensor:
        x = args[0]
        mode.skipped[id(x)] = lambda y, _axis: act(y)
        return x

    return rewrite


def _filled_out(mask, value) -> bool:
    """A boolean mask filled with a value that takes its positions out of a softmax (-inf, or below -1e4)."""
    return isinstance(mask, torch.Tensor) and mask.dtype == torch.bool and isinstance(value, float) and value <= -1e4


def _fill_after_softmax(args: tuple, kwargs: dict, out: torch.Tensor, mode: _Changing) -> torch.Tensor:
    """A fill of masked positions skipped; the next softmax zeroes those probabilities instead."""
    mode.after_softmax = args[1]
    return args[0]


def _undilated(func) -> Callable[[tuple, dict, torch.Tensor], torch.Tensor]:
    """A dilated conv run undilated, its last outputs kept (a causal conv's: each reads its nearest steps)."""

    def rewrite(args: tuple, kwargs: dict, out: torch.Tensor) -> torch.Tensor:
        rest = dict(kwargs)
        rest["dilation"] = 1
        return func(*args[:5], **rest, **({"groups": args[6]} if len(args) > 6 else {}))[..., -out.shape[-1] :]

    return rewrite


def _flipped_kernel(args: tuple, kwargs: dict, out: torch.Tensor) -> torch.Tensor:
    if len(args) > 1:
        return F.conv1d(args[0], args[1].flip(-1), *args[2:], **kwargs)
    return F.conv1d(args[0], **{**kwargs, "weight": kwargs["weight"].flip(-1)})  # the kernel given by name


def _mean_last_two(args: tuple, kwargs: dict, out: torch.Tensor) -> torch.Tensor:
    return args[0].mean(dim=(-2, -1), keepdim=True).to(out.dtype)


def _mean_over(axis: int) -> Callable[[tuple, dict, torch.Tensor], torch.Tensor]:
    def rewrite(args: tuple, kwargs: dict, out: torch.Tensor) -> torch.Tensor:
        return args[0].mean(dim=axis, keepdim=True).to(out.dtype)

    return rewrite


def _softmax_last(x: torch.Tensor) -> torch.Tensor:
    return torch.softmax(x, dim=-1)


def _applied(act: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[tuple, dict, torch.Tensor], torch.Tensor]:
    """A rewrite applying ``act`` to the call's input in place of its own function."""

    def rewrite(args: tuple, kwargs: dict, out: torch.Tensor) -> torch.Tensor:
        return act(args[0]).to(out.dtype)

    return rewrite


def _tiled(repeats: int, dim: int) -> Callable[[tuple, dict, torch.Tensor], torch.Tensor]:
    """A rewrite repeating the call's input as whole blocks along ``dim`` (``repeat``) in place of interleaving."""

    def rewrite(args: tuple, kwargs: dict, out: torch.Tensor) -> torch.Tensor:
        return torch.cat([args[0]] * repeats, dim=dim)

    return rewrite


def _ones(args: tuple, kwargs: dict, out: torch.Tensor) -> torch.Tensor:
    """A rewrite giving ones where the call gave its result (a reciprocal root: the normalisation skipped)."""
    return torch.ones_like(out)


def _operand(k: int) -> Callable[[tuple, dict, torch.Tensor], torch.Tensor]:
    """A rewrite returning the call's ``k``-th operand (the other one left out), in the output's dtype."""

    def rewrite(args: tuple, kwargs: dict, out: torch.Tensor) -> torch.Tensor:
        return args[k].to(out.dtype)

    return rewrite


def _indexed(index: tuple) -> Callable[[tuple, dict, torch.Tensor], torch.Tensor]:
    """A rewrite indexing the call's tensor with ``index`` instead of its own."""

    def rewrite(args: tuple, kwargs: dict, out: torch.Tensor) -> torch.Tensor:
        return args[0][index]

    return rewrite


def _other_end(site: Site, x: torch.Tensor, index) -> list[Change]:
    """A slice ``[..., :n]`` (or ``[..., k:]``) of an axis longer than it taken from the other end."""
    items = index if isinstance(index, tuple) else (index,)
    if any(i is None or isinstance(i, torch.Tensor | list) for i in items):
        return []
    found = []
    ellipsis = next((p for p, i in enumerate(items) if i is Ellipsis), None)
    for p, item in enumerate(items):
        if not isinstance(item, slice) or item.step not in (None, 1):
            continue
        dim = p if ellipsis is None or p < ellipsis else x.dim() - (len(items) - p)
        if not 0 <= dim < x.dim():
            continue
        size = x.shape[dim]
        start, stop = item.start, item.stop
        if start is None and isinstance(stop, int) and 0 < stop < size:
            other = slice(size - stop, None)
        elif stop is None and isinstance(start, int) and 0 < start < size:
            other = slice(None, size - start)
        else:
            continue
        moved = tuple(other if q == p else i for q, i in enumerate(items))
        words = (
            f"axis {dim}'s slice [{_text(item)}] taken from the other end ([{_text(other)}] of {size}: a causal "
            "window read from the wrong side)"
        )
        found.append(Change(site, words, _indexed(moved)))
        if start is None and stop is not None and stop + 1 <= size:  # a conv's padding one short on the left
            later = slice(1, stop + 1)
            shifted = tuple(later if q == p else i for q, i in enumerate(items))
            words = (
                f"axis {dim}'s slice [{_text(item)}] taken one step later ([{_text(later)}] of {size}: a causal "
                "window shifted one step into the future, its padding one short on the left)"
            )
            found.append(Change(site, words, _indexed(shifted)))
    return found


def _text(s: slice) -> str:
    return f"{'' if s.start is None else s.start}:{'' if s.stop is None else s.stop}"


def _output(out, index: int = 0) -> torch.Tensor | None:
    """A module's output tensor: itself, or the ``index``-th of a tuple it returns (a router's logits, weights
    and choices)."""
    if isinstance(out, torch.Tensor):
        return out if index == 0 else None
    if isinstance(out, tuple | list) and len(out) > index and isinstance(out[index], torch.Tensor):
        return out[index]
    return None


@dataclass(frozen=True)
class Target:
    """A node the search reads: the reference's module path producing it, the node's view of that output, and
    two tests of a value there: ``agrees`` (equal to ours) and ``recorded`` (equal to the reference's traced
    value: the unchanged run must reproduce it, else the node is not read)."""

    name: str
    path: str
    agrees: Callable[[torch.Tensor], bool]
    recorded: Callable[[torch.Tensor], bool]
    transform: Callable[[torch.Tensor], torch.Tensor] | None = None

    @property
    def module(self) -> str:
        """The module producing it (``path`` without a ``#n`` output index)."""
        return self.path.partition("#")[0]

    @property
    def index(self) -> int:
        """Which tensor of the module's output it is (``#n``; 0 for a module returning one)."""
        tail = self.path.partition("#")[2]
        return int(tail) if tail.isdigit() else 0


def search(
    model: torch.nn.Module,
    block: str,
    targets: list[Target],
    forward: Callable[[], object],
    scope: str | None = None,
    unseen: tuple[str, ...] = (),
) -> list[tuple[Change, str]] | None:
    """The changes inside ``block`` (a module path of ``model``) after which one of ``targets`` (the failing
    node, and a later one: ours may record a node of a block it computes in functions at another step of it)
    agrees with ours; None when the search could not run (no such module, no target produced as the trace
    recorded it, the budget spent) or nothing agrees. ``forward()`` runs ``model`` on the run's inputs (the dry
    run); ``scope``: a module holding the block and every target (its decoder layer), re-run alone on the inputs
    it had there for each change. Each pass stops once the last target is produced. ``unseen``: modules no node
    records (an attention residual computing the MLP's input), each tried left out: its input handed on."""
    modules = dict(model.named_modules())
    block = block.partition("#")[0]
    targets = [t for t in targets if t.module in modules]
    if block not in modules or not targets:
        return None
    if scope is not None and (
        scope not in modules
        or not all(p == scope or p.startswith(scope + ".") for p in (block, *(t.module for t in targets)))
    ):
        scope = None
    called: list[tuple[tuple, dict]] = []
    #: the calls of the scope's sibling layers before it (their path -> (args, kwargs)) and what they returned,
    #: from the dry run
    siblings: dict[str, tuple[tuple, dict]] = {}
    returned: dict[str, object] = {}

    def inputs(_module, args, kwargs):
        if not called:
            called.append((args, kwargs))

    def sibling(path: str):
        def keep(_module, args, kwargs):
            siblings.setdefault(path, (args, kwargs))

        return keep

    def sibling_out(path: str):
        def keep(_module, _args, out):
            returned.setdefault(path, out)

        return keep

    params = {id(p): n for n, p in model.named_parameters()}
    kept: dict[int, torch.Tensor] = {}

    def keeper(i: int, target: Target):
        def keep(_module, _args, out):
            t = _output(out, target.index)
            if t is not None and i not in kept:
                kept[i] = target.transform(t) if target.transform is not None else t
            if len(kept) == len(targets):
                raise _Stop

        return keep

    def run(mode: _Changing) -> dict[int, torch.Tensor]:
        kept.clear()

        def enter(*_):
            mode.inside += 1

        def leave(*_):
            mode.inside -= 1

        patched = _patch(mode)
        flipped = mode.change.attribute if mode.change is not None else None
        if flipped is not None:
            setattr(modules[flipped[0]], flipped[1], not getattr(modules[flipped[0]], flipped[1]))
            mode.applied += 1
        handles = [
            *_module_hooks(mode, modules),
            *(m.register_forward_hook(_keeps_normed(mode)) for _, m in norms),
            modules[block].register_forward_pre_hook(enter),
            modules[block].register_forward_hook(leave, always_call=True),
            *(modules[t.module].register_forward_hook(keeper(i, t)) for i, t in enumerate(targets)),
        ]
        if scope is not None and not called:
            handles.append(modules[scope].register_forward_pre_hook(inputs, with_kwargs=True))
            for p in _sibling_layers(modules, scope):
                handles.append(modules[p].register_forward_pre_hook(sibling(p), with_kwargs=True))
                handles.append(modules[p].register_forward_hook(sibling_out(p)))
        try:
            with torch.no_grad(), mode:
                if scope is not None and called:
                    args, kwargs = called[0]
                    if mode.change is not None and mode.change.argument is not None:
                        args, kwargs = _with_argument(args, kwargs, *mode.change.argument)
                        mode.applied += 1
                    modules[scope](*args, **kwargs)
                else:
                    forward()
        except _Stop:
            pass
        finally:
            for h in handles:
                h.remove()
            if patched is not None:
                setattr(*patched)
            if flipped is not None:
                setattr(modules[flipped[0]], flipped[1], not getattr(modules[flipped[0]], flipped[1]))
            mode.inside = 0
        return dict(kept)

    norms = _norm_modules(modules, block)
    started = time.monotonic()
    dry = _Changing(params=frozenset(params))
    original = run(dry)
    read = [i for i, value in original.items() if targets[i].recorded(value) and not targets[i].agrees(value)]
    if not read:
        return None
    try:
        home = inspect.getsourcefile(type(modules[block]))
    except TypeError:
        home = None
    found: list[tuple[Change, str]] = []
    runs = 1
    sites = dry.candidates(home)
    first = [c for site, (func, args, kwargs) in sites for c in changes(site, func, args, kwargs, params)]
    first += [c for site, (_func, args, _kwargs) in sites for c in _scale_from_a_dim(site, args, _config_dims(model))]
    defaults = _config_defaults(model)
    first += [c for site, (func, args, _kwargs) in sites for c in _default_read(site, func, args, defaults)]
    terms = [c for site, (func, args, kwargs, out) in dry.outputs(sites) for c in term_changes(site, args, out, params)]
    terms += _added_after_activation(dry.outputs(sites), params)
    terms += _ranked_activated(dry.outputs(sites), {**{id(b): n for n, b in model.named_buffers()}, **params})
    # the layer's input, as its re-runs read it: the source of a mix-up with the residual stream
    args, kwargs = called[0] if called else ((), {})
    first_input = args[0] if args else next(iter(kwargs.values()), None)
    layer_input = first_input if isinstance(first_input, torch.Tensor) else None
    gated = _gated_norms(modules, block) + _read_before_norm(dry, sites, norms)
    swaps = dry.weight_swaps(sites, params)
    orders = _scan_orders(modules[block]) + _cell_orders(modules, block) + _gates_across_norms(dry, sites, norms)
    orders += _norms_moved(norms) + _rope_pairings(modules[block])
    unreproduced: set[str] = set()  # scans whose replacement in the reference's own order does not reproduce it
    # first: a handful of passes, one per distinct value another layer received
    handed = _arguments_of_other_layers(scope, modules, called, siblings, returned)
    flags = _flags(modules, block, model)
    inside = [p for p in unseen if p in modules and (scope is None or p.startswith(scope + "."))]
    flags += [_left_out(p, modules[p]) for p in inside]
    for change in (
        handed + _with_pairs(first) + gated + orders + swaps + terms + flags + dry.mix_ups(sites, layer_input)
    ):
        if runs >= MAX_RUNS or time.monotonic() - started > MAX_SECONDS:
            break
        if change.patch is not None and change.patch[1] in unreproduced:
            continue
        runs += 1
        mode = _Changing(change, layer_input, frozenset(params))
        try:
            values = run(mode)
        except Exception:  # a change the code cannot run with (a shape it rejects): not this one
            if change.patch is not None:
                unreproduced.add(change.patch[1])
            continue
        kept_shape = [i for i in read if i in values and values[i].shape == original[i].shape]
        matched = next((i for i in kept_shape if targets[i].agrees(values[i])), None)
        # a norm or activation moved across a product counts only once it was applied there (only skipped, it is
        # another change: the skip, named by its own kind)
        moved = change.norm_gate != "moved" or mode.moved
        if mode.applied and matched is not None and moved:
            found.append((change, targets[matched].name))
        elif (
            change.patch is not None
            and getattr(change.patch[2], "own", False)
            and not (mode.applied and kept_shape and all(targets[i].recorded(values[i]) for i in kept_shape))
        ):
            unreproduced.add(change.patch[1])  # the replacement does not compute what the original does
    return found or None


def _flags(modules: dict[str, torch.nn.Module], block: str, model: torch.nn.Module) -> list[Change]:
    """Each boolean attribute of the block's modules that holds a boolean field of the config (by value: a
    ``self.safe_gate = config.kda_safe_gate`` whose branch a port never took) flipped for one pass."""
    config = getattr(model, "config", None)
    to_dict = getattr(config, "to_dict", None)
    fields: dict = to_dict() if callable(to_dict) else {}
    found = []
    for path, module in modules.items():
        if path != block and not path.startswith(block + "."):
            continue
        try:
            file = inspect.getsourcefile(type(module)) or ""
            line = inspect.getsourcelines(type(module))[1]
        except (TypeError, OSError):
            continue
        for attr, value in vars(module).items():
            if attr.startswith("_") or not isinstance(value, bool) or attr == "training":
                continue
            named = [f for f, v in fields.items() if isinstance(v, bool) and v == value and attr in f]
            if not named:
                continue  # only a flag the config sets (by its name): a port reading that field otherwise
            words = (
                f"{path}.{attr} = {not value} (config.{named[0]} read as {not value}: the branch the config's "
                f"{value} skips taken)"
            )
            found.append(Change(Site("flag", file, line), words, _ones, attribute=(path, attr)))
    return found


def _sibling_layers(modules: dict[str, torch.nn.Module], scope: str) -> list[str]:
    """The other layers of ``scope``'s list (``model.layers.1`` for ``model.layers.3``) of its class."""
    stem, _, index = scope.rpartition(".")
    if not index.isdigit():
        return []
    kind = type(modules[scope])
    return [
        p
        for p, m in modules.items()
        if p != scope and p.rpartition(".")[0] == stem and p.rpartition(".")[2].isdigit() and type(m) is kind
    ]


def _with_argument(args: tuple, kwargs: dict, key: str | int, value: torch.Tensor) -> tuple[tuple, dict]:
    """The call's ``(args, kwargs)`` with one argument (a position or a keyword) replaced by ``value``."""
    if isinstance(key, int):
        return (*args[:key], value, *args[key + 1 :]), kwargs
    return args, {**kwargs, key: value}


def _arguments_of_other_layers(
    scope: str | None,
    modules: dict[str, torch.nn.Module],
    called: list[tuple[tuple, dict]],
    siblings: dict[str, tuple[tuple, dict]],
    returned: dict[str, object],
) -> list[Change]:
    """The layer's call with one tensor argument other than its hidden states (a top-k selection, a state handed
    on from layer to layer) given the value an earlier layer's call received for it or returned (a tensor of its
    output after the first, of the argument's shape and dtype), where that value differs from its own: a value
    handed between layers taken from another layer (a shared layer reading the first full layer's selection
    instead of the latest one, or the reverse). One change per distinct value, named by the first layer that
    received or returned it."""
    if scope is None or not called or not siblings:
        return []
    args, kwargs = called[0]
    keys: list[tuple[str | int, torch.Tensor]] = [(k, a) for k, a in enumerate(args) if k > 0]
    keys += list(kwargs.items())
    try:  # named at the layer's forward (its signature)
        forward = inspect.unwrap(type(modules[scope]).forward)
        lines, start = inspect.getsourcelines(forward)
        start += next((i for i, line in enumerate(lines) if line.lstrip().startswith("def ")), 0)  # past decorators
        site = Site("argument", inspect.getsourcefile(forward) or "", start)
    except (TypeError, OSError):
        return []
    found = []
    for key, own in keys:
        if not isinstance(own, torch.Tensor):
            continue
        seen: list[torch.Tensor] = [own]
        name = f"`{key}`" if isinstance(key, str) else f"argument {key}"
        for path, (other_args, other_kwargs) in siblings.items():
            value = other_args[key] if isinstance(key, int) and key < len(other_args) else other_kwargs.get(key)
            out = returned.get(path)
            offered = [(value, "received for it")]
            offered += (
                [(t, f"returned (its output {i})") for i, t in enumerate(out) if i] if isinstance(out, tuple) else []
            )
            for candidate, how in offered:
                if (
                    not isinstance(candidate, torch.Tensor)
                    or candidate.shape != own.shape
                    or candidate.dtype != own.dtype
                    or any(torch.equal(candidate, v) for v in seen)
                ):
                    continue
                seen.append(candidate)
                words = (
                    f"{scope}'s {name} given the value {path}'s call {how} (a value that differs from layer to layer "
                    "taken from another layer)"
                )
                found.append(Change(site, words, _ones, argument=(key, candidate)))
    return found


def _added_after_activation(sites: list[tuple[Site, tuple]], params: dict[int, str]) -> list[Change]:
    """A parameter added to an activation's input added to its output instead (``softplus(dt) + dt_bias`` for
    ``softplus(dt + dt_bias)``: Mamba-2's and Lara Mini's time step, Zamba's per head): the add's site rewritten to
    leave the parameter out, and the activation's to add it to its output; call by call, so a loop over heads adds
    each head's own bias."""
    sums = {  # a sum's output -> the parameter (or a view of it) it added, and the sum's site
        id(out): (b, site)
        for site, (_func, args, _kwargs, out) in sites
        if _arithmetic(site.op) == "add" and isinstance(out, torch.Tensor) and len(args) == 2
        for b in args
        if _param_of(b, params) is not None  # the parameter, or a view of it (one head's ``bias[h][..., None]``)
    }
    found = []
    for site, (_func, args, _kwargs, _out) in sites:
        op = site.op.strip("_")
        if op not in _ACTIVATIONS or not args or not isinstance(args[0], torch.Tensor) or id(args[0]) not in sums:
            continue
        b, add = sums[id(args[0])]
        words = f"{_param_of(b, params)} added after the {op} instead of to its input ({op}(x) + b for {op}(x + b))"
        found.append(Change(site, words, _bias_moved(params), also=add))
    return found


def _ranked_activated(sites: list[tuple[Site, tuple]], names: dict[int, str]) -> list[Change]:
    """The scores a top-k ranks built from an activation of the logits: ``sigmoid(logits) + bias`` (DeepSeek-V3's
    choice) in place of ``logits + bias`` (Kolibri's), at an add of a vector (a correction bias, a parameter or a
    buffer: ``names``, by id) whose output a ``topk`` reads."""
    ranked = [args[0] for site, (_f, args, _k, _o) in sites if site.op == "topk" and args]
    found = []
    for site, (_func, args, _kwargs, out) in sites:
        if _arithmetic(site.op) != "add" or len(args) != 2 or not any(out is r for r in ranked):
            continue
        for k in (0, 1):
            x, bias = args[k], args[1 - k]
            if not (isinstance(x, torch.Tensor) and isinstance(bias, torch.Tensor)) or bias.dim() != 1 or x.dim() < 2:
                continue
            name = _param_of(bias, names) or "the bias"
            for act, fn in (("sigmoid", torch.sigmoid), ("softmax", _softmax_last)):
                words = f"the top-k ranking {act}(scores) + {name} in place of scores + {name} (an activation first)"
                found.append(Change(site, words, _operand_activated(k, fn)))
    return found


def _operand_activated(k: int, act: Callable[[torch.Tensor], torch.Tensor]) -> Callable:
    """An add's ``k``-th operand passed through ``act`` first."""

    def rewrite(args: tuple, kwargs: dict, out: torch.Tensor) -> torch.Tensor:
        x = act(args[k].float()).to(args[k].dtype)
        return (x + args[1 - k] if k == 0 else args[1 - k] + x).to(out.dtype)

    return rewrite


def _bias_moved(params: dict[int, str]) -> Callable[[tuple, dict, torch.Tensor], torch.Tensor]:
    """The rewrite of :func:`_added_after_activation`, at both sites: the add returns its other operand and holds
    the parameter; the activation's output gets the held parameter added."""
    held: list[torch.Tensor] = []

    def rewrite(args: tuple, kwargs: dict, out: torch.Tensor) -> torch.Tensor:
        bias = next((a for a in args[:2] if _param_of(a, params) is not None), None) if len(args) == 2 else None
        if bias is not None:  # the add: the other operand alone
            held[:] = [bias]
            return next(a for a in args[:2] if a is not bias)
        return out + held[0] if held else out

    return rewrite


def _same_shape(args: tuple, out) -> bool:
    """Whether a call's first two arguments are tensors of its output's shape (a gate times a value)."""
    return (
        len(args) >= 2
        and all(isinstance(a, torch.Tensor) for a in args[:2])
        and isinstance(out, torch.Tensor)
        and args[0].shape == args[1].shape == out.shape
    )


def _norm_modules(modules: dict[str, torch.nn.Module], block: str) -> list[tuple[str, torch.nn.Module]]:
    """The norms inside ``block`` (a module whose class name says Norm and whose forward takes no gate)."""
    found = []
    for path, module in modules.items():
        if not path.startswith(block + ".") or "Norm" not in type(module).__name__:
            continue
        try:
            if "gate" in inspect.signature(module.forward).parameters:
                continue  # a gated norm: _gated_norms' changes
        except (TypeError, ValueError):
            continue
        found.append((path, module))
    return found


def _keeps_normed(mode: _Changing) -> Callable:
    """A forward hook noting a norm module's output (by id) with the module and its input."""

    def keep(module, args, out):
        if isinstance(out, torch.Tensor) and args and isinstance(args[0], torch.Tensor):
            mode.normed[id(out)] = (module, args[0])

    return keep


def _gates_across_norms(
    dry: _Changing, sites: list[tuple[Site, tuple]], norms: list[tuple[str, torch.nn.Module]]
) -> list[Change]:
    """A gate moved across a norm, both ways: a norm's output times a gate of its shape rewritten as the norm of
    the gated input (``norm(x) * g`` read as ``norm(x * g)``: MiniMax's output gate, a gate applied before the
    norm), and a norm reading a product of two tensors of one shape rewritten as the norm of one times the other
    (``norm(x * g)`` read as ``norm(x) * g``)."""
    found = []
    paths = {id(m): p for p, m in norms}
    for site, (_func, args, _kwargs) in sites:
        if site.op not in ("mul", "__mul__", "__rmul__") or len(args) < 2:
            continue
        for k in (0, 1):
            hit = dry.normed.get(id(args[k]))
            other = args[1 - k]
            if hit is None or not isinstance(other, torch.Tensor) or other.numel() != hit[1].numel():
                continue  # a gate of the norm's input's size (its heads merged: xLSTM's (batch, seq, heads * dim))
            norm = paths.get(id(hit[0]), "the norm")
            words = f"the gate applied before {norm}'s normalisation (norm(x * g)), not after (norm(x) * g)"
            found.append(Change(site, words, _gate_before_norm, norm_gate="before"))
    for path, module in norms:
        inputs = [x for m, x in dry.normed.values() if m is module]
        if not any(s.op in ("mul", "__mul__", "__rmul__") and any(o is x for x in inputs) for s, o in dry.outs.items()):
            continue  # the norm reads no product this block made
        try:
            file, line = inspect.getsourcefile(type(module)), inspect.getsourcelines(type(module).forward)[1]
        except (OSError, TypeError):
            continue
        for k in (0, 1):
            words = (
                f"{path}'s input gate (operand {1 - k} of the product it reads) applied after its normalisation "
                "(norm(x) * g), not before (norm(x * g))"
            )
            found.append(
                Change(
                    Site(f"{type(module).__name__}.forward", file or "?", line),
                    words,
                    _gate_after_norm(k),
                    module=path,
                    norm_gate="after",
                )
            )
    return found


def _norms_moved(norms: list[tuple[str, torch.nn.Module]]) -> list[Change]:
    """Each weightless norm (no parameter but ones: FalconMamba's dt, B and C norms) moved across the product
    that reads its output: its call skipped, that product's output normalised over the features it makes
    (``norm(x) @ W`` read as ``norm(x @ W)``: a time-step norm applied after dt_proj)."""
    found = []
    for path, module in norms:
        if any(bool((p != 1).any()) for p in module.parameters()):
            continue
        try:
            file, line = inspect.getsourcefile(type(module)), inspect.getsourcelines(type(module).forward)[1]
        except (OSError, TypeError):
            continue
        words = (
            f"{path}'s normalisation applied to the output of the product reading it (norm(x @ W), over the "
            "features it makes), not to its input (norm(x) @ W)"
        )
        site = Site(f"{type(module).__name__}.forward", file or "?", line)
        left_out = f"{path}'s normalisation left out (its input handed on as it is)"
        found.append(Change(site, left_out, _norm_left_out, module=path, norm_gate="left_out"))
        found.append(Change(site, words, _norm_skipped, module=path, norm_gate="moved"))
    return found


def _read_before_norm(
    dry: _Changing, sites: list[tuple[Site, tuple]], norms: list[tuple[str, torch.nn.Module]]
) -> list[Change]:
    """Each product or projection reading a norm's output, rewritten to read that norm's input (the value before
    its normalisation: a block attention residual's values taken from the raw states, its keys from the normed
    ones), that operand only: the norm's other readers keep its output."""
    found = []
    paths = {id(m): p for p, m in norms}
    for site, (func, args, _kwargs) in sites:
        if site.op not in _READS:
            continue
        for k, a in enumerate(args[:2]):
            hit = dry.normed.get(id(a)) if isinstance(a, torch.Tensor) else None
            if hit is None or hit[1].numel() != a.numel():
                continue
            words = (
                f"{site.op} reading {paths.get(id(hit[0]), 'the norm')}'s input (the value before its normalisation) "
                f"in place of its output (operand {k})"
            )
            found.append(Change(site, words, _unnormed_operand(func, k), norm_gate="read_before"))
    return found


def _unnormed_operand(func, k: int) -> Callable:
    """The call re-run with its ``k``-th operand, a norm's output this pass made, replaced by that norm's input."""

    def rewrite(args: tuple, kwargs: dict, out: torch.Tensor, mode: _Changing) -> torch.Tensor:
        hit = mode.normed.get(id(args[k])) if len(args) > k else None
        if hit is None or hit[1].numel() != args[k].numel():
            return out
        raw = hit[1].reshape(args[k].shape).to(args[k].dtype)
        return func(*args[:k], raw, *args[k + 1 :], **kwargs)

    return rewrite


def _norm_left_out(module, args, kwargs, out, mode: _Changing) -> torch.Tensor | None:
    """A weightless norm module's call left out: its input handed on (Gemma 3n's and 4's value norm skipped)."""
    x = args[0] if args else next(iter(kwargs.values()), None)
    if not isinstance(x, torch.Tensor) or not isinstance(out, torch.Tensor) or x.shape != out.shape:
        return None
    return x.to(out.dtype)


def _norm_skipped(module, args, kwargs, out, mode: _Changing) -> torch.Tensor | None:
    """A norm module's call skipped (:func:`_norm_left_out`): its input handed on, marked for the product that
    reads it."""
    y = _norm_left_out(module, args, kwargs, out, mode)
    if y is None:
        return None
    eps = next(
        (getattr(module, n) for n in ("eps", "variance_epsilon") if isinstance(getattr(module, n, None), float)), 1e-6
    )
    mode.skipped[id(y)] = lambda out, axis: _rms(out, axis, eps)
    return y


def _rms(out: torch.Tensor, axis: int, eps: float) -> torch.Tensor:
    """``out`` normalised by its root mean square over ``axis`` (computed in float32 at least)."""
    y = out.to(torch.promote_types(out.dtype, torch.float32))
    return (y * torch.rsqrt(y.pow(2).mean(axis, keepdim=True) + eps)).to(out.dtype)


def _gate_before_norm(args: tuple, kwargs: dict, out: torch.Tensor, mode: _Changing) -> torch.Tensor:
    """``norm(x) * g`` rewritten as ``norm(x * g)`` (the norm module called again on the gated input)."""
    for k in (0, 1):
        hit = mode.normed.get(id(args[k]))
        gate = args[1 - k]
        if hit is not None and isinstance(gate, torch.Tensor) and gate.numel() == hit[1].numel():
            module, x = hit
            return (
                module.forward((x.float() * gate.reshape(x.shape).float()).to(x.dtype)).reshape(out.shape).to(out.dtype)
            )
    return out


def _gate_after_norm(k: int) -> Callable:
    """A norm module's call on ``x * g`` (a product this pass made) rewritten as ``norm(x) * g``, ``x`` its
    ``k``-th operand."""

    def rewrite(module, args, kwargs, out, mode: _Changing):
        factors = mode.products.get(id(args[0])) if args else None
        if factors is None or not isinstance(out, torch.Tensor):
            return None
        x, gate = factors[k], factors[1 - k]
        return (module.forward(x).float() * gate.float()).to(out.dtype)

    return rewrite


def _patch(mode: _Changing) -> tuple[object, str, object] | None:
    """The change's replacement function set in the reference's modeling module for the pass (counted as
    applied when called); what restores the original (``setattr``'s arguments), None for no such change."""
    change = mode.change
    if change is None or change.patch is None or change.patch[0] not in sys.modules:
        return None
    module, name, replacement = sys.modules[change.patch[0]], change.patch[1], change.patch[2]
    original = getattr(module, name)

    def counted(*args, **kwargs):
        mode.applied += 1
        return replacement(*args, **kwargs)

    setattr(module, name, counted)
    return module, name, original


def _left_out(path: str, module: torch.nn.Module) -> Change:
    """``path``'s call left out: each output of its input's shape replaced by that input (Inkling-2's final block
    attention residual skipped, the last layer's output normalised as it is)."""
    try:
        file, line = inspect.getsourcefile(type(module)) or "?", inspect.getsourcelines(type(module).forward)[1]
    except (OSError, TypeError):
        file, line = "?", 0

    def rewrite(module, args, kwargs, out):
        inputs = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]

        def handed_on(t):
            same = [a for a in inputs if isinstance(t, torch.Tensor) and a.shape == t.shape]
            return same[-1].to(t.dtype) if same else t

        if isinstance(out, tuple | list):
            parts = type(out)(handed_on(t) for t in out)
            return parts if any(a is not b for a, b in zip(parts, out, strict=True)) else None
        new = handed_on(out)
        return new if new is not out else None

    site = Site(f"{type(module).__name__}.forward", file, line)
    return Change(site, f"{path} left out (its input handed on as it is)", rewrite, module=path)


def _scan_orders(block: torch.nn.Module) -> list[Change]:
    """Each recurrent scan the block's modeling code calls by name (a delta rule, a selective scan), run in each
    step order (:mod:`parity.diagnose.scan_order`), the reference's own order first: the others are tried only
    where that one reproduces the reference's recorded value."""
    found = []
    for module, name, function in scan_order.scan_functions(block):
        site = _function_site(module, name, function)
        for replacement, words in scan_order.replacements(name, function):
            found.append(Change(site, words, _ones, patch=(module, name, replacement)))
    return found


def _rope_pairings(block: torch.nn.Module) -> list[Change]:
    """Each RoPE function the block's modeling code calls by name run over the other pairs
    (:mod:`parity.diagnose.rope_pairs`: half-split read as interleaved, or the reverse)."""
    found = []
    for module, name, function in rope_pairs.rope_functions(block):
        site = _function_site(module, name, function)
        replacement, words = rope_pairs.other_pairs(name, function)
        found.append(Change(site, words, _ones, patch=(module, name, replacement)))
        lines = rope_pairs.callers(module, name)
        file = inspect.getsourcefile(sys.modules[module]) or module
        for line in lines if len(lines) > 1 else []:  # an attention's and its indexer's calls told apart
            replacement, words = rope_pairs.other_pairs(name, function, (file, line))
            found.append(Change(replace(site, caller=(file, line)), words, _ones, patch=(module, name, replacement)))
    return found


def _function_site(module: str, name: str, function: Callable) -> Site:
    """The site of a module-level function of the reference's modeling code: its ``def`` line (past decorators;
    a kernel-hub decorator's wrapper read as the function it wraps)."""
    source = inspect.unwrap(function)
    try:
        lines, line = inspect.getsourcelines(source)
        file = inspect.getsourcefile(source)
    except (OSError, TypeError):
        lines, file, line = [], module, 0
    line += next((i for i, text in enumerate(lines) if text.lstrip().startswith("def ")), 0)
    return Site(name, file or module, line)


#: the arguments of a recurrent cell module's forward that :func:`scan_order.mlstm` computes (xLSTM's backend)
_MLSTM_ARGS = ("query", "key", "value", "igate", "fgate")


def _cell_orders(modules: dict[str, torch.nn.Module], block: str) -> list[Change]:
    """Each mLSTM cell module inside ``block`` (a module whose forward takes query, key, value, igate and fgate:
    xLSTM's backend, which binds its kernels at init) run in each variant of :data:`scan_order.MLSTM_ORDERS`, its
    output replaced; a variant other than Transformers' own is applied only where the cell in Transformers' own
    order reproduces the module's output."""
    found = []
    for path, module in modules.items():
        if not path.startswith(block + "."):
            continue
        try:
            names = inspect.signature(module.forward).parameters
            file, line = inspect.getsourcefile(type(module)), inspect.getsourcelines(type(module).forward)[1]
        except (OSError, TypeError, ValueError):
            continue
        if not all(a in names for a in _MLSTM_ARGS):
            continue
        site = Site(f"{type(module).__name__}.forward", file or "?", line)
        own = next(iter(scan_order.MLSTM_ORDERS))
        for order, state in scan_order.MLSTM_ORDERS.items():
            found.append(Change(site, f"the mLSTM cell with {state}", _cell_in(own, order), module=path))
    return found


def _cell_in(own: str, order: str) -> Callable:
    """A cell module's call rewritten as :func:`scan_order.mlstm` in ``order`` (its first output replaced): in
    ``own`` order always (the fault may sit in the reference's cell), in another where the cell in ``own`` order
    reproduces what the module returned."""

    def rewrite(module, args, kwargs, out):
        given = dict(zip(inspect.signature(module.forward).parameters, args, strict=False)) | kwargs
        if any(not isinstance(given.get(a), torch.Tensor) for a in _MLSTM_ARGS):
            return None
        h = out[0] if isinstance(out, tuple) else out
        eps = float(getattr(getattr(module, "config", None), "eps", 1e-6))
        q, k, v, i, f = (given[a] for a in _MLSTM_ARGS)
        mine = scan_order.mlstm(own, q, k, v, i, f, eps)
        if not isinstance(h, torch.Tensor) or mine.shape != h.shape:
            return None
        scale = float(h.double().abs().max().clamp_min(1e-30))
        if order != own and float((mine.double() - h.double()).abs().max()) > 1e-4 * scale:
            return None  # the cell written here does not compute the module's: no variant of it is read
        new = scan_order.mlstm(order, q, k, v, i, f, eps).to(h.dtype)
        return (new, *out[1:]) if isinstance(out, tuple) else new

    return rewrite


def _module_hooks(mode: _Changing, modules: dict[str, torch.nn.Module]) -> list:
    """A forward hook on the module a change rewrites whole (none for a change of one operation)."""
    change = mode.change
    if change is None or change.module is None or change.module not in modules:
        return []

    def rewrite(module, args, kwargs, out):
        new = (
            change.rewrite(module, args, kwargs, out, mode)
            if change.norm_gate
            else change.rewrite(module, args, kwargs, out)
        )
        if new is None:
            return out
        mode.applied += 1
        return new

    return [modules[change.module].register_forward_hook(rewrite, with_kwargs=True)]


def _gated_norms(modules: dict[str, torch.nn.Module], block: str) -> list[Change]:
    """For each gated norm inside ``block`` (a module whose forward takes a ``gate``: Mamba2's and Gated
    DeltaNet's RMSNormGated), its gate applied on the other side of the normalisation: ``norm(x) * silu(gate)``
    and ``norm(x * silu(gate))``, one of which is the reference's own order (Transformers' ``norm_before_gate``)."""
    found = []
    for path, module in modules.items():
        if not path.startswith(block + ".") or "gate" not in inspect.signature(module.forward).parameters:
            continue
        try:
            file, line = inspect.getsourcefile(type(module)), inspect.getsourcelines(type(module).forward)[1]
        except (OSError, TypeError):
            continue
        site = Site(f"{type(module).__name__}.forward", file or "?", line)
        for after in (True, False):
            words = (
                f"{path}'s gate applied after its normalisation (norm(x) * silu(gate))"
                if after
                else f"{path}'s gate applied before its normalisation (norm(x * silu(gate)))"
            )
            found.append(Change(site, words, _gate_moved(after), module=path))
    return found


def _gate_moved(after: bool) -> Callable:
    """A gated norm's call rewritten with its gate on one side of the normalisation (the module run ungated)."""

    def rewrite(module, args, kwargs, out):
        x = args[0] if args else kwargs.get("hidden_states")
        gate = args[1] if len(args) > 1 else kwargs.get("gate")
        if not isinstance(x, torch.Tensor) or not isinstance(gate, torch.Tensor) or not isinstance(out, torch.Tensor):
            return None
        gated = F.silu(gate.float())
        optional = inspect.signature(module.forward).parameters["gate"].default is None
        divisible = bool((gated != 0).all())
        if not optional and not divisible:
            return None

        def norm(y: torch.Tensor) -> torch.Tensor:
            """The module's normalisation alone: run ungated, or (a gate it always applies after, its default
            None not handled: Lara Mini's) divided out."""
            if optional:
                try:
                    return module.forward(y).float()
                except Exception:  # a forward that reads its gate whatever its default says
                    if not divisible:
                        raise
            return module.forward(y, gate).float() / gated

        if after:
            return (norm(x) * gated).to(out.dtype)
        return norm((x.float() * gated).to(x.dtype)).to(out.dtype)

    return rewrite


def _merges_to(t: torch.Tensor, own: torch.Tensor) -> bool:
    """Whether ``t`` ``(batch, heads, seq, dim)``, its heads merged, has ``own``'s shape ``(batch, seq, width)``."""
    return t.dim() == 4 and (t.shape[0], t.shape[2], t.shape[1] * t.shape[3]) == tuple(own.shape)


def _param_of(t, params: dict[int, str]) -> str | None:
    """The name of the parameter ``t`` is, or is a view of (``bias[:, None, :]``); None for any other tensor."""
    if not isinstance(t, torch.Tensor):
        return None
    return params.get(id(t)) or params.get(id(_base(t)))


def _base(t: torch.Tensor) -> torch.Tensor:
    """The tensor ``t`` views (itself when it views none)."""
    return t._base if t._base is not None else t


def _operands_swapped(func, others: dict[int, torch.Tensor]) -> Callable[[tuple, dict, torch.Tensor], torch.Tensor]:
    """A rewrite running the product with each operand that is (a view of) a parameter in ``others`` (by the
    parameter's id) replaced by its partner, viewed alike (``bias[:, None, :]`` of the other bias)."""

    def swapped(a):
        if not isinstance(a, torch.Tensor) or id(_base(a)) not in others:
            return a
        partner = others[id(_base(a))]
        return partner if a is _base(a) else partner.reshape(a.shape)

    def rewrite(args: tuple, kwargs: dict, out: torch.Tensor) -> torch.Tensor:
        new = tuple(swapped(a) for a in args)
        if all(n is a for n, a in zip(new, args, strict=True)):
            return out
        return func(*new, **kwargs)

    return rewrite


def _weights_swapped(
    a: torch.Tensor, b: torch.Tensor, biases: tuple[torch.Tensor, torch.Tensor] | None = None
) -> Callable[[tuple, dict, torch.Tensor], torch.Tensor]:
    """A rewrite running a projection with weight ``a`` on ``b`` and one with ``b`` on ``a``, their biases kept or
    (``biases``: ``a``'s and ``b``'s) swapped with them."""

    def rewrite(args: tuple, kwargs: dict, out: torch.Tensor) -> torch.Tensor:
        other = b if args[1] is a else a if args[1] is b else None
        if other is None:
            return out
        if biases is not None and len(args) > 2:
            return F.linear(args[0], other, biases[1] if args[1] is a else biases[0], **kwargs)
        return F.linear(args[0], other, *args[2:], **kwargs)

    return rewrite


def _callers_near(x: Site, y: Site) -> bool:
    """Whether ``x`` and ``y`` are one line of a helper called from two nearby lines of one function (an RMS norm
    of B and one of C)."""
    if x.line != y.line or x.caller is None or y.caller is None or x.caller[0] != y.caller[0]:
        return False
    return 0 < abs(x.caller[1] - y.caller[1]) <= 8


def _with_pairs(found: list[Change]) -> list[Change]:
    """``found``, and each change made alike at two nearby lines of one function (``repeat_interleave`` on q
    and on k, an L2 norm of each; a decoder layer's two hyper-connection mixes, after attention and after the
    MLP), or at a run of three or more (q, k and v each split into heads), as one change, after the single ones."""
    pairs = []
    alike: dict[tuple[str, str, str], list[Change]] = {}
    for change in found:
        alike.setdefault((change.words, change.site.op, change.site.file), []).append(change)
    for a, b in (pair for group in alike.values() for pair in itertools.pairwise(group)):
        x, y = a.site, b.site
        if 0 < abs(y.line - x.line) <= 8 or _callers_near(x, y):
            pairs.append(Change(x, a.words, a.rewrite, also=y))
    # runs of three or more, each within a few lines of the next: all together; then within a function's length
    # (RoFormer's q split into heads two dozen lines before k and v, its context merged back 40 lines on)
    seen_runs: set[tuple[str, tuple[Site, ...]]] = set()
    for gap in (8, 64):
        for group in alike.values():
            runs: list[list[Change]] = []
            for item in group:
                if runs and 0 < item.site.line - runs[-1][-1].site.line <= gap:
                    runs[-1].append(item)
                else:
                    runs.append([item])
            for first, second, *rest in (r for r in runs if len(r) >= 3):
                key = (first.words, tuple(c.site for c in (first, second, *rest)))
                if key in seen_runs:
                    continue
                seen_runs.add(key)
                pairs.append(
                    Change(first.site, first.words, first.rewrite, also=second.site, more=tuple(c.site for c in rest))
                )
    # two square weights read transposed on nearby lines (each of two gates' per-head blocks), named together
    transposed = [c for c in found if c.words.endswith(_TRANSPOSED)]
    for a, b in itertools.combinations(transposed, 2):
        x, y = a.site, b.site
        if x.op == y.op and x.file == y.file and 0 < abs(y.line - x.line) <= 3:
            words = f"{a.words.removesuffix(_TRANSPOSED)} and {b.words.removesuffix(_TRANSPOSED)}{_TRANSPOSED}"
            pairs.append(Change(x, words, a.rewrite, also=y))
    return found + pairs


def named(found: list[tuple[Change, str]], block: str) -> Hint:
    """The hint for what :func:`search` found: the first change, and up to two more that do as well."""
    (first, at), more = found[0], found[1:3]
    also = "".join(f"; or equally {c.words} at {c.where}" for c, _ in more)
    if first.module is not None and first.module != block and not first.module.startswith(block + "."):
        # a module beside the block (no node records it), left out: named as where the change sits
        block = first.module
    return Hint(
        "one_change",
        f"likely {first.words} at {first.where}: with that one change inside {block}, the reference agrees with "
        f"ours at {at}{also} (the nodes before agree; which side holds the fault, the change does not say)",
        {"block": block, "changes": [{"op": c.site.op, "where": c.where, "words": c.words, "at": n} for c, n in found]},
    )
