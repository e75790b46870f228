"""Errors as types: each carries a human message and maps to one exit code (CONTRACT §5)."""

from __future__ import annotations


class AmpdoctorError(Exception):
    """Base class: `message` is what the CLI prints; `exit_code` what it returns."""

    exit_code = 1

    def __init__(self, message: str, *, cause: BaseException | None = None):
        super().__init__(message)
        self.message = message
        self.cause = cause


def format_traceback(exc: BaseException | None) -> str | None:
    """The full traceback of an exception, as Python prints it (kept in records)."""
    if exc is None:
        return None
    import traceback
    return "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))


class SpecError(AmpdoctorError):
    """The spec is malformed or names something that does not exist (exit 2)."""

    exit_code = 2


class UsageError(AmpdoctorError):
    """A bad command line: missing record, unreadable file (exit 2)."""

    exit_code = 2


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
