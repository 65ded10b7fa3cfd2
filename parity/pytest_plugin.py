"""pytest plugin (entry point ``pytest11``): the ``parity_pair`` and ``parity_model`` fixture factories.

``parity_pair(family, config=None, **kwargs)`` builds a registered family's pair with
``family.build_pair(config=..., **kwargs)`` (``checkpoint=``, ``dtype=``, ``seed=``, cfg
overrides). Use it with :func:`parity.testing.assert_parity`.
"""

from __future__ import annotations

import pytest


@pytest.fixture
def parity_pair():
    """Factory: ``parity_pair("olmo3", "tiny", n_layers=2) -> parity.Pair``."""
    from .registry import get_family

    def make(family: str, config=None, **kwargs):
        fam = get_family(family)
        if config is None and kwargs.get("checkpoint") is None:
            config = fam.default_config
        return fam.build_pair(config=config, **kwargs)

    return make


@pytest.fixture
def parity_model():
    """Factory: ``parity_model(build, "olmo3:yarn", mode="both") -> parity.CheckResult`` for your own
    model (see :func:`parity.check_model`); use with ``assert_parity``."""
    from .user_model import check_model

    return check_model
