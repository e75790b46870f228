"""Importing the user's callables named by the spec (`UserCode`), calling them, and forgetting
what they imported once the diagnose ends.

A name that cannot be found is the spec's fault (SpecError, exit 2); user code that raises
while it is imported or called is the user's (UserCodeError, exit 3, with their file:line).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..core.errors import AmpdoctorInterrupt, SpecError, UserCodeError
from ..core.safetext import MESSAGE_LIMIT, cut
from ..probe.callsite import CallSiteFinder
from ..spec import Spec
from .naming import spec_where


def _user_error(what: str, exc: BaseException, finder: CallSiteFinder) -> UserCodeError:
    site = finder.from_traceback(exc.__traceback__)
    location = (site.file, site.line) if site else None
    if isinstance(exc, SyntaxError) and exc.filename and exc.lineno:
        # the error is in the file being compiled, which no traceback frame shows
        location = (os.path.realpath(exc.filename), exc.lineno)
    where = f" at {location[0]}:{location[1]}" if location else ""
    one_line = cut(traceback.format_exception_only(type(exc), exc)[-1].strip(), MESSAGE_LIMIT)
    return UserCodeError(f"{what} raised{where}: {one_line}", cause=exc, location=location)



#: What each spec callable is called with (CONTRACT: the train_loop signature).
CALLED_WITH = {"model": (), "data": (), "loss": ("model", "micro_batch"),
               "optimizer": ("model",),
               "train_loop": ("model", "optimizer", "micro_batches", "run"),
               "hf_trainer.factory": ("model", "args", "train_dataset"),
               "lightning.module": ()}


def _check_signature(key: str, ref: str, fn: Callable[..., Any]) -> None:
    """A callable that cannot take what ampdoctor passes is named at its `def` line now, not
    as a TypeError deep inside a rung."""
    import inspect

    args = CALLED_WITH[key]
    try:
        inspect.signature(fn).bind(*args)
    except TypeError as exc:
        location: tuple[str, int] | None = None
        try:
            target = inspect.unwrap(fn)
            file = inspect.getsourcefile(target)
            if file:
                location = (file, inspect.getsourcelines(target)[1])
        except (OSError, TypeError):
            location = None
        at = f" at {location[0]}:{location[1]}" if location else ""
        wanted = f"({', '.join(args)})"
        raise UserCodeError(f"spec key '{key}': '{ref}'{at} cannot be called as {ref}{wanted}: "
                            f"{exc}.", location=location) from exc
    except ValueError:   # a builtin without a signature: let the call decide
        pass


class UserCode:
    """The user's callables, imported once per diagnose."""

    def __init__(self, spec: Spec, finder: CallSiteFinder):
        self.spec = spec
        self.finder = finder
        #: process-wide settings a run of the loop left changed (restored after each run)
        self.left_behind: set[str] = set()
        self._imported_before = set(sys.modules)
        # ampdoctor never writes into the user's tree: no __pycache__ for what it imports
        self._wrote_bytecode = sys.dont_write_bytecode
        sys.dont_write_bytecode = True
        root = str(spec.root)
        if root not in sys.path:
            sys.path.insert(0, root)
            self._added_path: str | None = root
        else:
            self._added_path = None
        try:
            from .entrypoints import hf_trainer_loop, lightning_loop
            # with `lightning` the LightningModule is the model; with `hf_trainer` or
            # `lightning` ampdoctor writes the loop (see entrypoints.py)
            self.model_factory = self.resolve("lightning.module" if spec.lightning else "model")
            self.data_factory = self.resolve("data")
            if spec.hf_trainer is not None:
                self.train_loop = hf_trainer_loop(spec, self.resolve("hf_trainer.factory"))
            elif spec.lightning is not None:
                self.train_loop = lightning_loop(spec, self.model_factory)
            elif spec.deepspeed is not None:
                from .deepspeed import deepspeed_loop
                self.train_loop = deepspeed_loop(spec, self.resolve("loss"))
            else:
                self.train_loop = self.resolve("train_loop")
            self.loss = self.resolve("loss") if spec.loss else None
            self.optimizer_factory = (self.resolve("optimizer")
                                      if isinstance(spec.optimizer, str) else None)
        except BaseException:
            self.forget()    # an import that failed leaves no path entry and no module behind
            raise

    def resolve(self, key: str) -> Callable[..., Any]:
        ref = str(functools.reduce(getattr, key.split("."), self.spec))
        given = self.spec.callable_for(key)
        if given is not None:   # a Spec built in code: the object itself, nothing to import
            _check_signature(key, ref, given)
            return given
        module_name, _, attr_path = ref.partition(":")
        where = spec_where(self.spec, key).rstrip(": ")
        limit = sys.getrecursionlimit()
        try:
            try:
                module = importlib.import_module(module_name)
            finally:
                restore_recursion_limit(limit)   # a module that lowers it on import
        except ModuleNotFoundError as exc:
            missing = exc.name or module_name
            if missing == module_name or module_name.startswith(missing + "."):
                raise SpecError(
                    f"{where}: spec key '{key}': module '{module_name}' was not found under "
                    f"project_root {self.spec.root} (nor on sys.path).", cause=exc) from exc
            raise _user_error(f"importing '{module_name}' (spec key '{key}')", exc,
                              self.finder) from exc
        except BaseException as exc:  # the user's module raised while imported
            if isinstance(exc, (KeyboardInterrupt, AmpdoctorInterrupt)):
                raise
            raise _user_error(f"importing '{module_name}' (spec key '{key}')", exc,
                              self.finder) from exc
        obj: Any = module
        for part in attr_path.split("."):
            if not hasattr(obj, part):
                names = [n for n in dir(module) if not n.startswith("_")]
                import difflib
                close = difflib.get_close_matches(part, names, n=1)
                hint = f" Did you mean '{close[0]}'?" if close else ""
                raise SpecError(f"{where}: spec key '{key}': module '{module_name}' has no "
                                f"attribute '{attr_path}'.{hint}")
            obj = getattr(obj, part)
        if not callable(obj):
            raise SpecError(f"{where}: spec key '{key}': '{ref}' is a "
                            f"{type(obj).__name__}, not a callable.")
        _check_signature(key, ref, obj)
        return obj

    def source_files(self) -> list[str]:
        """The files that define the spec's callables (the diagnosed loop's own path)."""
        import inspect
        files = []
        for fn in (self.train_loop, self.model_factory, self.data_factory, self.loss,
                   self.optimizer_factory):
            if fn is None:
                continue
            try:
                path = inspect.getsourcefile(inspect.unwrap(fn))
            except TypeError:
                path = None
            if path:
                files.append(path)
        # a config file an entry point hands its framework (`hf_trainer.args.deepspeed`)
        files += list(getattr(self.train_loop, "config_files", ()))
        return files

    def call(self, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        limit = sys.getrecursionlimit()
        try:
            return fn(*args)
        except BaseException as exc:
            restore_recursion_limit(limit)   # before ampdoctor formats the error
            if isinstance(exc, (KeyboardInterrupt, AmpdoctorInterrupt)):
                raise
            raise _user_error(what, exc, self.finder) from exc
        finally:
            restore_recursion_limit(limit)

    def forget(self) -> None:
        """Drop the modules this diagnose imported and its sys.path entry."""
        root = str(self.spec.root)   # a property that resolves the path: read once
        # A project root that holds its virtual environment holds torch too: what a package
        # imported before the run (torch, ampdoctor) loaded lazily during it stays, as does
        # anything installed (torch registers its operator libraries once per process and
        # refuses a second import).
        packages = {name.partition(".")[0] for name in self._imported_before}
        installed = _installed_prefixes()
        for name in set(sys.modules) - self._imported_before:
            if name.partition(".")[0] in packages:
                continue
            module = sys.modules.get(name)
            path = getattr(module, "__file__", None) or ""
            if path.startswith(root) and not os.path.realpath(path).startswith(installed):
                del sys.modules[name]
        if self._added_path and self._added_path in sys.path:
            sys.path.remove(self._added_path)
        sys.dont_write_bytecode = self._wrote_bytecode


def restore_recursion_limit(limit: int) -> None:
    """Put back the recursion limit the user's code changed (`sys.setrecursionlimit(50)` in a
    loop would otherwise fail ampdoctor's own code after it: the judge, the report). Restored
    silently: the limit changes no number the triage compares."""
    if sys.getrecursionlimit() != limit:
        sys.setrecursionlimit(limit)


def _installed_prefixes() -> tuple[str, ...]:
    """Where installed packages live (site-packages, the standard library) and ampdoctor."""
    import site
    import sysconfig
    paths = sysconfig.get_paths()
    found = {paths.get("purelib"), paths.get("platlib"), paths.get("stdlib"),
             paths.get("platstdlib"), str(Path(__file__).resolve().parent.parent)}
    with contextlib.suppress(AttributeError):   # a virtualenv's old site module
        found |= set(site.getsitepackages()) | {site.getusersitepackages()}
    return tuple(os.path.realpath(p) + os.sep for p in found if p)

