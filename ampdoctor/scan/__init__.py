"""The static double-scaling search (CONTRACT §3 `double-scaling`, §6 `ampdoctor scan`).

`scan_paths(paths)` reads Python files (syntax tree only: nothing is imported or executed),
DeepSpeed / HF Trainer / accelerate / Lightning configs (JSON, YAML) and shell launchers, finds
every loss-scale owner, links the files that run together, and returns a `ScanReport` whose
findings are `double-scaling` errors (two owners on one training path) or a warning (owners of
different kinds in separate entry points). See docs/scan.md.

Only regular files are read (symlinks to them included): a FIFO, a socket or a device, given as a
path or met in a folder, is listed under `skipped` as "not a regular file (FIFO)" (with
`file_type`) and never opened; a file is opened non-blocking and checked again on its
descriptor, so that no scan can wait on a pipe.

Nothing in this package imports torch.
"""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Iterable
from typing import Any

from ampdoctor.core.safetext import FIELD_LIMIT, exc_text, safe_str
from ampdoctor.scan.configs import scan_config, scan_shell
from ampdoctor.scan.graph import Graph
from ampdoctor.scan.hints import hint_findings
from ampdoctor.scan.python_ast import scan_python
from ampdoctor.scan.sites import (
    CONFIG_EXTS,
    PYTHON_EXTS,
    SHELL_EXTS,
    FileScan,
    ScanPathError,
    ScanReport,
    Site,
    display_path,
)
from ampdoctor.scan.verdict import decide

__all__ = ["ScanPathError", "ScanReport", "Site", "describe", "display_path", "scan_paths",
           "SKIP_DIRS", "MAX_BYTES"]

#: Folders never searched when walking a tree (a path given explicitly is always read).
SKIP_DIRS = frozenset({
    ".git", ".hg", ".svn", ".venv", "venv", ".env", "node_modules", "__pycache__", "site-packages",
    "dist-packages", ".tox", ".nox", ".mypy_cache", ".pytest_cache", ".ruff_cache", ".eggs",
    ".ampdoctor", ".ipynb_checkpoints", ".idea",
})
#: Files larger than this are not read (datasets, tokenizers): reported as skipped.
MAX_BYTES = 2 * 1024 * 1024

_EXTS = PYTHON_EXTS + CONFIG_EXTS + SHELL_EXTS


def _file_type(path: str) -> str | None:
    if path.endswith(PYTHON_EXTS):
        return "python"
    if path.endswith(CONFIG_EXTS):
        return "config"
    if path.endswith(SHELL_EXTS):
        return "shell"
    return None


def file_kind(mode: int) -> str:
    """What a file that is not a regular file is, for the skip note."""
    if stat.S_ISFIFO(mode):
        return "FIFO"
    if stat.S_ISSOCK(mode):
        return "socket"
    if stat.S_ISCHR(mode):
        return "character device"
    if stat.S_ISBLK(mode):
        return "block device"
    if stat.S_ISDIR(mode):
        return "folder"
    return "special file"


def not_regular(mode: int) -> str:
    """The skip reason of a path that is not a regular file (a FIFO would block a read)."""
    return f"not a regular file ({file_kind(mode)})"


def _walk(root: str) -> Iterable[tuple[str, int, int]]:
    """(path, size, mode) of each file of a searched type under `root`, regular or not (a FIFO,
    a socket, a device: the caller skips it, never opens it). Symlinks are followed for files;
    symlinked folders are not entered."""
    stack = [root]
    while stack:
        folder = stack.pop()
        try:
            with os.scandir(folder) as it:
                entries = list(it)
        except OSError:
            continue
        if any(e.name == "pyvenv.cfg" for e in entries) and folder != root:
            continue
        subdirs = []
        for entry in entries:
            name = entry.name
            try:
                if entry.is_dir(follow_symlinks=False):
                    if name not in SKIP_DIRS and not name.endswith(".egg-info"):
                        subdirs.append(entry.path)
                elif name.endswith(_EXTS):
                    info = entry.stat()          # follows a symlink; never opens the file
                    if not stat.S_ISDIR(info.st_mode):
                        yield entry.path, info.st_size, info.st_mode
            except OSError:
                continue
        stack.extend(sorted(subdirs, reverse=True))


#: Flags for reading a scanned file: never blocking (a FIFO swapped in after the stat opens at
#: once instead of waiting for a writer), never becoming the controlling terminal.
_OPEN_FLAGS = (os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0)
               | getattr(os, "O_BINARY", 0))


