"""`Accelerator`: the project's own minimal version of accelerate's API. It owns the project's
only loss-scale state machine (a torch.amp.GradScaler, enabled for fp16 only)."""

import contextlib

import torch


class Accelerator:
    def __init__(self, mixed_precision="no", gradient_accumulation_steps=1, device_type="cuda"):
        if mixed_precision not in ("no", "fp16", "bf16"):
            raise ValueError(f"Unknown mixed_precision: {mixed_precision!r}")
        self.mixed_precision = mixed_precision
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self.device_type = device_type
        self.scaler = torch.amp.GradScaler(device_type, enabled=mixed_precision == "fp16")
        self._accum_step = 0
        self.sync_gradients = True

    def autocast(self):
        if self.mixed_precision == "no":
            return contextlib.nullcontext()
        dtype = torch.float16 if self.mixed_precision == "fp16" else torch.bfloat16
        return torch.autocast(device_type=self.device_type, dtype=dtype)

    @contextlib.contextmanager
    def accumulate(self, model):
        self._accum_step += 1
        self.sync_gradients = self._accum_step % self.gradient_accumulation_steps == 0
        if hasattr(model, "no_sync") and not self.sync_gradients:
            with model.no_sync():
                yield
        else:
            yield

    def backward(self, loss):
        loss = loss / self.gradient_accumulation_steps
        self.scaler.scale(loss).backward()

    def clip_grad_norm_(self, parameters, max_norm, norm_type=2):
        if self.sync_gradients:
            self.unscale_gradients()
            return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type=norm_type)
        return None

    def unscale_gradients(self, optimizer=None):
        if self.scaler.is_enabled():
            self.scaler.unscale_(optimizer if optimizer is not None else self._optimizer)

    def prepare(self, model, optimizer):
        self._optimizer = optimizer
        return model, optimizer

    def step(self, optimizer):
        """What accelerate's AcceleratedOptimizer.step does: only on a sync step."""
        if self.sync_gradients:
            self.scaler.step(optimizer)
            self.scaler.update()

    def zero_grad(self, optimizer):
        if self.sync_gradients:
            optimizer.zero_grad(set_to_none=True)
