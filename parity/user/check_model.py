"""``parity.check_model``: check a model you wrote yourself against a Transformers reference.

    res = parity.check_model(ours=build, reference="olmo3:yarn")

parity builds (or loads) the reference, hands its state dict and Transformers config to your
``build(state_dict, hf_config) -> nn.Module`` (a loader that assigns or copies, your names, your
layout), traces every reference tensor into your model (:mod:`parity.build.coverage`), aligns your modules
to the reference's nodes by those weights (:mod:`parity.user.align`), and runs :func:`parity.check`.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
import importlib.util
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from parity.build.builder import (
    Reference,
    build_reference,
    default_seq_len,
)
from parity.build.coverage import FUSED_PART, PART, PLAIN, SLICE, loader_coverage
from parity.build.reference import resolve_reference, unread_rows
from parity.build.settle import settle
from parity.model.facts_rules import GATE_UP_INTERLEAVED
from parity.model.pair import Loading, Pair, PairSource, fingerprints
from parity.record.functional import probe_reads
from parity.report.result import CheckResult
from parity.run.check import check
from parity.run.float64 import Float64Mode, float64_state_dict
from parity.run.options import CheckOptions
from parity.user.align import Aligned, align
from parity.user.derived import config_buffers, derived_keys, scalar_buffers
from parity.user.folded import folded_tensors, norm_readers
from parity.user.reference_nodes import reference_nodes
from parity.util.devices import Placement
from parity.util.errors import ParityError
from parity.util.resources import available_bytes
from parity.util.text import one_line

if TYPE_CHECKING:
    from importlib.abc import Loader
    from importlib.machinery import ModuleSpec


def load_callable(spec: str) -> Callable:
    """``"package.module:build"`` or ``"path/to/file.py:build"`` -> the callable. Raises ParityError."""
    target, sep, attr = spec.rpartition(":")
    if not sep or not target or not attr:
        raise ParityError(f"--ours {spec!r} must be module:function or path/to/file.py:function")
    try:
        if target.endswith(".py") or "/" in target:
            path = Path(target).expanduser()
            if not path.is_file():
                from parity.build.checkpoint import unreachable

                what = "is a folder, not a .py file" if path.is_dir() else "does not exist"
                raise ParityError(unreachable(path, "--ours:") or f"--ours: {path} {what}")
            folder = str(path.resolve().parent)
            if folder not in sys.path:  # its own imports find its neighbours, as `python path/file.py` would
                sys.path.insert(0, folder)
            # None (no loader for the file) fails below, reported as an import error
            module_spec = cast("ModuleSpec", importlib.util.spec_from_file_location(path.stem, path))
            module = importlib.util.module_from_spec(module_spec)
            sys.modules.setdefault(path.stem, module)
            cast("Loader", module_spec.loader).exec_module(module)
        else:
            if "" not in sys.path:
                sys.path.insert(0, "")  # the folder it runs in, as `python -c` would
            module = importlib.import_module(target)
    except ParityError:
        raise
    except Exception as e:  # ImportError, SyntaxError, anything the module raises on import
        raise ParityError(f"--ours: cannot import {target}: {type(e).__name__}: {one_line(e)}") from None
    fn = getattr(module, attr, None)
    if fn is None:
        raise ParityError(f"--ours: {target} has no attribute {attr!r}")
    return fn


def _raised(e: BaseException) -> str:
    """``SystemExit(3) (sys.exit)``, ``KeyboardInterrupt``, ``ValueError: ...``: what user code raised, in one line."""
    if isinstance(e, SystemExit):
        return f"SystemExit({e.code!r}) (sys.exit)"
    if isinstance(e, KeyboardInterrupt):
        return "KeyboardInterrupt (interrupted)"
    return f"{type(e).__name__}: {one_line(e)}"


def build_ours(ours, ref: Reference) -> nn.Module:
    """Call the user's ``build(state_dict, hf_config)`` (or take the module as it is). ``state_dict`` is
    the reference model's own, its tied names included as ``state_dict()`` gives them; a build that asks
    for a name only the checkpoint's files have (a loader written against the files, where Transformers
    renames or fuses tensors on load: Mixtral's per-expert ``w1``/``w2``/``w3``) is called again with the
    files' tensors, and the pair's conversions say so. Raises ParityError when it raises, returns something else than an nn.Module, or leaves
    weights on the meta device."""
    if isinstance(ours, nn.Module):
        model = ours
    elif callable(ours):
        name = getattr(ours, "__qualname__", repr(ours))
        try:
            # the tied names the files leave out (a tied lm_head.weight, BERT's decoder.bias) given as their sources,
            # as the reference model's own state_dict() holds them: a loader may read one where it is present
            model = _call_build(
                ours, name, _with_tied(ref.state_dict, ref.tied_keys), ref.hf_config, ref.build_on_copies
            )
        except KeyError as e:
            files = _files_if_asked(e, ref)
            if files is None:
                raise ParityError(f"build {name}(state_dict, hf_config) raised {_raised(e)}") from None
            try:
                model = _call_build(ours, name, files, ref.hf_config, ref.build_on_copies)
            except EditedInPlace:
                raise
            except (Exception, SystemExit, KeyboardInterrupt) as again:
                raise ParityError(
                    f"build {name}(state_dict, hf_config) raised {_raised(again)} (called with the checkpoint files' "
                    f"tensors after it asked for {e.args[0]!r}, a name only the files have)"
                ) from None
            ref.conversions.append(
                f"build {name} asked for {e.args[0]!r}, a name of the checkpoint's files that the reference model holds "
                "under another name or fused: it was called with the files' tensors as they are stored"
            )
        except EditedInPlace:
            raise
        except (Exception, SystemExit, KeyboardInterrupt) as e:  # sys.exit() in user code is no exit 0 of parity's
            raise ParityError(f"build {name}(state_dict, hf_config) raised {_raised(e)}") from None
        if not isinstance(model, nn.Module):
            raise ParityError(
                f"build {name}(state_dict, hf_config) returned {type(model).__name__}, not a torch.nn.Module"
            )
    else:
        raise ParityError(
            f"ours must be a build(state_dict, hf_config) callable or an nn.Module, got {type(ours).__name__}"
        )
    meta = [n for n, p in model.named_parameters() if p.is_meta]
    if meta:
        raise ParityError(
            f"your model still has {len(meta)} parameter(s) on the meta device ({', '.join(meta[:3])}): load them"
        )
    adopt_plain_tensors(model)
    return model.eval()


def _with_tied(state_dict: dict, tied_keys: dict[str, str] | None) -> dict:
    """``state_dict`` with each tied name (a tied ``lm_head.weight``, which the checkpoint's files leave out)
    holding its source's tensor, as the reference model's own ``state_dict()`` gives it to a loader."""
    ties = {alias: state_dict[source] for alias, source in (tied_keys or {}).items() if source in state_dict}
    return {**state_dict, **{k: v for k, v in ties.items() if k not in state_dict}} if ties else state_dict


class EditedInPlace(ParityError):
    """A build edited tensors of the state dict it was given in place (``changed``): the reference's own, which it
    holds too, so both sides changed alike."""

    def __init__(self, name: str, changed: list[str]):
        super().__init__(
            f"build {name}(state_dict, hf_config) changed {len(changed)} reference tensor(s) in place "
            f"({_first(changed, 3)}): the reference holds the same tensors, so both sides changed, and no copy to "
            "build from fits in the memory known to be free; compute a new tensor (w * 2, w.clone().mul_(2)) instead "
            "of editing the state dict's"
        )
        self.changed = changed


def _call_build(ours, name: str, state_dict: dict, hf_config, copies: bool = False) -> nn.Module:
    """``ours(state_dict, hf_config)`` on a dict of its own (a loader may pop the keys it consumed), of copies of
    the tensors with ``copies``; what it raises passes through. Raises :class:`EditedInPlace` when it edits a tensor
    of ``state_dict`` in place (a norm folded into a weight it holds as a view, ``w.mul_(g)``)."""
    if copies:
        return ours({k: t.detach().clone() if isinstance(t, torch.Tensor) else t for k, t in state_dict.items()},
                    hf_config)  # fmt: skip
    before = fingerprints(state_dict)
    model = ours(dict(state_dict), hf_config)
    after = fingerprints(state_dict)
    changed = [k for k, v in before.items() if after.get(k) != v]
    if changed:  # the reference holds these very tensors: an in-place edit changes both sides and hides it
        raise EditedInPlace(name, changed)
    return model


def _room_for_copies(state_dict: dict) -> bool:
    """Whether a copy of ``state_dict``'s tensors fits in the memory known to be free (twice over)."""
    size = sum(t.numel() * t.element_size() for t in state_dict.values() if isinstance(t, torch.Tensor))
    room = available_bytes()
    return room is not None and size * 2 <= room


def _files_if_asked(error: KeyError, ref: Reference) -> dict | None:
    """The checkpoint files' tensors when the KeyError names a key the files have and the reference's
    state dict has not (a loader written against the files), else None."""
    key = error.args[0] if len(error.args) == 1 else None
    if ref.file_tensors is None or not isinstance(key, str) or key in ref.state_dict:
        return None
    files = ref.file_tensors()
    if key not in files:
        return None
    # a tensor the reference holds under the files' own name is handed as the reference's (shared storage)
    return {
        k: ref.state_dict[k] if k in ref.state_dict and ref.state_dict[k].shape == v.shape else v
        for k, v in files.items()
    }


def adopt_plain_tensors(model: nn.Module) -> list[str]:
    """Weights a model keeps as plain tensors in a dict, list or tuple attribute (``self.w = {key:
    tensor}``, a JAX-style port) rather than parameters or buffers: each registered on its module as a
    parameter that shares the tensor's storage (``plain__w__model_layers_0_...``), so loader coverage,
    alignment and the function capture find it; the model still reads its own tensors. Returns the
    names registered (none for a model whose weights are all parameters or buffers)."""
    adopted = []

    def tensors(path: str, value, depth: int):
        """``(path, tensor)`` for every plain tensor in ``value``, through nested dicts, lists and tuples
        (``self.p = {"L0": {"qkv": W, ...}}``), a few levels deep."""
        if isinstance(value, torch.Tensor):
            yield path, value
        elif isinstance(value, (dict, list, tuple)) and depth < 4:
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for key, inner in list(items):
                yield from tensors(f"{path}__{key}", inner, depth + 1)

    for module in list(model.modules()):
        for attr, value in list(vars(module).items()):
            if attr.startswith("_") or not isinstance(value, (dict, list, tuple)):
                continue
            for path, t in tensors(attr, value, 0):
                if isinstance(t, nn.Parameter) or not t.is_floating_point() or t.dim() == 0:
                    continue
                name = PLAIN + re.sub(r"\W", "_", path)
                if name in module._parameters:
                    continue
                module.register_parameter(name, nn.Parameter(t.detach(), requires_grad=False))
                adopted.append(name)
    return adopted


def _first(items: list[str], n: int = 4) -> str:
    return ", ".join(items[:n]) + (f", ... ({len(items)} in all)" if len(items) > n else "")


def _transformer_lens_processed(model: nn.Module) -> bool:
    """A TransformerLens model whose weights were processed (``from_pretrained``'s default): norms folded
    into the next projections (its config then says ``LNPre`` / ``RMSPre``) or writing weights centred
    (each row of ``W_E`` has mean 0 along d_model). Neither is a layout of the reference's tensors."""
    if not type(model).__module__.startswith("transformer_lens"):
        return False
    if getattr(getattr(model, "cfg", None), "normalization_type", None) in ("LNPre", "RMSPre"):
        return True
    w_e = getattr(getattr(model, "embed", None), "W_E", None)
    if not isinstance(w_e, torch.Tensor) or w_e.numel() == 0:
        return False
    w_e = w_e.detach().float()
    return float(w_e.mean(-1).abs().max()) <= 1e-6 * max(float(w_e.abs().max()), 1e-30)


def _with_folded_gains(ref: Reference, held: dict, coverage, coverage_of):
    """Loader coverage of ``held`` (the checkpoint's tensors) with the norm gains a port folded into the next
    projections at load (:mod:`parity.user.folded`) read so, when that leaves fewer checkpoint tensors unplaced;
    else ``coverage`` as given. Each fold is a conversion line; a gain no parameter holds as well counts as
    computed into those projections."""
    assert ref.model is not None  # prepared() builds it
    folds, into = folded_tensors(norm_readers(ref.model, ref.facts.vocab_size), held, coverage.unused)
    trial = coverage_of({**held, **folds}) if folds else coverage
    # a gain folded into some of its projections only is no fold ours made (one folded otherwise: a wrong fold,
    # judged at its node as a value computed at load)
    partial = {g for g, weights in into.items() if set(weights) & set(trial.unused)}
    if partial:
        into = {g: weights for g, weights in into.items() if g not in partial}
        folds = {w: folds[w] for weights in into.values() for w in weights}
        trial = coverage_of({**held, **folds}) if folds else coverage
    if not folds or len(trial.unused) >= len(coverage.unused):
        return coverage
    holders = {s.key: s.param for sources in trial.sources.values() for s in sources}
    trial.folded.update(into)
    for g, weights in into.items():
        trial.conversions.append(f"{g}: folded into the input columns of {', '.join(weights)} (W * g, at load)")
        if g in trial.unused:
            trial.mark_derived({g: sorted({holders[w] for w in weights if w in holders})})
    return trial


def _unread_copies(coverage, model: nn.Module, tied_keys: dict[str, str] | None, vocab_size: int) -> None:
    """A checkpoint tensor ours holds in more parameters than the reference's ties allow, where some of them ours'
    forward never reads (a plain copy of the embedding kept beside the scaled copies forward uses): those are
    no consumers. The gap becomes a note when the parameters read are no more than the tie's members; a probe
    forward on four tokens says which parameters are read (:func:`parity.record.functional.first_reads`)."""
    gaps = {key: g for key in coverage.consumed for g in coverage.gaps if g.startswith(f"{key} consumed ")}
    if not gaps:
        return
    params = dict(model.named_parameters())
    read: dict[str, tuple[str, ...]] = {}
    probe_reads(model, vocab_size, read)
    if not read:  # the probe could not run: the gaps stand
        return
    tied = set(tied_keys or {}) | set((tied_keys or {}).values())
    for key, gap in gaps.items():
        holders = coverage.consumed[key]
        unread = [h for h in holders if h in params and h not in read]
        if unread and len(holders) - len(unread) <= (2 if key in tied else 1):
            coverage.gaps.remove(gap)
            coverage.conversions.append(
                f"{key}: also held by {', '.join(unread)}, which your model's forward never reads (a copy left "
                "beside the ones it uses)"
            )


def _held_twice(coverage, model: nn.Module | None) -> list[str]:
    """``"ln2.weight holds model.layers.0.input_layernorm.weight, as ln1.weight does"``: a reference tensor
    copied into two parameters of ours (not one Parameter shared), where the reference has another
    tensor for one of them: a name mapping that loads one tensor twice, or a head tied by mistake."""
    if model is None or not hasattr(coverage, "sources"):
        return []
    storage = {n: p.untyped_storage().data_ptr() for n, p in model.named_parameters(remove_duplicate=False)}
    holders: dict[str, list[tuple[str, frozenset[int] | None]]] = {}
    for name, sources in coverage.sources.items():
        for source in sources:
            holders.setdefault(source.key, []).append((name, _rows_held(source)))
    lines = []
    for key, held in holders.items():
        if any(f"{key} and " in u or f" and {key} are" in u for u in getattr(coverage, "untied", [])):
            continue  # one tensor in the reference (a tied head): ours' copies hold what the reference means
        distinct = list({storage.get(n, id(n)): (n, rows) for n, rows in held}.values())  # one Parameter counts once
        first, first_rows = distinct[0]
        # parts of one fused tensor held apart (Mamba-2's in_proj as z, xBC and dt) are no tensor held twice
        lines += [
            f"{n} holds {key}, as {first} does"
            for n, rows in distinct[1:]
            if rows is None or first_rows is None or rows & first_rows
        ]
    return lines


def _rows_held(source) -> frozenset[int] | None:
    """The key's rows a source holds, where it holds part of them (a part, a fused part, a block of rows kept as a
    view); None for the whole tensor, or a cut parity does not count by rows."""
    if source.how == PART and source.rows:
        return frozenset(source.rows)
    if source.how == FUSED_PART and source.key_rows:
        return frozenset(source.key_rows)
    rows = source.slice_rows if source.how == SLICE else None
    return frozenset(rows) if rows else None


def unread_by_reference(reference: nn.Module, vocab_size: int, keys: list[str]) -> list[str]:
    """The ``keys`` among the reference's parameters that its own forward, on a short probe, never reads (MBart's
    decoder run as a causal LM: its cross-attention without encoder states); [] where the probe cannot run."""
    ran: set[str] = set()
    paths = {id(m): n for n, m in reference.named_modules()}
    handles = [m.register_forward_pre_hook(lambda m, _args: ran.add(paths[id(m)])) for m in reference.modules()]
    handles.append(reference.register_forward_hook(lambda m, _args, _out: ran.add("<returned>")))
    read: dict[str, tuple[str, ...]] = {}
    try:
        probe_reads(reference, vocab_size, read)  # the products and lookups reading each parameter, and every call
    finally:
        for handle in handles:
            handle.remove()
    if "<returned>" not in ran:
        return []  # the probe's forward did not finish: what it never reached says nothing
    params = dict(reference.named_parameters())
    # unread: its module never called and no product or lookup read it (a parent reading a child's weight itself)
    unread = [k for k in keys if k in params and k not in read and k.rpartition(".")[0] not in ran]
    return unread + [k for k in _outside_the_logits(reference, vocab_size, keys) if k not in unread]


def _outside_the_logits(reference: nn.Module, vocab_size: int, keys: list[str]) -> list[str]:
    """The ``keys`` among the reference's parameters its logits do not depend on, on a short probe: each moved by
    noise in turn (put back after), the logits exactly as before (BigBird's pooler, computed beside the LM head and
    never read by it; Reformer's ``lm_head.bias``, a parameter its head holds and never adds). Moved, not
    differentiated: a model may read a parameter under ``no_grad`` (HRM's initial states). [] where the probe cannot
    run; at most 32 keys are probed."""
    params = dict(reference.named_parameters())
    wanted = [k for k in keys if k in params and params[k].is_floating_point()][:32]
    if not wanted:
        return []
    ids = torch.randint(0, max(vocab_size, 2), (1, 8), generator=torch.Generator().manual_seed(0))

    def logits() -> torch.Tensor | None:
        out = reference(ids.to(params[wanted[0]].device))
        t = getattr(out, "logits", None)
        t = t if isinstance(t, torch.Tensor) else out[0] if isinstance(out, tuple) else None
        return t.detach().clone() if isinstance(t, torch.Tensor) else None

    outside: list[str] = []
    with torch.no_grad():
        try:
            before = logits()
            if before is None:
                return []
            for k in wanted:
                p = params[k]
                kept = p.detach().clone()
                try:
                    p.add_(
                        torch.randn(p.shape, generator=torch.Generator().manual_seed(1)).to(p) * (kept.abs().max() + 1)
                    )
                    after = logits()
                finally:
                    p.copy_(kept)
                if after is not None and torch.equal(after, before):
                    outside.append(k)
        except Exception:  # the probe cannot run this way: nothing is said
            return []
    return outside


def unplaced_message(coverage, model: nn.Module | None = None) -> str:
    """One line for reference tensors no parameter or buffer of the user's model holds: which, which
    of theirs hold nothing, the conventions parity looked for, and a likely cause when one shows
    (for a TransformerLens model, the unprocessed load parity needs)."""
    ours = [u.split(" (")[0] for u in coverage.unwritten]  # (any object with the fields: a report's coverage)
    text = (
        f"reference tensor(s) {_first(coverage.unused)} are in no parameter or buffer of your model, in any "
        "convention parity knows (shared, copied, transposed, w + 1 or w - 1, scaled by a named constant, axes "
        "permuted and reshaped, rows reordered or fused, rows copied out of a fused tensor, a part cut along one "
        "axis then permuted and reshaped, reversed along one axis)"
    )
    text += f"; parameters of yours that hold no reference tensor: {_first(ours)}" if ours else ""
    why = next((u.split("; ", 1)[1].rstrip(")") for u in coverage.unwritten if "; " in u), None)
    text += f" ({ours[0]}: {why})" if why else ""
    constants = [c.split(" holds")[0] for c in coverage.constants]
    text += f"; parameters of yours holding only zeros or ones: {_first(constants)}" if constants else ""
    again = _held_twice(coverage, model)
    text += (
        f"; parameters of yours holding a reference tensor another one of yours holds too: {_first(again)}"
        if again
        else ""
    )
    norms = [k for k in coverage.unused if "norm" in k.lower() or "ln_" in k]
    if model is not None and _transformer_lens_processed(model):
        text += (
            "; a TransformerLens model needs its weights unprocessed: HookedTransformer.from_pretrained_no_processing, "
            "or load_and_process_state_dict(..., fold_ln=False, center_writing_weights=False, center_unembed=False)"
        )
    elif norms and ours and len(norms) >= len(coverage.unused) // 2:
        text += (
            "; the norm weights look folded into the next projections (processed weights, e.g. TransformerLens' "
            "fold_ln / center_writing_weights): load the weights unprocessed"
        )
    return text


def build_user_pair(
    ours,
    reference="olmo3",
    *,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    node_map: dict[str, str] | None = None,
    cache_protocol=None,
    device=None,
    device_map: str | None = None,
) -> Pair:
    """The Pair of a user's model and the reference, nodes aligned by shared weights. Raises
    ParityError for bad input (see :func:`check_model`)."""
    placement = Placement.of(device, device_map)

    def prepared() -> tuple[Reference, str, Reference]:
        ref, family = resolve_reference(reference, dtype, seed)
        assert ref.model is not None  # resolve_reference builds it
        if not placement.is_cpu:  # the reference on its device(s) first; build() then receives those tensors
            ref.model = placement.dispatch(ref.model, placement.plan(type(ref.model), ref.hf_config, dtype))
            on_device = ref.model.state_dict()
            ref.state_dict = {k: on_device.get(k, v) for k, v in ref.state_dict.items()}
        # a reference rewriting its own weights on its first forward (RWKV's rescaling) does it now; ours is built
        # from the tensors as the checkpoint holds them
        ref.rewritten = rewritten = settle(ref.model, ref.state_dict, ref.facts.vocab_size)
        return ref, family, dataclasses.replace(ref, state_dict={**ref.state_dict, **rewritten}) if rewritten else ref

    ref, family, loaded = prepared()
    try:
        model = build_ours(ours, loaded)
    except EditedInPlace as edited:  # it edited the reference's own tensors: a fresh reference, copies to build from
        if not _room_for_copies(loaded.state_dict):
            raise
        ref, family, loaded = prepared()
        ref.build_on_copies = loaded.build_on_copies = True
        model = build_ours(ours, loaded)
        ref.conversions.append(
            f"build {getattr(ours, '__qualname__', repr(ours))} edits {len(edited.changed)} tensor(s) of the state dict "
            f"in place ({_first(edited.changed, 3)}): the reference was loaded again and the build called on copies"
        )
    assert ref.model is not None  # prepared() builds it
    rewritten = ref.rewritten
    if not placement.is_cpu:
        model = placement.dispatch(model)

    reference_model = ref.model  # the closure below keeps it narrowed (not None)

    def coverage_of(state_dict: dict):
        return loader_coverage(
            model,
            state_dict,
            ref.tied_keys,
            ref.conversions,
            by_design=ref.by_design,
            copies_break_ties=False,
            constants=ref.facts.named_constants(),
            interleaved=GATE_UP_INTERLEAVED in ref.facts.features,
            unread=unread_rows(reference_model),
        )

    held = ref.state_dict  # the tensors as the reference runs them
    coverage = coverage_of(held)
    if rewritten and set(coverage.unused) & set(rewritten):  # ours applies the rewrite in its forward instead
        held = {**ref.state_dict, **rewritten}
        coverage = coverage_of(held)
    if coverage.unused:  # a norm's gain folded into the projections reading it, at load
        coverage = _with_folded_gains(ref, held, coverage, coverage_of)
    _unread_copies(coverage, model, ref.tied_keys, ref.facts.vocab_size)
    if (coverage.unused or coverage.unwritten) and not _transformer_lens_processed(model):  # processed: see message
        coverage.mark_numbers(scalar_buffers(ref.model, coverage.unused))
        coverage.mark_from_config(config_buffers(ref.model, ref.hf_config, coverage.unused))
        coverage.mark_derived(derived_keys(ours, loaded, model, coverage))
    if coverage.unused:  # tensors the reference's forward never reads in this config: not required of ours
        coverage.mark_unread_by_reference(unread_by_reference(ref.model, ref.facts.vocab_size, coverage.unused))
    if coverage.unused:
        raise ParityError(unplaced_message(coverage, model))
    nodes, _ = reference_nodes(ref.model, ref.facts)
    probe = Pair(
        ours=model,
        reference=ref.model,
        nodes=nodes,
        facts=ref.facts,
        source=PairSource(family=family, config_name=ref.config_name),
    )
    specs, rows = align(ref.model, model, probe.nodes, coverage, ref.state_dict, ref.facts, node_map)
    if not any(r.how in ("weights", "fused rows", "container", "input", "functional", "part") for r in rows):
        reasons = "; ".join(f"{r.node}: {r.detail}" for r in rows[:3])
        raise ParityError(f"no node of the reference could be aligned to your model ({reasons}, ...)")
    return Pair(
        ours=model,
        reference=ref.model,
        nodes=specs,
        facts=ref.facts,
        dtype=dtype,
        source=PairSource(
            family=family,
            config_name=ref.config_name,
            seed=seed,
            checkpoint=ref.checkpoint,
            checkpoint_hash=ref.checkpoint_hash,
            device=placement.label,
            **cast(
                "dict[str, Any]",
                {"probe": f"the weights of {ref.config_name}"}
                if ref.checkpoint or isinstance(reference, torch.nn.Module)
                else {},
            ),
        ),
        loading=Loading(
            state_dict=ref.state_dict,
            conversions=ref.conversions,
            tied_keys=ref.tied_keys,
            by_design=ref.by_design,
            coverage=coverage,
        ),
        default_seq_len=default_seq_len(ref.facts),
        alignment=rows,
        cache_protocol=cache_protocol,
        rebuild64=_rebuild64(ours, ref) if placement.is_cpu else None,
    )


def _rebuild64(ours, ref: Reference) -> Callable[[], tuple[nn.Module, nn.Module]] | None:
    """Both models built anew in float64 for the semantic run: the reference from its config over a
    float64 copy of the state dict, ours by calling ``build`` on that copy and a float64 config, both
    under :class:`~parity.run.float64.Float64Mode`, so each makes its tables (RoPE frequencies) and
    derived weights (a norm's ``1 + w``) in float64. None when ``ours`` is a module (nothing to call)."""
    if isinstance(ours, nn.Module) or not callable(ours) or ref.model is None:
        return None
    reference_cls = type(ref.model)

    def rebuild() -> tuple[nn.Module, nn.Module]:
        state_dict = float64_state_dict({**ref.state_dict, **ref.rewritten})  # as the checkpoint holds them
        files = ref.file_tensors
        config = copy.deepcopy(ref.hf_config)
        config.dtype = torch.float64
        with Float64Mode():
            reference = build_reference(reference_cls, config, state_dict)
            settled = settle(reference, state_dict, ref.facts.vocab_size)  # as the float32 one was
            state_dict = {**state_dict, **settled}
            # a build that asks for the files' names gets their tensors again, in float64, as build_ours retries
            float64_files = (lambda: float64_state_dict(files())) if files is not None else None
            model = build_ours(
                ours,
                dataclasses.replace(
                    ref, state_dict=state_dict, hf_config=config, conversions=[], file_tensors=float64_files
                ),
            )
        return model, reference

    return rebuild


def check_model(
    ours,
    reference="olmo3",
    *,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    node_map: dict[str, str] | None = None,
    cache_protocol=None,
    device=None,
    device_map: str | None = None,
    input_ids: torch.Tensor | list | None = None,
    attention_mask: torch.Tensor | None = None,
    options: CheckOptions | None = None,
    **option_values,
) -> CheckResult:
    """Check your own model against a Transformers reference, node by node.

    ``ours``: ``build(state_dict, hf_config) -> nn.Module`` (assigning or copying the reference's
    tensors, in any naming and layout: fused ``qkv``, Conv1D-style transposes; never editing them in
    place: the reference holds the same tensors), or an nn.Module that already holds the weights.

    The model's contract: ``forward(input_ids, attention_mask=None, position_ids=None) -> logits``.
    ``input_ids`` is ``(batch, seq)`` int64; ``attention_mask`` (1 for real tokens, 0 for padding)
    is passed only to a padded run (``left_pad``), and a forward without that argument is refused
    there; ``position_ids`` (``(batch, seq)``, as ``generate`` derives them from the mask; counted from
    ``padding_idx + 1`` for a reference whose embedding derives them so, RoBERTa's) comes with the mask
    when forward takes it (take it, or a padded row's positions may differ from the reference's); what
    forward returns is compared as the ``logits`` node: a tensor
    ``(batch, seq, vocab)``, or a tuple or dict whose first tensor is that.

    ``reference``: ``"family[:config]"`` (e.g. ``"olmo3:yarn"``: a
    registered family's reference with parity's random weights), a checkpoint folder, a config.json,
    a ``PretrainedConfig`` or a ``PreTrainedModel``. ``node_map``: ``{reference node or glob: your
    module path}`` overrides of the automatic alignment. ``input_ids``, ``attention_mask``,
    ``options`` and option keywords: as :func:`parity.check` (``seq_len``, ``batch_size``, ``mode``,
    ``atol``, ``exact``, ``decode``, ``prompts`` / ``chat`` (real text, tokenized with the reference
    checkpoint's tokenizer), ``input_ids`` as lists of token ids (a prompt set)...: a
    :class:`parity.CheckOptions`), checked before anything is built.
    ``cache_protocol``: how to run your model with its KV cache for ``decode=`` checks when its API is
    not ``new_cache()`` / ``forward(..., cache=)`` (a :class:`parity.run.decode.CacheProtocol`).
    ``device`` / ``device_map``: where both models run (see :func:`parity.build.build_pair`);
    ``build`` receives the reference's tensors already there.

    Functional nodes (after RoPE, scores, probabilities, context) need ``parity.tap(tensor, name)``
    in your forward; a node without a tap is ``untapped``: shown and counted, never a pass or a
    failure. ``result.alignment`` says how each reference node was found in your model.

    Raises:
        ParityError: ``build`` raised or returned something else than an nn.Module; your model
            leaves a reference tensor unused or keeps a parameter on the meta device; nothing could
            be aligned; a bad reference or bad check arguments (see :func:`parity.check`).
    """
    options = CheckOptions.of(options, **option_values)  # bad options fail before anything is built
    if isinstance(input_ids, (list, tuple)):  # rows of token ids, any lengths: a prompt set, checked now
        options, input_ids = dataclasses.replace(options, prompt_ids=tuple(input_ids)), None
    pair = build_user_pair(
        ours,
        reference,
        dtype=dtype,
        seed=seed,
        node_map=node_map,
        cache_protocol=cache_protocol,
        device=device,
        device_map=device_map,
    )
    return check(pair, input_ids, attention_mask=attention_mask, options=options)


__all__ = ["Aligned", "build_user_pair", "check_model", "load_callable", "resolve_reference"]
