"""DeepSpeed loops written the way DeepSpeed's getting-started guide writes them:
`deepspeed.initialize(model=..., model_parameters=..., config=...)`, then on every micro-batch
`loss = ...; engine.backward(loss); engine.step()`. The engine divides the loss by its
config's `gradient_accumulation_steps` (`scale_wrt_gas`), and `engine.step()` updates only at
its own accumulation boundary. Precision comes from the config (`bf16`/`fp16`), switched by
`run.precision`; the engine casts the module itself and keeps fp32 master weights.

One process, no launcher: ampdoctor sets what DeepSpeed needs to form a group of one."""

import deepspeed
import torch
import torch.nn.functional as F

ENGINE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def ds_config(run, stage=0, **extra):
    config = {
        "train_micro_batch_size_per_gpu": run.micro_batch_size,
        "gradient_accumulation_steps": run.accumulation_steps,
        # torch's Adam: no FusedAdam to compile
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
        "zero_optimization": {"stage": stage},
        "bf16": {"enabled": run.precision == "bf16"},
        "fp16": {"enabled": run.precision == "fp16"},
        "steps_per_print": 10_000,
    }
    if run.max_grad_norm:
        config["gradient_clipping"] = run.max_grad_norm
    config.update(extra)
    return config


def _train(model, micro_batches, run, config, divide_by=1):
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=config)
    for inputs, targets in micro_batches:
        outputs = engine(inputs.to(ENGINE_DTYPES[run.precision]))
        loss = F.mse_loss(outputs.float(), targets)
        engine.backward(loss / divide_by)
        engine.step()


def healthy_zero0(model, optimizer, micro_batches, run):
    _train(model, micro_batches, run, ds_config(run, stage=0))


def healthy_zero1(model, optimizer, micro_batches, run):
    _train(model, micro_batches, run, ds_config(run, stage=1))


def healthy_zero2(model, optimizer, micro_batches, run):
    _train(model, micro_batches, run, ds_config(run, stage=2))


def healthy_zero3(model, optimizer, micro_batches, run):
    _train(model, micro_batches, run, ds_config(run, stage=3))


def double_average(model, optimizer, micro_batches, run):
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=ds_config(run, stage=2))
    for inputs, targets in micro_batches:
        loss = F.mse_loss(engine(inputs.to(ENGINE_DTYPES[run.precision])).float(), targets)
        engine.backward(loss / run.accumulation_steps)  # BUG: double-average
        engine.step()


def zero_grad_inside(model, optimizer, micro_batches, run):
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=ds_config(run, stage=0))
    for inputs, targets in micro_batches:
        engine.zero_grad()  # BUG: zero-grad-inside-accumulation
        loss = F.mse_loss(engine(inputs.to(ENGINE_DTYPES[run.precision])).float(), targets)
        engine.backward(loss)
        engine.step()


def config_accumulation_mismatch(model, optimizer, micro_batches, run):
    config = ds_config(run, stage=0)
    config["gradient_accumulation_steps"] = 2   # BUG: step-per-microbatch
    _train(model, micro_batches, run, config)


def scheduler_twice(model, optimizer, micro_batches, run):
    config = ds_config(run, stage=0, scheduler={
        "type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2,
                                       "warmup_num_steps": 10}})
    engine, ds_optimizer, _, engine_scheduler = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config)
    for inputs, targets in micro_batches:
        loss = F.mse_loss(engine(inputs.to(ENGINE_DTYPES[run.precision])).float(), targets)
        engine.backward(loss)
        engine.step()
        engine_scheduler.step()  # BUG: scheduler-per-microbatch


def optimizer_step_besides(model, optimizer, micro_batches, run):
    # ZeRO-0 in fp32: the optimizer initialize returns is the torch optimizer itself
    engine, ds_optimizer, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=ds_config(run, stage=0))
    for inputs, targets in micro_batches:
        loss = F.mse_loss(engine(inputs.to(ENGINE_DTYPES[run.precision])).float(), targets)
        engine.backward(loss)
        ds_optimizer.step()  # BUG: step-per-microbatch
        engine.step()



def loss_over_world_size(model, optimizer, micro_batches, run):
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=ds_config(run, stage=2))
    for inputs, targets in micro_batches:
        loss = F.mse_loss(engine(inputs.to(ENGINE_DTYPES[run.precision])).float(), targets)
        engine.backward(loss / run.world_size)  # BUG: double-average
        engine.step()
