"""Gemma 4 fault catalogue for ``parity selftest gemma4``."""

FAULTS = ()
