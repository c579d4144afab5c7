"""``kvstrata estimate`` (placeholder: being written)."""
import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    pass


def run(args: argparse.Namespace) -> int:
    raise SystemExit("kvstrata estimate: not implemented yet")
