"""Python code, read by its syntax tree only: the scanned code is never imported or executed.

What one file can say about loss scaling:

- GradScaler constructions (`torch.amp.GradScaler`, `torch.cuda.amp.GradScaler`, imported
  aliases, `ShardedGradScaler`); a literal `enabled=False` makes it information, not an owner;
- `scaler.scale(loss)` feeding a backward (`.backward()`, `engine.backward(...)`,
  `accelerator.backward(...)`, `manual_backward(...)`): a use of a GradScaler;
- `deepspeed.initialize(config=...)`: a literal path is followed, a literal dict is read;
- `TrainingArguments(fp16=True / bf16=True, deepspeed=...)` (and trl's config subclasses);
- `Accelerator(mixed_precision=...)`; Lightning `Trainer(precision=...)` / `Fabric(precision=...)`;
- apex `amp.initialize(...)`;
- a hand-written static loss scale: a power-of-two constant (or a `*scale*` name) multiplied
  into the loss before backward.

It also records what links the file to others: its imports and the file names it mentions.
"""

from __future__ import annotations

import ast
import re
import warnings
from collections.abc import Sequence

from ampdoctor.scan.configs import PATH_LIKE
from ampdoctor.scan.hints import find_hints
from ampdoctor.scan.python_literals import number
from ampdoctor.scan.python_owners import OwnerCalls
from ampdoctor.scan.python_scale import LossScale
from ampdoctor.scan.sites import FileScan

#: Without one of these words a file holds no owner: it is only searched for links (regex).
PY_KEYWORDS = re.compile(
    rb"GradScaler|deepspeed|DeepSpeed|TrainingArguments|Accelerator|Trainer|Fabric|LightningCLI"
    rb"|HfArgumentParser|apex|backward|\.scale\(|precision|SFTConfig|DPOConfig|GRPOConfig"
)
_IMPORT_RE = re.compile(
    r"^[ \t]*(?:from[ \t]+(\.*)([\w.]*)[ \t]+import[ \t]+(\([^)]*\)|[^\n#;]+)"
    r"|import[ \t]+([^\n#;]+))",
    re.M,
)
_PATH_STR_RE = re.compile(r"[\"']([^\"'\n\r]{1,255}?\.(?:json|ya?ml|py|sh|bash))[\"']")

_TRAINING_ARGS = {"SFTConfig", "DPOConfig", "GRPOConfig", "ORPOConfig", "KTOConfig", "CPOConfig",
                  "RewardConfig", "PPOConfig"}
_BACKWARD_ATTRS = {"backward", "manual_backward"}


def scan_python(path: str, data: bytes, scan: FileScan) -> None:
    """Add the sites and links of one Python file to `scan` (or mark it skipped)."""
    if not PY_KEYWORDS.search(data):
        _cheap_links(data, scan)
        return
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tree = ast.parse(data, filename=path)
    except SyntaxError as exc:
        where = f" (line {exc.lineno})" if exc.lineno else ""
        scan.skipped = f"does not parse: {exc.msg}{where}"
        return
    except (ValueError, RecursionError, MemoryError) as exc:
        scan.skipped = f"does not parse: {type(exc).__name__}: {exc}"
        return
    visitor = _Visitor(path, scan)
    visitor.run(tree)
    try:
        scan.hints = find_hints(tree, visitor.aliases)
    except RecursionError:
        scan.hints = []    # nested too deeply for the hints; the owners above still stand


def _cheap_links(data: bytes, scan: FileScan) -> None:
    """Imports and file names of a file that cannot hold an owner, without parsing it."""
    text = data.decode("utf-8", errors="replace")
    for match in _IMPORT_RE.finditer(text):
        dots, module, names, plain = match.groups()
        if plain is not None:
            for part in plain.split(","):
                name = part.strip().split(" as ")[0].strip()
                if re.fullmatch(r"[\w.]+", name or ""):
                    scan.imports.append((name, (), 0))
        else:
            items = []
            for part in names.strip("()").replace("\\\n", " ").split(","):
                name = part.strip().split(" as ")[0].strip()
                if re.fullmatch(r"\w+", name or ""):
                    items.append(name)
            scan.imports.append((module or "", tuple(items), len(dots)))
    for match in _PATH_STR_RE.finditer(text):
        scan.refs.append((match.group(1), False))


_PATH_ENDINGS = (".json", ".yaml", ".yml", ".py", ".sh", ".bash")
_TRY_TYPES = tuple(t for t in (ast.Try, getattr(ast, "TryStar", None)) if t is not None)


