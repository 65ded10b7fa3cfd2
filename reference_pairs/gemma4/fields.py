"""Gemma 4 config fields."""

FIELDS = ()
