"""Find the user's call site: the first stack frame that is the user's code, not torch or ours."""

from __future__ import annotations

import functools
import linecache
import os
import re
import sys
import sysconfig
import traceback
from dataclasses import dataclass
from pathlib import Path
from types import FrameType, TracebackType

_AMPDOCTOR_DIR = str(Path(__file__).resolve().parents[1]) + os.sep


_TORCH_DIRS: list[str] = []


def _real(filename: str) -> str:
    """`os.path.realpath` of a code object's file name, once per absolute name (a probe asks
    for the call site of every event it records); a relative one depends on the working
    directory and is resolved each time."""
    return _real_absolute(filename) if os.path.isabs(filename) else os.path.realpath(filename)


@functools.lru_cache(maxsize=4096)
def _real_absolute(filename: str) -> str:
    return os.path.realpath(filename)


def installed(path: str) -> bool:
    """Whether a real path lies in an installation's package folder (site-packages,
    dist-packages): never the user's own code, even inside the project's folder (a `.venv`)."""
    return f"{os.sep}site-packages{os.sep}" in path or f"{os.sep}dist-packages{os.sep}" in path


def _torch_dir() -> str:
    """torch's own Python files (skipped when asking who called a torch function); read once
    torch is imported."""
    if not _TORCH_DIRS:
        torch_file = getattr(sys.modules.get("torch"), "__file__", None)
        if not torch_file:
            return "\0"
        _TORCH_DIRS.append(str(Path(torch_file).resolve().parent) + os.sep)
    return _TORCH_DIRS[0]


def library_dirs() -> tuple[str, ...]:
    """The folders of the standard library, torch and ampdoctor (never the user's code):
    read once torch is imported (each run of a script makes its finders)."""
    if _LIBRARY_DIRS:
        return _LIBRARY_DIRS[0]
    dirs = {_AMPDOCTOR_DIR}
    for key in ("stdlib", "platstdlib"):
        path = sysconfig.get_paths().get(key)
        if path:
            dirs.add(str(Path(path).resolve()) + os.sep)
    torch_mod = sys.modules.get("torch")
    torch_file = getattr(torch_mod, "__file__", None) if torch_mod is not None else None
    if torch_file:
        dirs.add(str(Path(torch_file).resolve().parent) + os.sep)
    found = tuple(sorted(dirs))
    if torch_file:
        _LIBRARY_DIRS.append(found)
    return found


_LIBRARY_DIRS: list[tuple[str, ...]] = []


@dataclass(frozen=True)
class Site:
    """A file:line in the user's code."""

    file: str
    line: int
    function: str | None

    @property
    def code(self) -> str:
        return linecache.getline(self.file, self.line).strip()


#: One frame of a faulthandler dump: `  File "path", line 12 in name`.
_DUMP_FRAME = re.compile(r'File "([^"]+)", line (\d+) in (\S+)')


class CallSiteFinder:
    """Walks frames outward; prefers frames under the user's roots, skips library frames."""

    def __init__(self, user_roots: list[Path] | None = None):
        self.user_roots = tuple(str(Path(r).resolve()) + os.sep for r in (user_roots or []))
        self.library_dirs = library_dirs()
        self._cache: dict[str, tuple[bool, bool]] = {}

    def _classify(self, filename: str) -> tuple[bool, bool]:
        """(is_library, is_user_root) for one file name, cached."""
        hit = self._cache.get(filename)
        if hit is None:
            if filename.startswith("<"):
                hit = (True, False)
            else:
                path = _real(filename)
                # Installed code is never the user's, even under project_root (a project's own
                # .venv holding torch and ampdoctor).
                library = path.startswith(self.library_dirs) or installed(path)
                if library:
                    hit = (True, False)
                elif path.startswith(self.user_roots) and self.user_roots:
                    hit = (False, True)
                else:
                    hit = (False, False)
            self._cache[filename] = hit
        return hit

    def from_frame(self, frame: FrameType | None) -> Site | None:
        first_outside: Site | None = None
        while frame is not None:
            filename = frame.f_code.co_filename
            is_library, is_user = self._classify(filename)
            if is_user:
                return Site(_real(filename), frame.f_lineno, frame.f_code.co_name)
            if not is_library and first_outside is None:
                first_outside = Site(_real(filename), frame.f_lineno,
                                     frame.f_code.co_name)
            frame = frame.f_back
        return first_outside

    def direct_user_site(self, frame: FrameType | None) -> Site | None:
        """The site of `frame`'s caller when that caller is the user's code itself, skipping
        torch's own Python frames (a `Tensor.__truediv__`, `F.mse_loss`); None when a library
        (a framework) made the call."""
        torch_dir = _torch_dir()
        while frame is not None and \
                _real(frame.f_code.co_filename).startswith(torch_dir):
            frame = frame.f_back
        if frame is None or not self._classify(frame.f_code.co_filename)[1]:
            return None
        return Site(_real(frame.f_code.co_filename), frame.f_lineno,
                    frame.f_code.co_name)

    def from_stack_dump(self, text: str) -> Site | None:
        """The innermost user frame of a faulthandler dump (most recent call first)."""
        for match in _DUMP_FRAME.finditer(text):
            filename, line, function = match.group(1), int(match.group(2)), match.group(3)
            if self._classify(filename)[1]:
                return Site(_real(filename), line, function)
        return None

    def here(self) -> Site | None:
        return self.from_frame(sys._getframe(1))

    def user_sites(self, tb: TracebackType | None) -> list[Site]:
        """Every frame of the traceback that is the user's code, outermost first."""
        return [Site(_real(frame.f_code.co_filename), lineno, frame.f_code.co_name)
                for frame, lineno in traceback.walk_tb(tb)
                if self._classify(frame.f_code.co_filename)[1]]

    def from_traceback(self, tb: TracebackType | None) -> Site | None:
        """The deepest frame of the traceback that is the user's code."""
        best: Site | None = None
        best_outside: Site | None = None
        for frame, lineno in traceback.walk_tb(tb):
            filename = frame.f_code.co_filename
            is_library, is_user = self._classify(filename)
            site = Site(_real(filename), lineno, frame.f_code.co_name)
            if is_user:
                best = site
            elif not is_library:
                best_outside = site
        return best or best_outside
