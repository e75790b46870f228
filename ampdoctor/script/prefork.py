"""Start-up paid once per command line: the fork server that starts each run of a script has
already imported the libraries the script imports (its `import x` / `from x import y`, read
with `ast`, wherever they are in the file), so a run pays only the script's own set-up and steps.

Measured on an image-model script (transformers' ViT, DataLoader workers): the imports were
about half of each run's time before its first step, and a diagnose makes about 12 runs.

What is preloaded, and what is not:

- libraries only: a name that resolves inside the script's folder or the working directory
  (the user's own modules) is left to the run, so whatever it does at import (a seed, a model
  built at module level) still happens under the probe, in each run;
  the standard library and torch (imported anyway) are not listed;
- `from x import y` also resolves `y` (a lazily loading library such as transformers imports the
  model's module only then);
- a name that fails to import (any exception) stays lazy: the run imports it as it would;
- a library imported before the probe's patches could hold its own reference to a function the
  probe patches (`from torch.nn.utils import clip_grad_norm_` at its top level): each run rebinds
  such module-level names to the patched function (`rebind`), as a fresh import would have bound
  them.

Each run is still forked from the server into a process of its own: nothing one run does
reaches the next. The server is restarted when another script needs other libraries.
"""

from __future__ import annotations

import ast
import contextlib
import json
import os
import sys
import types
from typing import Any

from ..probe.callsite import installed, library_dirs

#: the environment variable that hands the server its import list (read when it starts)
ENV = "AMPDOCTOR_PREFORK_IMPORTS"

#: the modules the server imported for the script (set in the server, inherited by each run)
PRELOADED: list[str] = []

#: the import list the server was started with (`script_imports` of the script its runs run;
#: None in a run started without the server)
SERVED: list[str] | None = None

#: the modules loaded in the server once it had imported everything (each run looks for the
#: names it must rebind only in the modules loaded since), and those among them that hold
#: `(module name, attribute)` of safetensors' functions (`native`)
SERVER_MODULES: frozenset[str] = frozenset()
SAFETENSORS_NAMES: list[tuple[str, str]] = []
#: id of each callable a preloaded module holds -> (module name, name) of each holder (in the
#: server, once its imports are done; `rebind` reads it in each run)
_HELD: dict[int, list[tuple[str, str]]] = {}

#: the import list the running server was started with (in the process that starts runs)
_SERVING: tuple[str, ...] | None = None


def script_imports(script: str, cwd: str) -> list[str]:
    """`module` or `module:name` for every absolute import of the script that is neither the
    standard library, torch, nor a module of the user's own (in the script's folder or `cwd`).
    Read once per version of the file (each run of a diagnose asks again)."""
    try:
        st = os.stat(script)
        key = (os.path.realpath(script), os.path.realpath(cwd), st.st_mtime_ns, st.st_size)
    except OSError:
        return []
    if key not in _READ:
        _READ.clear()
        _READ[key] = _read_imports(script, cwd)
    return list(_READ[key])


#: script_imports' answer for the one script it read last
_READ: dict[tuple[str, str, int, int], list[str]] = {}


def _read_imports(script: str, cwd: str) -> list[str]:
    try:
        with open(script, "rb") as f:
            tree = ast.parse(f.read(), filename=script)
    except (OSError, SyntaxError, ValueError):
        return []
    folders = [os.path.realpath(os.path.dirname(script)), os.path.realpath(cwd)]
    wanted: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [f"{node.module}:{alias.name}" for alias in node.names if alias.name != "*"]
            names = names or [node.module]
        else:
            continue
        for name in names:
            top = name.split(":")[0].split(".")[0]
            if (top in sys.stdlib_module_names or top in ("torch", "ampdoctor", "__future__")
                    or _local(top, folders) or name in wanted):
                continue
            wanted.append(name)
    return wanted


#: the frameworks whose classes the probe patches (`probe.frameworks`): a run imports those its
#: script imports before the patches go in, when the server did not preload them
FRAMEWORKS = ("accelerate", "transformers", "lightning", "pytorch_lightning", "lightning_fabric",
              "deepspeed")


