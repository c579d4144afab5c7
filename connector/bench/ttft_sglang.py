"""``kvstrata bench ttft --engine sglang`` (placeholder: being written)."""
import argparse


def run(args: argparse.Namespace) -> dict:
    raise SystemExit("kvstrata bench ttft --engine sglang: not implemented yet")


def print_table(summary: dict) -> None:
    pass
