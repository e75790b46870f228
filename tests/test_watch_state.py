"""`ampdoctor.watch` leaves nothing on the objects it watches that travels with them: a
checkpoint of the scheduler pickles (`state_dict()` is the scheduler's `__dict__`), a copy of
the model made for an EMA is a model of its own, and the HF Trainer saves checkpoints while it
is watched."""

from __future__ import annotations

import copy
import io
import warnings

import torch

import ampdoctor


def _loop(tmp_path, steps=4, K=2):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
    data = [(torch.randn(3, 4), torch.randn(3, 1)) for _ in range(steps * K)]
    saved = []

    def loss_fn(m, batch):
        return torch.nn.functional.mse_loss(m(batch[0]), batch[1])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with ampdoctor.watch(model, opt, scheduler=sched, accumulation_steps=K,
                             loss_fn=loss_fn, every=1) as w:
            for i, batch in enumerate(w.batches(data)):
                (loss_fn(model, batch) / K).backward()
                if i % K == K - 1:
                    opt.step()
                    sched.step()
                    opt.zero_grad()
                    buffer = io.BytesIO()
                    torch.save({"scheduler": sched.state_dict(),
                                "optimizer": opt.state_dict()}, buffer)
                    saved.append(buffer.getvalue())
                    ema = copy.deepcopy(model)
                    for p in ema.parameters():
                        p.grad = torch.ones_like(p)
                    ema.zero_grad(set_to_none=True)     # the copy's own zero_grad
                    assert all(p.grad is None for p in ema.parameters())
                    assert all(p.grad is None for p in model.parameters())
    return w, sched, saved


def test_a_checkpoint_of_the_watched_scheduler_pickles_and_loads_clean(tmp_path):
    w, sched, saved = _loop(tmp_path)
    assert len(saved) == 4 and w.record["verdict"] == "healthy"
    # its steps were still counted (each after its optimizer step: in the next window)
    assert w.scheduler_counts == [0, 1, 1]
    state = torch.load(io.BytesIO(saved[-1]), weights_only=False)["scheduler"]
    assert "step" not in state
    fresh = torch.optim.lr_scheduler.LambdaLR(
        torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1), lambda s: 1.0)
    fresh.load_state_dict(state)
    assert "step" not in vars(fresh) and "step" not in vars(sched)


def test_the_methods_are_put_back_on_their_classes(tmp_path):
    before = (torch.nn.Module.zero_grad, torch.optim.Optimizer.zero_grad,
              torch.optim.lr_scheduler.LRScheduler.step)
    _loop(tmp_path, steps=2)
    assert (torch.nn.Module.zero_grad, torch.optim.Optimizer.zero_grad,
            torch.optim.lr_scheduler.LRScheduler.step) == before
