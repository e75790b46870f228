"""A typer command: `python typer_cli.py --accum-steps 4 --batch-size 8 [--bug]`."""

import typer

from common import train


def main(batch_size: int = 8, accum_steps: int = typer.Option(4, "--accum-steps"),
         bug: bool = False):
    train(batch_size, accum_steps, bug=bug)


if __name__ == "__main__":
    typer.run(main)
