"""What `ampdoctor init` proposes for the spec's `loss` from a script's syntax tree (never
run): the loss the model's forward returns (`_, loss = model(x, y)`, `model(**batch).loss`), or
the known criterion the loop calls (`nn.CrossEntropyLoss()`, `F.mse_loss`, ...), written as the
`(model, micro_batch) -> loss` function the spec's `loss` names. Without a `loss` the reference
is the loop itself re-run at K = 1: it states no intended weighting. No torch here.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

#: torch.nn criterion classes and the torch.nn.functional function each one calls
CRITERIA = {"CrossEntropyLoss": "cross_entropy", "MSELoss": "mse_loss", "L1Loss": "l1_loss",
            "NLLLoss": "nll_loss", "BCEWithLogitsLoss": "binary_cross_entropy_with_logits",
            "BCELoss": "binary_cross_entropy", "SmoothL1Loss": "smooth_l1_loss",
            "HuberLoss": "huber_loss", "KLDivLoss": "kl_div"}
FUNCTIONAL = set(CRITERIA.values())
#: the name of the function init proposes
NAME = "triage_loss"


@dataclass(frozen=True)
class LossProposal:
    """A `loss` function to add to the user's file, and what in the file it comes from."""

    source: str          # "nn.CrossEntropyLoss at line 41", "the model's forward returns ..."
    code: str            # the function's text


def _callee(call: ast.Call) -> str | None:
    return getattr(call.func, "attr", None) or getattr(call.func, "id", None)


def _is_model_call(node: ast.AST | None) -> bool:
    return isinstance(node, ast.Call) and _callee(node) == "model"


def _model_call_text(call: ast.Call) -> tuple[str, str]:
    """How the proposal unpacks the micro-batch and calls the model as the loop does: by
    keyword splat (`model(**batch)`), else x then y in the places the loop passes them."""
    if any(k.arg is None for k in call.keywords):
        return "", "model(**micro_batch)"
    names = ["x", "y"]
    places = len(call.args) + len(call.keywords)
    shown = [names[min(i, 1)] for i in range(len(call.args))]
    shown += [f"{k.arg}={names[min(len(call.args) + i, 1)]}" for i, k in enumerate(call.keywords)]
    unpack = "    x, y = micro_batch\n" if places >= 2 else "    x, _ = micro_batch\n"
    return unpack, f"model({', '.join(shown)})"


def _header(source: str) -> str:
    return (f"def {NAME}(model, micro_batch):\n"
            f"    # one micro-batch's loss, not divided by K ({source})\n")


def from_model(tree: ast.AST) -> LossProposal | None:
    """`loss = model(...)`, `_, loss = model(...)`, `model(...).loss` or `out.loss` of
    `out = model(...)`: the model's forward returns the loss."""
    calls: dict[str, ast.Call] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and _is_model_call(node.value):
            assert isinstance(node.value, ast.Call)
            target = node.targets[0]
            if isinstance(target, ast.Name):
                calls[target.id] = node.value
                if "loss" in target.id.lower():
                    return _proposal(node.value, "", node.lineno)
            if isinstance(target, ast.Tuple):
                for index, element in enumerate(target.elts):
                    if isinstance(element, ast.Name) and "loss" in element.id.lower():
                        return _proposal(node.value, f"[{index}]", node.lineno)
        if isinstance(node, ast.Attribute) and node.attr == "loss":
            value = node.value
            if _is_model_call(value):
                assert isinstance(value, ast.Call)
                return _proposal(value, ".loss", node.lineno)
            if isinstance(value, ast.Name) and value.id in calls:
                return _proposal(calls[value.id], ".loss", node.lineno)
    return None


def _proposal(call: ast.Call, pick: str, line: int) -> LossProposal:
    unpack, model_call = _model_call_text(call)
    source = f"the model's forward returns the loss, line {line}"
    return LossProposal(source, _header(source) + unpack + f"    return {model_call}{pick}\n")


def from_criterion(tree: ast.AST) -> LossProposal | None:
    """The first known criterion the file builds or calls, with its keyword arguments (but
    `reduction`: the proposal is the micro-batch's mean, the weighting a loop divides by K)."""
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = _callee(node)
        function = CRITERIA.get(name or "") or (name if name in FUNCTIONAL else None)
        if function is None:
            continue
        keywords = [f"{k.arg}={ast.unparse(k.value)}" for k in node.keywords
                    if k.arg not in (None, "reduction", "input", "target")]
        source = f"{'nn.' + name if name in CRITERIA else 'F.' + function}, line {node.lineno}"
        code = (_header(source) + "    import torch.nn.functional as F\n\n"
                "    x, y = micro_batch\n"
                f"    return F.{function}({', '.join(['model(x)', 'y'] + keywords)})\n")
        return LossProposal(source, code)
    return None


def propose(tree: ast.AST) -> LossProposal | None:
    """The model's own loss first (it is what the loop backpropagates), else a criterion."""
    return from_model(tree) or from_criterion(tree)
