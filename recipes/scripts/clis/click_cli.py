"""A click command: `python click_cli.py --grad-accum 4 -b 8 [--bug]`."""

import click

from common import train


@click.command()
@click.option("-b", "--batch-size", type=int, default=8)
@click.option("--grad-accum", type=int, default=4)
@click.option("--bug", is_flag=True)
def main(batch_size, grad_accum, bug):
    train(batch_size, grad_accum, bug=bug)


if __name__ == "__main__":
    main()
