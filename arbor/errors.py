"""Exceptions that cross module boundaries."""


class ConfigError(ValueError):
    """A configuration problem, found before any work starts.

    The message names the offending key (``loss.clip_high``) and, where known, the file.
    """
