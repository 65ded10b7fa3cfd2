"""Errors that mean "bad input", not "parity failed". The CLI turns them into exit code 2."""


class ParityError(Exception):
    """Bad usage or bad input; the message is one line naming the problem (key, shape, file)."""


class LoaderError(ParityError):
    """A weight loader could not map a checkpoint onto a model: missing, unused or mis-shaped keys."""


class CheckpointError(ParityError):
    """A checkpoint directory is missing, of another model_type, corrupt or truncated."""


class ConfigError(ParityError):
    """A config (built-in name, dict or config.json) is unknown or has a field the pair cannot honour."""


class OutputError(ParityError):
    """An output (report folder, golden trace, baseline, spilled trace) could not be written: a full
    disk, a read-only folder. Nothing of it is left visible; the message says how much space it needed."""
