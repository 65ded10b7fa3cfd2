"""Which families a project has and which of them a change touches: ``[tool.parity]`` in its
pyproject.toml, its ``parity.pairs`` entry points, the files of each family, and the features
its real configs use that no CI config exercises."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import cast

from parity.gate.baseline import DEFAULT_BASELINE
from parity.model.family import Family
from parity.util.errors import ParityError

#: what a project's pyproject.toml may set under [tool.parity]
SETTINGS = ("baseline", "pythonpath", "shared")


# --- the project: its families, settings, and which files belong to which family -------------------------


def _toml(path: Path) -> dict:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise ParityError(f"{path} cannot be read: {e}") from None


def _module_file(obj) -> Path | None:
    module = sys.modules.get(getattr(obj, "__module__", "") or "")
    file = getattr(module, "__file__", None)
    return Path(file).resolve() if file else None


@dataclass
class Project:
    """A repository that defines parity families: ``root`` (its pyproject.toml's folder, or the
    folder the gate runs in), its families, and its [tool.parity] settings."""

    root: Path
    families: dict[str, Family]
    installed: dict[str, Family]
    settings: dict
    folders: dict[str, tuple[str, ...]]

    @classmethod
    def load(cls, root: str | Path = ".") -> Project:
        """Read ``root/pyproject.toml``: families declared under [project.entry-points."parity.pairs"]
        are imported from the working tree (``root`` and [tool.parity] ``pythonpath`` go first on
        sys.path), so the gate tests the code being committed, not an installed copy. Installed
        families whose code lies under ``root`` belong to the project too."""
        from importlib import import_module

        from parity.model.registry import family_names, get_family

        root = Path(root).resolve()
        data = _toml(root / "pyproject.toml") if (root / "pyproject.toml").is_file() else {}
        settings = dict(data.get("tool", {}).get("parity", {}))
        unknown = sorted(set(settings) - set(SETTINGS))
        if unknown:
            raise ParityError(
                f"{root / 'pyproject.toml'}: unknown [tool.parity] setting(s) {', '.join(unknown)}; known: {', '.join(SETTINGS)}"
            )
        for key, value in settings.items():
            ok = (
                isinstance(value, str)
                if key == "baseline"
                else isinstance(value, list) and all(isinstance(v, str) for v in value)
            )
            if not ok:
                raise ParityError(
                    f"{root / 'pyproject.toml'}: [tool.parity] {key} must be {'a path' if key == 'baseline' else 'a list of paths'}, got {value!r}"
                )
        for path in reversed([root, *(root / p for p in settings.get("pythonpath", []))]):
            if str(path) in sys.path:
                sys.path.remove(str(path))
            sys.path.insert(0, str(path))
        declared = data.get("project", {}).get("entry-points", {}).get("parity.pairs", {})
        families: dict[str, Family] = {}
        entry_files: dict[str, Path] = {}
        for name, target in declared.items():
            module_name, _, attr = str(target).partition(":")
            try:
                obj = import_module(module_name)
                for part in attr.split(".") if attr else []:
                    obj = getattr(obj, part)
            except Exception as e:  # an import error in a family is the project's bad input
                raise ParityError(
                    f"family {name} ({target}, pyproject.toml) cannot be imported: {type(e).__name__}: {e}"
                ) from None
            if not isinstance(obj, Family):
                raise ParityError(f"family {name} ({target}, pyproject.toml) is not a parity.Family")
            families[name] = obj
            entry_files[name] = Path(cast(str, sys.modules[module_name].__file__)).resolve()
        installed = {}
        for name in family_names():
            try:
                installed[name] = get_family(name)
            except ParityError:
                continue  # a broken family of another package is not this project's concern
        for name, fam in installed.items():
            if name not in families and (_module_file(fam.model_class) or root.parent).is_relative_to(root):
                families[name] = fam
        folders = {}
        for name, fam in families.items():
            files = [_module_file(fam.model_class), _module_file(fam.load) if fam.load else None, entry_files.get(name)]
            folders[name] = tuple(
                sorted(
                    {
                        f.parent.relative_to(root).as_posix() + "/"
                        for f in files
                        if f is not None and f.is_relative_to(root)
                    }
                )
            )
        return cls(root, families, installed, settings, folders)

    @property
    def baseline(self) -> Path:
        return self.root / self.settings.get("baseline", DEFAULT_BASELINE)

    def shared(self, baseline: Path) -> tuple[str, ...]:
        """Paths whose change runs every family: pyproject.toml, the baseline, [tool.parity] ``shared``."""
        try:
            rel = Path(baseline).resolve().relative_to(self.root).as_posix()
        except ValueError:
            rel = None
        folders = [
            p if p.endswith("/") or not (self.root / p).is_dir() else p + "/" for p in self.settings.get("shared", [])
        ]
        return tuple(p for p in ("pyproject.toml", rel, *folders) if p)

    def family(self, name: str) -> Family:
        fam = self.families.get(name) or self.installed.get(name)
        if fam is None:
            known = sorted(set(self.families) | set(self.installed))
            raise ParityError(f"unknown family {name}; known families: {', '.join(known) or 'none'}")
        return fam


def choose_families(
    changed: Iterable[str], folders: dict[str, tuple[str, ...]], shared: Iterable[str]
) -> tuple[list[str], list[str]]:
    """Families to run for a list of changed paths (relative to the project root), with one reason
    line each: a shared path runs all, a family's folder runs that family."""
    changed = sorted({Path(p).as_posix().removeprefix("./") for p in changed})
    shared = tuple(shared)
    hits = [p for p in changed if any(p == s or (s.endswith("/") and p.startswith(s)) for s in shared)]
    if hits:
        return sorted(folders), [
            f"all families: shared code changed ({', '.join(hits[:5])}{', ...' if len(hits) > 5 else ''})"
        ]
    chosen, reasons = [], []
    for name, dirs in sorted(folders.items()):
        mine = [p for p in changed if p.startswith(dirs)] if dirs else []
        if mine:
            chosen.append(name)
            reasons.append(f"{name}: {', '.join(mine[:5])}{', ...' if len(mine) > 5 else ''} changed")
    if not chosen:
        reasons.append(f"no family or shared file changed ({len(changed)} other path(s))")
    return chosen, reasons