def import_frameworks(script: str, cwd: str) -> None:
    """In a run, before the probe's patches: import the frameworks among the script's imports
    that the server did not preload (it stops at a library that starts a thread, and a run
    started without the server preloads nothing), so that the Accelerator or Trainer the script
    builds is one the probe watches. The script imports them anyway; one that fails to import
    is left to the script.

    A script that hands a DeepSpeed config to the HF Trainer or accelerate (`deepspeed=`,
    `--deepspeed ds.json`) never imports DeepSpeed itself: they import it when the engine is
    built, after the patches. DeepSpeed is imported up front for such a script too, so its
    engine is the one the probe watches and a process of one finds its group."""
    wanted = list(SERVED) if SERVED is not None else script_imports(script, cwd)
    tops = {n.partition(":")[0].split(".")[0] for n in wanted}
    if tops & {"transformers", "accelerate"} and "deepspeed" not in tops \
            and _mentions_deepspeed(script):
        wanted.append("deepspeed")
    for name in wanted:
        module, _, attr = name.partition(":")
        if module.split(".")[0] not in FRAMEWORKS:
            continue
        try:
            __import__(module, fromlist=[attr] if attr else [])
        except BaseException:  # noqa: BLE001 - the script's own import says why
            continue


def _mentions_deepspeed(script: str) -> bool:
    try:
        with open(script, encoding="utf-8", errors="replace") as f:
            return "deepspeed" in f.read().lower()
    except OSError:
        return False


def _local(top: str, folders: list[str]) -> bool:
    """Whether a top-level name is (or may be) the user's own: a module or package of that name
    in one of `folders`, or one that resolves under them."""
    for folder in folders:
        if (os.path.exists(os.path.join(folder, top + ".py"))
                or os.path.isdir(os.path.join(folder, top))):
            return True
    import importlib.util
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return True
    if spec is None:
        return True
    origin = spec.origin or (list(spec.submodule_search_locations or []) or [""])[0]
    origin = os.path.realpath(origin) if origin else ""
    if installed(origin):
        return False   # even in a virtual environment inside the project's folder
    return any(origin.startswith(folder + os.sep) for folder in folders)


def serve(ctx: Any, imports: list[str]) -> None:
    """Make the fork server of `ctx` (multiprocessing's forkserver context) one that imported
    `imports`: start it with them, or restart it when it runs with other ones."""
    global _SERVING
    wanted = tuple(imports)
    if wanted == _SERVING:
        return
    from multiprocessing import forkserver
    server = forkserver._forkserver
    if _SERVING is not None:
        stop = getattr(server, "_stop", None)   # (private; a server left running is harmless)
        if stop is not None:
            with contextlib.suppress(Exception):
                stop()
    added = {ENV: json.dumps(list(wanted))}
    if WAIT_POLICY not in os.environ:
        added.update({WAIT_POLICY: "PASSIVE", PASSIVE_ENV: "1"})
    os.environ.update(added)
    try:
        server.ensure_running()
    finally:
        for name in added:
            os.environ.pop(name, None)
    _SERVING = wanted


#: OpenMP's wait policy (read once, when torch loads its OpenMP runtime). Runs of a script may
#: run two at a time (`ahead`); with OpenMP's default the threads of each run spin while they
#: wait for work, and two runs of 2 threads on 2 cores took 4x as long as one after the other
#: (8 runs of the light recipe: 3.8 s two at a time, 0.9 s one at a time). Passive waiting:
#: 0.55 s two at a time, one at a time unchanged, and no number a run computes changes (the
#: threads and their work are the same). Set for the fork server only, where the user has not
#: set it; the runs' environment does not show it.
WAIT_POLICY = "OMP_WAIT_POLICY"
#: marks a wait policy that `serve` set (the server removes both once torch is imported)
PASSIVE_ENV = "AMPDOCTOR_OMP_PASSIVE"


def forget_wait_policy() -> None:
    """In the fork server, torch imported (its OpenMP runtime has read it): the wait policy
    `serve` set is not the runs' to see."""
    if os.environ.pop(PASSIVE_ENV, None):
        os.environ.pop(WAIT_POLICY, None)


