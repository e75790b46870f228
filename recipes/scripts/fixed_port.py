"""A healthy AMP + accumulation script that holds a fixed TCP port while it trains (a metrics
endpoint, a rendezvous of its own): two copies of it cannot run at once, the second fails to
bind. ampdoctor runs some of a diagnose's runs side by side on a CPU; a run that failed beside
another is run again alone, so this script is diagnosed healthy, with a note.

    python fixed_port.py --port 29517 --accum-steps 4 --batch-size 8
"""

import argparse
import socket
import time

import torch
import torch.nn as nn

parser = argparse.ArgumentParser()
parser.add_argument("--port", type=int, required=True)
parser.add_argument("--batch-size", type=int, default=8)
parser.add_argument("--accum-steps", type=int, default=4)
parser.add_argument("--amp", action="store_true")
args = parser.parse_args()

endpoint = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
endpoint.bind(("127.0.0.1", args.port))     # fails while another copy holds it
endpoint.listen()

torch.manual_seed(0)
net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
opt = torch.optim.SGD(net.parameters(), lr=0.05)
scaler = torch.amp.GradScaler("cpu", enabled=args.amp)
data = torch.randn(256, 16, generator=torch.Generator().manual_seed(1))
target = data[:, :1] * 0.5
K = args.accum_steps

time.sleep(0.5)      # (its set-up takes a moment: long enough for two runs to meet)
for i in range(len(data) // args.batch_size):
    x = data[i * args.batch_size:(i + 1) * args.batch_size]
    y = target[i * args.batch_size:(i + 1) * args.batch_size]
    with torch.autocast("cpu", dtype=torch.float16, enabled=args.amp):
        loss = nn.functional.mse_loss(net(x), y) / K
    scaler.scale(loss).backward()
    if (i + 1) % K == 0:
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
endpoint.close()
