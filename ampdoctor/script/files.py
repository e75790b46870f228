"""The script's files during a run (`child`): an overlay over the file system, at Python level.

Every write of the script to a path outside its run's scratch folder lands in
`scratch/<the path's absolute form>` instead (its shadow): `open`/`io.open` in a writing mode,
`os.open` with a writing flag, `torch.save`, `os.replace`/`rename`/`remove`/`unlink`/`mkdir`
(and so `os.makedirs`)/`rmdir`/`utime`/`chmod`/`truncate`/`setxattr`, `shutil.rmtree` (and
so `shutil.copy*`/`move`/`copytree`, built on those; `logging.FileHandler` opens with `open`),
and the `pathlib` methods built on them. An original file that is appended to or renamed is
copied into the scratch first; one that is removed (or renamed away, or under a removed tree) is
only hidden from the script. Every read (`open`, `os.stat`/`lstat`/`access`, `os.listdir`/`scandir`,
`torch.load`, `os.chdir`) sees the shadow first and a hidden path as missing, so the script sees
its own writes as it would plainly, and nothing that existed before is changed. The temp dir
(`tempfile`, `TMPDIR`) is a folder of the scratch. Writers that open their path outside Python
are redirected where ampdoctor knows them (`native`: torch.save/load, safetensors' files, which
the HF Trainer and accelerate save checkpoints with); another C library's own `fopen` is not.
"""

from __future__ import annotations

import builtins
import errno
import functools
import io
import os
import shutil
import stat as stat_module
import tempfile
from typing import Any

from ..probe import patches
from . import native

#: paths never redirected (devices, kernel files)
SYSTEM = ("/dev", "/proc", "/sys")
#: extended attributes (Linux): shutil.copystat copies them
_XATTR = ("listxattr", "getxattr", "setxattr", "removexattr")
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


def build_caches() -> list[str]:
    """The folders where compiled ops are built and kept, as a plain run builds them (torch's
    C++ extensions, which DeepSpeed's ops are, and Triton's kernels): their writes pass
    through, because the compiler they start (ninja, a C++ compiler: other processes) reads
    and writes the real folder, and nothing of the user's is there. Redirected, the first build
    on a machine failed (the build folder made in the scratch, the compiler pointed at the real
    one)."""
    home = os.path.expanduser("~")
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(home, ".cache")
    folders = [os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(cache, "torch_extensions"),
               os.environ.get("TRITON_CACHE_DIR") or os.path.join(home, ".triton")]
    found = []
    for folder in folders:
        for form in (os.path.abspath(folder), os.path.realpath(folder)):
            if form not in found and form != os.sep:
                found.append(form)
    return found


def _missing(path: Any) -> FileNotFoundError:
    return FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), path)


def _special(st: os.stat_result) -> bool:
    """Neither a file nor a folder (a socket, a fifo, a device): no content to protect."""
    return not (stat_module.S_ISREG(st.st_mode) or stat_module.S_ISDIR(st.st_mode))


