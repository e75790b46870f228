"""The pytest plugin as a project uses it in its own CI: a pytester project with a healthy loop
and a broken one, checked through the `ampdoctor` fixture and `ampdoctor.assert_healthy`."""

from __future__ import annotations

import textwrap

import pytest

from user_code import FACTORIES, loop

pytest_plugins = ["pytester"]

LOOPS = (FACTORIES + loop("good_loop", clip=True)
         + loop("clip_first_loop", clip=True, unscale=False, marker="# BUG"))

SPEC = textwrap.dedent('''\
    model: loops:make_model
    data: loops:make_data
    train_loop: loops:{loop}
    accumulation_steps: 4
    micro_batch_size: 8
    max_grad_norm: 0.01
    optimizer: {{name: SGD, lr: 0.05}}
    device: cpu
    ''')

TESTS = textwrap.dedent('''\
    import ampdoctor
    from loops import make_model, make_data, clip_first_loop


    def test_good_loop_from_yaml(ampdoctor):
        record = ampdoctor.assert_healthy("good.yaml")
        assert record.verdict == "healthy"


    def test_clip_first_loop_from_yaml(ampdoctor):
        ampdoctor.assert_healthy("clip_first.yaml")


    def test_clip_first_loop_built_in_code():
        import ampdoctor as api
        spec = api.Spec(model=make_model, data=make_data, train_loop=clip_first_loop,
                        accumulation_steps=4, micro_batch_size=8, max_grad_norm=0.01,
                        optimizer={"name": "SGD", "lr": 0.05}, device="cpu")
        api.assert_healthy(spec, rungs=["fp32-accum", "fp16-scaler", "clip-space"])
    ''')


@pytest.fixture
def project(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makepyfile(loops=LOOPS, test_training=TESTS)
    (pytester.path / "good.yaml").write_text(SPEC.format(loop="good_loop"))
    (pytester.path / "clip_first.yaml").write_text(SPEC.format(loop="clip_first_loop"))
    pytester.syspathinsert()
    return pytester


def test_plugin_passes_the_healthy_loop_and_fails_the_broken_one_with_the_diagnosis(
        project: pytest.Pytester) -> None:
    result = project.runpytest_subprocess("-p", "no:cacheprovider", "-q",
                                          "--ampdoctor-records", str(project.path / "runs"))
    result.assert_outcomes(passed=1, failed=2)
    text = result.stdout.str()
    bug = next(n for n, line in enumerate(LOOPS.splitlines(), 1) if "# BUG" in line)
    # the failure message is the diagnosis: kind, rung, numbers, the loop's line, the fix
    assert "the training loop is not healthy" in text
    assert "clip-before-unscale [fp16-scaler]" in text
    assert f"loops.py:{bug}" in text
    assert "fix: " in text
    # the test line that asked, not a traceback through ampdoctor's own frames
    assert "test_training.py:11: the training loop is not healthy" in text
    assert "ampdoctor/api.py" not in text
    # both YAML checks kept their records where the option said
    assert len(list((project.path / "runs").glob("*.json"))) == 2


def test_plugin_registers_through_the_entry_point(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_fixture='''
        def test_fixture_exists(ampdoctor):
            assert hasattr(ampdoctor, "assert_healthy") and hasattr(ampdoctor, "diagnose")
    ''')
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-q")
    result.assert_outcomes(passed=1)
    help_text = pytester.runpytest_subprocess("--help").stdout.str()
    assert "--ampdoctor-records" in help_text
