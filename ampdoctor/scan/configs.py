"""Configs read as data: DeepSpeed JSON, HF Trainer args, accelerate config, Lightning YAML.

Also the shell launchers (`accelerate launch --mixed_precision fp16 ...`, `deepspeed train.py
--deepspeed ds.json`), which only link files and, for accelerate, set the precision.

Nothing here imports DeepSpeed, transformers, accelerate or Lightning: their configs are text.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from typing import Any

import yaml

from ampdoctor.core import limits
from ampdoctor.scan.sites import FileScan, Site

_YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

#: Without one of these, a config cannot own or describe loss scaling (cheap pre-filter).
CONFIG_KEYWORDS = re.compile(
    rb"fp16|bf16|bfloat16|precision|loss_scale|deepspeed|initial_scale_power|[\"']amp[\"']|\bamp:"
)
#: A string that names a file the scan may know.
PATH_LIKE = re.compile(r"^[^\n\r\"'<>|*?]{1,255}\.(?:json|ya?ml|py|sh|bash)$")

MISSING = object()


class NonLiteral:
    """A value the scan cannot know without running the code (`args.fp16`)."""

    def __init__(self, source: str) -> None:
        self.source = source

    def __repr__(self) -> str:
        return self.source


Locate = Callable[[tuple[str, ...]], "int | None"]

_DS_KEYS = {
    "zero_optimization",
    "train_micro_batch_size_per_gpu",
    "train_batch_size",
    "gradient_clipping",
    "zero_allow_untested_optimizer",
    "steps_per_print",
    "wall_clock_breakdown",
    "fp16",
    "bf16",
    "bfloat16",
    "amp",
}
_HF_KEYS = {
    "output_dir",
    "overwrite_output_dir",
    "per_device_train_batch_size",
    "per_device_eval_batch_size",
    "evaluation_strategy",
    "eval_strategy",
    "save_strategy",
    "logging_strategy",
    "logging_steps",
    "half_precision_backend",
    "fp16_opt_level",
    "report_to",
    "num_train_epochs",
    "deepspeed",
}
_ACCELERATE_KEYS = {
    "compute_environment",
    "distributed_type",
    "num_processes",
    "num_machines",
    "machine_rank",
    "main_training_function",
    "use_cpu",
    "downcast_bf16",
}
_LIGHTNING_FP16 = {"16", "16-mixed", "16_mixed"}
_LIGHTNING_BF16 = {"bf16", "bf16-mixed", "bf16-true", "bf16_mixed"}


def _truthy(value: Any) -> bool:
    return value is True or (isinstance(value, str) and value.strip().lower() == "true")


def _is_auto(value: Any) -> bool:
    return isinstance(value, str) and value.strip().lower() == "auto"


def _is_false(value: Any) -> bool:
    return value is False or (isinstance(value, str) and value.strip().lower() == "false")


def _switched_off(section: str, file: str, line: int | None, key_path: str,
                  unset: bool = False) -> Site:
    """A DeepSpeed fp16/bf16 section that is off (`enabled: false`, or no `enabled` at all):
    not shown, only compared with a Trainer that hands this config over."""
    how = "section without `enabled` (DeepSpeed leaves it off)" if unset else "enabled: false"
    return Site(f"DeepSpeed {section} (off)", file, line, key_path, f"{section} {how}",
                "precision", "", precision=f"{section}:{'unset' if unset else 'off'}")


def _key(prefix: tuple[str, ...], *keys: str) -> tuple[str, ...]:
    return prefix + keys


def _dotted(path: tuple[str, ...]) -> str:
    return ".".join(path)


#: How a DeepSpeed bf16 section left to the launcher ("auto") is described.
BF16_AUTO = "bf16 auto"


def _bf16_sites(data: dict, file: str, locate: Locate, prefix: tuple[str, ...]) -> list[Site]:
    """The bf16 section of a DeepSpeed config (either spelling): information, and its state."""
    sites: list[Site] = []
    for name in ("bf16", "bfloat16"):
        section = data.get(name, MISSING)
        if isinstance(section, dict):
            enabled = section.get("enabled", MISSING)
            key = _key(prefix, name, "enabled")
            # (transformers compares and fills in only the `bf16` spelling)
            state = "" if name != "bf16" else (
                "bf16:auto" if _is_auto(enabled) else "bf16:on" if _truthy(enabled) else "")
            if _truthy(enabled) or _is_auto(enabled) or isinstance(enabled, NonLiteral):
                sites.append(
                    Site("DeepSpeed bf16", file, locate(key), _dotted(key),
                         f"{BF16_AUTO if _is_auto(enabled) else 'bf16 on'}: "
                         "mixed precision without loss scaling",
                         "info", "", precision=state)
                )
            elif name == "bf16" and enabled is MISSING:
                sites.append(_switched_off("bf16", file, locate(_key(prefix, name)),
                                           _dotted(_key(prefix, name)), unset=True))
            elif name == "bf16" and _is_false(enabled):
                sites.append(_switched_off("bf16", file, locate(key), _dotted(key)))
    return sites


def deepspeed_sites(
    data: dict, file: str, locate: Locate, prefix: tuple[str, ...] = ()
) -> list[Site]:
    """The loss-scale sites of one DeepSpeed config (a mapping)."""
    sites: list[Site] = []
    fp16 = data.get("fp16", MISSING)
    if isinstance(fp16, dict):
        enabled = fp16.get("enabled", MISSING)
        notes = []
        loss_scale = fp16.get("loss_scale", MISSING)
        if isinstance(loss_scale, (int, float)) and not isinstance(loss_scale, bool):
            notes.append("dynamic loss scale" if loss_scale == 0
                         else f"static loss scale {loss_scale:g}")
        elif loss_scale is not MISSING:
            notes.append(f"loss_scale={loss_scale!r}")
        power = fp16.get("initial_scale_power", MISSING)
        if power is not MISSING:
            notes.append(f"initial_scale_power={power!r}")
        extra = ("; " + ", ".join(notes)) if notes else ""
        key = _key(prefix, "fp16", "enabled")
        if _truthy(enabled):
            sites.append(
                Site("DeepSpeed fp16", file, locate(key), _dotted(key),
                     "DeepSpeed's fp16 loss scaler is on" + extra, "owner", "deepspeed",
                     precision="fp16:on")
            )
        elif isinstance(enabled, NonLiteral):
            sites.append(
                Site("DeepSpeed fp16", file, locate(key), _dotted(key),
                     f"enabled={enabled.source} (decided at run time)" + extra, "owner",
                     "deepspeed")
            )
        elif _is_auto(enabled):
            sites.append(
                Site("DeepSpeed fp16 (auto)", file, locate(key), _dotted(key),
                     '"auto": the Trainer/accelerate launcher decides; '
                     "an owner only where the same entry point enables fp16" + extra, "possible",
                     "deepspeed", precision="fp16:auto")
            )
        elif enabled is MISSING:
            key = _key(prefix, "fp16")
            sites.append(
                Site("DeepSpeed fp16 (off)", file, locate(key), _dotted(key),
                     "fp16 section without `enabled`: DeepSpeed leaves fp16 off", "info", "",
                     precision="fp16:unset")
            )
        elif _is_false(enabled):
            sites.append(_switched_off("fp16", file, locate(key), _dotted(key)))
    sites += _bf16_sites(data, file, locate, prefix)
    amp = data.get("amp", MISSING)
    if isinstance(amp, dict) and (
        _truthy(amp.get("enabled")) or isinstance(amp.get("enabled"), NonLiteral)
    ):
        key = _key(prefix, "amp", "enabled")
        level = amp.get("opt_level", "O1")
        sites.append(
            Site("DeepSpeed amp", file, locate(key), _dotted(key),
                 f"apex AMP inside DeepSpeed (opt_level {level}) scales the loss", "owner",
                 "deepspeed")
        )
    return sites


def looks_deepspeed(data: dict) -> bool:
    if any(isinstance(data.get(k), dict) for k in ("fp16", "bf16", "bfloat16", "amp")):
        return True
    return len(_DS_KEYS.intersection(data)) >= 2 and "zero_optimization" in data


def looks_hf_args(data: dict) -> bool:
    has_flag = any(k in data and not isinstance(data[k], dict) for k in ("fp16", "bf16"))
    return has_flag and bool(_HF_KEYS.intersection(data))


def looks_accelerate(data: dict) -> bool:
    return "mixed_precision" in data and bool(_ACCELERATE_KEYS.intersection(data))


def analyze_mapping(data: dict, file: str, locate: Locate, scan: FileScan) -> None:
    """Add the sites of one config mapping to `scan` (types, delegation, consumers)."""
    if looks_deepspeed(data):
        scan.config_types.add("deepspeed")
        scan.sites.extend(deepspeed_sites(data, file, locate))
    elif looks_hf_args(data):
        scan.config_types.add("hfargs")
        ds = data.get("deepspeed", MISSING)
        delegates = ds is not MISSING and ds not in (None, "", False)
        fp16 = data.get("fp16", MISSING)
        if _truthy(fp16) or isinstance(fp16, NonLiteral):
            detail = "TrainingArguments fp16: the Trainer's AMP GradScaler"
            if delegates:
                detail = "TrainingArguments fp16 handed to DeepSpeed (`deepspeed` is set)"
            sites = Site("Trainer fp16", file, locate(("fp16",)), "fp16", detail, "owner",
                         "trainer", delegates=delegates,
                         precision="fp16" if _truthy(fp16) else "")
            scan.sites.append(sites)
        if _truthy(data.get("bf16")):
            scan.sites.append(
                Site("Trainer bf16", file, locate(("bf16",)), "bf16",
                     "TrainingArguments bf16: mixed precision without loss scaling", "info", "",
                     delegates=delegates, precision="bf16")
            )
        flags = [data.get("fp16", False), data.get("bf16", False)]
        if delegates and all(v is False for v in flags):
            scan.sites.append(trainer_fp32(file, locate(("deepspeed",)), "deepspeed",
                                           "TrainingArguments"))
        if isinstance(ds, dict):
            scan.config_types.add("deepspeed")
            scan.sites.extend(deepspeed_sites(ds, file, locate, ("deepspeed",)))
    if looks_accelerate(data):
        scan.config_types.add("accelerate")
        mp = data.get("mixed_precision")
        delegates = str(data.get("distributed_type", "")).upper() == "DEEPSPEED"
        site = accelerate_site(mp, file, locate(("mixed_precision",)), "mixed_precision", delegates)
        if site is not None:
            scan.sites.append(site)
    trainer, trainer_key = _lightning_trainer(data)
    if trainer is not None and "precision" in trainer:
        scan.config_types.add("lightning")
        strategy = trainer.get("strategy")
        delegates = isinstance(strategy, str) and "deepspeed" in strategy.lower()
        key = trainer_key + ("precision",)
        site = lightning_site(trainer["precision"], file, locate(key), _dotted(key), delegates)
        if site is not None:
            scan.sites.append(site)
    for text in _strings(data):
        if PATH_LIKE.match(text):
            scan.refs.append((text, True))


def trainer_fp32(file: str, line: int | None, key_path: str | None, name: str) -> Site:
    """A Trainer that hands DeepSpeed a config and asks for neither fp16 nor bf16 (literally):
    not shown, only compared with that config's precision sections."""
    return Site("Trainer fp32", file, line, key_path,
                f"{name} without fp16/bf16, handing DeepSpeed a config", "precision",
                "trainer", delegates=True, precision="fp32")