def _preload() -> None:
    """In the fork server, at its start: import what `serve` listed. The script's stdout is
    not ours to write to (`--json` prints the record there): anything printed goes to stderr."""
    global SERVED
    forget_wait_policy()
    raw = os.environ.pop(ENV, None)
    if not raw:
        return
    import threading
    out = os.dup(1)
    os.dup2(2, 1)
    SERVED = list(json.loads(raw))
    try:
        for name in SERVED:
            if threading.active_count() > 1:
                break   # a library started a thread: forking more of them is not safe
            before = set(sys.modules)
            module, _, attr = name.partition(":")
            try:
                __import__(module, fromlist=[attr] if attr else [])
            except BaseException:  # noqa: BLE001 - the run imports it itself (and says why)
                continue
            PRELOADED.extend(sorted(set(sys.modules) - before))
    finally:
        with contextlib.suppress(OSError):
            sys.stdout.flush()
        os.dup2(out, 1)
        os.close(out)
    _snapshot()


def _snapshot() -> None:
    """In the server, its imports done: what each run need not look through again."""
    global SERVER_MODULES
    library_dirs()      # (sysconfig's paths resolved once, not in every run's finder)
    SAFETENSORS_NAMES.extend(_bound_names(list(sys.modules.items())))
    SERVER_MODULES = frozenset(sys.modules)
    for modname in PRELOADED:     # what `rebind` looks up instead of reading every module
        module = sys.modules.get(modname)
        if isinstance(module, types.ModuleType):
            for key, value in vars(module).items():
                if callable(value):
                    _HELD.setdefault(id(value), []).append((modname, key))


def safetensors_holders() -> list[tuple[str, str]]:
    """(module name, attribute) for each loaded module that holds safetensors' own
    `serialize_file` or `safe_open` under that name (`native` rebinds them in each run). In a
    run forked from the server, only the modules loaded since the server's imports are looked
    through: the server found the others once."""
    if not SERVER_MODULES:
        return _bound_names(list(sys.modules.items()))
    names = [(m, a) for m, a in SAFETENSORS_NAMES if m in sys.modules]
    return names + _bound_names([(m, sys.modules[m]) for m in _loaded_since()])


#: how many of the server's modules in a row end the look back through sys.modules
_RUN_OF_OLD = 64


def _loaded_since() -> list[str]:
    """The modules a run loaded since the server's imports: the last ones of sys.modules (it
    keeps the order modules were added in), read from the end until a run of the server's own.
    Reading every module name would write to every one's reference count: in a forked run each
    write copies a page (~3 ms a run)."""
    found: list[str] = []
    old = 0
    for name in reversed(sys.modules):
        if name in SERVER_MODULES:
            old += 1
            if old >= _RUN_OF_OLD:
                break
            continue
        old = 0
        found.append(name)
    return [name for name in found if name in sys.modules]


def _bound_names(modules: list[tuple[str, Any]]) -> list[tuple[str, str]]:
    """(module name, attribute) for each of `modules` that holds safetensors' own
    `serialize_file` or `safe_open` under that name (none when safetensors is not loaded)."""
    safetensors = sys.modules.get("safetensors")
    if safetensors is None:
        return []
    real = {"serialize_file": getattr(safetensors, "serialize_file", None),
            "safe_open": getattr(safetensors, "safe_open", None)}
    found = []
    for name, module in modules:
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        found += [(name, attr) for attr, fn in real.items()
                  if fn is not None and namespace.get(attr) is fn]
    return found


def plain_start_method() -> None:
    """In a run, before the script: the multiprocessing start method a plain `python script.py`
    starts with (the platform's default). A process forked by the server inherits the
    server's ("forkserver"): a DataLoader's workers would then each be started through a new
    fork server of the run's own and import the script's `__main__` again (measured: 40 s of a
    60 s run of an image-model script, against 0.5 s forked)."""
    import multiprocessing
    with contextlib.suppress(Exception):
        multiprocessing.set_start_method(multiprocessing.get_all_start_methods()[0], force=True)


def rebind(patched: list[tuple[Any, str, Any]]) -> None:
    """In a run, once the probe's patches are in: every module the server preloaded that holds
    one of the patched functions under a name of its own gets the patched one instead (the
    holders the server noted once its imports were done, `_HELD`)."""
    if not _HELD:
        return
    for target, name, old in patched:
        new = getattr(target, name, None)
        if not callable(old) or new is None or new is old:
            continue
        for modname, key in _HELD.get(id(old), ()):
            module = sys.modules.get(modname)
            if getattr(module, "__dict__", {}).get(key) is old:
                with contextlib.suppress(Exception):
                    setattr(module, key, new)

_preload()
