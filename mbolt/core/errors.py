"""The one exception type for user-facing failures.

Its message names the file, tensor, layer or line at fault; the CLI prints it on one line and
exits 2. Anything else is a bug and keeps its traceback.
"""


class MboltError(Exception):
    pass


class MboltWarning(UserWarning):
    """Something the user should know that does not stop the command (printed as one line)."""


def warn(message: str) -> None:
    import warnings

    warnings.warn(message, MboltWarning, stacklevel=2)
