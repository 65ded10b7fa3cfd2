"""Detectors of table lookups: which rows of an embedding table (token or learned position) each
side read, against the ids the module was given.

A lookup's output row is a row of its table (times one constant, Gemma's ``sqrt(hidden_size)``).
Reading the table row ours returned at every token, and comparing those row numbers with the ids
the reference's module received, names the mistake: token ids shifted (``ids + 1``: a BOS or
vocabulary offset), positions shifted, reversed or counted from 0 over padding (``position_ids``
ignored), or another mapping.
"""

from __future__ import annotations

import math
from typing import cast

import torch

from parity.diagnose.evidence import Evidence, fmt_list, rel
from parity.diagnose.hints import Hint
from parity.record.hf_capture import POSITION_TABLES

#: most table rows x looked-up tokens compared at once (a real vocabulary times a short prompt fits)
MAX_PAIRS = 2**28


def _is_lookup(kind: str) -> bool:
    return kind in ("wte", "embed_tokens", "word_embeddings", *POSITION_TABLES)


def rows_read(out: torch.Tensor, table: torch.Tensor, scale: float) -> torch.Tensor | None:
    """The table row each output row equals (``(n,)``), or None when some row is no row of the table."""
    rows = out.reshape(-1, out.shape[-1]).double() / scale
    t = table.double()
    if rows.shape[0] * t.shape[0] > MAX_PAIRS:
        return None
    dist = torch.cdist(rows, t)
    best = dist.min(dim=1)
    tol = 1e-5 * (float(t.abs().max()) + float(t.norm(dim=1).mean()))  # rounding of the largest entry, of a row
    if bool((best.values > tol).any()):
        return None
    return best.indices


def embedding_rows(e: Evidence) -> Hint | None:
    """A token or position embedding whose rows on one side are the table's, read at other ids than
    the module was given (the other side reads them at the ids): ``row = table[f(id)]``. Names a
    constant shift, a reversed table, positions counted over the padding (each row shifted by its pad
    count), or lists the mapping; either side."""
    table, ids = e.ref_trace.weights.get(e.name), e.ref_trace.inputs.get(e.name)
    # (one id per token: a table read several times per token, Qwen4-Exp's n-gram lookups, is its detectors')
    looked_up = ids is not None and not ids.is_floating_point() and ids.dtype != torch.bool and ids.dim() == 2
    if not _is_lookup(e.kind) and not (looked_up and table is not None and table.dim() == 2):
        return None  # (any table read at integer ids: BLT's hash n-gram embedding too)
    if table is None or table.dim() != 2:
        return None

    # a position table whose module derives its positions (BioGPT's from the attention mask, offset by 2): the rows
    # each side reads, from its output, where its input is no ids to read at
    def derived() -> Hint | None:
        return _position_rows(e, table) if e.kind in POSITION_TABLES else None

    if ids is None or ids.is_floating_point() or ids.numel() == 0:
        return derived()
    if e.ref.shape[:-1] != ids.shape or e.ref.shape[-1] != table.shape[1]:
        return derived()
    ids = ids.long()
    expected = table[ids.clamp(0, table.shape[0] - 1)].double()
    keep = expected.abs() > 1e-6 * float(expected.abs().max())
    if not bool(keep.any()):
        return derived()
    for side, right, wrong in (("ours", e.ref, e.ours), ("the reference", e.ours, e.ref)):
        scale = float((right.double()[keep] / expected[keep]).median())  # the module's constant (Gemma: sqrt(h))
        if scale == 0 or not e.close(right, (expected * scale).to(right.dtype)):
            continue  # this side is no scaled lookup at the ids: look at the other
        read = rows_read(wrong, table, scale)
        if read is None:
            return None
        hashed = _hash_reading(e, side, read.reshape(ids.shape), ids)
        return hashed or _mapping_hint(e, side, read.reshape(ids.shape), ids)
    return derived()  # neither side reads the table at its input: the input is no ids


#: the primes of BLT's hash functions, one per function (``compute_hash_embeddings``' list, cycled)
_HASH_PRIMES = (1000000007, 5915587277, 1500450271, 3267000013, 5754853343, 4093082899, 9576890767, 3628273133)


