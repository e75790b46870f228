"""A DeepSpeed loop whose config file enables DeepSpeed's fp16 loss scaler, with a torch
GradScaler of its own on top: two loss-scale state machines on one loss (double-scaling). Found
from the code and the config together, by `scan` and `diagnose` alike, whether or not this
device can run fp16 (DeepSpeed refuses it on a CPU without fp16 kernels)."""

import json
from pathlib import Path

import deepspeed
import torch
import torch.nn.functional as F

CONFIG = Path(__file__).with_name("deepspeed_fp16.json")
ENGINE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def gradscaler_over_fp16_config(model, optimizer, micro_batches, run):
    with open(CONFIG) as f:
        config = json.load(f)   # its fp16 section turns DeepSpeed's own loss scaler on
    config["fp16"]["enabled"] = run.precision == "fp16"
    config["bf16"] = {"enabled": run.precision == "bf16"}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=config)
    scaler = torch.amp.GradScaler(run.device_type, enabled=run.precision == "fp16")  # BUG: double-scaling
    for inputs, targets in micro_batches:
        loss = F.mse_loss(engine(inputs.to(ENGINE_DTYPES[run.precision])).float(), targets)
        engine.backward(scaler.scale(loss))
        engine.step()
