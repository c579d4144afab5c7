"""``python -m tests.harness.counted MODULE ARGS...``: run ``python -m MODULE ARGS...`` with the
engines kvstrata's launcher starts counted into the suite's tally (``starts.py``)."""

import runpy
import sys

from tests.harness.starts import count_engine_starts

if __name__ == "__main__":
    count_engine_starts()
    module, sys.argv = sys.argv[1], sys.argv[1:]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
