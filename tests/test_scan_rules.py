"""The owner rules and the "same training path" rules of the double-scaling search, on small
trees."""

from __future__ import annotations

import shutil
import textwrap
from pathlib import Path

import pytest

from ampdoctor.scan import MAX_BYTES, scan_paths

RECIPES = Path(__file__).resolve().parents[1] / "recipes" / "double_scaling"


def tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text).lstrip("\n"))
    return root


def line_of(path: Path, marker: str) -> int:
    hits = [i for i, text in enumerate(path.read_text().splitlines(), 1) if marker in text]
    assert len(hits) == 1, (marker, hits)
    return hits[0]


def owners(report) -> list[tuple]:
    return sorted((s.kind, Path(s.file).name, s.line, s.key_path) for s in report.owners)


def severities(report) -> list[str]:
    return [f.severity for f in report.findings]


LOOP = """
import torch

def train(model, opt, loader):
    scaler = torch.amp.GradScaler("cuda")  # SCALER
    for x, y in loader:
        loss = model(x, y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
"""


# -- Python owners ---------------------------------------------------------------------------

@pytest.mark.parametrize(
    "code, kinds",
    [
        ("from torch.cuda.amp import GradScaler as GS\ns = GS()\n", ["GradScaler"]),
        ("import torch.cuda.amp as tamp\ns = tamp.GradScaler()\n", ["GradScaler"]),
        ("from torch import amp\ns = amp.GradScaler('cuda')\n", ["GradScaler"]),
        ("from torch.amp import GradScaler\ns = GradScaler('cuda', enabled=False)\n", []),
        ("import torch\ns = torch.cuda.amp.GradScaler(2.**16, 2.0, 0.5, 2000, False)\n", []),
        ("import torch\ns = torch.amp.GradScaler('cuda', 2.**16, 2.0, 0.5, 2000, False)\n", []),
        ("import torch\ns = torch.amp.GradScaler('cuda', enabled=args.fp16)\n", ["GradScaler"]),
        ("from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler\n"
         "s = ShardedGradScaler()\n", ["GradScaler"]),
        ("from transformers import TrainingArguments\na = TrainingArguments('o', fp16=True)\n",
         ["Trainer fp16"]),
        ("from transformers import TrainingArguments\na = TrainingArguments('o', bf16=True)\n", []),
        ("from transformers import TrainingArguments\n"
         "a = TrainingArguments('o', fp16=False)\n", []),
        ("from trl import SFTConfig\nc = SFTConfig(output_dir='o', fp16=True)\n", ["Trainer fp16"]),
        ("from accelerate import Accelerator\na = Accelerator(mixed_precision='fp16')\n",
         ["accelerate fp16"]),
        ("from accelerate import Accelerator\na = Accelerator(mixed_precision='bf16')\n", []),
        ("import pytorch_lightning as pl\nt = pl.Trainer(precision=16)\n", ["Lightning 16-mixed"]),
        ("import lightning as L\nt = L.Trainer(precision='bf16-mixed')\n", []),
        ("import lightning as L\nt = L.Trainer(precision='16-true')\n", []),
        ("from lightning.fabric import Fabric\nf = Fabric(precision='16-mixed')\n",
         ["Lightning 16-mixed"]),
        ("from transformers import Trainer\nt = Trainer(model=m, args=a)\n", []),
        ("from apex import amp\nm, o = amp.initialize(m, o, opt_level='O2')\n", ["apex amp"]),
        ("from apex import amp\nm, o = amp.initialize(m, o, opt_level='O0')\n", []),
        ("def step(loss):\n    (loss * 1024).backward()\n", ["static loss scale"]),
        ("def step(loss):\n    (loss * 2 ** 16).backward()\n", ["static loss scale"]),
        ("LOSS_SCALE = 512\ndef step(loss):\n    loss *= LOSS_SCALE\n    loss.backward()\n",
         ["static loss scale"]),
        ("def step(self, loss):\n    scaled = loss * self.loss_scale\n    scaled.backward()\n",
         ["static loss scale"]),
        ("def step(loss, aux):\n    (loss + 0.5 * aux).backward()\n", []),
        ("def step(loss, k):\n    (loss / k).backward()\n", []),
        ("W = 0.5\ndef step(loss):\n    (loss * W).backward()\n", []),
    ],
)
def test_python_owner_rules(tmp_path, code, kinds):
    tree(tmp_path, {"mod.py": code})
    report = scan_paths([tmp_path])
    assert [s.kind for s in report.owners] == kinds
    assert report.findings == []


