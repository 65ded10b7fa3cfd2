"""The sensitivity audit (``parity selftest <family> --fields``): each declared config field changed on
the reference side only; the check must fail at the node where the field first acts, with a named
hint kind."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

import parity.build
from parity.model.fields import Field, get_value
from parity.util.errors import LoaderError, ParityError

# --- the audit ----------------------------------------------------------------------------------------------


@dataclass
class FieldRow:
    """One audited field: the values on each side, the node where parity saw the change, its hint."""

    field: Field
    ours: object
    reference: object
    found: str | None
    hint_kind: str | None
    hint: str = ""
    problems: list[str] = dataclasses.field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.problems


def audit_field(family, f: Field, dtype: torch.dtype = torch.float32, seed: int = 0) -> FieldRow:
    """Change ``f`` on the reference side only and judge where the check sees it."""
    from parity.run.check import check

    base = family.configs[f.config](None)
    ours_value = get_value(base, f.key)
    new = f.changed(base) if callable(f.changed) else f.changed
    problems: list[str] = []
    found: str | None
    kind: str | None
    if new == ours_value:
        problems.append(f"the audit value {new!r} equals the config's")
    try:
        pair = parity.build.build_pair(family, config=f.config, dtype=dtype, seed=seed, reference_changes={f.key: new})
    except LoaderError as e:
        found, kind, text = "loader", "loader", str(e)
    except ParityError as e:
        return FieldRow(f, ours_value, new, None, None, str(e), [f"the changed config cannot be built: {e}"])
    else:
        res = check(pair, **dict(f.check))
        bad = res.first_mismatch
        found = bad.name if bad is not None else None
        kind = bad.hint.kind if bad is not None and bad.hint is not None else None
        text = bad.hint.text if bad is not None and bad.hint is not None else ""
        if bad is None and res.coverage is not None and not res.coverage.ok:
            found, kind, text = "loader", "loader", "; ".join(res.coverage.gaps)
    if found is None:
        problems.append("unseen: every node agrees although the reference runs with the changed value")
    elif found != f.acts_at:
        problems.append(f"seen at {found}, expected at {f.acts_at}")
    if f.hint is not None and found is not None and kind != f.hint:
        problems.append(f"hint kind {kind or 'none'}, expected {f.hint}")
    return FieldRow(f, ours_value, new, found, kind, text, problems)


def audit(family, dtype: torch.dtype = torch.float32) -> list[FieldRow]:
    """One row per audited field of ``family`` (structural fields are drawn, not audited)."""
    return [audit_field(family, f, dtype) for f in family.fields if f.audited]
