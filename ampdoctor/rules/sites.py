"""Where in the user's code a mistake stands when no probe event marks it: a hand-written
gradient division or clip between the backward and the step, a second division by the scale."""

from __future__ import annotations

import linecache
import re

from ..probe.callsite import Site
from ..probe.events import Backward, Event, GetScale, Scale, Unscale, of_type


def grad_division_between(first: Site | None, last: Site | None) -> Site | None:
    """A hand-written `p.grad.div_(K)` / `p.grad /= K` between the backward and the step."""
    return line_between(first, last, GRAD_DIVISION)


def line_between(first: Site | None, last: Site | None, pattern: re.Pattern) -> Site | None:
    """The first line strictly between two call sites of one file whose code matches."""
    if first is None or last is None or first.file != last.file or last.line <= first.line:
        return None
    for line in range(first.line + 1, last.line):
        code = linecache.getline(first.file, line).split("#", 1)[0]
        if pattern.search(code):
            return Site(first.file, line, first.function)
    return None


#: A line that measures or clips gradient norms (a hand-written clip).
NORM_OR_CLIP = re.compile(r"norm|clip", re.I)


def unscaled_backward(events: list[Event]) -> tuple[Backward, Scale] | None:
    """A window whose loss was scaled (`scaler.scale(loss)` ran, enabled) while every backward
    ran on a tensor that was not its result: the first such backward and the unused scale.
    unscale_ then divides gradients that were never multiplied by the scale."""
    scales = [e for e in of_type(events, Scale) if e.enabled]
    backwards = list(of_type(events, Backward))
    if not scales or not backwards or any(b.scaled_by for b in backwards):
        return None
    return backwards[0], scales[0]


def second_unscale_site(events: list[Event]) -> Site | None:
    """Where gradients were divided by the scale a second time: a `get_scale()` read after
    unscale_ (a hand-written division), else the unscale_ call itself."""
    unscales = [e for e in of_type(events, Unscale) if e.enabled]
    if not unscales:
        return None
    after = [e for e in of_type(events, GetScale) if e.seq > unscales[0].seq]
    if not after:
        return unscales[-1].site
    site = after[0].site
    # The read of the scale is often a line above the division itself (inv = 1 / get_scale();
    # p.grad.mul_(inv)): point at the division when it follows within a few lines.
    if site is not None:
        for line in range(site.line, site.line + 12):
            code = linecache.getline(site.file, line).split("#", 1)[0]
            if GRAD_DIVISION.search(code):
                return Site(site.file, line, site.function)
    return site


GRAD_DIVISION = re.compile(r"\.grad\b.*(\b(div_|mul_|mul|div)\(|/=|\*=)|"
                            r"\b(div_|mul_)\(.*scale")
