"""``kvstrata bench serve`` (placeholder: being written)."""
import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    pass


def run(args: argparse.Namespace) -> int:
    raise SystemExit("kvstrata bench serve: not implemented yet")
