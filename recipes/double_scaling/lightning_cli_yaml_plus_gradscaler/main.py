"""`python main.py fit --config config.yaml`"""

from lightning.pytorch.cli import LightningCLI

from model import Regressor


def cli_main() -> None:
    LightningCLI(Regressor)


if __name__ == "__main__":
    cli_main()
