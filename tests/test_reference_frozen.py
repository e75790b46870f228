"""The reference trains what the loop trains: parameters the loop freezes on the model it was
handed (`requires_grad_(False)`) are left out of the reference's gradient and its clipping
norm, as torch leaves them out of the loop's. The healthy recipe passes clean (the e2e healthy
set runs it); here, a mistake in such a loop is still named with its factor and line."""

from __future__ import annotations

from pathlib import Path

from conftest import CONFIGS, RECIPES, run_cli


def test_a_missing_average_in_a_loop_that_freezes_its_backbone_is_still_named(tmp_path):
    source = (RECIPES / "healthy_frozen_backbone_in_loop.py").read_text()
    broken = source.replace("loss = criterion(model(x).float(), y) / K",
                            "loss = criterion(model(x).float(), y)  # no / K")
    assert broken != source
    (tmp_path / "loop.py").write_text(broken)
    (tmp_path / "common.py").write_text((RECIPES / "common.py").read_text())
    spec = (CONFIGS / "healthy_frozen_backbone_in_loop.yaml").read_text()
    spec = spec.replace("project_root: ../recipes", f"project_root: {tmp_path}").replace(
        "healthy_frozen_backbone_in_loop:train_loop", "loop:train_loop")
    spec = "\n".join(line for line in spec.splitlines() if "paths:" not in line
                     and not line.startswith("scan:"))
    (tmp_path / "spec.yaml").write_text(spec + "\n")
    result = run_cli("diagnose", tmp_path / "spec.yaml", "--json", "--out", tmp_path / "runs")
    assert result.returncode == 1, result.stderr
    finding = result.record["findings"][0]
    assert (finding["kind"], finding["rung"]) == ("missing-accumulation-average", "fp32-accum")
    assert 3.99 <= finding["evidence"]["measured"] <= 4.01
    # the backward of the undivided loss (the line the e2e recipes mark for this kind)
    line = next(n for n, text in enumerate(broken.splitlines(), 1)
                if "scaler.scale(loss).backward()" in text)
    assert Path(finding["location"]["file"]).resolve() == (tmp_path / "loop.py").resolve()
    assert finding["location"]["line"] == line
