"""This file must never be executed by `ampdoctor scan`: it leaves a marker and stops."""

import pathlib

pathlib.Path(__file__).with_name("EXECUTED.marker").write_text("scan executed user code\n")
raise SystemExit("executed!")

import torch  # noqa: E402

scaler = torch.amp.GradScaler("cuda")  # MARK-GRADSCALER