def test_bf16_and_disabled_settings_are_information(tmp_path):
    tree(tmp_path, {
        "a.py": """
            import torch
            from transformers import TrainingArguments
            from accelerate import Accelerator
            scaler = torch.amp.GradScaler("cuda", enabled=False)
            args = TrainingArguments("out", bf16=True)
            acc = Accelerator(mixed_precision="bf16")
        """,
        "ds.json": '{"bf16": {"enabled": true}, "fp16": {"enabled": false}}',
    })
    report = scan_paths([tmp_path])
    assert report.owners == [] and report.findings == []
    assert sorted(s.kind for s in report.infos) == [
        "DeepSpeed bf16", "GradScaler (disabled)", "Trainer bf16", "accelerate bf16"]


def test_scaler_use_without_a_visible_construction_is_an_owner(tmp_path):
    tree(tmp_path, {
        "step.py": """
            def step(engine, scaler, loss):
                engine.backward(scaler.scale(loss))  # USE
                scaler.scale(loss)  # same scaler, not a second owner
        """,
        "launch.py": """
            import deepspeed
            from step import step
            engine, *_ = deepspeed.initialize(model=m, config="ds.json")
        """,
        "ds.json": '{"fp16": {"enabled": true}}',
    })
    report = scan_paths([tmp_path])
    assert owners(report) == [
        ("DeepSpeed fp16", "ds.json", 1, "fp16.enabled"),
        ("GradScaler", "step.py", line_of(tmp_path / "step.py", "USE"), None),
    ]
    assert severities(report) == ["error"]


def test_exclusive_branches_are_one_owner(tmp_path):
    tree(tmp_path, {"train.py": """
        import torch
        if torch.cuda.is_available():
            scaler = torch.cuda.amp.GradScaler()
        else:
            scaler = torch.amp.GradScaler("cpu")
        other = torch.amp.GradScaler("cpu") if cpu else torch.cuda.amp.GradScaler()
    """})
    report = scan_paths([tmp_path])
    assert len(report.owners) == 4
    # the if/else pair and the conditional-expression pair each are one machine... but the two
    # pairs stand side by side in one module: two scalers
    assert severities(report) == ["error"]
    assert report.findings[0].evidence["measured"] == 2


def test_two_gradscalers_in_one_module(tmp_path):
    tree(tmp_path, {"train.py": LOOP + "\nsecond = torch.cuda.amp.GradScaler()  # SECOND\n"})
    report = scan_paths([tmp_path])
    assert severities(report) == ["error"]
    lines = sorted(o["line"] for o in report.findings[0].evidence["owners"])
    assert lines == sorted([line_of(tmp_path / "train.py", "SCALER"),
                            line_of(tmp_path / "train.py", "SECOND")])


# -- DeepSpeed "auto" and delegation -----------------------------------------------------------

