"""Config fields as data: what each field may be (for generated configs) and where a change to it
must show (for the sensitivity audit, ``parity selftest <family> --fields``).

A family declares its fields once (``Family.fields``). Two things read the declaration:

* the **audit** changes one field on the reference side only (ours keeps the config's value, both
  hold the same weights), checks, and requires the first mismatch at ``acts_at`` (with the hint
  kind ``hint`` when one is named). A field whose change goes unseen fails: the probes do not make
  it observable, so a wrong value in a user's port would pass too.
* the **property tests** draw whole configs from the fields' ``domain`` s, in declaration order (a
  domain may depend on fields drawn before it), and require parity or a one-line refusal.
"""

from __future__ import annotations

import copy
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

# --- domains: the valid values of a field -----------------------------------------------------------


@dataclass(frozen=True)
class Domain:
    """The values a field may take in a generated config. ``draw(rng, cfg)`` returns one; ``cfg``
    holds the fields drawn before (for domains that depend on them)."""

    describe: str
    sample: Callable[[random.Random, dict], object]

    def draw(self, rng: random.Random, cfg: dict):
        return self.sample(rng, cfg)


def floats(low: float, high: float, log: bool = False) -> Domain:
    """A float in ``[low, high]``, uniform, or log-uniform with ``log``."""
    if log:
        return Domain(f"{low:g}..{high:g} (log)", lambda rng, cfg: math.exp(rng.uniform(math.log(low), math.log(high))))
    return Domain(f"{low:g}..{high:g}", lambda rng, cfg: rng.uniform(low, high))


def ints(low: int, high: int) -> Domain:
    """An integer in ``[low, high]``."""
    return Domain(f"{low}..{high}", lambda rng, cfg: rng.randint(low, high))


def choice(*values) -> Domain:
    """One of ``values``."""
    return Domain(" | ".join(map(str, values)), lambda rng, cfg: copy.deepcopy(rng.choice(values)))


def multiple_of(key: str, low: int, high: int) -> Domain:
    """``cfg[key] * k`` for ``k`` in ``[low, high]`` (query heads as a multiple of KV heads)."""
    return Domain(f"{key} x {low}..{high}", lambda rng, cfg: cfg[key] * rng.randint(low, high))


def pattern(length_key: str, *values) -> Domain:
    """A list of ``cfg[length_key]`` entries, each one of ``values`` (layer types)."""
    return Domain(
        f"[{' | '.join(values)}] x {length_key}", lambda rng, cfg: [rng.choice(values) for _ in range(cfg[length_key])]
    )


def relative(key: str, low: int, high: int) -> Domain:
    """``cfg[key] + d`` for ``d`` in ``[low, high]``, at least 1 (a window around the sequence length)."""
    return Domain(f"{key} + {low}..{high}", lambda rng, cfg: max(1, cfg[key] + rng.randint(low, high)))


# --- fields -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Field:
    """One config field of a family.

    ``key``: the family's cfg key (``a.b`` reaches into a dict value, e.g. ``rope_freq.factor``).
    ``changed``: the value (or ``f(cfg) -> value``) the audit gives the reference; None when the field
    is structural (a width, a count: both sides' shapes change, so it is drawn but not audited).
    ``acts_at``: the node (canonical name) where the change must show first; ``loader`` when only the
    loader can see it. ``hint``: the hint kind required there (None: any). ``domain``: its valid values
    for generated configs (None: never drawn). ``config``: the built-in config the audit starts from;
    ``check``: extra arguments of :func:`parity.check` for the audit (a sequence past a window).
    """

    key: str
    domain: Domain | None = None
    changed: object | Callable[[dict], object] | None = None
    acts_at: str = ""
    hint: str | None = None
    config: str = "tiny"
    check: tuple[tuple[str, Any], ...] = ()
    why: str = ""

    @property
    def audited(self) -> bool:
        return self.changed is not None


def get_value(cfg: dict, key: str):
    value = cfg
    for part in key.split("."):
        value = value[part]
    return value


def set_value(cfg: dict, key: str, value) -> dict:
    """A copy of ``cfg`` with ``key`` (dotted into dict values) set to ``value``."""
    out = copy.deepcopy(cfg)
    target = out
    parts = key.split(".")
    for part in parts[:-1]:
        target = target[part]
    target[parts[-1]] = value
    return out


def draw_config(fields: Sequence[Field], base: dict, rng: random.Random) -> dict:
    """``base`` with every drawable field drawn, in declaration order."""
    cfg = copy.deepcopy(base)
    for f in fields:
        if f.domain is not None:
            cfg = set_value(cfg, f.key, f.domain.draw(rng, cfg))
    return cfg
