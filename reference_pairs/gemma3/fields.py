"""Gemma 3 config fields."""

FIELDS = ()
