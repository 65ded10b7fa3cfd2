"""Do two checkouts of parity give the same results? Dump every number of every check, then diff.

    cd /path/to/checkout-a && HF_HUB_OFFLINE=1 PYTHONPATH=. python bench/same_results.py dump a.json
    cd /path/to/checkout-b && HF_HUB_OFFLINE=1 PYTHONPATH=. python bench/same_results.py dump b.json
    python bench/same_results.py diff a.json b.json

``dump`` checks every registered family's configs (except ``*-shape``) in mode both, and every fault
of its catalogue injected (mode both; chained for a KV-cache fault), and writes each node's status,
metrics, hint and detail, chained and isolated, with the notes, the logits effect and the error
profile (``dump OUT family,family`` for some families only). ``diff`` prints how many cases are
identical and every value that is not. A few minutes on 2 cores. Not a test: a tool for changes
meant to leave results alone (speed work, refactors).
"""

from __future__ import annotations

import json
import math
import sys
import warnings

import parity.build

FIELDS = (
    "name",
    "status",
    "max_abs",
    "mean_abs",
    "max_rel",
    "cosine",
    "rel_l2",
    "atol_needed",
    "rtol_needed",
    "hint",
    "detail",
)


def _num(x):
    return None if isinstance(x, float) and math.isnan(x) else x


def _rows(result) -> dict:
    groups = [
        [[n.hint_text if f == "hint" else _num(getattr(n, f)) for f in FIELDS] for n in group]
        for group in (result.nodes, result.isolated or ())
    ]
    return {"nodes": groups, "logits": result.logits, "profile": result.profile, "notes": list(result.notes)}


def dump(path: str, only: str | None = None) -> None:
    from parity.model.registry import family_names, get_family
    from parity.run.check import check

    warnings.filterwarnings("ignore")
    out = {}
    for name in only.split(",") if only else family_names():
        family = get_family(name)
        for config in family.configs:
            if not config.endswith("-shape"):
                try:
                    out[f"{name}:{config}"] = _rows(check(parity.build.build_pair(family, config=config), mode="both"))
                except Exception as e:  # a refusal is a result too
                    out[f"{name}:{config}"] = f"error {type(e).__name__}: {e}"
        for fault in family.faults:
            try:
                pair = parity.build.build_pair(family, config=fault.config, **dict(fault.overrides))
                kwargs = dict(fault.check_kwargs)
                fault.inject(pair)
                out[f"{name}:fault:{fault.id}"] = _rows(
                    check(pair, mode="chained" if "decode" in kwargs else "both", **kwargs)
                )
            except Exception as e:
                out[f"{name}:fault:{fault.id}"] = f"error {type(e).__name__}: {e}"
        print(name, file=sys.stderr, flush=True)
    with open(path, "w") as fh:
        json.dump(out, fh, default=str)


def diff(path_a: str, path_b: str) -> int:
    with open(path_a) as fh:
        a = json.load(fh)
    with open(path_b) as fh:
        b = json.load(fh)
    same, lines = 0, []
    for case in sorted(set(a) | set(b)):
        x, y = a.get(case), b.get(case)
        if x == y:
            same += 1
            continue
        if not isinstance(x, dict) or not isinstance(y, dict):
            lines.append(f"{case}: {str(x)[:120]} | {str(y)[:120]}")
            continue
        lines += [f"{case}: {part} differs" for part in ("logits", "profile", "notes") if x[part] != y[part]]
        for label, ga, gb in zip(("chained", "isolated"), x["nodes"], y["nodes"]):
            if len(ga) != len(gb):
                lines.append(f"{case} {label}: {len(ga)} vs {len(gb)} nodes")
            for ra, rb in zip(ga, gb):
                lines += [f"{case} {label} {ra[0]} {f}: {u!r} vs {v!r}" for f, u, v in zip(FIELDS, ra, rb) if u != v]
    print("\n".join(lines[:200]))
    print(f"{same} of {len(set(a) | set(b))} cases identical; {len(lines)} differences")
    return 0 if not lines else 1


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "dump":
        dump(sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else None)
    elif len(sys.argv) == 4 and sys.argv[1] == "diff":
        sys.exit(diff(sys.argv[2], sys.argv[3]))
    else:
        sys.exit(__doc__)
