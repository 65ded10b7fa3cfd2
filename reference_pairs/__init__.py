"""From-scratch reference implementations, one folder per family, each paired with its Transformers class."""