def changed_since(ref: str, cwd: str | Path = ".") -> list[str]:
    """Paths changed between ``ref`` and the working tree (committed or not), plus untracked files,
    relative to the repository's top. Raises ParityError (one line) if ``ref`` is not a commit here."""

    def git(*args) -> subprocess.CompletedProcess:
        try:
            return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True)
        except FileNotFoundError:
            raise ParityError("--changed-since needs git, which is not installed") from None

    if git("rev-parse", "--git-dir").returncode:
        raise ParityError(f"--changed-since {ref}: {Path(cwd).resolve()} is not in a git repository")
    if git("rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}").returncode:
        raise ParityError(
            f"--changed-since {ref}: no such commit in this repository (a branch, tag or commit; "
            "in CI fetch the history, e.g. actions/checkout with fetch-depth: 0)"
        )
    diff = git("diff", "--name-only", "--relative", ref, "--")
    untracked = git("ls-files", "--others", "--exclude-standard")
    if diff.returncode or untracked.returncode:
        reason = (diff.stderr or untracked.stderr).strip().splitlines()
        raise ParityError(
            f"--changed-since {ref}: git cannot list the changes ({reason[0] if reason else 'no reason given'})"
        )
    return sorted({line for line in (diff.stdout + untracked.stdout).splitlines() if line})


# --- config coverage ----------------------------------------------------------------------------------


def config_features(family: Family, name: str) -> set[str]:
    """What a built-in config exercises, read from the facts of its Transformers config (head sharing,
    layer types, RoPE type per layer type, soft-caps, logit scale, Q/K norm, tying, biases, the
    facts' named ``features``) plus the family's own ``features``."""
    from parity.build.builder import to_reference_config
    from parity.model.derive import derive_facts

    cfg = family.configs[name](None)
    hf_config = to_reference_config(family, cfg)
    facts = derive_facts(hf_config)
    kv, heads = facts.num_kv_heads, facts.num_heads
    feats = {"MQA" if kv == 1 else "MHA" if kv == heads else "GQA"}
    for layer_type in set(facts.layer_types):
        rope = facts.rope_of_type(layer_type)
        head_dim = next(layer.head_dim for layer in facts.layers if layer.layer_type == layer_type)
        feats.add(f"{layer_type} layers")
        feats.add(
            f"{'no' if rope is None else rope.rope_type} RoPE on {layer_type}"
            + (" (interleaved)" if rope is not None and rope.interleaved else "")
            + (" (partial)" if rope is not None and rope.rotary_dim < head_dim else "")
        )
    feats.add("tied head" if facts.tie_word_embeddings else "untied head")
    for label, value in (
        ("logit scale", facts.logit_scale),
        ("final soft-cap", facts.final_softcap),
        ("attention soft-cap", facts.attn_softcap),
        ("embedding scale", facts.embed_scale),
    ):
        if value not in (None, 1.0):
            feats.add(label)
    if facts.qk_norm:
        feats.add(f"Q/K norm per {facts.qk_norm}")
    sparse = {layer.sparse for layer in facts.layers}
    if True in sparse:
        feats.add("mixture-of-experts feed-forward")
    if sparse == {True, False}:
        feats.add("dense and mixture-of-experts layers")
    if getattr(hf_config, "attention_bias", False):
        feats.add("attention bias")
    return feats | set(facts.features) | family.config_features(name)


def config_holes(family: Family) -> list[str]:
    """Features a real config uses that no CI config exercises (one line per real config)."""
    covered = set().union(*(config_features(family, c) for c in family.ci_configs))
    holes = []
    for real in family.real_configs:
        missing = sorted(config_features(family, real) - covered)
        if missing:
            holes.append(
                f"{family.name}: {real} uses {', '.join(missing)}, which no CI config ({', '.join(family.ci_configs)}) exercises"
            )
    return holes
