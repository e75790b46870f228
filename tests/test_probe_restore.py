"""The probe restores torch exactly on every exit path, and never changes the user's files."""

from __future__ import annotations

import hashlib

import pytest
import torch

from ampdoctor.core.errors import UserCodeError
from ampdoctor.probe import patches, recorder, wrappers
from ampdoctor.runner import run_diagnose
from ampdoctor.spec import load_spec
from conftest import CONFIGS, RECIPES


def _patched_now():
    """Every (target, name) the probe patches, with the object there right now."""
    patcher = patches.Patcher()
    wrappers.install(patcher)
    saved = [(target, name, old) for target, name, old in patcher.patched]
    patcher.undo()
    return saved


def _snapshot():
    return {(id(t), n): t.__dict__.get(n) if isinstance(t, type) else getattr(t, n)
            for t, n, _ in _patched_now()}


def _hooks():
    from torch.optim import optimizer as opt_module
    return dict(opt_module._global_optimizer_pre_hooks)


def _recipes_digest():
    h = hashlib.sha256()
    for path in sorted(RECIPES.rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts:
            h.update(path.read_bytes())
    return h.hexdigest()


@pytest.mark.parametrize("config,raises,verdict", [
    ("healthy_sgd", None, "healthy"),
    ("broken_clip_before_unscale", None, "failed"),
    ("broken_clip_with_total_norm_before_unscale", None, "failed"),
    ("broken_loop_error", None, "error"),
    ("bad/factory_raises", UserCodeError, None),
])
def test_torch_is_restored_after_diagnose(config, raises, verdict):
    before = _snapshot()
    hooks_before = _hooks()
    originals = (torch.Tensor.backward, torch.nn.utils.clip_grad_norm_,
                 torch.amp.GradScaler.step, torch.optim.Optimizer.zero_grad,
                 torch.autocast.__enter__, torch.nn.Module.__init__,
                 getattr(torch.nn.utils, "get_total_norm", None),
                 getattr(torch.nn.utils, "clip_grads_with_norm_", None))
    digest = _recipes_digest()
    spec = load_spec(CONFIGS / f"{config}.yaml")
    if raises:
        with pytest.raises(raises):
            run_diagnose(spec)
    else:
        record = run_diagnose(spec)
        assert record.verdict == verdict
    assert _snapshot() == before
    assert _hooks() == hooks_before
    assert (torch.Tensor.backward, torch.nn.utils.clip_grad_norm_, torch.amp.GradScaler.step,
            torch.optim.Optimizer.zero_grad, torch.autocast.__enter__,
            torch.nn.Module.__init__, getattr(torch.nn.utils, "get_total_norm", None),
            getattr(torch.nn.utils, "clip_grads_with_norm_", None)) == originals
    assert recorder.ACTIVE is None
    assert _recipes_digest() == digest


def test_every_clipping_path_is_patched_and_restored():
    """clip_grad_norm_, clip_grad_value_ and the two-step get_total_norm +
    clip_grads_with_norm_, where this torch has them, in torch.nn.utils and clip_grad alike."""
    from torch.nn.utils import clip_grad
    names = ("clip_grad_norm_", "clip_grad_value_", "get_total_norm", "clip_grads_with_norm_")
    present = [(module, name) for module in (torch.nn.utils, clip_grad) for name in names
               if hasattr(module, name)]
    before = {(id(module), name): getattr(module, name) for module, name in present}
    patched = {(id(t), n) for t, n, _ in _patched_now()}
    assert {(id(module), name) for module, name in present} <= patched
    if hasattr(torch.nn.utils, "clip_grads_with_norm_"):
        assert (id(torch.nn.utils), "get_total_norm") in patched
    assert {(id(module), name): getattr(module, name) for module, name in present} == before


def test_patcher_undo_twice_is_harmless():
    class Target:
        value = 1
    patcher = patches.Patcher()
    patcher.setattr(Target, "value", 2)
    patcher.setattr(Target, "added", 3)
    assert Target.value == 2 and Target.added == 3
    patcher.undo()
    patcher.undo()
    assert Target.value == 1 and not hasattr(Target, "added")


def test_user_modules_are_forgotten_between_runs():
    import sys
    run_diagnose(load_spec(CONFIGS / "healthy_sgd.yaml"))
    assert "healthy_sgd" not in sys.modules
    assert str(RECIPES) not in sys.path
