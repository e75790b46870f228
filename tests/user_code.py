"""Source text of small user projects that tests write into a temporary folder: a model and
data factory as users write them, with loops appended by each test."""

import textwrap

FACTORIES = textwrap.dedent('''\
    import torch
    import torch.nn as nn
    import torch.nn.functional as F


    def make_model():
        return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


    def make_data():
        g = torch.Generator().manual_seed(0)
        return torch.randn(96, 8, generator=g), torch.randn(96, 1, generator=g)
    ''')


def loop(name: str, *, divide: bool = True, unscale: bool = True, clip: bool = False,
         marker: str = "") -> str:
    """A user loop: GradScaler + autocast switched by `run`, one knob per classic mistake;
    `marker` is appended to the line the mistake is on."""
    loss = "F.mse_loss(model(x).float(), y)" + (" / run.accumulation_steps" if divide else "")
    lines = [
        f"def {name}(model, optimizer, micro_batches, run):",
        "    scaler = torch.amp.GradScaler(run.device_type, enabled=run.precision == \"fp16\")",
        "    for i, (x, y) in enumerate(micro_batches):",
        "        with torch.autocast(run.device_type, dtype=run.autocast_dtype,",
        "                            enabled=run.autocast_dtype is not None):",
        f"            loss = {loss}",
        "        scaler.scale(loss).backward()" + ("" if divide else f"  {marker}"),
        "        if (i + 1) % run.accumulation_steps == 0:",
    ]
    if unscale:
        lines.append("            scaler.unscale_(optimizer)")
    if clip:
        lines.append("            torch.nn.utils.clip_grad_norm_(model.parameters(), "
                     "run.max_grad_norm)" + ("" if unscale else f"  {marker}"))
    lines += ["            scaler.step(optimizer)", "            scaler.update()",
              "            optimizer.zero_grad(set_to_none=True)"]
    return "\n\n" + "\n".join(lines) + "\n"