def accelerate_site(value: Any, file: str, line: int | None, key_path: str | None,
                    delegates: bool) -> Site | None:
    how = ("handed to DeepSpeed (distributed_type DEEPSPEED)" if delegates
           else "accelerate's GradScaler")
    if isinstance(value, NonLiteral):
        return Site("accelerate fp16", file, line, key_path,
                    f"mixed_precision={value.source} (decided at run time; fp16 means {how})",
                    "owner", "accelerate", delegates=delegates)
    text = str(value).strip().lower() if value is not None else ""
    if text == "fp16":
        return Site("accelerate fp16", file, line, key_path, f"mixed_precision fp16: {how}",
                    "owner", "accelerate", delegates=delegates)
    if text in ("bf16", "fp8"):
        return Site(f"accelerate {text}", file, line, key_path,
                    f"mixed_precision {text}: no loss scaling", "info", "")
    return None


def lightning_site(value: Any, file: str, line: int | None, key_path: str | None,
                   delegates: bool) -> Site | None:
    how = "handed to DeepSpeed (strategy deepspeed)" if delegates else "Lightning's GradScaler"
    if isinstance(value, NonLiteral):
        return Site("Lightning 16-mixed", file, line, key_path,
                    f"precision={value.source} (decided at run time; 16-mixed means {how})",
                    "owner", "lightning", delegates=delegates)
    text = str(value).strip().lower()
    if text in _LIGHTNING_FP16:
        return Site("Lightning 16-mixed", file, line, key_path, f"precision {value!r}: {how}",
                    "owner", "lightning", delegates=delegates)
    if text in _LIGHTNING_BF16:
        return Site("Lightning bf16", file, line, key_path,
                    f"precision {value!r}: no loss scaling", "info", "")
    if text in ("16-true", "16_true"):
        return Site("Lightning 16-true", file, line, key_path,
                    "precision '16-true': pure fp16 weights, no loss scaling", "info", "")
    return None