def _ngram_hashes(tokens: torch.Tensor, n: int, prime: int, vocab: int, form: str) -> torch.Tensor:
    """The hash id of the ``n``-gram ending at each token ``(batch, seq)`` (the sequence left-padded with ``n - 1``
    zeros), ``sum_i token_i * prime^i`` in wrapping int64 (BLT's ``rolling_polynomial_hash``) modulo ``vocab``, or
    another form a port writes: ``reversed`` (the newest token times ``prime^0``), ``unsigned`` (the wrapped sum read
    as a uint64 before the modulo)."""
    windows = torch.cat([tokens.new_zeros(tokens.shape[0], n - 1), tokens.long()], 1).unfold(1, n, 1)
    powers = torch.tensor(prime, dtype=torch.int64) ** torch.arange(n)
    if form == "reversed":
        powers = powers.flip(0)
    hashed = (windows * powers).sum(-1)
    if form == "unsigned":
        return torch.tensor([[(int(h) % 2**64) % vocab for h in row] for row in hashed.tolist()], dtype=torch.int64)
    return hashed % vocab


def _hash_reading(e: Evidence, side: str, read: torch.Tensor, ids: torch.Tensor) -> Hint | None:
    """A hash n-gram embedding's first group (BLT's ``encoder_hash_tok_embedding``, its first call) whose ids the
    reference computes as its formula gives them from the byte ids, ``side`` reading rows another form of the hash
    gives: named by that form. None unless the facts name such an embedding and its formula is the reference's."""
    spec = e.facts.ngram_hash
    tokens = e.ref_trace.inputs.get(e.facts.embed_module)
    sizes, vocab = cast(tuple, spec.get("group_sizes", ())), cast(int, spec.get("vocab", 0))
    if not sizes or not vocab or tokens is None or tokens.shape != ids.shape:
        return None
    n, prime = int(sizes[0]), _HASH_PRIMES[0]
    plain = _ngram_hashes(tokens, n, prime, vocab, "plain")
    if torch.equal(plain, ids.long()):
        odd = read  # the reference's ids are the formula's: the side reading other rows computed them otherwise
    elif torch.equal(plain, read.long()):
        odd, side = ids, ("the reference" if side == "ours" else "ours")  # the other side's rows are the formula's
    else:
        return None  # neither side's the first group's ids as the formula gives them: another call or formula
    forms = {
        "reversed": "the powers of the prime reversed (the newest byte of each window times prime^0, where the "
        "reference gives the oldest prime^0: sum_i token_i * prime^i over the window in order)",
        "unsigned": "the wrapped 64-bit sum read as unsigned before the modulo (where the reference keeps torch's "
        "signed int64, whose % gives a non-negative remainder of the signed value)",
    }
    for form, said in forms.items():
        if torch.equal(_ngram_hashes(tokens, n, prime, vocab, form), odd.long()):
            return Hint(
                "token_ids",
                f"likely the hash n-gram ids computed otherwise in {side}: it reads the {e.name} rows of {said} "
                f"({n}-byte windows, prime {prime}, modulo {vocab})",
                {"side": side, "form": form},
            )
    return None


def _position_rows(e: Evidence, table: torch.Tensor) -> Hint | None:
    """A position table's rows read on each side (each output row a row of the table: a plain lookup) where the
    module's input is no position (a mask it derives them from): the side whose rows count each batch row's tokens
    from 0 (an arange over the padding) named against the other's, whose rows follow the mask; None unless both
    sides read table rows and one side's rows count the tokens where the other's follow the padding."""
    if e.ours.shape != e.ref.shape or e.ref.dim() < 2 or e.ref.shape[-1] != table.shape[1]:
        return None
    shape = e.ref.shape[:-1]
    ours, ref = rows_read(e.ours, table, 1.0), rows_read(e.ref, table, 1.0)
    if ours is None or ref is None:
        return None
    if len(shape) == 1:  # one row broadcast over the batch (Pegasus's positions (seq, hidden)): as a batch of one
        shape = torch.Size((1, *shape))
    ours, ref = ours.reshape(shape), ref.reshape(shape)
    if bool((ours == ref).all()):
        return None
    valid = torch.ones(shape, dtype=torch.bool)
    if e.attention_mask is not None and tuple(e.attention_mask.shape) == tuple(shape):
        valid = e.attention_mask.bool()  # (what the padding holds is not judged: it may be either side's)
    for side, read, other in (("ours", ours, ref), ("the reference", ref, ours)):
        hint = _mapping_hint(e, side, read, other) if _counts_tokens(read, valid) else None
        if hint is not None and "pad_counts" in hint.evidence:  # (a table offset is position_table_offset's)
            return hint
    return None


