"""User-facing errors.

A `SpecserveError` carries a message written for the person at the keyboard: what went
wrong and how to fix it. The CLI prints it without a traceback; the server maps it to
an HTTP 4xx body. Anything else escaping is a bug.
"""


class SpecserveError(Exception):
    """An error caused by input or environment, with a message that names the fix."""


class ConfigError(SpecserveError):
    """A bad flag, config value or speculative config."""


class ModelLoadError(SpecserveError):
    """A model that cannot be found, installed, verified or read."""
