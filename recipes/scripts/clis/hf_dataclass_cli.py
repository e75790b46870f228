"""Options made of a dataclass by transformers' HfArgumentParser:
`python hf_dataclass_cli.py --gradient_accumulation_steps 4 --per_device_train_batch_size 8`."""

from dataclasses import dataclass, field

from transformers import HfArgumentParser

from common import train


@dataclass
class Arguments:
    per_device_train_batch_size: int = field(default=8, metadata={"help": "micro-batch"})
    gradient_accumulation_steps: int = 4
    bug: bool = False


if __name__ == "__main__":
    (args,) = HfArgumentParser(Arguments).parse_args_into_dataclasses()
    train(args.per_device_train_batch_size, args.gradient_accumulation_steps, bug=args.bug)