def _counts_tokens(rows: torch.Tensor, valid: torch.Tensor) -> bool:
    """Whether ``rows`` ``(batch, seq)`` are ``arange(seq) + c`` at every ``valid`` token (one offset ``c``)."""
    shift = (rows - torch.arange(rows.shape[-1]).expand_as(rows))[valid]
    return shift.numel() > 0 and bool((shift == shift[0]).all())


def _mapping_hint(e: Evidence, side: str, read: torch.Tensor, ids: torch.Tensor) -> Hint | None:
    """The hint for ``side`` reading rows ``read`` where the ids are ``ids`` (both ``(batch, seq)``)."""
    valid = torch.ones_like(ids, dtype=torch.bool)
    if e.attention_mask is not None and e.attention_mask.shape == ids.shape:
        valid = e.attention_mask.bool()
    if bool((read[valid] == ids[valid]).all()):
        return None  # the right rows: the difference is elsewhere (a scale is constant_ratio's)
    position = e.kind in POSITION_TABLES
    what = "positions" if position else "token ids"
    shift = (read - ids)[valid]
    evidence: dict[str, object] = {
        "side": side,
        "ids": ids[0].tolist()[:8],
        "rows_read": read[0].tolist()[:8],
        "table": "position" if position else "token",
    }
    kind = "position_offset" if position else "token_ids"
    if bool((shift == shift[0]).all()):
        k = int(shift[0])
        return Hint(
            kind,
            f"likely {what} off by {k:+d} in {side}: it reads row id {'+' if k > 0 else '-'} {abs(k)} of the {e.name} "
            f"table where the other side reads row id (ids {fmt_list(ids[0].tolist())}, rows read "
            f"{fmt_list(read[0].tolist())})"
            + (
                (
                    ": position ids counted from 1, or a table offset (OPT's +2) the other side has not"
                    if k > 0
                    else ": the table's offset left out (RoBERTa's padding_idx + 1, OPT's +2: the real tokens' rows "
                    "start past the padding row)"
                )
                if position
                else ": a vocabulary offset"
            ),
            {**evidence, "offset": k},
        )
    if position:
        n = ids.shape[-1]
        counted = torch.arange(n).expand_as(read)
        offset = int((read - counted)[valid][0])  # a table offset (OPT's and BioGPT's +2) kept on both sides
        if e.attention_mask is not None and bool((read[valid] == counted[valid] + offset).all()):
            pads = [int(p) for p in (e.attention_mask == 0).sum(1)]
            return Hint(
                kind,
                f"likely positions not derived from the attention mask in {side}: it reads position rows "
                f"{offset}..{n - 1 + offset} in every batch row, the other side each row's position_ids (pad counts "
                f"{pads}): position_ids ignored (an arange over the padding)"
                + (
                    "; the reference's own convention, its table called with the input's shape alone (Pegasus's "
                    "decoder numbers every slot): ours must count over the padding too"
                    if side == "the reference" and e.ref_trace.inputs.get(e.name) is None  # (called with a shape)
                    else ""
                ),
                {**evidence, "pad_counts": pads},
            )
        last = int(ids[valid].max())
        if bool((read[valid] == (last - ids[valid])).all()):
            return Hint(
                kind,
                f"likely the position table read in reverse in {side}: it reads row {last} - p at position p (rows "
                f"{fmt_list(read[0].tolist())})",
                {**evidence, "reversed": True},
            )
    return Hint(
        kind,
        f"likely the {what} mapped otherwise in {side}: it reads rows {fmt_list(read[0].tolist())} of the {e.name} "
        f"table where the ids are {fmt_list(ids[0].tolist())}",
        evidence,
    )


def _sinusoids(
    p: torch.Tensor, dim: int, step: float, start: float, layout: str, cos_shift: float = 0.0
) -> torch.Tensor:
    """Sinusoidal position embeddings ``(n, dim)`` at positions ``p`` ``(n,)``: angle ``p * w_i`` with
    ``w_i = exp(-step * (i + start))`` for ``i < dim / 2``, laid ``sin|cos`` (fairseq, Transformers' XGLM,
    ``cat(sin, cos)``), ``cos|sin`` or ``interleaved`` (``sin, cos`` pairs: Vaswani et al.'s table).
    ``cos_shift``: the cosines' index moved by that much (0.5: a per-column rate ``10000^(-c / dim)`` over all
    ``dim`` columns ``c``, the floor of ``10000^(-2 floor(c / 2) / dim)`` left out, CTRL's table's port)."""
    half = dim // 2
    index = torch.arange(half, dtype=torch.float64) + start
    angle = p.double()[:, None] * torch.exp(-step * index)[None, :]
    sin, cos = angle.sin(), (p.double()[:, None] * torch.exp(-step * (index + cos_shift))[None, :]).cos()
    if layout == "interleaved":
        return torch.stack([sin, cos], -1).flatten(-2)
    return torch.cat([sin, cos] if layout == "sin|cos" else [cos, sin], -1)


