"""Spec validation: every bad spec names the key (and the YAML line) and exits 2."""

from __future__ import annotations

from pathlib import Path

import pytest

from ampdoctor.core.errors import SpecError
from ampdoctor.spec import load_spec
from conftest import CONFIGS, RECIPES, run_cli

GOOD = """\
model: common:make_mlp
data: common:make_regression_data
train_loop: healthy_sgd:train_loop
accumulation_steps: 4
micro_batch_size: 8
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "spec.yaml"
    path.write_text(text)
    return path


def test_defaults(tmp_path):
    spec = load_spec(write(tmp_path, GOOD))
    assert spec.optimizer_steps == 3
    assert spec.device == "auto"
    assert spec.seed == 0
    assert spec.max_grad_norm is None
    assert spec.display_name == "spec"
    assert spec.root == tmp_path.resolve()
    assert spec.scan_paths() == [tmp_path.resolve()]


@pytest.mark.parametrize("text,key,line,words", [
    (GOOD.replace("accumulation_steps", "accumulation_step"), "accumulation_step", 4,
     "Did you mean 'accumulation_steps'"),
    (GOOD.replace("accumulation_steps: 4", "accumulation_steps: four"), "accumulation_steps", 4,
     "integer"),
    (GOOD.replace("accumulation_steps: 4", "accumulation_steps: 0"), "accumulation_steps", 4,
     "greater than or equal to 1"),
    (GOOD.replace("model: common:make_mlp", "model: common.make_mlp"), "model", 1,
     "module.path:attribute"),
    (GOOD.replace("train_loop: healthy_sgd:train_loop\n", ""), "train_loop", None, "missing"),
    (GOOD + "device: tpu\n", "device", 6, "auto, cpu, cuda"),
    (GOOD + "max_grad_norm: -1\n", "max_grad_norm", 6, "greater than 0"),
    (GOOD + "scan: {pathz: [x]}\n", "scan.pathz", 6, "Did you mean 'paths'"),
    (GOOD + "tolerances: {fp8: {rtol: 1}}\n", "tolerances", 6, ""),
    (GOOD + "dropout: sometimes\n", "dropout", 6, "'align' or 'off'"),
])
def test_bad_spec_names_key_and_line(tmp_path, text, key, line, words):
    with pytest.raises(SpecError) as info:
        load_spec(write(tmp_path, text))
    message = info.value.message
    assert f"'{key}" in message
    if line is not None:
        assert f"spec.yaml:{line}:" in message
    assert words in message


@pytest.mark.parametrize("value,expected", [("align", "align"), ("off", "off"), ("'off'", "off")])
def test_dropout_key(tmp_path, value, expected):
    """`dropout: off` is YAML 1.1's false; it still means off."""
    assert load_spec(write(tmp_path, GOOD + f"dropout: {value}\n")).dropout == expected
    assert load_spec(write(tmp_path, GOOD)).dropout == "align"


def test_yaml_syntax_error_names_line(tmp_path):
    with pytest.raises(SpecError) as info:
        load_spec(write(tmp_path, GOOD + "optimizer: {name: SGD, lr: 0.1\n"))
    assert "not valid YAML" in info.value.message
    assert "spec.yaml:" in info.value.message


def test_non_mapping_and_empty(tmp_path):
    with pytest.raises(SpecError, match="mapping"):
        load_spec(write(tmp_path, "- a\n- b\n"))
    with pytest.raises(SpecError, match="empty"):
        load_spec(write(tmp_path, ""))


def test_missing_project_root_and_file(tmp_path):
    with pytest.raises(SpecError, match="project_root"):
        load_spec(write(tmp_path, GOOD + "project_root: nowhere\n"))
    with pytest.raises(SpecError, match="does not exist"):
        load_spec(tmp_path / "absent.yaml")


def test_a_project_root_the_file_system_cannot_name_is_a_spec_error(tmp_path):
    # YAML's escaped surrogate pair loads as two lone surrogates: no file name can hold them
    with pytest.raises(SpecError, match=r"project_root.*not a usable folder name"):
        load_spec(write(tmp_path, GOOD + 'project_root: "\\ud800\\udc00"\n'))


def test_optimizer_mapping_and_callable(tmp_path):
    spec = load_spec(write(tmp_path, GOOD + "optimizer: {name: AdamW, lr: 0.001}\n"))
    assert spec.optimizer.name == "AdamW"
    spec = load_spec(write(tmp_path, GOOD + "optimizer: opts:make\n"))
    assert spec.optimizer == "opts:make"


BAD_CONFIGS = {
    "unknown_key": (2, "accumulation_step"),
    "missing_train_loop": (2, "train_loop"),
    "bad_callable": (2, "'model'"),
    "missing_module": (2, "nosuchmodule"),
    "missing_attr": (2, "no_such_factory"),
    "unknown_optimizer": (2, "unknown_optimizer.yaml:10: spec key 'optimizer.name': torch.optim "
                             "has no optimizer 'AdamWW'"),
    "wrong_type": (2, "accumulation_steps"),
    "yaml_syntax": (2, "not valid YAML"),
    "bad_project_root": (2, "project_root"),
    "factory_raises": (3, "bad_factories.py:"),
    "import_raises": (3, "bad_import.py:"),
    "nan_data": (3, "NaN"),
    "no_parameters": (2, "no trainable parameters"),
}


#: Exit-2 inputs found once the spec loaded (what a factory returned): recorded.
RECORDED_EXIT_2 = {"no_parameters"}


