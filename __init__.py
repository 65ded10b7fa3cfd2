"""This folder is the parity *repository*; the package is ``parity/`` inside it.

Python looks for modules in the folder a script runs from (or the current folder) before anything
installed. Run from the folder that *holds* a clone named ``parity``, ``import parity`` finds this
folder, not the package; without this file it became an empty namespace package and the first use
failed far from the cause (``module 'parity' has no attribute 'check'``). This file hands the import
on to the installed package (an editable install of this clone or any other), or, when there is
none, says so in one line. It is never part of an installed package.
"""

import importlib.util as _util
import os as _os
import sys as _sys

_HERE = _os.path.dirname(_os.path.abspath(__file__))
_PARENT = _os.path.dirname(_HERE)


def _installed_spec(name):
    """The spec Python would find for ``name`` if the folder holding this clone were not on sys.path."""
    saved = list(_sys.path)
    ours = _sys.modules.pop(name, None)
    try:
        _sys.path[:] = [p for p in saved if _os.path.abspath(p or _os.curdir) != _PARENT]
        spec = _util.find_spec(name)
    finally:
        _sys.path[:] = saved
        if ours is not None:
            _sys.modules[name] = ours
    if spec is None or spec.origin is None or _os.path.dirname(_os.path.abspath(spec.origin)) == _HERE:
        return None
    return spec


def _hand_on(name):
    spec = _installed_spec(name)
    if spec is None:
        raise ImportError(
            f"`import {name}` found the parity repository folder {_HERE} (Python searches the folder you run "
            f"from first), and no installed parity package: install it with `pip install -e {_HERE}`, then run "
            "from inside the clone or from any folder that does not hold it"
        )
    module = _util.module_from_spec(spec)
    _sys.modules[name] = module  # the import statement returns what sys.modules holds after this file
    spec.loader.exec_module(module)


# Only an import of this folder as a package is handed on; a tool that loads this file as a plain
# module (pytest collecting the repository root, a linter) gets an empty module.
if __spec__ is not None and __spec__.submodule_search_locations is not None:
    _hand_on(__name__)
