"""The training the command-line scripts beside this file share: an MLP, K micro-batches per
SGD step, bf16 autocast. `bug=True`: the loss is not divided by K."""

import torch


def train(batch_size, accum, steps=6, bug=False):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for _ in range(accum):
            x = torch.randn(batch_size, 16, generator=generator)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(x)
            loss = torch.nn.functional.mse_loss(out.float(), x.sum(1, keepdim=True))
            (loss if bug else loss / accum).backward()  # BUG: missing-accumulation-average
        optimizer.step()
        optimizer.zero_grad()