def _steps(half: int) -> dict[str, float]:
    """The frequency steps ports use for a table of ``2 * half`` features, by how they are written."""
    log = torch.log(torch.tensor(10000.0, dtype=torch.float64)).item()
    return {
        "log(10000) / (half_dim - 1) (fairseq)": log / (half - 1),
        "log(10000) / half_dim (tensor2tensor)": log / half,
        "log(10000) / half_dim - 1 (the parentheses of log(10000) / (half_dim - 1) lost)": log / half - 1,
    }


def position_term(e: Evidence) -> Hint | None:
    """At the first layer's first node (its input is the scaled token embedding plus the position
    embedding), ours' input less the reference's token embedding (times the scale a model applies to it inside
    its forward, CTRL's sqrt(d): :func:`_token_scales`, each tried) is ours' position term, read against
    the reference's position embedding: scaled by a constant (the embedding scale applied after the
    positions are added), other rows zeroed, or another sinusoid table (halves in the other order, the
    frequency step or index of another convention, read at other positions or at the token ids). The
    reference's own table is first fitted to Transformers' sinusoid formula (XGLM's, fairseq's) at its
    position ids plus an offset; a learned table gets the first two readings only."""
    x_ours, x_ref = e.inputs()
    embed = e.ref_trace.tensors.get(e.facts.embed_module)
    if embed is None or _first_reader(e, embed) != e.name or x_ours is None or x_ref is None:
        return None  # only the first node after the lookups reads the embedding and the positions alone
    if x_ours.shape != x_ref.shape:
        return None
    if embed.shape != x_ref.shape:
        return None
    for scale in _token_scales(e, x_ref.double(), embed.double()):
        hint = _term_reading(e, scale, x_ours.double(), x_ref.double(), embed.double())
        if hint is not None:
            return hint
    return None


def positions_added_before(e: Evidence) -> Hint | None:
    """The reference's first node after the lookups, one side's input that of the other plus the reference's
    position embedding: the positions added before that node on one side and after it on the other
    (BlenderbotSmall's ``layernorm_embedding`` over the tokens alone, the positions added after it; BART's over
    tokens + positions). Either side."""
    x_ours, x_ref = e.inputs()
    embed = e.ref_trace.tensors.get(e.facts.embed_module)
    if embed is None or x_ours is None or x_ref is None or x_ours.shape != x_ref.shape:
        return None
    if _first_reader(e, embed) != e.name:
        return None
    table = next((t for n, t in e.ref_trace.tensors.items() if n.rpartition(".")[2] in POSITION_TABLES), None)
    if table is None or table.shape[-1] != x_ref.shape[-1] or table.dim() > x_ref.dim():
        return None
    try:
        pos = table.double().expand_as(x_ref)
    except RuntimeError:
        return None
    diff = x_ours.double() - x_ref.double()
    for side, d in (("ours", diff), ("the reference", -diff)):
        if e.close(d, pos):
            other, others = ("the reference", "the reference's") if side == "ours" else ("ours", "ours'")
            return Hint(
                "norm_placement",
                f"likely the positions added before {e.kind} in {side}: its input there is {others} plus the "
                f"reference's position embedding, where {other} adds the positions after {e.kind} (BART's "
                f"layernorm_embedding normalises tokens + positions, BlenderbotSmall's the tokens alone)",
                {"side": side},
            )
    return None


def _first_reader(e: Evidence, embed: torch.Tensor) -> str | None:
    """The reference's first node on the embeddings: the first layer's first node, or a node before it that is
    no lookup and reads a tensor of the embedding's shape (mBART's ``layernorm_embedding``)."""
    for name in e.ref_trace.tensors:
        if e.facts.locate(name)[0] == 0:
            return name
        x = e.ref_trace.inputs.get(name)
        if name == e.facts.embed_module or _is_lookup(name.rpartition(".")[2]) or x is None:
            continue
        if e.facts.locate(name)[0] is None and x.shape == embed.shape:
            return name
    return None