def _lightning_trainer(data: dict) -> tuple[dict | None, tuple[str, ...]]:
    trainer = data.get("trainer")
    if isinstance(trainer, dict):
        return trainer, ("trainer",)
    for sub in ("fit", "validate", "test", "predict"):
        section = data.get(sub)
        if isinstance(section, dict) and isinstance(section.get("trainer"), dict):
            return section["trainer"], (sub, "trainer")
    return None, ()


def _strings(data: Any, depth: int = 0) -> Iterator[str]:
    if depth > 12:
        return
    if isinstance(data, str):
        yield data
    elif isinstance(data, dict):
        for value in data.values():
            yield from _strings(value, depth + 1)
    elif isinstance(data, (list, tuple)):
        for value in data[:200]:
            yield from _strings(value, depth + 1)


def text_locator(text: str) -> Locate:
    """Find the line of a key path in JSON or YAML text: each key searched after the previous."""

    def locate(path: tuple[str, ...]) -> int | None:
        pos = 0
        start = None
        for key in path:
            pattern = re.compile(r"(?<![\w.-])([\"']?)" + re.escape(key) + r"\1\s*:")
            match = pattern.search(text, pos)
            if match is None:
                break
            start = match.start()
            pos = match.end()
        if start is None:
            return None
        return text.count("\n", 0, start) + 1

    return locate