class Overlay:
    """The redirection of one run (module docstring): `written` and `hidden` are the original
    paths the script wrote and removed."""

    def __init__(self, scratch: str):
        self.root = os.path.realpath(scratch)
        os.makedirs(self.root, exist_ok=True)
        self.hidden: set[str] = set()
        self.written: set[str] = set()
        self.real: dict[str, Any] = {}
        #: folders never redirected: devices and kernel files, the build caches of compiled
        #: ops (`build_caches`), and the multiprocessing temp folder the run inherited from
        #: ampdoctor's fork server (its sockets, not the user's)
        self.passing = list(SYSTEM) + build_caches()
        import multiprocessing.process
        config = getattr(multiprocessing.process.current_process(), "_config", {})
        inherited = config.get("tempdir")
        if inherited:
            self.passing.append(os.path.abspath(inherited))

    # --- paths ----------------------------------------------------------------------------
    def outside(self, path: Any) -> str | None:
        """The absolute form of `path` when it is redirected; None for what passes through (a
        file descriptor, bytes, the scratch itself, a system path)."""
        if isinstance(path, int) or path is None:
            return None
        try:
            text = os.fspath(path)
        except TypeError:
            return None
        if not isinstance(text, str):
            return None
        full = os.path.abspath(text)
        if full == self.root or full.startswith(self.root + os.sep):
            return None
        if any(full == s or full.startswith(s + "/") for s in self.passing):
            return None
        return full

    def shadow(self, full: str) -> str:
        return os.path.join(self.root, full.lstrip(os.sep))

    def is_hidden(self, full: str) -> bool:
        if not self.hidden:
            return False
        here = full
        while True:
            if here in self.hidden:
                return True
            parent = os.path.dirname(here)
            if parent == here:
                return False
            here = parent

    def _lexists(self, path: str) -> bool:
        try:
            self.real["lstat"](path)
        except OSError:
            return False
        return True

    def original(self, full: str) -> bool:
        """The path exists outside the scratch and is not hidden."""
        return not self.is_hidden(full) and self._lexists(full)

    def read(self, path: Any) -> Any:
        """Where a read of `path` goes: its shadow when there is one, else itself; a hidden path
        is missing."""
        full = self.outside(path)
        if full is None or (not self.hidden and not self.written):
            return path
        shadow = self.shadow(full)
        if self._lexists(shadow):
            return shadow
        if self.is_hidden(full):
            raise _missing(path)
        return path

    def write(self, path: Any, keep: bool) -> Any:
        """Where a write to `path` goes: its shadow, its folder made in the scratch when the
        folder exists for the script; `keep`: an original's content copied there first."""
        full = self.outside(path)
        if full is None:
            return path
        shadow = self.shadow(full)
        folder = os.path.dirname(full)
        if not self._lexists(os.path.dirname(shadow)):
            if not self.original(folder):
                raise _missing(path)
            self.real["makedirs"](os.path.dirname(shadow), exist_ok=True)
        if keep and not self._lexists(shadow) and self.original(full) \
                and stat_module.S_ISREG(self.real["stat"](full).st_mode):
            shutil.copy2(full, shadow)
        self.written.add(full)
        return shadow

    def exists(self, full: str) -> bool:
        return self._lexists(self.shadow(full)) or self.original(full)

    def remove(self, path: Any, directory: bool = False) -> None:
        """The script removes `path`: its shadow deleted, the original hidden."""
        full = self.outside(path)
        shadow = self.shadow(full) if full is not None else None
        if full is None or shadow is None:
            (self.real["rmdir"] if directory else self.real["unlink"])(path)
            return
        if not self.exists(full):
            raise _missing(path)
        if directory and self.listdir_merged(full):
            raise OSError(errno.ENOTEMPTY, os.strerror(errno.ENOTEMPTY), path)
        if self._lexists(shadow):
            (self.real["rmdir"] if directory else self.real["unlink"])(shadow)
        if self._lexists(full):
            self.hidden.add(full)

    def listdir_merged(self, full: str) -> list[str]:
        names: list[str] = []
        if self.original(full):
            names = [n for n in self.real["listdir"](full)
                     if not self.is_hidden(os.path.join(full, n))]
        shadow = self.shadow(full)
        if self._lexists(shadow):
            names += [n for n in self.real["listdir"](shadow) if n not in names]
        return names

    def touched(self, full: str) -> bool:
        """Something under `full` was written or hidden (a listing must merge)."""
        prefix = full.rstrip(os.sep) + os.sep
        return (self._lexists(self.shadow(full))
                or any(h == full or h.startswith(prefix) for h in self.hidden))

    def report(self, cwd: str) -> dict[str, Any]:
        """The original paths the script wrote (and left there) and removed (relative to
        `cwd` when under it)."""
        def shown(paths: set[str]) -> list[str]:
            return sorted(os.path.relpath(p, cwd) if p.startswith(cwd + os.sep) else p
                          for p in paths)
        left = {p for p in self.written if self._lexists(self.shadow(p))}
        return {"scratch": self.root, "written": shown(left),
                "hidden": shown({h for h in self.hidden if self._lexists(h)})}