class _NotRegular(OSError):
    def __init__(self, mode: int) -> None:
        super().__init__(not_regular(mode))
        self.mode = mode


def read_regular(path: str, max_bytes: int) -> bytes | None:
    """The bytes of `path` when it is a regular file of at most `max_bytes` (None when larger).
    Raises `OSError` when it cannot be read, or when it is not a regular file (a FIFO, a socket,
    a device: checked before opening, and again on the open descriptor, which is opened
    non-blocking, so that a read can never wait)."""
    mode = os.stat(path).st_mode
    if not stat.S_ISREG(mode):
        raise _NotRegular(mode)
    fd = os.open(path, _OPEN_FLAGS)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise _NotRegular(info.st_mode)
        if info.st_size > max_bytes:
            return None
        chunks = []
        left = max_bytes + 1
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
    finally:
        os.close(fd)
    data = b"".join(chunks)
    return None if len(data) > max_bytes else data


def _read(scan: FileScan, size: int | None = None) -> None:
    if scan.skipped:
        return
    if size is not None and size > MAX_BYTES:
        scan.skipped = f"larger than {MAX_BYTES // (1024 * 1024)} MiB, not read"
        return
    try:
        data = read_regular(scan.path, MAX_BYTES)
    except _NotRegular as exc:
        scan.skipped = not_regular(exc.mode)
        scan.file_type = file_kind(exc.mode)
        return
    except OSError as exc:
        scan.skipped = f"cannot be read: {safe_str(exc.strerror or exc)}"
        return
    if data is None:
        scan.skipped = f"larger than {MAX_BYTES // (1024 * 1024)} MiB, not read"
        return
    try:
        if scan.type == "python":
            scan_python(scan.path, data, scan)
        elif scan.type == "config":
            scan_config(scan.path, data, scan)
        else:
            scan_shell(scan.path, data, scan)
    except RecursionError:
        scan.skipped = "nested too deeply to analyse"
    except Exception as exc:  # noqa: BLE001 - a file the analysers do not expect must not stop the scan
        scan.skipped = f"could not be analysed ({exc_text(exc, FIELD_LIMIT)})"


def _runtime_site(runtime_owner: dict[str, Any]) -> Site:
    file = os.path.abspath(str(runtime_owner.get("file") or "<unknown>"))
    line = runtime_owner.get("line")
    kind = str(runtime_owner.get("kind") or "GradScaler")
    framework = "gradscaler" if "scaler" in kind.lower() else kind.lower().split()[0]
    return Site(kind, file, int(line) if line is not None else None, None,
                "the owner the fp16 run actually used", "owner", framework, runtime=True)


def _merge_runtime(scans: dict[str, FileScan], runtime_owner: dict[str, Any]) -> None:
    site = _runtime_site(runtime_owner)
    path = site.file
    if path not in scans:
        real = os.path.realpath(path)
        match = next((p for p in scans if os.path.realpath(p) == real), None)
        if match is not None:
            path = site.file = match
    scan = scans.get(path)
    if scan is None:
        scan = FileScan(path=path, type="python", root=os.path.dirname(path))
        if os.path.isfile(path):
            _read(scan)
        scan.skipped = None  # the run saw it: it stands on the graph whatever its text says
        scans[path] = scan
    if site.line is not None:
        for static in scan.sites:
            if static.framework != site.framework or static.role not in ("owner", "info", "use"):
                continue
            if static.role == "use":
                continue
            start, end = static.line or 0, static.end_line or static.line or 0
            if start <= site.line <= end:
                static.runtime = True
                if static.role != "owner":
                    static.role = "owner"
                    static.kind = site.kind
                    static.detail += "; yet the fp16 run used it"
                static.detail += " (used by the fp16 run)"
                return
    scan.sites.append(site)


