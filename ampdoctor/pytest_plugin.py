"""pytest plugin (the `pytest11` entry point, active wherever ampdoctor is installed).

In a project's own tests:

    def test_training_loop_is_honest(ampdoctor):
        ampdoctor.assert_healthy("triage.yaml")            # or an ampdoctor.Spec(...)

or, without the fixture, `ampdoctor.assert_healthy(spec)` anywhere. A loop that is not healthy
fails the test with the diagnosis as its whole message: kind, rung, evidence, the loop's
file:line and the fix (no traceback through ampdoctor's own frames).

A spec given as a relative path is found beside the test file first, then under pytest's
rootdir, whatever the working directory (a test that names the spec next to it passes from
any folder); a spec found in neither fails the test naming both paths tried.

`--ampdoctor-records DIR` keeps every run record of the session in DIR (default: the test's
tmp_path). Nothing here imports torch until a check runs.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from .record.model import RecordModel


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("ampdoctor")
    group.addoption("--ampdoctor-records", metavar="DIR", default=None,
                    help="keep the run records of ampdoctor checks in DIR (default: each "
                         "test's tmp_path)")


class AmpdoctorFixture:
    """What the `ampdoctor` fixture gives a test: the API, saving records in one folder, with
    a relative spec path found beside the test file, then under the rootdir."""

    def __init__(self, out: Path, test_dir: Path | None = None, rootdir: Path | None = None):
        self.out = out
        self.bases = [b for b in (test_dir, rootdir) if b is not None]

    def spec_path(self, spec: Any) -> Any:
        """`spec` as the API takes it: a relative path resolved beside the test file, then
        under the rootdir (the first that exists); a Spec or an absolute path as it is.
        Fails the test, naming the paths tried, when neither holds it."""
        if not isinstance(spec, (str, os.PathLike)) or Path(spec).is_absolute():
            return spec
        tried = []
        for base in self.bases:
            candidate = base / spec
            if candidate.is_file():
                return candidate
            if candidate not in tried:
                tried.append(candidate)
        if not tried:
            return spec
        places = " or ".join(f"{p} ({why})" for p, why in zip(
            tried, ("beside the test file", "under the rootdir"), strict=False))
        pytest.fail(f"ampdoctor: spec {os.fspath(spec)!r} not found: looked for {places}; a "
                    "relative spec path is read beside the test file, then under the rootdir, "
                    "never the working directory", pytrace=False)

    def diagnose(self, spec: Any, **overrides: Any) -> RecordModel:
        """`ampdoctor.diagnose(spec, **overrides)`, the record saved under `self.out`."""
        from .api import diagnose
        return diagnose(self.spec_path(spec), out=self.out, **overrides)

    def assert_healthy(self, spec: Any, *, allow_warnings: bool = True, **overrides: Any
                       ) -> RecordModel:
        """Fail the test, with the diagnosis as the message, unless `spec` is healthy."""
        from .api import assert_healthy
        return assert_healthy(self.spec_path(spec), allow_warnings=allow_warnings, out=self.out,
                              **overrides)

    def assert_fixed(self, *, spec: Any = None, script: Any = None, args: Any = None,
                     reference_args: Any = None, cwd: Any = None, rungs: Any = None,
                     steps: int | None = 3, device: str | None = "cpu",
                     kinds: Any = None) -> RecordModel:
        """Re-run a diagnosis (what `ampdoctor export-test` writes a call of): `spec=` a YAML
        spec, or `script=` with its `args`, `reference_args` and `cwd`; on `rungs`, `steps`
        optimizer steps, `device`. Fails the test, with the diagnosis (kind, rung, numbers,
        file:line, fix) as its message, unless the verdict is healthy and none of `kinds`
        (the bugs it guards) is found, at any severity. The record, when it passes."""
        from .runner.export_test import run_guard
        if spec is not None:
            spec = self.spec_path(spec)
        record, why = run_guard(spec=spec, script=script, args=args,
                                reference_args=reference_args, cwd=cwd, rungs=rungs,
                                steps=steps, device=device, kinds=kinds, out=self.out)
        if why is not None:
            pytest.fail(f"ampdoctor: {why}", pytrace=False)
        assert record is not None
        return record


@pytest.fixture
def ampdoctor(request: pytest.FixtureRequest, tmp_path: Path) -> AmpdoctorFixture:
    """Diagnose a training loop from a test: `ampdoctor.assert_healthy("triage.yaml")`."""
    chosen = request.config.getoption("ampdoctor_records")
    test_file = getattr(request, "path", None)
    return AmpdoctorFixture(Path(chosen) if chosen else tmp_path / "ampdoctor-runs",
                            Path(test_file).parent if test_file else None,
                            Path(request.config.rootpath))


def _is_unhealthy(exc: BaseException) -> bool:
    import sys
    api = sys.modules.get("ampdoctor.api")
    return api is not None and isinstance(exc, api.Unhealthy)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Any:
    outcome = yield
    report = outcome.get_result()
    excinfo = call.excinfo
    if excinfo is None or not report.failed or not _is_unhealthy(excinfo.value):
        return
    # the test's own line that asked, then the diagnosis; ampdoctor's frames say nothing
    where = ""
    test_file = os.path.realpath(str(getattr(item, "path", "")))
    for entry in reversed(excinfo.traceback):
        if os.path.realpath(str(entry.path)) == test_file:
            where = f"{entry.path}:{entry.lineno + 1}: "
            break
    report.longrepr = f"{where}the training loop is not healthy\n{excinfo.value}"