class _Visitor(OwnerCalls, LossScale):
    """One pass over the tree collects imports, literals and calls (with the `if` arms and the
    function they stand in); the calls are then read once every import alias is known."""

    # -- driver -----------------------------------------------------------------------------
    def run(self, tree: ast.Module) -> None:
        self.scope = tree
        #: classes this file defines: a local `class Accelerator` is not accelerate's
        self.local_classes = {n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}
        self._visit(tree)
        for call, branch, scope in self.calls:
            self.branch = list(branch)
            self.scopes = [scope if scope is not None else tree]
            self._call(call)
        if self.ds_strategy:
            for site in self.lightning:
                site.delegates = True
                site.detail += "; handed to DeepSpeed (DeepSpeedStrategy)"

    def _visit(self, node: ast.AST) -> None:
        kind = type(node)
        if kind is ast.Name or kind is ast.Load or kind is ast.Store:
            return
        if isinstance(node, ast.Constant):
            text = node.value
            if (type(text) is str and len(text) < 300 and text.endswith(_PATH_ENDINGS)
                    and PATH_LIKE.match(text)):
                self.scan.refs.append((text, False))
            return
        if isinstance(node, ast.Call):
            self.calls.append((node, tuple(self.branch), self.scope))
        elif isinstance(node, ast.Import):
            self._import(node)
            return
        elif isinstance(node, ast.ImportFrom):
            self._import_from(node)
            return
        elif isinstance(node, ast.Assign):
            self._assign(node)
        elif isinstance(node, ast.If):
            self._arms(node, [node.body, node.orelse], [node.test])
            return
        elif isinstance(node, ast.IfExp):
            self._arms(node, [[node.body], [node.orelse]], [node.test])
            return
        elif isinstance(node, _TRY_TYPES):
            self._arms(node, [node.body + node.orelse] + [[h] for h in node.handlers])
            for item in node.finalbody:
                self._visit(item)
            return
        elif isinstance(node, ast.Match):
            self._arms(node, [[c] for c in node.cases], [node.subject])
            return
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            outer = self.scope
            self.scope = node
            self._children(node)
            self.scope = outer
            return
        self._children(node)

    def _children(self, node: ast.AST) -> None:
        for name in node._fields:
            value = getattr(node, name, None)
            if value.__class__ is list:
                for item in value:
                    if isinstance(item, ast.AST):
                        self._visit(item)
            elif isinstance(value, ast.AST):
                self._visit(value)

    def _arms(
        self,
        node: ast.stmt | ast.expr,
        arms: Sequence[Sequence[ast.AST]],
        pre: Sequence[ast.AST] = (),
    ) -> None:
        for item in pre:
            self._visit(item)
        bid = (node.lineno, node.col_offset)
        for index, arm in enumerate(arms):
            self.branch.append((bid, index))
            for item in arm:
                self._visit(item)
            self.branch.pop()

    def _import(self, node: ast.Import) -> None:
        for alias in node.names:
            self.scan.imports.append((alias.name, (), 0))
            if alias.asname:
                self.aliases[alias.asname] = alias.name
            else:
                head = alias.name.split(".")[0]
                self.aliases.setdefault(head, head)

    def _import_from(self, node: ast.ImportFrom) -> None:
        module = node.module or ""
        names = tuple(a.name for a in node.names if a.name != "*")
        self.scan.imports.append((module, names, node.level or 0))
        for alias in node.names:
            local = alias.asname or alias.name
            if node.level:
                self.aliases[local] = alias.name
            else:
                self.aliases[local] = f"{module}.{alias.name}" if module else alias.name

    def _assign(self, node: ast.Assign) -> None:
        target = node.targets[0]
        if len(node.targets) != 1 or not isinstance(target, ast.Name):
            return
        if isinstance(node.value, ast.Dict):
            self.dicts[target.id] = node.value
        else:
            value = number(node.value)
            if value is not None:
                self.numbers[target.id] = value

    # -- calls --------------------------------------------------------------------------------
    def _call(self, node: ast.Call) -> None:
        func = node.func
        qual = self.qual(func) or (func.attr if isinstance(func, ast.Attribute) else "")
        last = qual.rsplit(".", 1)[-1]
        kw = {k.arg: k.value for k in node.keywords if k.arg}
        scaler_kw = kw.get("scaler")
        if isinstance(scaler_kw, ast.Call):
            self.handed[id(scaler_kw)] = qual or "a framework"
        self._owner_call(node, qual, last, kw)
        if isinstance(func, ast.Attribute):
            if func.attr in _BACKWARD_ATTRS:
                self._backward(node)
            elif func.attr == "scale" and len(node.args) == 1 and not node.keywords:
                self._scale_use(node, inside_backward=False)

    def _owner_call(self, node: ast.Call, qual: str, last: str, kw: dict[str, ast.expr]) -> None:
        """A call that may build a loss-scale owner, by the name called (`last` is its last
        dotted part)."""
        if last in ("GradScaler", "ShardedGradScaler"):
            self._gradscaler(node, qual, kw)
        elif last == "initialize" and qual.split(".")[0] == "deepspeed":
            self._deepspeed_initialize(node, kw)
        elif last == "initialize" and qual.split(".")[0] == "apex":
            self._apex(node, kw)
        elif last.endswith("TrainingArguments") or last in _TRAINING_ARGS:
            self._training_args(node, last, kw)
        elif last == "Accelerator" and self._from_framework(qual, "accelerate"):
            self._accelerator(node, kw)
        elif last in ("Trainer", "Fabric") and self._is_lightning(qual, kw):
            self._lightning(node, last, kw)
        elif last == "LightningCLI":
            self.scan.consumes.add("lightning")
        elif last == "HfArgumentParser":
            self.scan.consumes.update(("hfargs", "deepspeed"))
        elif last in ("DeepSpeedStrategy", "DeepSpeedPlugin"):
            if last == "DeepSpeedStrategy":
                self.ds_strategy = True
            cfg = kw.get("config", kw.get("hf_ds_config", node.args[0] if node.args else None))
            self._ds_config_arg(cfg, node)
        elif last == "add_config_arguments" and "deepspeed" in qual:
            self.scan.consumes.add("deepspeed")

    def _from_framework(self, qual: str, package: str) -> bool:
        """Is the called name bound to `package`'s class? A name imported from another module
        (a project-local wrapper named like the framework's) or defined in this file is not."""
        if "." in qual:
            return qual.split(".")[0] == package
        return qual not in self.local_classes

    def _is_lightning(self, qual: str, kw: dict[str, ast.expr]) -> bool:
        head = qual.split(".")[0]
        if head in ("lightning", "pytorch_lightning", "lightning_fabric"):
            return True
        return "precision" in kw and head != "transformers"