def test_deepspeed_auto_with_trainer_fp16_is_one_owner(tmp_path):
    tree(tmp_path, {
        "train.py": """
            from transformers import TrainingArguments
            args = TrainingArguments("out", fp16=True, deepspeed="ds.json")  # TA
        """,
        "ds.json": '{\n  "fp16": {\n    "enabled": "auto"\n  },\n'
                   '  "zero_optimization": {"stage": 2}\n}\n',
    })
    report = scan_paths([tmp_path])
    assert report.findings == []
    assert owners(report) == [
        ("DeepSpeed fp16 (auto)", "ds.json", 3, "fp16.enabled"),
        ("Trainer fp16", "train.py", line_of(tmp_path / "train.py", "TA"), None),
    ]
    assert report.groups[0]["measured"] == 1
    auto = [s for s in report.owners if "auto" in s.kind][0]
    assert "filled in as fp16 by Trainer fp16" in auto.detail


def test_deepspeed_auto_alone_is_information(tmp_path):
    tree(tmp_path, {
        "train.py": LOOP,
        "ds.json": '{"fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"}}',
        "run.sh": "deepspeed train.py --deepspeed ds.json\n",
    })
    report = scan_paths([tmp_path])
    assert owners(report) == [("GradScaler", "train.py", 4, None)]
    assert report.findings == []
    assert {"DeepSpeed fp16 (auto)", "DeepSpeed bf16"} <= {s.kind for s in report.infos}


def test_deepspeed_auto_with_trainer_and_a_gradscaler_is_double(tmp_path):
    tree(tmp_path, {
        "train.py": LOOP + """
from transformers import TrainingArguments
args = TrainingArguments("out", fp16=True, deepspeed="ds.json")
""",
        "ds.json": '{"fp16": {"enabled": "auto"}}',
    })
    report = scan_paths([tmp_path])
    assert severities(report) == ["error"]
    evidence = report.findings[0].evidence
    assert evidence["measured"] == 2
    kinds = sorted(o["kind"] for o in evidence["owners"])
    assert kinds == ["DeepSpeed fp16 (auto)", "GradScaler"]
    ds = [o for o in evidence["owners"] if o["kind"].startswith("DeepSpeed")][0]
    assert [a["kind"] for a in ds["also_at"]] == ["Trainer fp16"]


def test_accelerate_handing_fp16_to_deepspeed_is_one_owner(tmp_path):
    tree(tmp_path, {
        "accelerate.yaml": """
            compute_environment: LOCAL_MACHINE
            distributed_type: DEEPSPEED
            deepspeed_config:
              deepspeed_config_file: ds_config.json
            mixed_precision: fp16
            num_processes: 8
        """,
        "ds_config.json": '{"fp16": {"enabled": true}, "zero_optimization": {"stage": 3}}',
        "train.py": "from accelerate import Accelerator\nacc = Accelerator()\n",
    })
    report = scan_paths([tmp_path])
    assert report.findings == []
    assert sorted(s.kind for s in report.owners) == ["DeepSpeed fp16", "accelerate fp16"]
    assert report.groups[0]["measured"] == 1


def test_trainer_without_deepspeed_plus_deepspeed_config_on_one_path_is_double(tmp_path):
    tree(tmp_path, {
        "train.py": """
            import json, deepspeed
            from transformers import TrainingArguments
            args = TrainingArguments("out", fp16=True)
            engine, *_ = deepspeed.initialize(model=m, config="ds.json")
        """,
        "ds.json": '{"fp16": {"enabled": true}}',
    })
    assert severities(scan_paths([tmp_path])) == ["error"]


def test_inline_deepspeed_dict(tmp_path):
    tree(tmp_path, {"launch.py": """
        import deepspeed
        import torch
        DS_CONFIG = {
            "train_batch_size": 32,
            "fp16": {
                "enabled": True,  # DS-FP16
                "loss_scale": 0,
            },
        }
        scaler = torch.cuda.amp.GradScaler()  # SCALER
        engine, *_ = deepspeed.initialize(model=m, config=DS_CONFIG)
    """})
    report = scan_paths([tmp_path])
    assert owners(report) == [
        ("DeepSpeed fp16", "launch.py", line_of(tmp_path / "launch.py", "DS-FP16"), "fp16.enabled"),
        ("GradScaler", "launch.py", line_of(tmp_path / "launch.py", "SCALER"), None),
    ]
    assert severities(report) == ["error"]