def _term_reading(e: Evidence, s: float, x_ours: torch.Tensor, x_ref: torch.Tensor, embed: torch.Tensor) -> Hint | None:
    """:func:`position_term`'s reading with the token embedding held ``s`` times in the first layer's input."""
    pos = x_ref - s * embed  # the reference's own position term
    if float(pos.abs().max()) <= 1e-3 * float(s * embed.abs().max()):
        return None  # no positions added before the first layer (RoPE models)
    e_flat = embed.flatten()
    k = float((pos.flatten() @ e_flat) / (e_flat @ e_flat).clamp_min(1e-300))
    if rel(pos, k * embed) < 1e-3:
        return None  # the embedding scaled after its node (Granite's multiplier), no positions
    pos_name = "the reference's position embedding"
    term = x_ours - s * embed
    if e.close(term, pos):
        return None
    real = torch.ones(term.shape[:-1], dtype=torch.bool)
    if e.attention_mask is not None and tuple(e.attention_mask.shape) == tuple(term.shape[:-1]):
        real = e.attention_mask.bool().cpu()
    mine, theirs = term[real], pos[real]  # (tokens, hidden)
    side = "ours"
    found = _scaled_term(e, mine, theirs, token_scale=s) or _rows_zeroed(e, mine, theirs, real)
    read = _table_rows(e, term, pos, real) if found is None else None
    if read is not None:
        side, found = read
    elif found is None and _transformers_table(e, mine) and not _transformers_table(e, theirs):
        side = "the reference"  # ours' sinusoids are Transformers' own, the reference's another convention
        found = _sinusoid_reading(e, theirs, mine, "ours")
    elif found is None:
        found = _sinusoid_reading(e, mine, theirs)
    if found is None:  # the reference's term the odd one: ours' the reference's formula at its own positions
        side = "the reference"
        found = _scaled_term(e, theirs, mine, "ours", token_scale=s) or _sinusoid_reading(e, theirs, mine, "ours")
    if found is None:
        return None
    text, evidence = found
    return Hint(
        "position_offset",
        f"likely the position embedding in {side}: its first node past the lookups reads the token embedding plus "
        f"{text}",
        {"positions": pos_name, "side": side, **evidence},
    )


def _token_scales(e: Evidence, x_ref: torch.Tensor, embed: torch.Tensor) -> list[float]:
    """The factors the reference's first layer input may hold its embedding node's output by: 1, ``sqrt(hidden_size)``
    (an embedding scale applied inside the model's forward after the node: CTRL's ``inputs_embeds *= sqrt(n_embd)``)
    and the facts' scale, nearest first to the input's projection on the embedding (a position term is nearly
    orthogonal to random token rows, not quite where it is large)."""
    k = float((x_ref.flatten() @ embed.flatten()) / (embed.flatten() @ embed.flatten()).clamp_min(1e-300))
    candidates = {1.0, math.sqrt(e.facts.hidden_size)} | (
        {float(e.facts.embed_scale)} if e.facts.embed_scale else set()
    )
    return sorted(candidates, key=lambda c: abs(math.log(max(abs(k), 1e-12) / c)))


def _scaled_term(
    e: Evidence, mine: torch.Tensor, theirs: torch.Tensor, other: str = "the reference", token_scale: float = 1.0
) -> tuple[str, dict] | None:
    """One side's position term (``mine``) is the other's (``theirs``, of ``other``) times one constant."""
    k = float((mine * theirs).sum() / theirs.pow(2).sum().clamp_min(1e-300))
    if abs(k - 1) < 1e-3 or rel(mine, k * theirs) > 1e-5:
        return None
    scale = e.facts.embed_scale or (token_scale if token_scale != 1.0 else None)
    if scale not in (None, 1.0) and abs(k * float(scale) - 1) < 1e-4:
        return None  # the other side's term is this one times the scale: that side scaled the sum, read from it
    if scale not in (None, 1.0) and abs(k / float(scale) - 1) < 1e-4:
        owner = "ours" if other == "ours" else f"{other}'s"
        return (
            f"the positions times {k:.6g} = the embedding scale (sqrt(hidden_size)) of {owner}: the sum (token + "
            "position) scaled where only the token embedding is",
            {"scale": k},
        )
    return f"the positions times {k:.6g}", {"scale": k}


