"""Building blocks shared by every family: norms, RoPE variants, attention, weight maps, pair building."""
