#!/usr/bin/env bash
# Two GPUs, fp16 from the accelerate config.
set -euo pipefail
accelerate launch --config_file accelerate_config.yaml train.py "$@"
