"""Which files run together: the "same training path" graph.

An edge A -> B means "running A also uses B":

- a Python file imports a module of the scanned tree (`import x`, `from x import y`, relative
  imports; the packages' `__init__.py` on the way count too);
- a file names another scanned file by a literal string (`config="ds_config.json"`,
  `open("configs/ds.json")`, a launcher's `subprocess.run(["python", "train.py"])`, a shell
  line `deepspeed train.py --deepspeed ds.json`, a config's `deepspeed_config_file: ds.json`),
  resolved against the file's folder, its parents up to the scan root, the scan roots, and
  finally any scanned file whose path ends with that string when only one does;
- a config that nothing names is handed to the code that reads such configs from its command
  line (a DeepSpeed config to `deepspeed.initialize(args=...)`, an accelerate config to
  `Accelerator()`, a LightningCLI config to `LightningCLI`, an HF args file to
  `HfArgumentParser`), when that code lies in the config's folder or below it (a folder named
  like `configs/` counts as its parent).

A *training path* is everything reachable from an entry point: a file nothing else uses (or one
file of a cycle nothing else uses).
"""

from __future__ import annotations

import os
from collections import defaultdict, deque

from ampdoctor.scan.sites import FileScan

_CONFIG_DIR_NAMES = {"conf", "confs", "cfg", "cfgs", "settings", "deepspeed", "accelerate", "yaml",
                     "json", "launch", "launchers", "scripts"}
_CONSUMER_OF = {"deepspeed": "deepspeed", "accelerate": "accelerate", "lightning": "lightning",
                "hfargs": "hfargs"}


def _is_config_dir(name: str) -> bool:
    low = name.lower()
    return low in _CONFIG_DIR_NAMES or "config" in low