def test_literal_config_path_outside_the_scan_is_followed(tmp_path):
    tree(tmp_path, {
        "configs/ds.json": '{"fp16": {"enabled": true}}',
        "src/train.py": LOOP + '\nimport deepspeed\n'
                        'engine = deepspeed.initialize(model=m, config="../configs/ds.json")\n',
    })
    report = scan_paths([tmp_path / "src"])
    assert owners(report) == [("DeepSpeed fp16", "ds.json", 1, "fp16.enabled"),
                              ("GradScaler", "train.py", 4, None)]
    assert severities(report) == ["error"]


# -- configs -----------------------------------------------------------------------------------

def test_hf_args_json_read_by_hfargumentparser(tmp_path):
    tree(tmp_path, {
        "args.json": '{\n  "output_dir": "out",\n  "per_device_train_batch_size": 8,\n'
                     '  "fp16": true\n}\n',
        "run.py": """
            from transformers import HfArgumentParser, TrainingArguments
            from loop import train
            (args,) = HfArgumentParser(TrainingArguments).parse_json_file("args.json")
        """,
        "loop.py": LOOP,
    })
    report = scan_paths([tmp_path])
    assert owners(report) == [("GradScaler", "loop.py", 4, None),
                              ("Trainer fp16", "args.json", 4, "fp16")]
    assert severities(report) == ["error"]
    assert report.findings[0].evidence["entry"] == str(tmp_path / "run.py")


def test_hf_args_yaml_bf16_is_information(tmp_path):
    tree(tmp_path, {"args.yaml": "output_dir: out\nbf16: true\nlearning_rate: 0.0001\n"})
    report = scan_paths([tmp_path])
    assert report.owners == []
    assert [(s.kind, s.key_path, s.line) for s in report.infos] == [("Trainer bf16", "bf16", 2)]


def test_generic_fp16_flag_in_an_app_config_is_not_an_owner(tmp_path):
    # `fp16: true` in the project's own config is read by its own code (which builds the
    # GradScaler): counting it would count the GradScaler twice
    tree(tmp_path, {"config.yaml": "fp16: true\nlr: 0.1\n", "train.py": LOOP})
    report = scan_paths([tmp_path])
    assert [s.kind for s in report.owners] == ["GradScaler"]
    assert report.findings == []


def test_accelerate_config_found_without_a_launcher(tmp_path):
    src = RECIPES / "accelerate_fp16_plus_gradscaler"
    dst = tmp_path / "proj"
    shutil.copytree(src, dst)
    (dst / "launch.sh").unlink()
    report = scan_paths([dst])
    assert severities(report) == ["error"]
    assert sorted(s.kind for s in report.owners) == ["GradScaler", "accelerate fp16"]


def test_unreferenced_config_of_another_project_is_not_linked(tmp_path):
    tree(tmp_path, {
        "a/train.py": "from accelerate import Accelerator\nacc = Accelerator()\n" + LOOP,
        "b/accelerate.yaml": "distributed_type: MULTI_GPU\nmixed_precision: fp16\n"
                             "num_processes: 2\n",
    })
    report = scan_paths([tmp_path])
    # not on one path: a warning (different kinds in separate entry points), not an error
    assert severities(report) == ["warning"]


def test_accelerate_launch_flag_in_a_shell_script(tmp_path):
    tree(tmp_path, {
        "train.py": LOOP,
        "run.sh": "#!/bin/sh\naccelerate launch \\\n  --mixed_precision fp16 \\\n  train.py\n",
    })
    report = scan_paths([tmp_path])
    assert owners(report) == [("GradScaler", "train.py", 4, None),
                              ("accelerate fp16", "run.sh", 3, None)]
    assert severities(report) == ["error"]


