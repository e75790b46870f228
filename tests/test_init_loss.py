"""`ampdoctor init` proposes the spec's `loss` from the loop's own loss (a known criterion, or
the loss the model's forward returns) and fills K, b, max_grad_norm and the optimizer from the
code it reads; the proposed function, added to the file, makes a spec that diagnoses."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import yaml

from ampdoctor.init.loss import propose
from conftest import run_cli

TRAIN_PY = '''\
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset


def make_model():
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))


def make_data():
    g = torch.Generator().manual_seed(0)
    return torch.randn(96, 6, generator=g), torch.randint(0, 3, (96,), generator=g)


def train(model, optimizer, micro_batches, run):
    criterion = nn.CrossEntropyLoss(label_smoothing=0.1)
    for step, (x, y) in enumerate(micro_batches):
        loss = criterion(model(x), y) / run.accumulation_steps
        loss.backward()
        if (step + 1) % run.accumulation_steps == 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            optimizer.step()
            optimizer.zero_grad()


def main():
    x, y = make_data()
    loader = DataLoader(TensorDataset(x, y), batch_size=8)
    accumulation_steps = 4
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    train(model, optimizer, loader, None)
'''


def test_init_proposes_the_loss_and_fills_the_settings_it_reads(tmp_path: Path):
    (tmp_path / "train.py").write_text(TRAIN_PY)
    result = run_cli("init", "train.py", "-o", "triage.yaml", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    err = re.sub(r"\s+", " ", result.stderr)
    line = next(n for n, text in enumerate(TRAIN_PY.splitlines(), 1) if "CrossEntropyLoss" in text)
    assert f"proposed `loss` (nn.CrossEntropyLoss, line {line})" in err
    assert "without `loss` the reference re-runs your loop at K = 1" in err
    text = (tmp_path / "triage.yaml").read_text()
    spec = yaml.safe_load(text)
    assert "loss" not in spec          # proposed, commented: the function is not in the file yet
    assert spec["accumulation_steps"] == 4 and spec["micro_batch_size"] == 8
    assert spec["max_grad_norm"] == 0.5
    assert spec["optimizer"] == {"name": "AdamW", "lr": 3e-4}
    assert "# loss: train:triage_loss" in text and "states no intended weighting" in text
    # add the proposed function to the file and uncomment `loss`: the spec diagnoses healthy
    proposed = [line[4:] for line in text.splitlines() if line.startswith("#   ")]
    code = "\n".join(proposed[proposed.index("def triage_loss(model, micro_batch):"):])
    assert "F.cross_entropy(model(x), y, label_smoothing=0.1)" in code
    (tmp_path / "train.py").write_text(TRAIN_PY + "\n\n" + code + "\n")
    spec["loss"] = "train:triage_loss"
    (tmp_path / "triage.yaml").write_text(yaml.safe_dump(spec))
    run = run_cli("diagnose", "triage.yaml", "--device", "cpu", "--json",
                  "--rungs", "fp32-accum", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert run.record["reference_mode"] == "loss"


def test_the_models_own_loss_is_proposed_before_a_criterion():
    for source, call in (
            ("logits, loss = model(X, Y)\nloss = F.cross_entropy(logits, Y)",
             "return model(x, y)[1]"),
            ("out = model(**batch)\n(out.loss / K).backward()", "return model(**micro_batch).loss"),
            ("loss = model(input_ids=a, labels=b).loss",
             "return model(input_ids=x, labels=y).loss"),
    ):
        proposal = propose(ast.parse(source))
        assert proposal is not None and proposal.source.startswith("the model's forward")
        assert call in proposal.code, proposal.code
        compile(proposal.code, "<proposal>", "exec")
    # nothing the loop backpropagates is known: no proposal
    assert propose(ast.parse("loss = my_loss(model(x), y)")) is None
