"""Child-process helper for tests/tiers/test_disk_safety.py (not collected by pytest).

    python tests/tiers/kv_child.py put TMP_PATH TAG NUM_TOKENS
        Open a BlockStore on TMP_PATH/l2, store the prompt random_tokens(TAG, NUM_TOKENS) with
        key-derived payloads (write-through), print "stored <blocks>" and exit.

    python tests/tiers/kv_child.py crash-forker TMP_PATH BLOCK_BYTES L2_SIZE
        Import everything once and print "loaded". For each line ROUND read from stdin, fork a
        writer, print "pid <writer pid>", wait for the writer to die and print
        "exit <pid> <wait status>" (so the pid is reaped: a dead writer, not a zombie).
        The writer opens a BlockStore on TMP_PATH/l2 and puts crash_prompt(ROUND, i) for
        i = 0, 1, ... forever, printing "done ROUND i" after each put returns; the test SIGKILLs
        it at a random moment. Forking here (a fresh interpreter, no threads yet) saves one
        torch import per round; the test process itself is never forked.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root (tests.builders), run as a script too

from tests.builders import make_config, make_namespace, random_tokens, store_prompt  # noqa: E402
from kvstrata.store import BlockStore  # noqa: E402

CRASH_PROMPT_TOKENS = 3 * 16 + 5  # three full blocks and a 5-token tail


def crash_prompt(round_: int, i: int):
    return random_tokens(f"crash-{round_}-{i}", CRASH_PROMPT_TOKENS)


def _say(line: str) -> None:
    """One write() per line: a pipe write this small is atomic, so a SIGKILL never tears it."""
    os.write(1, f"{line}\n".encode())


def _write_forever(tmp: Path, ns, round_: int, size: int, l2_size: int) -> None:
    store = BlockStore(make_config(tmp, **{"l1.size": 64 * size, "l2.size": l2_size}))
    i = 0
    while True:
        store_prompt(store, ns, crash_prompt(round_, i), size)
        _say(f"done {round_} {i}")
        i += 1


def main(argv: list[str]) -> int:
    cmd, tmp = argv[0], Path(argv[1])
    ns = make_namespace()
    if cmd == "put":
        tag, length = argv[2], int(argv[3])
        with BlockStore(make_config(tmp)) as store:
            chain, stored = store_prompt(store, ns, random_tokens(tag, length))
        print(f"stored {stored}", flush=True)
        return 0
    if cmd == "crash-forker":
        size, l2_size = int(argv[2]), int(argv[3])
        print("loaded", flush=True)
        for line in sys.stdin:
            round_ = int(line)
            sys.stdout.flush()
            pid = os.fork()
            if pid == 0:
                try:
                    _write_forever(tmp, ns, round_, size, l2_size)
                finally:
                    os._exit(1)
            _say(f"pid {pid}")
            _, status = os.waitpid(pid, 0)
            _say(f"exit {pid} {status}")
        return 0
    raise SystemExit(f"unknown command {cmd!r}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