def test_lightning_yaml_under_fit(tmp_path):
    tree(tmp_path, {"cfg.yaml": "fit:\n  trainer:\n    precision: 16\n"})
    report = scan_paths([tmp_path])
    assert owners(report) == [("Lightning 16-mixed", "cfg.yaml", 3, "fit.trainer.precision")]


def test_deepspeed_legacy_amp_and_static_loss_scale(tmp_path):
    tree(tmp_path, {
        "ds_amp.json": '{"amp": {"enabled": true, "opt_level": "O1"}}',
        "ds_static.json": '{"fp16": {"enabled": true, "loss_scale": 128}}',
    })
    report = scan_paths([tmp_path])
    assert sorted(s.kind for s in report.owners) == ["DeepSpeed amp", "DeepSpeed fp16"]
    fp16 = [s for s in report.owners if s.kind == "DeepSpeed fp16"][0]
    assert "static loss scale 128" in fp16.detail
    assert report.findings == []  # two alternative configs nobody links: one framework


def test_fp16_section_without_enabled_is_off(tmp_path):
    tree(tmp_path, {"ds.json": '{"fp16": {"loss_scale": 0}, "zero_optimization": {"stage": 1}}'})
    report = scan_paths([tmp_path])
    assert report.owners == []
    assert [s.kind for s in report.infos] == ["DeepSpeed fp16 (off)"]


# -- the training-path graph -------------------------------------------------------------------

def test_shared_library_does_not_join_two_entry_points(tmp_path):
    tree(tmp_path, {
        "lib/__init__.py": "",
        "lib/models.py": "import torch\n",
        "a.py": "from lib.models import torch\n" + LOOP,
        "b.py": "from lib import models\n" + LOOP,
    })
    report = scan_paths([tmp_path])
    assert len(report.owners) == 2
    assert report.findings == []  # two GradScaler scripts are two programs, one owner each


def test_relative_and_package_imports_join_a_path(tmp_path):
    tree(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/loop.py": LOOP,
        "pkg/main.py": """
            from .loop import train
            from transformers import TrainingArguments
            args = TrainingArguments("out", fp16=True)
        """,
    })
    report = scan_paths([tmp_path])
    assert severities(report) == ["error"]
    assert report.findings[0].evidence["entry"] == str(tmp_path / "pkg" / "main.py")


def test_a_launcher_naming_the_script_joins_the_path(tmp_path):
    tree(tmp_path, {
        "train.py": LOOP,
        "ds.json": '{"fp16": {"enabled": true}}',
        "launch.py": 'import subprocess\n'
                     'subprocess.run(["deepspeed", "train.py", "--deepspeed", "ds.json"])\n',
    })
    report = scan_paths([tmp_path])
    assert severities(report) == ["error"]
    assert report.findings[0].evidence["entry"] == str(tmp_path / "launch.py")


def test_import_cycle_is_one_path(tmp_path):
    tree(tmp_path, {
        "a.py": "import b\n" + LOOP,
        "b.py": "import a\nfrom transformers import TrainingArguments\n"
                "x = TrainingArguments('o', fp16=True)\n",
    })
    assert severities(scan_paths([tmp_path])) == ["error"]


# -- robustness --------------------------------------------------------------------------------

def test_syntax_error_is_skipped_not_fatal(tmp_path):
    tree(tmp_path, {
        "broken.py": "import torch\nscaler = torch.amp.GradScaler(\n",
        "train.py": LOOP,
        "bad.json": '{"fp16": {"enabled": tru',
        "bad.yaml": "trainer: {precision: [16\n",
    })
    report = scan_paths([tmp_path])
    skipped = {Path(s["file"]).name: s["reason"] for s in report.skipped}
    assert set(skipped) == {"broken.py", "bad.json", "bad.yaml"}
    assert skipped["broken.py"].startswith("does not parse")
    assert "JSON" in skipped["bad.json"] and "YAML" in skipped["bad.yaml"]
    assert [s.kind for s in report.owners] == ["GradScaler"]
    assert report.files_scanned == 1