class Graph:
    def __init__(self, scans: dict[str, FileScan], roots: list[str]) -> None:
        self.scans = scans
        self.roots = roots
        self.edges: dict[str, set[str]] = defaultdict(set)
        self.by_name: dict[str, list[str]] = defaultdict(list)
        self.dirs: set[str] = set()
        for path in scans:
            self.by_name[os.path.basename(path)].append(path)
            parent = os.path.dirname(path)
            while parent and parent not in self.dirs:
                self.dirs.add(parent)
                up = os.path.dirname(parent)
                if up == parent:
                    break
                parent = up
        self._bases: dict[tuple[str, str], list[str]] = {}

    # -- resolution -----------------------------------------------------------------------------
    def bases(self, scan: FileScan) -> list[str]:
        folder = os.path.dirname(scan.path)
        key = (folder, scan.root)
        cached = self._bases.get(key)
        if cached is not None:
            return cached
        out = [folder]
        root = scan.root
        current = folder
        inside = current == root or current.startswith(root.rstrip(os.sep) + os.sep)
        while inside and current != root:
            up = os.path.dirname(current)
            if up == current:
                break
            current = up
            out.append(current)
        for other in self.roots:
            if other not in out:
                out.append(other)
        self._bases[key] = out
        return out

    def resolve_import(
        self, scan: FileScan, module: str, names: tuple[str, ...], level: int
    ) -> list[str]:
        if level:
            base = os.path.dirname(scan.path)
            for _ in range(level - 1):
                base = os.path.dirname(base)
            bases = [base]
        else:
            bases = self.bases(scan)
        parts = [p for p in module.split(".") if p] if module else []
        for base in bases:
            walked = self._module_path(base, parts)
            if walked is None:
                continue
            hits, folder = walked
            for name in names:
                sub = os.path.join(folder, name + ".py")
                sub_pkg = os.path.join(folder, name, "__init__.py")
                if sub in self.scans:
                    hits.append(sub)
                elif sub_pkg in self.scans:
                    hits.append(sub_pkg)
            if hits:
                return hits
        return []

    def _module_path(self, base: str, parts: list[str]) -> tuple[list[str], str] | None:
        """The scanned files met on the way down the dotted module `parts` from `base` (each
        package's `__init__.py`, then the module file or package), and the folder reached;
        None where a part is neither a scanned file nor a folder under `base`."""
        hits: list[str] = []
        folder = base
        for index, part in enumerate(parts):
            pkg_init = os.path.join(folder, part, "__init__.py")
            if index == len(parts) - 1:
                mod = os.path.join(folder, part + ".py")
                if mod in self.scans:
                    hits.append(mod)
                elif pkg_init in self.scans:
                    hits.append(pkg_init)
                elif os.path.join(folder, part) not in self.dirs:
                    return None
            elif pkg_init in self.scans:
                hits.append(pkg_init)
            elif os.path.join(folder, part) not in self.dirs:
                return None
            folder = os.path.join(folder, part)
        return hits, folder

    def resolve_ref(self, scan: FileScan, text: str) -> str | None:
        text = text.strip()
        if not text or "://" in text:
            return None
        norm = os.path.normpath(text)
        if os.path.isabs(norm):
            return norm if norm in self.scans else None
        for base in self.bases(scan):
            candidate = os.path.normpath(os.path.join(base, norm))
            if candidate in self.scans:
                return candidate
        matches = [
            p for p in self.by_name.get(os.path.basename(norm), ())
            if p.endswith(os.sep + norm) and p != scan.path
        ]
        return matches[0] if len(matches) == 1 else None

    def disk_candidates(self, scan: FileScan, text: str) -> list[str]:
        norm = os.path.normpath(text.strip())
        if os.path.isabs(norm):
            return [norm]
        return [os.path.normpath(os.path.join(b, norm)) for b in self.bases(scan) + [os.getcwd()]]

    # -- edges ----------------------------------------------------------------------------------
    def build(self) -> None:
        for path, scan in self.scans.items():
            if scan.skipped:
                continue
            targets = self.edges[path]
            for module, names, level in scan.imports:
                targets.update(self.resolve_import(scan, module, names, level))
            for text, _follow in scan.refs:
                hit = self.resolve_ref(scan, text)
                if hit is not None:
                    targets.add(hit)
            targets.discard(path)
        self._link_orphan_configs()

    def _link_orphan_configs(self) -> None:
        referenced = {t for targets in self.edges.values() for t in targets}
        consumers: dict[str, list[str]] = defaultdict(list)
        for path, scan in self.scans.items():
            for what in scan.consumes:
                consumers[what].append(path)
        if not consumers:
            return
        for path, scan in self.scans.items():
            if scan.type != "config" or path in referenced or not scan.config_types:
                continue
            anchor = os.path.dirname(path)
            while _is_config_dir(os.path.basename(anchor)):
                up = os.path.dirname(anchor)
                if up == anchor:
                    break
                anchor = up
            prefix = anchor.rstrip(os.sep) + os.sep
            for ctype in scan.config_types:
                for consumer in consumers.get(_CONSUMER_OF.get(ctype, ""), ()):
                    if consumer.startswith(prefix):
                        self.edges[consumer].add(path)

    # -- training paths -------------------------------------------------------------------------
    def paths(self, relevant: set[str]) -> list[tuple[str, set[str]]]:
        """(entry, files reachable from it) for every entry point that reaches a relevant file."""
        reverse: dict[str, set[str]] = defaultdict(set)
        for src, targets in self.edges.items():
            for dst in targets:
                reverse[dst].add(src)
        wanted: set[str] = set()
        queue = deque(relevant)
        while queue:
            node = queue.popleft()
            if node in wanted:
                continue
            wanted.add(node)
            queue.extend(reverse.get(node, ()))
        out: list[tuple[str, set[str]]] = []
        visited: set[str] = set()
        starts = sorted(n for n in wanted if not reverse.get(n))
        leftovers = sorted(wanted)
        for start in starts + leftovers:
            if start in visited:
                continue
            seen = self.reach(start)
            visited.update(seen)
            out.append((start, seen))
        return out

    def reach(self, start: str) -> set[str]:
        seen = {start}
        stack = [start]
        while stack:
            node = stack.pop()
            for nxt in self.edges.get(node, ()):
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append(nxt)
        return seen
