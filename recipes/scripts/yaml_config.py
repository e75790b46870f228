"""A script configured by a YAML file it is handed (`--config configs/finetune.yaml`), as many
fine-tuning repositories are: K and the micro-batch are keys of the file's `train` section, not
options. fp16 autocast with a GradScaler, clipping after `unscale_`, a warm-up schedule per
optimizer step.

    python yaml_config.py --config configs/finetune.yaml
    ampdoctor diagnose yaml_config.py -- --config configs/finetune.yaml

ampdoctor's reference reads a copy of the file with `gradient_accumulation_steps: 1` and
`batch_size` K times as large. `--bug no-divide`: the loss is not divided by K.
"""

import argparse

import torch
import torch.nn.functional as F
import yaml


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--bug", default="none", choices=["none", "no-divide"])
    args = parser.parse_args()
    with open(args.config) as f:
        cfg = yaml.safe_load(f)
    train = cfg["train"]
    accum = train["gradient_accumulation_steps"]
    torch.manual_seed(cfg.get("seed", 0))
    model = torch.nn.Sequential(torch.nn.Linear(24, cfg["model"]["hidden"]), torch.nn.Tanh(),
                                torch.nn.Linear(cfg["model"]["hidden"], 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=train["lr"])
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / train["warmup_steps"]))
    scaler = torch.amp.GradScaler("cpu")
    generator = torch.Generator().manual_seed(1)
    data = torch.randn(train["batch_size"] * accum * train["steps"], 24, generator=generator)
    labels = torch.randint(0, 4, (len(data),), generator=generator)
    batches = zip(data.split(train["batch_size"]), labels.split(train["batch_size"]), strict=True)
    for i, (x, y) in enumerate(batches):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(model(x).float(), y)
        if args.bug != "no-divide":
            loss = loss / accum
        scaler.scale(loss).backward()  # BUG: missing-accumulation-average
        if (i + 1) % accum == 0:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), train["max_grad_norm"])
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)


if __name__ == "__main__":
    main()
