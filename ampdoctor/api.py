"""The Python API: run a diagnose from a script or a test, get a typed record back.

    import ampdoctor

    record = ampdoctor.diagnose("triage.yaml", optimizer_steps=6)
    record.verdict, record.failed_rung, record.findings[0].location

    spec = ampdoctor.Spec(model=make_model, data=triage_slice, train_loop=train_loop,
                          accumulation_steps=4, micro_batch_size=8)
    ampdoctor.assert_healthy(spec)      # AssertionError whose message is the diagnosis

The CLI's `diagnose` command runs through `diagnose()` below. A spec that is not valid raises
`SpecError`; the user's code failing is not an exception here: the record says so (verdict
"error", exit code 3), as the CLI's record does.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .core.errors import (
    AmpdoctorError,
    AmpdoctorInterrupt,
    InputError,
    SpecError,
    UserCodeError,
)
from .core.safetext import exc_text, safe_repr
from .record.model import RecordModel, Verdict
from .spec import Spec, load_spec

if TYPE_CHECKING:
    from .core.findings import RungResult

#: What `diagnose` accepts as a spec: a `Spec` (built in code or loaded), or a YAML path.
SpecLike = Spec | str | os.PathLike

__all__ = ["ALIASES", "Record", "SpecLike", "Unhealthy", "Verdict", "assert_healthy", "diagnose",
           "load"]

#: Keyword overrides the CLI also offers, under the name of the flag (`steps=` is
#: `optimizer_steps=`); every other keyword must be a spec key.
ALIASES = {"steps": "optimizer_steps", "K": "accumulation_steps"}


def load(spec: SpecLike, *, origins: dict[str, str] | None = None, **overrides: Any) -> Spec:
    """The validated spec, with `overrides` (spec keys, or `steps=`) applied. `origins`: spec
    key -> where its override came from (the CLI's flag); by default the keyword (`steps=`),
    which messages name instead of the spec's line."""
    if isinstance(spec, Spec):
        resolved = spec
    elif isinstance(spec, (str, os.PathLike)):
        resolved = load_spec(spec)
    else:
        raise SpecError(f"ampdoctor.diagnose() takes a Spec or the path of a YAML spec, not a "
                        f"{type(spec).__name__}.")
    came_from = {ALIASES.get(k, k): f"{k}=" for k in overrides}
    came_from.update(origins or {})
    overrides = {ALIASES.get(k, k): v for k, v in overrides.items() if v is not None}
    unknown = sorted(k for k in overrides if k not in Spec.model_fields or k == "spec_path")
    if unknown:
        raise SpecError(f"unknown override(s) {', '.join(unknown)}: an override is a spec key "
                        f"({', '.join(k for k in Spec.model_fields if k != 'spec_path')}).")
    return resolved.with_overrides(
        origins={k: came_from[k] for k in overrides if k in came_from}, **overrides)


#: A run record: `diagnose()` returns one (its `path`, its `exception`), `.data` is the JSON
#: the CLI saves, `.summary()` the diagnosis as text.
Record = RecordModel


def diagnose(spec: SpecLike, *, out: str | os.PathLike | None = None, save: bool = True,
             on_start: Callable[[str], None] | None = None,
             on_done: Callable[[RungResult], None] | None = None,
             on_progress: Callable[[dict[str, Any]], None] | None = None,
             **overrides: Any) -> Record:
    """Run the triage ladder on `spec` and return its record.

    `spec`: a `Spec` or a YAML path. `overrides`: spec keys to replace for this run
    (`optimizer_steps=6`, `device="cpu"`, `precisions=["fp32", "bf16"]`,
    `rungs=["fp32-accum"]`; `steps=` is `optimizer_steps=`). The record is saved under `out`
    (default `.ampdoctor/runs`) unless `save=False`. Raises `SpecError` for a spec that is not
    valid; the user's code raising is recorded (verdict "error"), not raised.
    """
    from .runner import error_record, run_diagnose

    resolved = load(spec, **overrides)
    if resolved.ddp is not None and (resolved.rungs is None or "ddp-sync" in resolved.rungs):
        from .spec import to_wire
        to_wire(resolved)   # the rank processes must be able to import the spec's code
    exception: AmpdoctorError | None = None
    from .core.processes import owned
    try:
        with owned():     # what the loop starts ends with the diagnose
            record = run_diagnose(resolved, on_start=on_start, on_done=on_done,
                                  on_progress=on_progress)
    except (UserCodeError, InputError) as exc:
        exception = exc
    except Exception:
        raise          # SpecError, LaunchError, or a bug in ampdoctor itself
    except BaseException as exc:
        if isinstance(exc, (KeyboardInterrupt, AmpdoctorInterrupt)):
            raise
        # Only the user's code raises a BaseException that is not Ctrl-C from inside a diagnose
        # (sys.exit in a factory or a loss, GeneratorExit, its own subclass): not healthy.
        what = (f"called sys.exit({safe_repr(exc.code)})" if isinstance(exc, SystemExit)
                else f"raised {exc_text(exc)}")
        exception = UserCodeError(f"the user's code {what} during the diagnose; nothing after "
                                  "it could be judged", cause=exc)
    if exception is not None:
        record = error_record(resolved, exception)
    from .record import exit_code
    record.exit_code = exit_code(record)
    path = None
    if save:
        from .record import save as save_record
        path = save_record(record, Path(out) if out is not None else None)
    return record.saved(path, exception)


class Unhealthy(AssertionError):
    """`assert_healthy` failed: the message is the diagnosis; `record` is the run."""

    def __init__(self, record: Record):
        super().__init__(record.summary())
        self.record = record


def assert_healthy(spec: SpecLike, *, allow_warnings: bool = True,
                   out: str | os.PathLike | None = None, **overrides: Any) -> Record:
    """Diagnose `spec` and raise `Unhealthy` (an AssertionError) unless it is healthy.

    For a project's own tests: the failure message is the diagnosis (kind, rung, evidence,
    file:line, fix). Records are saved only when `out` is given. `allow_warnings=False` also
    fails on warnings.
    """
    record = diagnose(spec, out=out, save=out is not None, **overrides)
    if not record.healthy or (not allow_warnings and record.warnings):
        raise Unhealthy(record)
    return record
