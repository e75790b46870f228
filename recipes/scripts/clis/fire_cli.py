"""A python-fire command: `python fire_cli.py --gradient_accumulation_steps 4 --batch-size 8`."""

import fire

from common import train


def main(batch_size: int = 8, gradient_accumulation_steps: int = 4, bug: bool = False):
    train(batch_size, gradient_accumulation_steps, bug=bug)


if __name__ == "__main__":
    fire.Fire(main)
