"""``python -m parity``: the command line, with the current folder first on sys.path.

This is how the pre-commit hook runs the gate: run from a repository's top, it imports the
repository's own code (for parity's own repository, ``parity/`` and ``reference_pairs/`` as they are
being committed), not a copy installed elsewhere.
"""

import sys

from parity.cli import main

sys.exit(main())