def test_skipped_directories_and_large_files(tmp_path):
    tree(tmp_path, {
        ".venv/lib/site-packages/x.py": LOOP,
        "node_modules/y.py": LOOP,
        "myenv/pyvenv.cfg": "home = /usr\n",
        "myenv/lib/z.py": LOOP,
        "train.py": LOOP,
    })
    big = tmp_path / "tokenizer.json"
    big.write_text('{"fp16": {"enabled": true}, "pad": "' + "x" * (MAX_BYTES + 10) + '"}')
    report = scan_paths([tmp_path])
    assert [Path(s.file).name for s in report.owners] == ["train.py"]
    assert report.skipped == [{"file": str(big), "reason": "larger than 2 MiB, not read"}]


def test_single_files_can_be_scanned(tmp_path):
    tree(tmp_path, {"train.py": LOOP, "notes.txt": "GradScaler"})
    report = scan_paths([tmp_path / "train.py", tmp_path / "notes.txt"])
    assert [s.kind for s in report.owners] == ["GradScaler"]
    assert report.skipped == [{"file": str(tmp_path / "notes.txt"),
                               "reason": "not a Python, JSON, YAML or shell file"}]


def test_file_without_keywords_is_not_parsed_but_still_links(tmp_path):
    # main.py mentions none of the keywords: it is read by regex only, yet joins the path
    tree(tmp_path, {
        "main.py": "from loop import train\nfrom hf import args\n\n"
                   "if __name__ == '__main__':\n    train()\n",
        "loop.py": LOOP,
        "hf.py": "from transformers import TrainingArguments\n"
                 "args = TrainingArguments('o', fp16=True)\n",
    })
    report = scan_paths([tmp_path])
    assert severities(report) == ["error"]
    assert report.findings[0].evidence["entry"] == str(tmp_path / "main.py")


def test_if_else_alternatives_alone_pass(tmp_path):
    tree(tmp_path, {"train.py": """
        import torch
        if torch.cuda.is_available():
            scaler = torch.cuda.amp.GradScaler()
        else:
            scaler = torch.amp.GradScaler("cpu")
    """})
    report = scan_paths([tmp_path])
    assert len(report.owners) == 2
    assert report.findings == [] and report.groups[0]["measured"] == 1


def test_non_utf8_and_null_bytes_are_skipped(tmp_path):
    (tmp_path / "nul.py").write_bytes(b"import torch\x00\nscaler = torch.amp.GradScaler()\n")
    (tmp_path / "latin.py").write_bytes(
        "# -*- coding: latin-1 -*-\n# caf\xe9\nimport torch\ns = torch.amp.GradScaler()\n"
        .encode("latin-1"))
    (tmp_path / "bin.json").write_bytes(b'{"fp16": "\xff\xfe"}')
    report = scan_paths([tmp_path])
    assert [Path(s.file).name for s in report.owners] == ["latin.py"]
    assert {Path(s["file"]).name for s in report.skipped} == {"nul.py", "bin.json"}


def test_self_referencing_and_deeply_nested_code_does_not_stop_the_scan(tmp_path):
    deep = "x = " + "(" * 400 + "1" + ")" * 400 + "\n"
    tree(tmp_path, {
        "cyc.py": "import deepspeed\nA = {'fp16': {'enabled': True}, 'b': A}\n"
                  "deepspeed.initialize(config=A)\ndeepspeed.initialize(config=A)\n",
        "deep.py": "import torch\n" + deep + "scaler = torch.amp.GradScaler()\n",
        "train.py": LOOP,
    })
    report = scan_paths([tmp_path])
    kinds = sorted((s.kind, Path(s.file).name) for s in report.owners)
    assert ("DeepSpeed fp16", "cyc.py") in kinds and ("GradScaler", "train.py") in kinds
    assert kinds.count(("DeepSpeed fp16", "cyc.py")) == 1  # one dict, read once
