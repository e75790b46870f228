"""The framework calls that make a loss-scale owner, read from the AST: GradScaler,
deepspeed.initialize, apex amp.initialize, TrainingArguments, Accelerator, Lightning
Trainer/Fabric. A mixin of the visitor in `python_ast`."""

from __future__ import annotations

import ast
from typing import Any

from ampdoctor.scan.configs import (
    MISSING,
    NonLiteral,
    accelerate_site,
    deepspeed_sites,
    lightning_site,
    trainer_fp32,
)
from ampdoctor.scan.python_literals import const, source_text
from ampdoctor.scan.python_state import VisitorState
from ampdoctor.scan.sites import Site


class OwnerCalls(VisitorState):
    """Handlers for the calls that construct a loss-scale owner."""

    def _gradscaler(self, node: ast.Call, qual: str, kw: dict[str, ast.expr]) -> None:
        enabled = kw.get("enabled")
        if enabled is None:
            if "cuda.amp" in qual or "cpu.amp" in qual:
                index = 4
            elif "." in qual:
                index = 5
            else:
                first = node.args[0] if node.args else None
                index = 5 if isinstance(first, ast.Constant) and isinstance(first.value, str) else 4
            if len(node.args) > index and not any(isinstance(a, ast.Starred) for a in node.args):
                enabled = node.args[index]
        src = source_text(node)
        handed = self.handed.get(id(node))
        suffix = f"; handed to {handed}" if handed else ""
        value = const(enabled) if enabled is not None else True
        if value is False or (type(value) is int and value == 0):
            self._add(Site("GradScaler (disabled)", self.path, node.lineno, None,
                           f"{src}: enabled=False, scales nothing", "info", "gradscaler"), node)
        elif value is MISSING and enabled is not None:  # MISSING: read from an argument
            self._add(Site("GradScaler", self.path, node.lineno, None,
                           f"{src}: on whenever {source_text(enabled, 60)} is true{suffix}",
                           "owner", "gradscaler"), node)
        else:
            self._add(Site("GradScaler", self.path, node.lineno, None, src + suffix, "owner",
                           "gradscaler"), node)

    def _ds_config_arg(self, cfg: ast.AST | None, node: ast.Call) -> str:
        """Read a DeepSpeed `config=` argument; returns how it was given."""
        if cfg is None:
            self.scan.consumes.add("deepspeed")
            return "no config= argument: the config comes from the command line"
        if isinstance(cfg, ast.Constant) and isinstance(cfg.value, str):
            self.scan.refs.append((cfg.value, True))
            return f"config {cfg.value!r}"
        if isinstance(cfg, ast.Dict):
            self._inline_deepspeed(cfg)
            return "config from the inline dict"
        if isinstance(cfg, ast.Name) and cfg.id in self.dicts:
            dnode = self.dicts[cfg.id]
            self._inline_deepspeed(dnode)
            return f"config from the dict {cfg.id!r} (line {dnode.lineno})"
        self.scan.consumes.add("deepspeed")
        return (f"config={source_text(cfg, 60)} "
                "(not a literal: the owner is whatever config it holds)")

    def _inline_deepspeed(self, dnode: ast.Dict) -> None:
        if id(dnode) in self.inlined:
            return
        self.inlined.add(id(dnode))
        lines: dict[tuple[str, ...], int] = {}
        data = self._literal_dict(dnode, (), lines)
        sites = deepspeed_sites(data, self.path, lambda key: lines.get(key, dnode.lineno))
        for site in sites:
            self._add(site)
        self.scan.config_types.add("deepspeed")

    def _literal_dict(self, node: ast.Dict, prefix: tuple[str, ...], lines: dict) -> dict:
        out: dict[str, Any] = {}
        for key, value in zip(node.keys, node.values, strict=True):
            if not (isinstance(key, ast.Constant) and isinstance(key.value, str)):
                continue
            path = prefix + (key.value,)
            lines[path] = key.lineno
            if len(path) > 8:
                out[key.value] = NonLiteral(source_text(value, 60))
            elif isinstance(value, ast.Dict):
                out[key.value] = self._literal_dict(value, path, lines)
            elif isinstance(value, ast.Name) and value.id in self.dicts:
                out[key.value] = self._literal_dict(self.dicts[value.id], path, lines)
            else:
                try:
                    out[key.value] = ast.literal_eval(value)
                except (ValueError, TypeError, SyntaxError, RecursionError):
                    out[key.value] = NonLiteral(source_text(value, 60))
        return out

    def _deepspeed_initialize(self, node: ast.Call, kw: dict[str, ast.expr]) -> None:
        cfg = kw.get("config", kw.get("config_params"))
        how = self._ds_config_arg(cfg, node)
        self._add(Site("DeepSpeed engine", self.path, node.lineno, None,
                       f"deepspeed.initialize: {how}", "info", ""), node)

    def _apex(self, node: ast.Call, kw: dict[str, ast.expr]) -> None:
        level = const(kw.get("opt_level")) if "opt_level" in kw else "O1"
        enabled = const(kw.get("enabled")) if "enabled" in kw else True
        detail = f"apex amp.initialize(opt_level={level if level is not MISSING else '?'})"
        if "loss_scale" in kw:
            detail += f", loss_scale={source_text(kw['loss_scale'], 30)}"
        if level == "O0" or enabled is False:
            self._add(Site("apex amp (off)", self.path, node.lineno, None,
                           detail + ": no loss scaling", "info", ""), node)
        else:
            self._add(Site("apex amp", self.path, node.lineno, None, detail, "owner", "apex"), node)

    def _training_args(self, node: ast.Call, name: str, kw: dict[str, ast.expr]) -> None:
        ds = kw.get("deepspeed")
        ds_value = const(ds) if ds is not None else None
        delegates = ds is not None and ds_value not in (None, "", False)
        if ds is not None and delegates:
            self._ds_config_arg(ds, node)
        fp16 = kw.get("fp16")
        if fp16 is not None:
            value = const(fp16)
            how = ("handed to DeepSpeed (deepspeed= is set)" if delegates
                   else "the Trainer's AMP GradScaler")
            backend = (const(kw.get("half_precision_backend"))
                       if "half_precision_backend" in kw else None)
            if backend == "apex":
                how += ", apex backend"
            if value is True:
                self._add(Site("Trainer fp16", self.path, node.lineno, None,
                               f"{name}(fp16=True): {how}", "owner", "trainer",
                               delegates=delegates, precision="fp16"), node)
            elif value is MISSING:
                self._add(Site("Trainer fp16", self.path, node.lineno, None,
                               f"{name}(fp16={source_text(fp16, 50)}): "
                               f"decided at run time; {how}",
                               "owner", "trainer", delegates=delegates), node)
        bf16 = kw.get("bf16")
        if bf16 is not None and const(bf16) is True:
            self._add(Site("Trainer bf16", self.path, node.lineno, None,
                           f"{name}(bf16=True): mixed precision without loss scaling", "info", "",
                           delegates=delegates, precision="bf16"), node)
        literal_off = all(kw.get(k) is None or const(kw[k]) is False for k in ("fp16", "bf16"))
        if delegates and literal_off and not any(k.arg is None for k in node.keywords):
            # (no **kwargs that could carry fp16/bf16)
            self._add(trainer_fp32(self.path, node.lineno, None, name), node)

    def _accelerator(self, node: ast.Call, kw: dict[str, ast.expr]) -> None:
        delegates = "deepspeed_plugin" in kw
        if delegates:
            self.scan.consumes.add("deepspeed")
        mp = kw.get("mixed_precision")
        if mp is None:
            self.scan.consumes.add("accelerate")
            return
        site = accelerate_site(self._value(mp), self.path, node.lineno, None, delegates)
        if site is not None:
            site.detail = (f"Accelerator(mixed_precision={source_text(mp, 40)}): "
                           + site.detail.split(": ", 1)[-1])
            self._add(site, node)

    def _lightning(self, node: ast.Call, name: str, kw: dict[str, ast.expr]) -> None:
        strategy = kw.get("strategy")
        delegates = False
        if strategy is not None:
            value = const(strategy)
            named = isinstance(value, str) and "deepspeed" in value.lower()
            built = isinstance(strategy, ast.Call) and (self.qual(strategy.func) or "").endswith(
                "DeepSpeedStrategy"
            )
            delegates = named or built
        precision = kw.get("precision")
        if precision is None:
            return
        site = lightning_site(self._value(precision), self.path, node.lineno, None, delegates)
        if site is not None:
            site.detail = (f"{name}(precision={source_text(precision, 30)}): "
                           + site.detail.split(": ", 1)[-1])
            self._add(site, node)
            if site.framework:
                self.lightning.append(site)