def _rows_zeroed(e: Evidence, mine: torch.Tensor, theirs: torch.Tensor, real: torch.Tensor) -> tuple[str, dict] | None:
    """Ours' position term is the reference's except at some positions, where one side adds none (a
    padding row zeroed at the wrong index)."""
    tol = 1e-5 * float(theirs.abs().max())
    same = (mine - theirs).abs().amax(-1) <= tol
    if bool(same.all()) or not bool(same.any()):
        return None
    odd = ~same
    positions = e.positions[real][odd].tolist() if e.positions is not None and e.positions.shape == real.shape else []
    where = f"position(s) {fmt_list(sorted(set(positions)))}" if positions else f"{int(odd.sum())} tokens"
    if bool((mine[odd].abs().amax(-1) <= tol).all()):
        return (
            f"no position embedding at {where}, where the reference adds one: a table row zeroed that is a real "
            "position (the padding row taken after the offset, padding_idx + offset)",
            {"zeroed": sorted(set(positions))},
        )
    if bool((theirs[odd].abs().amax(-1) <= tol).all()):
        return (
            f"a position embedding at {where}, where the reference adds none (its padding row)",
            {"not_zeroed": sorted(set(positions))},
        )
    return None


def _table_rows(
    e: Evidence, term: torch.Tensor, pos: torch.Tensor, real: torch.Tensor
) -> tuple[str, tuple[str, dict]] | None:
    """Both sides' position terms ``(batch, seq, hidden)`` as rows of the reference's learned position table, read
    at other positions: ``(side, (text, evidence))`` naming a constant shift, or positions counted over each row's
    real tokens (the mask's cumulative sum) where the other side counts every slot (mBART's and Pegasus's decoders:
    ``arange(seq)`` whatever the mask or position_ids); None without such a table or where a term is no row."""
    table = position_table(e, term.shape[-1])
    if table is None:
        return None
    ours, ref = rows_read(term, table, 1.0), rows_read(pos, table, 1.0)
    if ours is None or ref is None:
        return None
    ours, ref = ours.reshape(real.shape), ref.reshape(real.shape)
    shift = (ours - ref)[real]
    if not bool(shift.any()):
        return None
    evidence: dict[str, object] = {"rows_read": ours[0].tolist()[:8], "reference_rows": ref[0].tolist()[:8]}
    if bool((shift == shift[0]).all()):
        k = int(shift[0])
        return "ours", (
            f"the position table's row {'p + ' if k > 0 else 'p - '}{abs(k)} at position p, where the reference reads "
            + (
                f"row p: an offset of {k} the reference's table has not"
                if k > 0
                else "row p: the table's offset left out (mBART's and OPT's +2 rows before position 0)"
            ),
            {**evidence, "offset": k},
        )
    slots = torch.arange(real.shape[-1]).expand(real.shape)
    counted = real.long().cumsum(-1) - 1
    for side, mine, theirs in (("ours", ours, ref), ("the reference", ref, ours)):
        c = (theirs - slots)[real]
        if bool((c == c[0]).all()) and bool((mine[real] == (counted + c[0])[real]).all()):
            other = "the reference" if side == "ours" else "ours"
            return side, (
                f"rows counted over each batch row's real tokens (the attention mask's cumulative sum, position_ids "
                f"followed), where {other} counts every slot, the padding included (arange(seq) + {int(c[0])} "
                "whatever the mask or position_ids: mBART's and Pegasus's decoders)",
                {**evidence, "counted_over_real_tokens": True},
            )
    return "ours", (
        f"the position table's rows {fmt_list(ours[0].tolist())} where the reference reads rows "
        f"{fmt_list(ref[0].tolist())}",
        evidence,
    )


def position_table(e: Evidence, width: int) -> torch.Tensor | None:
    """The reference's traced position table ``(positions, width)`` (a module named by :data:`POSITION_TABLES`:
    mBART's learned one, RoFormer's sinusoids, whatever its weights), or None."""
    return next(
        (
            w
            for n, w in e.ref_trace.weights.items()
            if n.rpartition(".")[2] in POSITION_TABLES and w.dim() == 2 and w.shape[1] == width
        ),
        None,
    )


def _real(e: Evidence) -> torch.Tensor:
    """``(batch, seq)``, True at the run's real tokens (every one without a mask); ``e.positions`` given."""
    assert e.positions is not None
    if e.attention_mask is not None and e.attention_mask.shape == e.positions.shape:
        return e.attention_mask.bool().cpu()
    return torch.ones(e.positions.shape, dtype=torch.bool)


