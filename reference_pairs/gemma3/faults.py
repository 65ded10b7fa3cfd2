"""Gemma 3 fault catalogue for ``parity selftest gemma3``."""

FAULTS = ()
