"""The JSON run record: save atomically under .ampdoctor/runs/, load the latest or a named one.

No torch here: `ampdoctor report` re-renders a record without it. Records written by older
versions load too: missing keys get their defaults.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from ..core.errors import UsageError
from .model import RecordModel, validate

DEFAULT_DIR = Path(".ampdoctor") / "runs"
#: The shape of the records this version writes (`record_version`).
RECORD_VERSION = 1
#: A record is a few KiB; `report` reads nothing larger.
MAX_RECORD_BYTES = 64 * 2**20
#: Temporary files of a save in progress: hidden, and not `*.json`.
TMP_PREFIX = ".tmp-"


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", name).strip("-")[:60] or "run"


def as_record(record: RecordModel | Mapping[str, Any]) -> RecordModel:
    """The model of a record given as one or as its JSON data (validated: UsageError naming
    the field when it is not a record)."""
    return record if isinstance(record, RecordModel) else validate(dict(record), "the record")


def save(record: RecordModel | Mapping[str, Any], out_dir: Path | None = None) -> Path:
    record = as_record(record)
    out_dir = Path(out_dir) if out_dir else DEFAULT_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    base = f"{stamp}-{_slug(record.name)}"
    # The whole record goes to a temporary file first (a name `latest` never reads), then is
    # linked under a name that did not exist: os.link fails rather than replace, so two saves in
    # the same second (two processes, one folder) each get their own name.
    with _temporary(out_dir, dumps(record)) as tmp:
        for n in range(1, 10_000):
            path = out_dir / (f"{base}.json" if n == 1 else f"{base}-{n}.json")
            try:
                _claim(tmp, path)
                return path
            except FileExistsError:
                continue
        raise OSError(f"no free record name for {base} in {out_dir}")


@contextlib.contextmanager
def _temporary(folder: Path, text: str) -> Iterator[str]:
    """`text` written whole to a hidden temporary file in `folder` (a name `latest` never
    reads), removed on the way out unless the caller renamed it away."""
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=TMP_PREFIX, suffix=".part")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.chmod(tmp, 0o666 & ~_umask())
        yield tmp
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _claim(tmp: str, path: Path) -> None:
    """Give the finished `tmp` the name `path` unless that name exists (FileExistsError)."""
    try:
        os.link(tmp, path)
    except FileExistsError:
        raise
    except OSError:   # a file system without hard links: an exclusive create, then the copy
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        with os.fdopen(fd, "w", encoding="utf-8") as fh, open(tmp, encoding="utf-8") as src:
            fh.write(src.read())


def dumps(record: RecordModel | Mapping[str, Any], filled: bool = False) -> str:
    """The record as strict JSON (RFC 8259 has no NaN or Infinity: a non-finite number, such as
    the gradient norm of a step that overflowed, is written as null), its keys in the order
    they were given; `filled`: every default filled in (a record read back, `report --json`)."""
    return as_record(record).to_json(filled=filled)


def latest(out_dir: Path | None = None) -> Path:
    """The newest loadable record of a folder: hidden files, temporary files and files that are
    not records (debris of a killed write, something else's JSON) are passed over."""
    out_dir = Path(out_dir) if out_dir else DEFAULT_DIR
    candidates = []
    if out_dir.is_dir():
        for p in out_dir.glob("*.json"):
            try:
                if not p.name.startswith(".") and p.is_file():
                    candidates.append((p.stat().st_mtime, p.name, p))
            except OSError:
                continue
    for _, _, path in sorted(candidates, reverse=True):
        try:
            load(path)
        except UsageError:
            continue
        return path
    raise UsageError(f"no saved run record under {out_dir}; run `ampdoctor diagnose "
                     "SPEC` first or give the record's path.")


#: How an interrupted run's stub record begins its error message (cli/diagnose.py writes it).
INTERRUPTED_PREFIX = "interrupted by "


def is_interrupted(record: RecordModel | Mapping[str, Any]) -> bool:
    """The stub record of a run stopped by a signal (Ctrl-C, SIGTERM): its `exit_code` is
    128 + the signal; a record written before `exit_code` existed is known by its message."""
    record = as_record(record)
    if record.exit_code is not None:
        return record.exit_code >= 128
    return (record.verdict == "error" and record.error is not None
            and record.error.message.startswith(INTERRUPTED_PREFIX))


def latest_complete(out_dir: Path | None = None) -> tuple[Path, Path | None]:
    """The newest record of a folder that is not an interrupted run's stub (the newest stub
    when there is nothing else), and the newest interrupted stub newer than it (or None)."""
    out_dir = Path(out_dir) if out_dir else DEFAULT_DIR
    newest = latest(out_dir)
    interrupted: Path | None = None
    candidates = sorted(((p.stat().st_mtime, p.name, p) for p in out_dir.glob("*.json")
                         if not p.name.startswith(".") and p.is_file()), reverse=True)
    for _, _, path in candidates:
        try:
            data = load(path)
        except UsageError:
            continue
        if not is_interrupted(data):
            return path, interrupted
        interrupted = interrupted or path
    return newest, newest


def load(path: Path) -> RecordModel:
    path = Path(path)
    if path.is_dir():
        return load(latest(path))
    if not path.exists():
        raise UsageError(f"{path}: no such run record.")
    try:
        if path.stat().st_size > MAX_RECORD_BYTES:
            raise UsageError(f"{path}: over {MAX_RECORD_BYTES // 2**20} MiB, not an ampdoctor "
                             "run record.")
        record = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as exc:   # (JSONDecodeError too) an integer of thousands of digits
        digits = not isinstance(exc, json.JSONDecodeError) and "digits" in str(exc)
        what = ("an integer too long to read (over the interpreter's "
                f"{sys.get_int_max_str_digits():,}-digit limit)" if digits
                else f"{type(exc).__name__}: {str(exc)[:200]}")
        raise UsageError(f"{path}: not a readable ampdoctor run record ({what}).") from exc
    except (OSError, UnicodeDecodeError, RecursionError) as exc:
        raise UsageError(f"{path}: not a readable ampdoctor run record "
                         f"({type(exc).__name__}: {str(exc)[:200]}).") from exc
    if not isinstance(record, dict) or "verdict" not in record:
        raise UsageError(f"{path}: not an ampdoctor run record (no 'verdict').")
    problem = _out_of_bounds(record)
    if problem is not None:
        raise UsageError(f"{path}: not a valid ampdoctor run record: {problem}.")
    # what older records lack gets its default: every renderer can rely on the current shape
    return validate(record, str(path))


#: Beyond these a record is not one ampdoctor wrote: nested deeper than MAX_DEPTH, an integer
#: past MAX_INT in magnitude (a step count, a line, an exit code are far below).
MAX_DEPTH = 32
MAX_INT = 2**63


def _out_of_bounds(record: Any) -> str | None:
    """What makes a parsed record hostile to read (its field named), or None. Iterative: a
    record nested thousands deep is named, not a RecursionError."""
    stack: list[tuple[Any, str, int]] = [(record, "", 0)]
    while stack:
        value, where, depth = stack.pop()
        field = where or "(the record)"
        if depth > MAX_DEPTH:
            return f"field '{field}' is nested over {MAX_DEPTH} levels deep"
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_INT:
            return (f"field '{field}' holds an integer of {len(str(abs(value))):,} digits "
                    f"(over {MAX_INT:.3g})")
        if isinstance(value, dict):
            stack.extend((v, f"{where}.{k}" if where else str(k), depth + 1)
                         for k, v in value.items())
        elif isinstance(value, list):
            stack.extend((v, f"{where}.{i}", depth + 1) for i, v in enumerate(value))
    return None


def exit_code(record: RecordModel | Mapping[str, Any]) -> int:
    """The `diagnose` exit code a record stands for. A healthy record written under `--strict`
    (`"strict": true`) with a warning (a `warning` finding, or a `warn` rung) is 1."""
    record = as_record(record)
    if record.verdict == "healthy":
        return 1 if record.strict is True and _warned(record) else 0
    if record.verdict == "failed":
        return 1
    if record.verdict == "inconclusive":
        return 2
    # only the codes an error can have: a record's own field never picks any other
    return 2 if record.error is not None and record.error.exit_code == 2 else 3


def _warned(record: RecordModel) -> bool:
    return (any(f.severity == "warning" for f in record.findings)
            or any(r.status == "warn" for r in record.rungs))


def atomic_write_text(path: Path, text: str) -> None:
    """Write to a temporary file beside `path` and rename: never a half-written file."""
    with _temporary(path.parent, text) as tmp:
        os.replace(tmp, path)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
