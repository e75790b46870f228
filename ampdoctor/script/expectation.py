"""In a script's runs, random draws inside the model's forward take their expected values.

A script's reference is the same script run with another command line (K = 1, a K-times
batch): its forward draws for K x b rows at once where the run draws for b rows K times.
Dropout is switched off (p = 0) in every run. The forward's other draws (stochastic depth's
`bernoulli_`, a random mask from `torch.rand`, noise from `randn`) come out of the generator in
another order in the reference as soon as one forward makes two of them, so the same rows would
see other masks there than in the run: a mismatch that is the randomness's, not the loop's.

While the model's forward runs with gradients on, each such draw returns its expected value
instead, without touching the generator: a keep-mask of probability p is p everywhere (the
stochastic depth of timm and torchvision then passes its input through unchanged, as in
`eval()`), a uniform draw is its midpoint, a normal draw its mean, a permutation the identity.
The forward becomes a function of its rows alone, the same in every run and in the reference;
the accumulation and scaling ampdoctor judges happen outside it. Draws outside the forward are
left alone (where the runs disagree, their call site is named), and so are draws without an
expected value of the same kind (`randint`, `multinomial`, `random_`).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

import torch

from ..probe import patches
from ..probe.callsite import CallSiteFinder

#: the most call sites of replaced draws an outcome names
MAX_SITES = 5


class Expectation:
    """The depth of the model's forwards in this run and the draws replaced in them."""

    def __init__(self, finder: CallSiteFinder):
        self.finder = finder
        self.depth = 0
        self.hooked: set[int] = set()
        #: "file:line name" of the draws replaced, first seen first (at most MAX_SITES)
        self.sites: list[str] = []
        self._seen: set[tuple[str, int, str]] = set()
        self.count = 0

    def track(self, model: torch.nn.Module) -> None:
        """Count `model`'s forwards (nested ones too; an exception in the forward ends it)."""
        if id(model) in self.hooked:
            return
        self.hooked.add(id(model))
        model.register_forward_pre_hook(self._enter)
        model.register_forward_hook(self._leave, always_call=True)

    def _enter(self, module: Any, args: Any) -> None:
        self.depth += 1

    def _leave(self, module: Any, args: Any, output: Any) -> None:
        self.depth = max(0, self.depth - 1)

    def active(self) -> bool:
        return self.depth > 0 and torch.is_grad_enabled()

    def replaced(self, name: str, frame: Any) -> None:
        self.count += 1
        key = (frame.f_code.co_filename, frame.f_lineno, name)
        if len(self.sites) < MAX_SITES and key not in self._seen:
            self._seen.add(key)     # (the call-site walk once per calling line: a forward
            site = self.finder.from_frame(frame)    # makes a draw per block, every step)
            where = f"{site.file.rsplit('/', 1)[-1]}:{site.line} " if site is not None else ""
            text = f"{where}{name}"
            if text not in self.sites:
                self.sites.append(text)


def _creation(kwargs: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """A random factory's keyword arguments as `torch.empty`'s (the generator dropped) and
    whether the result requires grad (set after the fill)."""
    kwargs = dict(kwargs)
    kwargs.pop("generator", None)
    return kwargs, bool(kwargs.pop("requires_grad", False))


def _done(tensor: torch.Tensor, requires_grad: bool) -> torch.Tensor:
    return tensor.requires_grad_() if requires_grad else tensor


def _factory(value: float) -> Callable[..., torch.Tensor]:
    """`torch.rand(*size, ...)` / `randn`: a tensor of that size filled with `value`."""
    def make(*size: Any, **kwargs: Any) -> torch.Tensor:
        kwargs, grad = _creation(kwargs)
        return _done(torch.empty(*size, **kwargs).fill_(value), grad)
    return make


def _like(value: float) -> Callable[..., torch.Tensor]:
    """`torch.rand_like(input, ...)` / `randn_like`."""
    def make(input: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        kwargs, grad = _creation(kwargs)
        return _done(torch.empty_like(input, **kwargs).fill_(value), grad)
    return make


def _bernoulli(input: torch.Tensor, p: Any = None, **kwargs: Any) -> torch.Tensor:
    """`torch.bernoulli(probs)` is `probs` in expectation; `torch.bernoulli(input, p)` is p."""
    if kwargs.get("out") is not None:
        raise TypeError("out=")      # the original handles it
    if p is None:
        return input.detach().clone()
    return torch.empty_like(input).fill_(float(p))


def _mask_value(tensor: torch.Tensor, p: float) -> float:
    """The expected value of a Bernoulli(p) fill, in the tensor's dtype: an integer or bool
    mask cannot hold p, so it keeps (1) when p >= 0.5 and drops (0) otherwise."""
    if tensor.is_floating_point() or tensor.is_complex():
        return p
    return 1.0 if p >= 0.5 else 0.0


def _bernoulli_(self: torch.Tensor, p: Any = 0.5, **kwargs: Any) -> torch.Tensor:
    if isinstance(p, torch.Tensor):
        if not self.is_floating_point():
            raise TypeError("a tensor of probabilities into a non-float mask")
        with torch.no_grad():
            return self.copy_(p.expand_as(self))
    with torch.no_grad():
        return self.fill_(_mask_value(self, float(p)))


def _uniform_(self: torch.Tensor, from_: float = 0.0, to: float = 1.0,
              **kwargs: Any) -> torch.Tensor:
    with torch.no_grad():
        return self.fill_((float(kwargs.pop("from", from_)) + float(to)) / 2)


def _normal_(self: torch.Tensor, mean: float = 0.0, std: float = 1.0,
             **kwargs: Any) -> torch.Tensor:
    with torch.no_grad():
        return self.fill_(float(mean))


def _randperm(n: int, **kwargs: Any) -> torch.Tensor:
    kwargs, grad = _creation(kwargs)
    kwargs.setdefault("dtype", torch.int64)
    kwargs.pop("layout", None)
    kwargs.pop("pin_memory", None)
    return _done(torch.arange(int(n), **kwargs), grad)


#: (owner, name, the expected-value version)
_REPLACED: tuple[tuple[Any, str, Any], ...] = (
    (torch, "rand", _factory(0.5)),
    (torch, "randn", _factory(0.0)),
    (torch, "rand_like", _like(0.5)),
    (torch, "randn_like", _like(0.0)),
    (torch, "bernoulli", _bernoulli),
    (torch, "randperm", _randperm),
    (torch.Tensor, "bernoulli_", _bernoulli_),
    (torch.Tensor, "uniform_", _uniform_),
    (torch.Tensor, "normal_", _normal_),
)


def _wrap(state: Expectation, name: str, original: Any, expected: Any) -> Any:
    @functools.wraps(original)
    def draw(*args: Any, **kwargs: Any) -> Any:
        if state.active():
            try:
                result = expected(*args, **kwargs)
            except (TypeError, ValueError, RuntimeError):
                return original(*args, **kwargs)   # a form the expectation does not take
            state.replaced(name, sys._getframe(1))
            return result
        return original(*args, **kwargs)
    return draw


def install(state: Expectation, patcher: patches.Patcher) -> None:
    """The expected-value draws of the module docstring, over whatever is patched already."""
    for owner, name, expected in _REPLACED:
        original = getattr(owner, name, None)
        if original is not None:
            patcher.setattr(owner, name, _wrap(state, name, original, expected))
