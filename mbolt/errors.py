"""The one exception type for user-facing failures.

Its message names the file, tensor, layer or line at fault; the CLI prints it on one line and
exits 2. Anything else is a bug and keeps its traceback.
"""


class MboltError(Exception):
    pass