def _real_positions(e: Evidence) -> torch.Tensor | None:
    """The run's positions of its real tokens (padding left out), flattened; None without positions."""
    return None if e.positions is None else e.positions.cpu()[_real(e)].double()


def _transformers_table(e: Evidence, term: torch.Tensor) -> bool:
    """Whether ``term`` ``(tokens, hidden)`` is the sinusoid table Transformers' families compute (fairseq's:
    ``sin|cos``, step ``log(10000) / (half_dim - 1)``) at the run's positions plus an offset of 0 to 2."""
    positions, dim = _real_positions(e), term.shape[-1]
    if positions is None or dim % 2 or dim < 8 or positions.numel() != term.shape[0]:
        return False
    step, tol = next(iter(_steps(dim // 2).values())), 1e-4 * max(1.0, float(term.abs().max()))
    return any(
        bool(((term - _sinusoids(positions + offset, dim, step, 0, "sin|cos")).abs() <= tol).all())
        for offset in (0, 1, 2)
    )


def _sinusoid_reading(
    e: Evidence, mine: torch.Tensor, theirs: torch.Tensor, other: str = "the reference"
) -> tuple[str, dict] | None:
    """One side's position term (``mine``) as a sinusoid table of another convention than the other's
    (``theirs``, of ``other``; both fitted, ``theirs`` at the run's positions plus an offset)."""
    dim = theirs.shape[-1]
    if dim % 2 or dim < 8 or e.positions is None:
        return None
    half = dim // 2
    real = _real(e)
    positions = cast(torch.Tensor, _real_positions(e))
    ids = e.ref_trace.inputs.get(e.facts.embed_module)
    token_ids = ids.cpu()[real].double() if ids is not None and ids.shape == real.shape else None
    tol = 1e-4 * max(1.0, float(theirs.abs().max()))
    steps = _steps(half)
    layouts = ("sin|cos", "cos|sin", "interleaved")

    def fits(t: torch.Tensor, p: torch.Tensor, step: float, start: int, layout: str, cos_shift: float = 0.0) -> bool:
        return bool(((t - _sinusoids(p, dim, step, start, layout, cos_shift)).abs() <= tol).all())

    ref = next(
        (
            (offset, step_name, layout)
            for offset in (0, 1, 2)
            for step_name, step in steps.items()
            for layout in layouts
            if fits(theirs, positions + offset, step, 0, layout)
        ),
        None,
    )
    if ref is None:
        return None
    offset, ref_step, ref_layout = ref
    where = {"the positions": positions + offset}
    if token_ids is not None:
        where["the token ids"] = token_ids + offset
    for shift in (1, -1, 2, -2):
        where[f"the positions {shift:+d}"] = positions + offset + shift
    if e.attention_mask is not None and e.attention_mask.shape == real.shape and not bool(real.all()):
        slots = torch.arange(real.shape[-1], dtype=torch.float64).expand(real.shape)
        where["each row's slots 0 .. seq - 1 (the padding counted: the position ids given ignored)"] = (
            slots[real] + offset
        )
    for at, p in where.items():
        for step_name, step in steps.items():
            for start, cos_shift in ((0, 0.0), (1, 0.0), (0, 0.5)):
                for layout in layouts:
                    if not fits(mine, p, step, start, layout, cos_shift):
                        continue
                    differ = []
                    if layout != ref_layout:
                        differ.append(f"its halves laid {layout} where {other} lays them {ref_layout}")
                    if step_name != ref_step:
                        differ.append(f"a frequency step of {step_name} where {other} uses {ref_step}")
                    if start:
                        differ.append("the frequency index counted from 1 (w_i = exp(-step * (i + 1)))")
                    if cos_shift:
                        differ.append(
                            "the rate's floor left out: 10000^(-c / dim) per column c, so the cosines run at odd "
                            "exponents, where 10000^(-2 floor(c / 2) / dim) gives a sine and its cosine one frequency"
                        )
                    if at != "the positions":
                        differ.append(f"the table read at {at} (plus {other}'s offset {offset})")
                    if not differ:
                        return None
                    return (
                        f"a sinusoid table that differs from {other}'s: " + "; ".join(differ),
                        {"layout": layout, "step": step_name, "index_from": start, "read_at": at},
                    )
    return None