def scan_paths(
    paths: Iterable[str | os.PathLike[str]],
    runtime_owner: dict[str, Any] | None = None,
    display_base: str | None = None,
    missing_ok: bool = False,
    strict: bool = False,
) -> ScanReport:
    """Search `paths` (files or folders) for loss-scale owners; see the module docstring.

    `runtime_owner` (`{"kind": "GradScaler", "file": ..., "line": ...}`) is the owner the fp16
    run saw; it counts as an owner in that file, merged with the static one at that line.
    A path that does not exist raises `ScanPathError` (a `FileNotFoundError`), or with
    `missing_ok` is reported under `skipped`. The static hints of the Python files read are
    `report.hints` (warnings; with `strict` they make the exit code 1).
    """
    started = time.perf_counter()
    given = [os.fspath(p) for p in paths]
    report = ScanReport(paths=given, runtime_owner=dict(runtime_owner) if runtime_owner else None,
                        display_base=display_base, strict=strict)
    scans, roots, sizes = _collect(given, report, missing_ok)

    for path, scan in scans.items():
        _read(scan, sizes.get(path))
    report.files_scanned = sum(1 for s in scans.values() if not s.skipped)

    graph = _follow_config_refs(scans, roots, report)
    if runtime_owner:
        _merge_runtime(scans, runtime_owner)
        graph = Graph(scans, roots)
    graph.build()
    decision = decide(scans, graph, display_base)
    report.owners = decision.owners
    report.infos = decision.infos
    report.groups = decision.groups
    report.findings = decision.findings
    report.hints = hint_findings({p: s for p, s in scans.items() if not s.skipped})
    report.skipped.extend(
        {"file": s.path, "reason": s.skipped, **({"file_type": s.file_type} if s.file_type else {})}
        for s in sorted(scans.values(), key=lambda s: s.path)
        if s.skipped
    )
    report.seconds = time.perf_counter() - started
    return report


def _collect(
    given: list[str], report: ScanReport, missing_ok: bool
) -> tuple[dict[str, FileScan], list[str], dict[str, int | None]]:
    """The files under the given paths (nothing read yet), the roots they were found under and
    the sizes the walk saw; a path that cannot be scanned goes to `report.skipped`."""
    scans: dict[str, FileScan] = {}
    roots: list[str] = []
    sizes: dict[str, int | None] = {}
    for raw in given:
        path = os.path.abspath(raw)
        try:
            mode = os.stat(path).st_mode
        except OSError:
            if missing_ok:
                report.skipped.append({"file": path, "reason": "does not exist"})
                continue
            raise ScanPathError(f"path does not exist: {raw}") from None
        if stat.S_ISDIR(mode):
            roots.append(path)
            for file, size, fmode in _walk(path):
                if file not in scans:
                    scans[file] = FileScan(path=file, type=_file_type(file) or "python", root=path)
                    sizes[file] = size
                    if not stat.S_ISREG(fmode):     # never opened: a FIFO would block the read
                        scans[file].skipped = not_regular(fmode)
                        scans[file].file_type = file_kind(fmode)
        else:
            folder = os.path.dirname(path)
            if folder not in roots:
                roots.append(folder)
            if not stat.S_ISREG(mode):
                # a FIFO, a socket, a device: reading it could block forever, or never end
                if path not in scans:
                    scans[path] = FileScan(path=path, type=_file_type(path) or "python",
                                           root=folder, skipped=not_regular(mode),
                                           file_type=file_kind(mode))
                continue
            ftype = _file_type(path)
            if ftype is None:
                report.skipped.append(
                    {"file": path, "reason": "not a Python, JSON, YAML or shell file"}
                )
                continue
            scans.setdefault(path, FileScan(path=path, type=ftype, root=folder))
            sizes.setdefault(path, None)
    return scans, roots, sizes


def _follow_config_refs(
    scans: dict[str, FileScan], roots: list[str], report: ScanReport
) -> Graph:
    """Read the literal config paths that lie outside the scanned folders (adding them to
    `scans`), until no new one turns up; returns the graph over all of them."""
    graph = Graph(scans, roots)
    pending = [s for s in scans.values() if not s.skipped]
    while pending:
        extra: list[FileScan] = []
        for scan in pending:
            for text, follow in scan.refs:
                if not follow or graph.resolve_ref(scan, text) is not None:
                    continue
                for candidate in graph.disk_candidates(scan, text):
                    if candidate in scans or _file_type(candidate) != "config":
                        continue
                    if os.path.isfile(candidate):
                        new = FileScan(path=candidate, type="config",
                                       root=os.path.dirname(candidate))
                        _read(new)
                        scans[candidate] = new
                        extra.append(new)
                        report.files_scanned += 0 if new.skipped else 1
                        break
        if extra:
            graph = Graph(scans, roots)
        pending = [s for s in extra if not s.skipped]
    return graph


def describe(site: Site, base: str | None = None) -> str:
    """`GradScaler at train.py:12` for summaries."""
    return f"{site.kind} at {site.where(base)}"

