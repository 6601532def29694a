"""The one exception type users see: a message that names the problem and the fix."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar


class MemlmError(Exception):
    """A user-facing error. The CLI prints ``error: <message>`` on one line and exits with status 2.

    Raise it for bad input (missing or corrupt files, mismatched datastores, unknown names, impossible specs),
    never for bugs. The message says what is wrong *and* what to do about it.
    """


_ON_COMMAND_LINE: ContextVar[bool] = ContextVar("memlm_on_command_line", default=False)

_API_SPELLING = {"--overwrite": "overwrite=True", "--append": "append=True", "--out": "`out` folder", "--skip": "skip",
                 "--tokenizer": "tokenizer"}  # fmt: skip


def option(flag: str) -> str:
    """How an error message names an option: ``--overwrite`` under the ``memlm`` command (:func:`memlm.cli.main`
    runs in :func:`command_line`), the argument ``overwrite=True`` when the library is called from Python."""
    return flag if _ON_COMMAND_LINE.get() else _API_SPELLING.get(flag, flag)


@contextmanager
def command_line() -> Iterator[None]:
    """Name options as command-line flags in the messages raised inside this block (:func:`option`)."""
    token = _ON_COMMAND_LINE.set(True)
    try:
        yield
    finally:
        _ON_COMMAND_LINE.reset(token)


def short_reason(error: BaseException) -> str:
    """``Type: first line`` of an exception's message (200 characters at most), for a one-line error message."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:200]}" if text else type(error).__name__