def scan_config(path: str, data: bytes, scan: FileScan) -> None:
    """Parse one JSON/YAML file and add what it says to `scan` (or mark it skipped)."""
    if not CONFIG_KEYWORDS.search(data):
        return
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError:
        scan.skipped = "not UTF-8 text"
        return
    docs: list[Any]
    if path.endswith(".json"):
        try:
            docs = [json.loads(text)]
        except ValueError as exc:
            scan.skipped = f"does not parse as JSON: {exc}"
            return
    else:
        try:
            docs = list(yaml.load_all(text, Loader=_YAML_LOADER))
        except yaml.YAMLError as exc:
            reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            scan.skipped = f"does not parse as YAML: {reason}"
            return
    if limits.exceeds(docs):
        scan.skipped = (f"expands to more than {limits.MAX_VALUES:,} values (YAML aliases "
                        "nested in aliases?), not read")
        return
    if any(_ampdoctor_output(doc) for doc in docs):
        return
    locate = text_locator(text)
    for doc in docs:
        if isinstance(doc, dict):
            analyze_mapping(doc, path, locate, scan)


def _ampdoctor_output(doc: Any) -> bool:
    """ampdoctor's own run records, scan reports and SARIF logs: they quote every owner's file,
    and reading them as configs would link unrelated scripts into one training path."""
    if not isinstance(doc, dict):
        return False
    if "ampdoctor_version" in doc:
        return True
    runs = doc.get("runs")
    if isinstance(runs, list) and runs and isinstance(runs[0], dict):
        driver = runs[0].get("tool", {}).get("driver", {}) if isinstance(
            runs[0].get("tool"), dict) else {}
        return isinstance(driver, dict) and driver.get("name") == "ampdoctor"
    return False


_SHELL_PATH = re.compile(r"[^\s\"'=]+\.(?:json|ya?ml|py|sh|bash)(?![\w.])")
_ACCELERATE_MP = re.compile(r"--mixed[_-]precision(?:=|\s+)[\"']?([\w-]+)")


def scan_shell(path: str, data: bytes, scan: FileScan) -> None:
    """A launcher script: the files it names, and `accelerate launch --mixed_precision`."""
    try:
        text = data.decode("utf-8", errors="replace")
    except Exception:  # noqa: BLE001  # pragma: no cover - errors="replace" cannot fail
        return
    launches_accelerate = "accelerate" in text
    for lineno, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("#"):
            continue
        code = line
        for token in _SHELL_PATH.findall(code):
            scan.refs.append((token, False))
        if launches_accelerate:
            match = _ACCELERATE_MP.search(code)
            if match:
                site = accelerate_site(match.group(1), path, lineno, None, False)
                if site is not None:
                    site.detail = f"accelerate launch --mixed_precision {match.group(1)}" + (
                        ": accelerate's GradScaler" if site.role == "owner" else ": no loss scaling"
                    )
                    scan.sites.append(site)
