"""The reference command line inferred from a script (issue 34 item 4, `script.infer`): over
scripts written as the popular ones are (HF's no_trainer examples, MAE, timm, nanoGPT with its
configurator and config files, HfArgumentParser), the option that sets K set to 1 and the batch
option multiplied by K, read from ARGS in every form argparse accepts, else the defaults; and
the exact command line to try when it cannot be inferred. The last test diagnoses with the
inferred reference through the real CLI."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from ampdoctor.core.errors import UsageError
from ampdoctor.script.infer import infer_reference
from conftest import RECIPES, marked_line, run_cli

SCRIPTS = RECIPES / "scripts"

HF_NO_TRAINER = '''
import argparse
def parse_args():
    parser = argparse.ArgumentParser(description="Finetune a causal LM")
    parser.add_argument("--model_name_or_path", type=str, required=False)
    parser.add_argument("--per_device_train_batch_size", type=int, default=8,
                        help="Batch size (per device) for the training dataloader.")
    parser.add_argument("--per_device_eval_batch_size", type=int, default=8)
    parser.add_argument("--learning_rate", type=float, default=5e-5)
    parser.add_argument("--gradient_accumulation_steps", type=int, default=1,
                        help="Number of updates steps to accumulate before a backward pass.")
    parser.add_argument("--output_dir", type=str, default=None)
    return parser.parse_args()
def main():
    args = parse_args()
    loss = model(batch).loss / args.gradient_accumulation_steps
    loss.backward()
if __name__ == "__main__":
    main()
'''

MAE = '''
import argparse
def get_args_parser():
    parser = argparse.ArgumentParser('MAE pre-training', add_help=False)
    parser.add_argument('--batch_size', default=64, type=int,
                        help='Batch size per GPU (effective batch size is batch_size * accum_iter')
    parser.add_argument('--epochs', default=400, type=int)
    parser.add_argument('--accum_iter', default=1, type=int,
                        help='Accumulate gradient iterations')
    parser.add_argument('--blr', type=float, default=1e-3, metavar='LR')
    return parser
if __name__ == '__main__':
    args = get_args_parser().parse_args()
'''

TIMM = '''
import argparse
parser = argparse.ArgumentParser(description='PyTorch ImageNet Training')
group = parser.add_argument_group('Training parameters')
group.add_argument('-b', '--batch-size', type=int, default=128, metavar='N')
group.add_argument('--grad-accum-steps', type=int, default=1, metavar='N')
group.add_argument('--lr', type=float, default=None)
group.add_argument('-j', '--workers', type=int, default=4)
'''

NANOGPT = '''
import os
batch_size = 12
block_size = 1024
gradient_accumulation_steps = 5 * 8
learning_rate = 6e-4
config_keys = [k for k,v in globals().items()
               if not k.startswith('_') and isinstance(v, (int, float, bool, str))]
exec(open('configurator.py').read()) # overrides from command line or config file
config = {k: globals()[k] for k in config_keys}
'''

NANOGPT_CONFIG = '''
out_dir = 'out-shakespeare-char'
gradient_accumulation_steps = 1
batch_size = 64
'''

HF_TRAINER = '''
from transformers import HfArgumentParser, TrainingArguments
from dataclasses import dataclass, field
@dataclass
class ModelArguments:
    model_name_or_path: str = field(default="gpt2")
parser = HfArgumentParser((ModelArguments, TrainingArguments))
model_args, training_args = parser.parse_args_into_dataclasses()
'''

NO_K_OPTION = '''
import argparse
parser = argparse.ArgumentParser()
parser.add_argument("--batch-size", type=int, default=16)
parser.add_argument("--lr", type=float, default=0.1)
args = parser.parse_args()
'''

REQUIRED = '''
import argparse
parser = argparse.ArgumentParser()
parser.add_argument("--accumulation-steps", type=int, required=True)
parser.add_argument("--bs", "--batch", dest="batch_size", type=int, required=True)
args = parser.parse_args()
'''


def script(tmp_path: Path, text: str, name: str = "train.py") -> str:
    (tmp_path / name).write_text(text)
    return name


@pytest.mark.parametrize("text, args, reference, K, b", [
    # HF no_trainer: separate and `=`-joined values, the rest of ARGS kept in place
    (HF_NO_TRAINER, ["--model_name_or_path", "gpt2", "--per_device_train_batch_size", "4",
                     "--gradient_accumulation_steps=8"],
     ["--model_name_or_path", "gpt2", "--per_device_train_batch_size", "32",
      "--gradient_accumulation_steps=1"], 8, 4),
    # MAE: --accum_iter given, --batch_size from its default (appended)
    (MAE, ["--accum_iter", "4", "--epochs", "1"],
     ["--accum_iter", "1", "--epochs", "1", "--batch_size", "256"], 4, 64),
    # timm: the short flag, attached and separate, and an abbreviation argparse accepts
    (TIMM, ["-b", "16", "--grad-accum", "2"], ["-b", "32", "--grad-accum", "1"], 2, 16),
    (TIMM, ["-b16", "--grad-accum-steps=3"], ["-b48", "--grad-accum-steps=1"], 3, 16),
    # the last setting wins, as argparse reads it; every occurrence is set
    (MAE, ["--batch_size", "2", "--accum_iter", "3", "--batch_size", "5"],
     ["--batch_size", "15", "--accum_iter", "1", "--batch_size", "15"], 3, 5),
    # nanoGPT's configurator: `--key=value` overrides the module-level settings
    (NANOGPT, ["--batch_size=4"], ["--batch_size=160", "--gradient_accumulation_steps=1"],
     40, 4),
    # HfArgumentParser over TrainingArguments: its defaults (K 1, per-device batch 8)
    (HF_TRAINER, ["--gradient_accumulation_steps", "4", "--output_dir", "o"],
     ["--gradient_accumulation_steps", "1", "--output_dir", "o",
      "--per_device_train_batch_size", "32"], 4, 8),
    (REQUIRED, ["--accumulation-steps", "2", "--batch", "6"],
     ["--accumulation-steps", "1", "--batch", "12"], 2, 6),
], ids=["hf-no-trainer", "mae", "timm-short", "timm-attached", "last-wins", "nanogpt",
        "hf-trainer", "required-alias"])
def test_the_reference_is_inferred(tmp_path, text, args, reference, K, b):
    inferred = infer_reference(script(tmp_path, text), args, cwd=str(tmp_path))
    assert inferred.args == reference
    assert (inferred.K, inferred.micro_batch, inferred.inferred) == (K, b, True)
    assert inferred.text == shlex.join(reference) + " (inferred)"
    assert inferred.to_record()["args"] == reference


def test_a_nanogpt_config_file_sets_the_values(tmp_path):
    script(tmp_path, NANOGPT_CONFIG, "shakespeare.py")
    inferred = infer_reference(script(tmp_path, NANOGPT), ["shakespeare.py"], cwd=str(tmp_path))
    assert inferred.args == ["shakespeare.py", "--gradient_accumulation_steps=1",
                             "--batch_size=64"]
    assert inferred.sources == {"K": "config shakespeare.py", "batch": "config shakespeare.py"}
    # a later --key=value overrides the file
    over = infer_reference("train.py", ["shakespeare.py", "--gradient_accumulation_steps=2"],
                           cwd=str(tmp_path))
    assert over.args == ["shakespeare.py", "--gradient_accumulation_steps=1",
                         "--batch_size=128"]


def test_the_recipes_scripts(tmp_path):
    amp = infer_reference(str(SCRIPTS / "amp_recipe.py"), ["--amp"])
    assert amp.args == ["--amp", "--accum-steps", "1", "--batch-size", "32"]
    assert amp.how == "--accum-steps 4 (default) -> 1, --batch-size 8 (default) -> 32"
    module = infer_reference(str(SCRIPTS / "module_loop.py"), ["--bs", "3"])
    assert module.args == ["--bs", "12", "--accum", "1"]   # `"--bs" in sys.argv` options


@pytest.mark.parametrize("text, args, said, to_try", [
    (NO_K_OPTION, ["--batch-size", "8"], "no option for the gradient accumulation steps (K)",
     "--reference-args 'ACCUM-OPTION 1 --batch-size K_x_MICRO_BATCH' -- --batch-size 8"),
    (REQUIRED, ["--batch", "6"], "--accumulation-steps has no default",
     "--reference-args '--accumulation-steps 1 --bs K_x_MICRO_BATCH' -- --batch 6"),
    (TIMM, ["--grad-accum-steps", "two"], "--grad-accum-steps is 'two', not a number",
     "--reference-args '--grad-accum-steps 1 --batch-size K_x_MICRO_BATCH'"),
    (MAE, ["--accum_iter", "0"], "not a positive whole number", "--accum_iter 1"),
], ids=["no-k-option", "required-missing", "not-a-number", "zero"])
def test_what_cannot_be_inferred_is_exit_2_with_the_line_to_try(tmp_path, text, args, said,
                                                                 to_try):
    with pytest.raises(UsageError) as caught:
        infer_reference(script(tmp_path, text), args, cwd=str(tmp_path))
    message = str(caught.value)
    assert caught.value.exit_code == 2
    assert said in message and "ampdoctor diagnose train.py --reference-args" in message
    assert to_try in message


def test_an_unreadable_script_is_exit_2(tmp_path):
    with pytest.raises(UsageError, match="cannot read the script"):
        infer_reference("nope.py", [], cwd=str(tmp_path))


@pytest.mark.xdist_group("script_mode")
def test_the_inferred_reference_diagnoses_as_the_written_one(tmp_path):
    """The CLI given the inferred reference finds the planted bug at its line."""
    amp = SCRIPTS / "amp_recipe.py"
    args = ["--amp", "--bug", "no-average"]
    inferred = infer_reference(str(amp), args)
    result = run_cli("diagnose", amp, "--json", "--out", tmp_path / "runs", "--steps", "2",
                     "--reference-args", shlex.join(inferred.args), "--", *args)
    assert result.returncode == 1, result.stderr
    first = result.record["findings"][0]
    assert (first["rung"], first["kind"]) == ("fp32-accum", "missing-accumulation-average")
    assert first["location"]["line"] == marked_line(amp, "missing-accumulation-average")
    assert result.record["accumulation_steps"] == 4


@pytest.mark.parametrize(("source", "builds"), [
    ("import deepspeed\nengine, *_ = deepspeed.initialize(model=m)\n", True),
    ("import deepspeed as ds\nengine, *_ = ds.initialize(args=a, model=m)\n", True),
    ("from deepspeed import initialize\ne = initialize(model=m)\n", True),
    ("import deepspeed\nparser = deepspeed.add_config_arguments(p)\n", False),   # no engine
    ("import torch\nx = torch.distributed.initialize()\n", False),
])
def test_a_script_that_builds_a_deepspeed_engine_is_recognised(source, builds):
    import ast

    from ampdoctor.script.infer import builds_deepspeed_engine
    assert builds_deepspeed_engine(ast.parse(source)) is builds


def test_a_deepspeed_script_takes_k_and_the_batch_from_its_engine_config():
    """Its K and batch live in the DeepSpeed config: the reference is the run's own arguments,
    its engine built with K = 1 and K x b once a first fp32 step shows the engine
    (tests/test_script_deepspeed.py runs it)."""
    from ampdoctor.script.infer import DEEPSPEED_BATCH, infer_reference
    script = SCRIPTS / "deepspeed_getting_started.py"
    args = ["--deepspeed", "--deepspeed_config", "deepspeed_getting_started.json"]
    inferred = infer_reference(str(script), args)
    assert inferred.deferred and inferred.args == args
    assert (inferred.k_option, inferred.batch_option) == ("gradient_accumulation_steps",
                                                           DEEPSPEED_BATCH)


@pytest.mark.parametrize(("k_option", "batch_option"), [
    ("--grad-accumulation-steps", "--train-batch-size"),
    ("--accumulate", "--batch-size"),
    ("--gradient-accumulation-steps", "--per-device-batch-size"),
    ("--iters-to-accumulate", "--batch-size-per-gpu"),
    ("--gradient_accumulate_every", "--micro_batch"),
])
def test_the_option_names_of_common_repositories_are_read(tmp_path, k_option, batch_option):
    """The names real training scripts give K and the micro-batch (MaxText/EasyLM, YOLO,
    PyTorch's AMP docs, lucidrains): each read as K and batch, set to 1 and K x b."""
    script = tmp_path / "train.py"
    script.write_text("import argparse\np = argparse.ArgumentParser()\n"
                      f"p.add_argument('{k_option}', type=int, default=4)\n"
                      f"p.add_argument('{batch_option}', type=int, default=8)\n"
                      "args = p.parse_args()\n")
    inferred = infer_reference(str(script), [], cwd=str(tmp_path))
    assert inferred.args == [k_option, "1", batch_option, "32"]


TOTAL_BATCH = SCRIPTS / "total_batch_lm.py"


def test_a_script_that_derives_k_from_a_total_batch_defers_the_batch():
    """build-nanogpt's shape: no K option, `grad_accum_steps = total_batch_size // (B * T)`:
    the reference is the run's own args with the batch option at K x b, once K is seen."""
    inferred = infer_reference(str(TOTAL_BATCH), ["-B", "2"])
    assert inferred.deferred and inferred.args == ["-B", "2"]
    assert (inferred.k_option, inferred.batch_option) == ("--total_batch_size",
                                                          "--micro_batch_size")


@pytest.mark.xdist_group("script_mode")
@pytest.mark.parametrize("bug", ["none", "no-average"])
def test_a_total_batch_script_is_diagnosed_with_the_batch_set_after_a_first_step(tmp_path,
                                                                                 bug):
    result = run_cli("diagnose", TOTAL_BATCH, "--json", "--out", tmp_path / "runs", "--",
                     "-B", "2", "--bug", bug)
    record = result.record
    # K = 256 tokens / (2 x 16) = 8 micro-batches of 2 rows: the reference sets -B to 16
    assert record["accumulation_steps"] == 8
    assert record["reference_args"] == ["-B", "16", "--bug", bug]
    assert record["reference_args_origin"] == "inferred"
    assert "reference: --micro_batch_size K x the micro-batch" in result.stderr
    assert any("its first fp32 step showed K = 8 micro-batches of 2" in n
               for n in record["notes"])
    if bug == "none":
        assert result.returncode == 0, result.stderr
        assert record["findings"] == []
        assert {r["id"]: r["status"] for r in record["rungs"]}["fp32-accum"] == "pass"
    else:
        assert result.returncode == 1, result.stderr
        found = next(f for f in record["findings"] if f["severity"] == "error")
        assert (found["rung"], found["kind"]) == ("fp32-accum", "missing-accumulation-average")
        assert found["location"]["line"] == marked_line(TOTAL_BATCH,
                                                        "missing-accumulation-average")
        assert found["evidence"]["measured"] == pytest.approx(8.0, rel=1e-3)
