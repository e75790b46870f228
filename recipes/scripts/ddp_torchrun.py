"""A script written for torchrun, the way PyTorch's DDP tutorial series writes one
(`multigpu_torchrun.py`: `init_process_group` from the launcher's environment, LOCAL_RANK read
from it, a Trainer class, a DistributedSampler), with gradient accumulation under `no_sync` and
bf16 autocast. On a CPU it uses gloo.

    torchrun --nproc_per_node 2 ddp_torchrun.py --accum-steps 4 --batch-size 8
    ampdoctor diagnose ddp_torchrun.py -- --accum-steps 4 --batch-size 8

Plainly (`python ddp_torchrun.py`) it fails: RANK is not set. Under ampdoctor each run forms a
group of one, as `torchrun --nproc_per_node 1` would. `--bug no-divide`: the loss is not
divided by K.
"""

import argparse
import os
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def ddp_setup():
    init_process_group(backend="gloo")


class Trainer:
    def __init__(self, model, train_data, optimizer, accum_steps, bug):
        self.local_rank = int(os.environ["LOCAL_RANK"])
        self.model = DDP(model)
        self.train_data = train_data
        self.optimizer = optimizer
        self.accum_steps = accum_steps
        self.bug = bug

    def _run_batch(self, source, targets, sync):
        with nullcontext() if sync else self.model.no_sync():
            with torch.autocast("cpu", dtype=torch.bfloat16):
                output = self.model(source)
            loss = F.mse_loss(output.float(), targets)
            if self.bug != "no-divide":
                loss = loss / self.accum_steps
            loss.backward()  # BUG: missing-accumulation-average

    def _run_epoch(self, epoch):
        self.train_data.sampler.set_epoch(epoch)
        for i, (source, targets) in enumerate(self.train_data):
            sync = (i + 1) % self.accum_steps == 0
            self._run_batch(source, targets, sync)
            if sync:
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)

    def train(self, max_epochs):
        for epoch in range(max_epochs):
            self._run_epoch(epoch)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--accum-steps", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--bug", default="none", choices=["none", "no-divide"])
    args = parser.parse_args()
    ddp_setup()
    torch.manual_seed(0)
    data = torch.randn(256, 20)
    dataset = TensorDataset(data, data[:, :1] * 2.0 - data[:, 1:2])
    loader = DataLoader(dataset, batch_size=args.batch_size, shuffle=False,
                        sampler=DistributedSampler(dataset, shuffle=False))
    model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.GELU(), torch.nn.Linear(64, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    Trainer(model, loader, optimizer, args.accum_steps, args.bug).train(args.epochs)
    destroy_process_group()


if __name__ == "__main__":
    main()
