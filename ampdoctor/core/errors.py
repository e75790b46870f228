"""Errors as types: each carries a human message and maps to one exit code (CONTRACT §5).

Text from the user's code enters a record through here, bounded (see `ampdoctor.core.safetext`): an
exception message quoted in a message is cut to `MESSAGE_LIMIT` characters (`exc_text`), a whole
error message to `ERROR_LIMIT`, a traceback to `TRACEBACK_LIMIT`, each with a note of how much
was cut; and an exception whose `__str__` raises cannot break ampdoctor (`safe_str`). What is
stored stays the text as it was (a record is data); the renderings make it inert.
"""

from __future__ import annotations

from .safetext import MESSAGE_LIMIT, TRACEBACK_LIMIT, cut, exc_text, safe_repr, safe_str

__all__ = [
    "ERROR_LIMIT",
    "MESSAGE_LIMIT",
    "TRACEBACK_LIMIT",
    "AmpdoctorError",
    "AmpdoctorInterrupt",
    "EnoughSteps",
    "LaunchError",
    "SpecError",
    "UsageError",
    "UserCodeError",
    "exc_text",
    "format_traceback",
    "safe_repr",
    "safe_str",
]

#: An error's whole message (ampdoctor's words around at most a few quoted user texts, or the
#: list of a spec's problems), in characters: a backstop for call sites that quote a user's
#: exception without `exc_text`.
ERROR_LIMIT = 16_000


class AmpdoctorError(Exception):
    """Base class: `message` is what the CLI prints; `exit_code` what it returns."""

    exit_code = 1
    #: the traceback text of an error raised in the process that ran the loop (`--debug`)
    remote_traceback: str | None = None

    def __init__(self, message: str, *, cause: BaseException | None = None):
        message = cut(safe_str(message), ERROR_LIMIT)
        super().__init__(message)
        self.message = message
        self.cause = cause


def format_traceback(exc: BaseException | None, limit: int = TRACEBACK_LIMIT) -> str | None:
    """The traceback of an exception, as Python prints it (kept in records), cut to `limit`
    characters: the start (the outermost frames) and the last quarter (the exception line),
    with a note of how much was cut between. Never raises: an exception whose `__str__` raises
    is shown as Python shows it, and a traceback that cannot be formatted at all becomes the
    exception's one line."""
    if exc is None:
        return None
    import traceback
    try:
        text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    except Exception:  # noqa: BLE001 - a broken __traceback__ or __notes__, a raising __repr__
        text = exc_text(exc, None) + "\n"
    return cut(text, limit, tail=limit // 4)


class SpecError(AmpdoctorError):
    """The spec is malformed or names something that does not exist (exit 2)."""

    exit_code = 2


class UsageError(AmpdoctorError):
    """A bad command line: missing record, unreadable file (exit 2)."""

    exit_code = 2


class InputError(SpecError):
    """The spec loaded, but the model or data its factories returned cannot be triaged (a
    meta-device model, half-precision weights, sparse data...): exit 2, and recorded, with the
    factory's line when known."""

    exit_code = 2

    def __init__(self, message: str, *, cause: BaseException | None = None,
                 location: tuple[str, int] | None = None):
        super().__init__(message, cause=cause)
        self.location = location


class UserCodeError(AmpdoctorError):
    """The user's model, data or loop could not run at all (exit 3).

    `location` is the (file, line) in the user's code where it failed, when known.
    """

    exit_code = 3

    def __init__(self, message: str, *, cause: BaseException | None = None,
                 location: tuple[str, int] | None = None):
        super().__init__(message, cause=cause)
        self.location = location


class LaunchError(AmpdoctorError):
    """ampdoctor could not start or join the processes of the ddp-sync rung (no free port, a
    spawn refused, a torchrun store it cannot reach): not the user's loop (exit 3: the check
    could not run)."""

    exit_code = 3


class AmpdoctorInterrupt(BaseException):
    """ampdoctor's own interruptions (a rung's timeout, SIGTERM/SIGHUP): they pass through every
    handler of the user's code, which catches any other exception as the loop's own."""


class EnoughSteps(BaseException):
    """Raised from the probe once a run has given what a rung asked of it (the first optimizer
    step of a repeat run): the loop stops there, its `finally` blocks run, and the trace ends
    cleanly (`Trace.stopped`). A BaseException, so `except Exception` in the loop lets it by."""
