"""Checkpoint tensors a user's build reads in a form no parameter holds: computed at load.

A loader may compute one value from several checkpoint tensors when it loads them: DiffLlama's
``lambda_full = exp(lambda_q1 . lambda_k1) - exp(lambda_q2 . lambda_k2) + lambda_init`` folded into one
number per layer, a norm's weight folded into the next projection's input columns. No parameter of
ours then holds the tensor by storage or value in any convention loader coverage knows
(:mod:`parity.build.coverage`), yet the model reads it. Coverage traces tensors, not functions of
several, so for those keys the question is asked of the build itself: each is perturbed alone and
``build`` called again; a key whose perturbation changes ours' logits, or a parameter of ours that coverage
could not explain and the forward reads (the probe's tokens may not reach what it decides), is read
(derived at load); one that changes nothing is never read and stays a gap. Parameters of ours that change
with it are the values derived from it. The nodes downstream judge whether the function was right.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import time
from typing import cast

import torch
from torch import nn

from parity.build.builder import Reference, construct
from parity.build.coverage import Coverage
from parity.record.functional import probe_reads

#: at most this many keys are probed one by one (each costs a build and a forward); past it, none is, unless
#: the probes fit :data:`PROBE_SECONDS` (a tiny config whose loader folds every norm into its projections)
MAX_PROBED = 64
#: the time the probes may take, judged from one build and forward, when more than MAX_PROBED keys are unused
PROBE_SECONDS = 45.0
#: tokens of the probe forward
PROBE_TOKENS = 12


def _logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor | None:
    """Ours' logits for ``ids`` (``(1, PROBE_TOKENS)``), or None when the forward raises or returns no
    tensor: the probe then says nothing."""
    from parity.run.prompt_set import logits_of

    try:
        with torch.no_grad():
            return logits_of(model(ids)).detach().to("cpu", torch.float64)
    except Exception:  # a user's forward failing here is judged by the check itself, with its message
        return None


def _perturbed(t: torch.Tensor, gen: torch.Generator, rows: tuple[int, ...] | None = None) -> torch.Tensor:
    """A new tensor near ``t`` and different from it everywhere (zeros included); with ``rows``, only in those rows
    of ``t`` flattened to ``(-1, last axis)``."""
    noise = torch.randn(t.shape, generator=gen, dtype=torch.float32).to(t.dtype)
    scale = float(t.float().abs().mean()) if t.numel() else 0.0
    if rows is not None and t.dim() > 1:
        keep = torch.zeros(t.numel() // t.shape[-1], 1, dtype=t.dtype)
        keep[list(rows)] = 1
        noise = noise * keep.expand(-1, t.shape[-1]).reshape(t.shape)
    return t + noise * (0.25 * scale if scale > 0 else 0.1)


def _values(model: nn.Module, names: set[str]) -> dict[str, torch.Tensor]:
    return {n: t.detach() for n, t in [*model.named_parameters(), *model.named_buffers()] if n in names}


def scalar_buffers(reference: nn.Module | None, keys: list[str]) -> dict[str, float]:
    """``{key: value}`` for each of ``keys`` that is a one-element buffer of ``reference`` (not a parameter):
    a constant of the architecture its module registers and saves (xIELU's ``eps`` and ``beta``), which a
    port holds as a plain number. A learned tensor is a parameter and never lands here."""
    if reference is None:
        return {}
    buffers = dict(reference.named_buffers())
    return {k: float(buffers[k].flatten()[0]) for k in keys if k in buffers and buffers[k].numel() == 1}


def config_buffers(reference: nn.Module | None, config, keys: list[str]) -> list[str]:
    """Those of ``keys`` that are multi-element buffers of ``reference`` (not parameters) holding what a fresh
    model of ``config`` computes when built (MiniMax's lightning decay rates, saved with the checkpoint): state
    of the architecture a port may compute itself, not weights it failed to load. The fresh model is built with
    its parameters on the meta device (no weights allocated); a learned buffer (a router's correction bias)
    holds other values than its initial ones and stays. Empty when the model cannot be built again."""
    buffers = dict(reference.named_buffers()) if reference is not None else {}
    wanted = [k for k in keys if k in buffers and buffers[k].numel() > 1 and buffers[k].is_floating_point()]
    if not wanted or config is None:
        return []
    try:
        with _parameters_on_meta():
            fresh = dict(construct(type(reference), copy.deepcopy(config)).named_buffers())
    except Exception:  # a class that cannot be built from its config alone: nothing is taken as computed
        return []
    found = []
    for key in wanted:
        new, old = fresh.get(key), buffers[key]
        if new is None or new.is_meta or new.shape != old.shape:
            continue
        tol = 8 * float(torch.finfo(old.dtype).eps)
        if torch.allclose(new.to(old.device, torch.float64), old.double(), rtol=tol, atol=tol):
            found.append(key)
    return found


@contextlib.contextmanager
def _parameters_on_meta():
    """While open, every parameter a module registers is moved to the meta device (buffers stay real)."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param) -> None:
        register(module, name, param)
        if param is not None and not param.is_meta:
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign, assignment]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def derived_keys(ours, ref: Reference, model: nn.Module, coverage: Coverage) -> dict[str, list[str]]:
    """``{checkpoint key: [our parameters derived from it]}`` for each of ``coverage.unused`` that ours'
    build reads in a form coverage cannot trace (see the module docstring), for each key held beside a
    parameter of ours that holds none (a key both copied and computed into another value at load), and for each
    key some of whose rows no parameter holds (those rows perturbed alone: folded into another weight). Empty when ``ours`` is a
    module (nothing to call again), when more than :data:`MAX_PROBED` keys are unused and probing them all would
    take longer than :data:`PROBE_SECONDS` (judged from one build), or when building
    twice from the same tensors does not give the same logits (a build that draws random values). A key
    whose perturbation changes a parameter coverage read as a likely loader mistake is left out: that
    refusal names the cause."""
    if isinstance(ours, nn.Module) or not callable(ours):
        return {}
    beside = [k for k in _beside_unwritten(coverage) if k not in coverage.unused]
    # keys some of whose rows no parameter holds (the key/value up-projection folded into the query's weights):
    # those rows alone perturbed
    partial = [k for k in coverage.rows_unheld if k not in coverage.unused and k not in beside]
    probed = list(coverage.unused) + (beside + partial)[: max(MAX_PROBED - len(coverage.unused), 0)]
    if not probed:
        return {}
    from parity.user.check_model import build_ours

    config = ref.hf_config
    vocab = getattr(config, "vocab_size", None) or getattr(getattr(config, "text_config", None), "vocab_size", None)
    if not vocab:
        return {}
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, int(vocab), (1, PROBE_TOKENS), generator=gen)
    unwritten = set(coverage.unwritten_names())
    mistaken = set(coverage.unwritten_names(reasoned=True))  # that refusal names the cause: it is kept
    before = _values(model, unwritten)
    first = _logits(model, ids)

    def rebuilt(state_dict: dict) -> nn.Module | None:
        try:
            return build_ours(ours, dataclasses.replace(ref, state_dict=state_dict, conversions=[]))
        except Exception:  # a build that fails on other values: no evidence either way
            return None

    started = time.monotonic()
    again = rebuilt(dict(ref.state_dict))
    same = None if again is None else _logits(again, ids)
    if first is None or same is None or not torch.equal(first, same):
        return {}
    if len(probed) > MAX_PROBED and len(probed) * (time.monotonic() - started) > PROBE_SECONDS:
        return {}  # too many keys to probe in the time a check may take
    twice = _values(cast(nn.Module, again), unwritten)
    # a parameter that differs between two builds from the same tensors is drawn at random (never written): no
    # perturbation's evidence
    drawn = {
        n for n, t in before.items() if n not in twice or twice[n].shape != t.shape or not torch.equal(twice[n], t)
    }
    found: dict[str, list[str]] = {}
    read: set[str] | None = None  # the parameters ours' forward reads, found when first needed
    for key in probed:
        state_dict = dict(ref.state_dict)
        state_dict[key] = _perturbed(state_dict[key], gen, coverage.rows_unheld.get(key))
        model2 = rebuilt(state_dict)
        logits = None if model2 is None else _logits(model2, ids)
        if logits is None:
            continue
        after = _values(cast(nn.Module, model2), unwritten)
        into = [
            n
            for n, t in before.items()
            if n in after and n not in drawn and (after[n].shape != t.shape or not torch.equal(after[n], t))
        ]
        if torch.equal(logits, first):
            # a parameter it changes that the forward reads is evidence too: the probe's tokens may not reach what
            # it decides (a lightning indexer's norms where every key block is kept); one never read is not
            if read is None:
                read = set(probe_reads(model, int(vocab)))
            into = [n for n in into if n in read]
            if not into:
                continue
        if not mistaken.intersection(into) and (key in coverage.unused or key in coverage.rows_unheld or into):
            found[key] = into
    return found


def _beside_unwritten(coverage: Coverage) -> list[str]:
    """The checkpoint keys held by the modules of ours that also hold a parameter holding none (``exp(A_log)``
    computed at load beside a copy of ``A_log``): each may be the one that parameter is computed from."""
    modules = {name.rpartition(".")[0] for name in coverage.unwritten_names()} - set(
        n.rpartition(".")[0] for n in coverage.unwritten_names(reasoned=True)
    )
    return sorted(
        {s.key for name, sources in coverage.sources.items() if name.rpartition(".")[0] in modules for s in sources}
    )
