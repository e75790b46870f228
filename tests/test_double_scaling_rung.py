"""The `double-scaling` rung's judgement of a diagnosed loop's own GradScalers (no run here:
the scan reads the real recipes, and what a run saw is given as the probe's events)."""

from __future__ import annotations

from ampdoctor.ladder.double_scaling import evaluate
from ampdoctor.probe.callsite import Site
from ampdoctor.probe.events import Scale, ScalerInit, ScalerStep, ZeroGrad
from ampdoctor.rules.scaler_ownership import ownership
from conftest import RECIPES

SIBLINGS = RECIPES / "broken_two_scalers_sibling_loops.py"
GAN = RECIPES / "healthy_gan_two_scalers.py"


def _scaler_lines(path):
    return [i for i, text in enumerate(path.read_text().splitlines(), 1)
            if "torch.amp.GradScaler(" in text]


def _run(path, lines, scaled_into, stepped):
    """Events of one window: scaler i (built at lines[i]) scales a loss into optimizer
    scaled_into[i] (parameter id 100 + slot), then steps optimizer stepped[i] (None: never)."""
    events = []

    def add(cls, **fields):
        events.append(cls(seq=len(events), microbatch=0, backwards=0,
                          site=fields.pop("site", None), **fields))

    for slot, line in enumerate(lines):
        add(ScalerInit, scaler=slot, enabled=True, site=Site(str(path), line, "train_loop"))
    for slot, opt in enumerate(scaled_into):
        add(Scale, scaler=slot, scale=2.0 ** 16, enabled=True, reaches=(100 + opt,))
    for slot, opt in enumerate(stepped):
        if opt is not None:
            add(ScalerStep, scaler=slot, optimizer=opt, scale=2.0 ** 16, enabled=True)
    for opt in set(scaled_into):
        add(ZeroGrad, optimizer=opt, owner="optimizer")
    return ownership(events, {100: 0, 101: 1})


def _evaluate(path, built, seen):
    return evaluate([path], None, [str(path)], {(str(path), line) for line in built}, seen)


def test_sibling_loops_scalers_are_left_out_of_the_count_message_and_location():
    pretrain, main, aux, finetune = _scaler_lines(SIBLINGS)
    result = _evaluate(SIBLINGS, [main, aux], _run(SIBLINGS, [main, aux], [0, 0], [0, None]))
    [finding] = result.findings
    assert finding.severity == "error"
    assert finding.location.line == main
    assert finding.evidence["measured"] == 2
    assert sorted(o["line"] for o in finding.evidence["owners"]) == [main, aux]
    for line in (pretrain, finetune):
        assert f":{line}" not in finding.message
    assert (f"optimizer 0's gradients held a loss scaled by GradScaler at "
            f"broken_two_scalers_sibling_loops.py:{aux}") in finding.message
    assert sorted(d["line"] for d in result.details["dormant_owners"]) == [pretrain, finetune]
    counted, _, not_counted = result.summary.partition("not counted")
    assert f":{pretrain}" not in counted and f":{pretrain}" in not_counted


def test_two_scalers_on_their_own_losses_and_optimizers_pass():
    g_line, d_line = _scaler_lines(GAN)
    result = _evaluate(GAN, [g_line, d_line], _run(GAN, [g_line, d_line], [0, 1], [0, 1]))
    assert result.findings == [] and result.status == "pass"
    assert result.summary.startswith("2 loss-scale owners on this loop's path")
    assert "separate state machines, not a double scaling" in result.summary


def test_two_scalers_stepping_one_optimizer_are_an_error():
    g_line, d_line = _scaler_lines(GAN)
    result = _evaluate(GAN, [g_line, d_line], _run(GAN, [g_line, d_line], [0, 1], [0, 0]))
    [finding] = result.findings
    assert finding.severity == "error" and finding.location.line == g_line
    assert "optimizer 0 was unscaled or stepped by" in finding.message


def test_without_a_run_that_had_them_enabled_two_scalers_are_a_warning():
    g_line, d_line = _scaler_lines(GAN)
    result = _evaluate(GAN, [g_line, d_line], None)
    [finding] = result.findings
    assert finding.severity == "warning" and result.status == "warn"
    assert "No run of this loop had a GradScaler enabled" in finding.message


def test_a_scaler_that_stepped_nothing_beside_one_that_did_is_a_warning():
    g_line, d_line = _scaler_lines(GAN)
    result = _evaluate(GAN, [g_line, d_line], _run(GAN, [g_line, d_line], [0], [0, None]))
    [finding] = result.findings
    assert finding.severity == "warning"
    assert "could not tell" in finding.message


def test_a_loop_that_builds_no_scaler_names_none_as_its_owner():
    """bf16: the module's other loop builds a GradScaler; this loop's runs built none."""
    result = evaluate([SIBLINGS], None, [str(SIBLINGS)], set(), None)
    assert result.findings == []
    assert result.summary.startswith("no loss-scale owner on this loop's path"), result.summary
    assert len(result.details["dormant_owners"]) == len(_scaler_lines(SIBLINGS))