class _Entry:
    """A scandir entry of the scratch shown under the path the script listed."""

    def __init__(self, entry: os.DirEntry, folder: str):
        self._entry = entry
        self.name = entry.name
        self.path = os.path.join(folder, entry.name)

    def __fspath__(self) -> str:
        return self.path

    def __getattr__(self, name: str) -> Any:   # is_dir, is_file, is_symlink, stat, inode
        return getattr(self._entry, name)


class _Listing:
    """A merged `os.scandir` (an iterator and a context manager, as scandir's)."""

    def __init__(self, entries: list[Any]):
        self._it = iter(entries)

    def __iter__(self) -> _Listing:
        return self

    def __next__(self) -> Any:
        return next(self._it)

    def __enter__(self) -> _Listing:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        self._it = iter(())


class _Calls:
    """The patched functions of one overlay (`install`), each as its original's signature."""

    def __init__(self, overlay: Overlay):
        self.o = overlay
        self.real = overlay.real

    def open(self, file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        if isinstance(mode, str) and any(c in mode for c in "wax+"):
            file = self.o.write(file, keep="w" not in mode and "x" not in mode)
        else:
            file = self.o.read(file)
        return self.real["io_open"](file, mode, *args, **kwargs)

    def os_open(self, path: Any, flags: int, mode: int = 0o777, *, dir_fd: Any = None) -> int:
        if dir_fd is None:
            path = (self.o.write(path, keep=not flags & os.O_TRUNC) if flags & _WRITE_FLAGS
                    else self.o.read(path))
        return self.real["open"](path, flags, mode, dir_fd=dir_fd)

    def reading(self, name: str) -> Any:
        def wrapper(path: Any = None, *args: Any, **kwargs: Any) -> Any:
            if kwargs.get("dir_fd") is None:
                path = self.o.read(path)
            return self.real[name](path, *args, **kwargs)
        return functools.wraps(self.real[name])(wrapper)

    def metadata(self, name: str) -> Any:
        o, real = self.o, self.real

        def wrapper(path: Any, *args: Any, **kwargs: Any) -> Any:
            full = o.outside(path) if kwargs.get("dir_fd") is None else None
            if full is not None:
                if not o.exists(full):
                    raise _missing(path)
                if o._lexists(o.shadow(full)) or not _special(real["lstat"](full)):
                    path = o.write(path, keep=True)   # (a socket or a fifo: as it is)
            return real[name](path, *args, **kwargs)
        return functools.wraps(real[name])(wrapper)

    def chdir(self, path: Any) -> None:   # into the original folder when there is one
        full = self.o.outside(path)
        self.real["chdir"](path if full is None or self.o.original(full) else self.o.read(path))

    def listdir(self, path: Any = ".") -> list[Any]:
        full = self.o.outside(path)
        if full is None or not self.o.touched(full):
            return self.real["listdir"](self.o.read(path))
        if not self.o.exists(full):
            raise _missing(path)
        return self.o.listdir_merged(full)

    def scandir(self, path: Any = ".") -> Any:
        o, real = self.o, self.real
        full = o.outside(path)
        if full is None or not o.touched(full):
            return real["scandir"](o.read(path))
        if not o.exists(full):
            raise _missing(path)
        entries: dict[str, Any] = {}
        if o.original(full):
            with real["scandir"](full) as it:
                entries = {e.name: e for e in it if not o.is_hidden(os.path.join(full, e.name))}
        if os.path.isdir(o.shadow(full)):
            with real["scandir"](o.shadow(full)) as it:
                entries.update({e.name: _Entry(e, os.fspath(path)) for e in it})
        return _Listing(list(entries.values()))

    def move(self, name: str) -> Any:
        o, real = self.o, self.real

        def wrapper(src: Any, dst: Any, *, src_dir_fd: Any = None,
                    dst_dir_fd: Any = None) -> None:
            if src_dir_fd is not None or dst_dir_fd is not None:
                return real[name](src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd)
            source, full_src = o.read(src), o.outside(src)
            original = full_src is not None and source == src
            if original and not real["access"](source, os.F_OK):
                raise _missing(src)
            target = o.write(dst, keep=False)
            if not original:
                real[name](source, target)
            elif stat_module.S_ISDIR(real["lstat"](source).st_mode):   # copied, then hidden
                shutil.copytree(source, target, symlinks=True, dirs_exist_ok=True)
            else:
                shutil.copy2(source, target, follow_symlinks=False)
            if full_src is not None and o._lexists(full_src):
                o.hidden.add(full_src)
            return None
        return functools.wraps(real[name])(wrapper)

    def mkdir(self, path: Any, mode: int = 0o777, *, dir_fd: Any = None) -> None:
        full = self.o.outside(path) if dir_fd is None else None
        if full is None:
            return self.real["mkdir"](path, mode, dir_fd=dir_fd)
        if self.o.exists(full):
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), path)
        return self.real["mkdir"](self.o.write(path, keep=False), mode)

    def unlink(self, path: Any, *, dir_fd: Any = None) -> None:
        if dir_fd is not None:
            return self.real["unlink"](path, dir_fd=dir_fd)
        return self.o.remove(path)

    def rmdir(self, path: Any, *, dir_fd: Any = None) -> None:
        if dir_fd is not None:
            return self.real["rmdir"](path, dir_fd=dir_fd)
        return self.o.remove(path, directory=True)

    def rmtree(self, path: Any, ignore_errors: bool = False, onerror: Any = None,
               **kw: Any) -> None:
        o = self.o
        full = o.outside(path)
        if full is None:
            return self.real["rmtree"](path, ignore_errors, onerror, **kw)
        if not o.exists(full):
            if ignore_errors:
                return None
            raise _missing(path)
        if o._lexists(o.shadow(full)):
            self.real["rmtree"](o.shadow(full), ignore_errors=True)
        if o._lexists(full):
            o.hidden.add(full)
        return None


