"""The user-error type every module raises, at the bottom of the package so that any module may import it.

A `ConfigError` is a problem with what the user asked for (a flag, a TOML value, a file, a layout that cannot
run): the CLI reports it as one line on stderr with exit code 2, never as a traceback. Anything else that
escapes is a bug or a failure of the machine and keeps its traceback.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A user-facing configuration problem: reported as one line, exit code 2, no traceback."""
