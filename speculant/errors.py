"""User-facing errors.

Everything a user can get wrong (a missing model file, a bad sampling value, an incompatible draft)
raises `SpeculantError` with a message that says what to fix. The CLI prints that message on one line
and exits non-zero; tracebacks are reserved for bugs.
"""


class SpeculantError(ValueError):
    """A problem with the user's input or environment, with a message that says how to fix it."""