def install(overlay: Overlay, patcher: patches.Patcher) -> None:
    """The overlay's patches (module docstring)."""
    real = overlay.real
    for name in ("open", "stat", "lstat", "access", "listdir", "scandir", "replace", "rename",
                 "remove", "unlink", "mkdir", "makedirs", "rmdir", "utime", "chmod", "chdir",
                 "truncate", *_XATTR):
        if hasattr(os, name):
            real[name] = getattr(os, name)
    real["io_open"] = io.open
    real["rmtree"] = shutil.rmtree
    calls = _Calls(overlay)
    @functools.wraps(io.open)
    def opener(*args: Any, **kwargs: Any) -> Any:
        return calls.open(*args, **kwargs)

    patcher.setattr(builtins, "open", opener)
    patcher.setattr(io, "open", opener)
    patcher.setattr(os, "open", calls.os_open)
    for name in ("stat", "lstat", "access", "listxattr", "getxattr"):
        if name in real:
            patcher.setattr(os, name, calls.reading(name))
    for name in ("utime", "chmod", "truncate", "setxattr", "removexattr"):
        if name in real:
            patcher.setattr(os, name, calls.metadata(name))
    for name, value in (("chdir", calls.chdir), ("listdir", calls.listdir),
                        ("scandir", calls.scandir), ("replace", calls.move("replace")),
                        ("rename", calls.move("rename")), ("mkdir", calls.mkdir),
                        ("unlink", calls.unlink), ("remove", calls.unlink),
                        ("rmdir", calls.rmdir)):
        patcher.setattr(os, name, value)
    patcher.setattr(shutil, "rmtree", calls.rmtree)
    temp = os.path.join(overlay.root, "tmp")
    real["makedirs"](temp, exist_ok=True)
    patcher.setattr(tempfile, "tempdir", temp)
    os.environ["TMPDIR"] = temp
    native.install(overlay, patcher)
