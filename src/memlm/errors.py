"""The one exception type users see: a message that names the problem and the fix."""


class MemlmError(Exception):
    """A user-facing error. The CLI prints ``error: <message>`` on one line and exits with status 2.

    Raise it for bad input (missing or corrupt files, mismatched datastores, unknown names, impossible specs),
    never for bugs. The message says what is wrong *and* what to do about it.
    """
