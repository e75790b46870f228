"""A script whose settings are a dict literal inside `main()` (`config = {...}`), bf16
autocast, no options: ampdoctor's reference runs compile it with `"grad_accum_steps": 1` and
`"batch_size"` K times as large. `python config_dict.py no-divide`: the loss is not divided by
K."""

import sys

import torch
import torch.nn.functional as F


def main():
    config = {"batch_size": 6, "grad_accum_steps": 3, "lr": 0.05, "steps": 5, "hidden": 32}
    bug = sys.argv[1] if len(sys.argv) > 1 else "none"
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, config["hidden"]), torch.nn.Tanh(),
                                torch.nn.Linear(config["hidden"], 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=config["lr"], momentum=0.9)
    generator = torch.Generator().manual_seed(2)
    n = config["batch_size"] * config["grad_accum_steps"] * config["steps"]
    data = torch.randn(n, 12, generator=generator)
    labels = torch.randint(0, 3, (n,), generator=generator)
    step_data = zip(data.split(config["batch_size"]), labels.split(config["batch_size"]),
                    strict=True)
    for i, (x, y) in enumerate(step_data):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(x)
        loss = F.cross_entropy(logits.float(), y)
        if bug != "no-divide":
            loss = loss / config["grad_accum_steps"]
        loss.backward()  # BUG: missing-accumulation-average
        if (i + 1) % config["grad_accum_steps"] == 0:
            optimizer.step()
            optimizer.zero_grad()


if __name__ == "__main__":
    main()