@pytest.mark.parametrize("name", sorted(BAD_CONFIGS))
def test_bad_input_exit_code_and_message(name, tmp_path):
    code, words = BAD_CONFIGS[name]
    result = run_cli("diagnose", CONFIGS / "bad" / f"{name}.yaml", "--out", tmp_path)
    assert result.returncode == code, result.stderr
    assert words in result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    # a bad spec writes no record; a model or data that cannot be used and user code that
    # failed do
    assert bool(list(tmp_path.glob("*.json"))) == (code == 3 or name in RECORDED_EXIT_2)


def test_debug_shows_the_traceback(tmp_path):
    result = run_cli("diagnose", CONFIGS / "bad" / "factory_raises.yaml", "--debug", "--out",
                     tmp_path)
    assert result.returncode == 3
    assert "Traceback" in result.stderr
    assert "ValueError" in result.stderr


def test_precisions_always_hold_fp32_and_no_repeats(tmp_path):
    from ampdoctor.core.errors import SpecError
    from ampdoctor.spec import load_spec

    base = (CONFIGS / "healthy_sgd.yaml").read_text().replace("../recipes", str(RECIPES))
    path = tmp_path / "spec.yaml"
    path.write_text(base + "precisions: [bf16]\n")
    assert load_spec(path).precisions == ["fp32", "bf16"]
    path.write_text(base + "precisions: [fp16, bf16, fp16]\n")
    with pytest.raises(SpecError, match="listed twice"):
        load_spec(path)
    path.write_text(base + "precisions: [fp8]\n")
    with pytest.raises(SpecError, match="precisions"):
        load_spec(path)


@pytest.mark.parametrize("optimizer,line", [
    ("optimizer: {name: Adamw, lr: 0.01}\n", 7),
    ("optimizer:\n  lr: 0.01\n  name: Adamw\n", 9),
])
def test_a_misspelled_optimizer_is_a_spec_error_before_any_rung(tmp_path, optimizer, line):
    """The name is checked with the spec (exit 2 naming key and line, and the class meant),
    not when the first rung builds the optimizer; the only problem shown is the name."""
    spec = tmp_path / "spec.yaml"
    spec.write_text(GOOD + f"project_root: {RECIPES}\n" + optimizer)
    out = tmp_path / "runs"
    result = run_cli("diagnose", spec, "--out", out)
    assert result.returncode == 2, result.stderr
    assert f"spec.yaml:{line}: spec key 'optimizer.name': torch.optim has no optimizer " \
           "'Adamw'. Did you mean 'AdamW'?" in " ".join(result.stderr.split())
    assert "valid string" not in result.stderr
    assert "rung" not in result.stderr.lower()
    assert not list(out.glob("*.json"))   # a bad spec writes no record


def test_the_optimizer_list_is_torch_optims():
    """The spec's list of optimizer classes (kept so that a spec validates without torch) is
    torch.optim's in the installed torch."""
    import torch

    from ampdoctor.spec import TORCH_OPTIMIZERS

    installed = sorted(n for n, c in vars(torch.optim).items()
                       if isinstance(c, type) and issubclass(c, torch.optim.Optimizer)
                       and c is not torch.optim.Optimizer)
    assert sorted(TORCH_OPTIMIZERS) == installed


def test_a_valid_optimizer_name_validates_without_torch(tmp_path):
    import subprocess
    import sys

    path = write(tmp_path, GOOD + "optimizer: {name: AdamW, lr: 0.01}\n")
    code = ("import sys\nfrom ampdoctor.spec import load_spec\n"
            f"spec = load_spec({str(path)!r})\nassert spec.optimizer.name == 'AdamW'\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("name,hint", [("sgd", "Did you mean 'SGD'?"),
                                       ("Adamm", "Did you mean 'Adam'?"),
                                       ("Lion", "Optimizers: ASGD, ")])
def test_an_unknown_optimizer_name_suggests_one(tmp_path, name, hint):
    with pytest.raises(SpecError) as info:
        load_spec(write(tmp_path, GOOD + f"optimizer: {{name: {name}, lr: 0.1}}\n"))
    assert f"spec.yaml:6: spec key 'optimizer.name': torch.optim has no optimizer {name!r}." \
           in info.value.message
    assert hint in info.value.message
    assert "'module:function'" in info.value.message


@pytest.mark.parametrize("text, words", [
    (GOOD.replace("model: common:make_mlp\n", ""), "spec key 'model' is missing"),
    (GOOD.replace("train_loop: healthy_sgd:train_loop\n", ""),
     "spec key 'train_loop' is missing: give exactly one of"),
    (GOOD + "lightning: {module: m:M}\n", "give exactly one of"),
    (GOOD.replace("train_loop: healthy_sgd:train_loop\n", "deepspeed: {config: {}}\n"),
     "spec key 'loss' is missing"),
])
def test_a_rule_over_several_keys_names_its_key_once(tmp_path, text, words):
    # was "spec.yaml: spec key '(spec)': spec key 'model' is missing": a placeholder for a key
    path = write(tmp_path, text)
    with pytest.raises(SpecError) as caught:
        load_spec(path)
    message = str(caught.value)
    assert message.startswith(f"{path}: {words}"), message
    assert "(spec)" not in message


@pytest.mark.parametrize("value", ["[SGD, AdamW]", "5"])
def test_an_optimizer_of_neither_form_is_one_sentence_naming_both(tmp_path, value):
    # was two sentences, one per pydantic branch: "Input should be a valid string" and "...a
    # valid dictionary or instance of OptimizerMapping"
    path = write(tmp_path, GOOD + f"optimizer: {value}\n")
    with pytest.raises(SpecError) as caught:
        load_spec(path)
    message = str(caught.value)
    assert message.count("spec key 'optimizer'") == 1, message
    assert f"{path}:6: spec key 'optimizer': give a 'module:function'" in message
    assert "{name: SGD, lr: 0.05}" in message and "OptimizerMapping" not in message
