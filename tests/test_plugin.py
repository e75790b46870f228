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


def test_a_relative_spec_is_found_beside_the_test_file_then_under_the_rootdir(tmp_path,
                                                                            monkeypatch):
    from ampdoctor.pytest_plugin import AmpdoctorFixture
    tests_dir, root = tmp_path / "proj" / "tests", tmp_path / "proj"
    tests_dir.mkdir(parents=True)
    (tests_dir / "near.yaml").write_text("x")
    (root / "near.yaml").write_text("x")
    (root / "top.yaml").write_text("x")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "cwd_only.yaml").write_text("x")
    monkeypatch.chdir(elsewhere)             # the working directory is never looked in
    fixture = AmpdoctorFixture(tmp_path / "runs", tests_dir, root)
    assert fixture.spec_path("near.yaml") == tests_dir / "near.yaml"   # the test file's first
    assert fixture.spec_path("top.yaml") == root / "top.yaml"
    assert fixture.spec_path(str(root / "top.yaml")) == str(root / "top.yaml")   # absolute
    with pytest.raises(pytest.fail.Exception) as missing:
        fixture.spec_path("cwd_only.yaml")
    message = str(missing.value)
    assert f"{tests_dir / 'cwd_only.yaml'} (beside the test file)" in message
    assert f"{root / 'cwd_only.yaml'} (under the rootdir)" in message


def test_a_missing_spec_fails_the_test_naming_the_paths_tried(pytester: pytest.Pytester):
    sub = pytester.mkdir("checks")
    (sub / "test_missing.py").write_text(
        "def test_missing(ampdoctor):\n    ampdoctor.assert_healthy('nowhere.yaml')\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-q")
    result.assert_outcomes(failed=1)
    text = result.stdout.str()
    assert "spec 'nowhere.yaml' not found" in text
    assert str(sub / "nowhere.yaml") in text and str(pytester.path / "nowhere.yaml") in text
    assert "Traceback" not in text
