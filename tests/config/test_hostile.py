"""Hostile config input: one clear, short message or a note, never a traceback, a hang, a huge
message or a change on disk.

The file and the engines' override dicts are untrusted: each test feeds one kind of bad input
through ``load_config`` / ``load_engine_config`` exactly as an engine or ``kvstrata config check``
would. Inputs that used to hang run in a forked child with a deadline, so that the old code fails
the test in seconds instead of taking the run (and gigabytes of memory) with it.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import time
from pathlib import Path
from typing import Any, Callable

import pytest

from kvstrata.config import ConfigError, load_config, load_engine_config

SHORT = 2000  # characters: every message below fits in this; the old ones ran to megabytes


def write(tmp_path: Path, content: str | bytes, name: str = "kvstrata.yaml") -> Path:
    path = tmp_path / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    return path


def error_of(path: Any, overrides: Any = None) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(path, overrides)
    return str(e.value)


def _child(conn: Any, fn: Callable[[], object]) -> None:
    start = time.perf_counter()
    try:
        fn()
        outcome = "no error"
    except ConfigError as e:
        outcome = "ConfigError:" + str(e)[:100_000]
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which fails the test
        outcome = f"{type(e).__name__}:{str(e)[:1000]}"
    conn.send((time.perf_counter() - start, outcome))


def within(deadline_s: float, fn: Callable[[], object]) -> tuple[float, str]:
    """Run ``fn`` in a forked child; (seconds it took, ``"ConfigError:<message>"`` or what else
    happened). A child still running at the deadline is killed and the test fails."""
    ctx = multiprocessing.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_child, args=(send, fn), daemon=True)
    child.start()
    try:
        if not recv.poll(deadline_s):
            pytest.fail(f"still running after {deadline_s} s (a hang or an explosion of memory)")
        return recv.recv()
    finally:
        child.kill()
        child.join()


# ------------------------------------------------------------------------------------ bad bytes
@pytest.mark.parametrize("content", [
    bytes(range(256)) * 4,  # binary garbage
    b"l1:\n  size: 1GiB\nl2:\n  path: /tmp/caf\xe9\n",  # Latin-1 where UTF-8 belongs
], ids=["binary-garbage", "latin1-value"])
def test_non_utf8_file_gets_one_message_naming_the_file(tmp_path, content):
    path = write(tmp_path, content)
    msg = error_of(path)
    assert str(path) in msg and "not UTF-8" in msg and "offset" in msg and len(msg) < SHORT


def test_deep_nesting_stops_at_a_bounded_depth(tmp_path):
    for text in ("l1: " + "[" * 100_000, "".join(f"{'  ' * i}k{i}:\n" for i in range(40)) + " " * 80 + "x\n"):
        path = write(tmp_path, text)
        msg = error_of(path)
        assert str(path) in msg and "nested deeper than 32 levels" in msg and len(msg) < SHORT


def test_yaml_alias_bomb_is_refused_in_well_under_a_second(tmp_path):
    """Scenario: a "billion laughs" on a typed key. Nine levels of nine aliases each, 9^9 (387
    million) strings once expanded, in 700 bytes; it used to hang past 60 s and 4.5 GB."""
    lines = ['a0: &a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, 9)]
    path = write(tmp_path, "\n".join(lines) + "\nl1:\n  size: *a8\n")
    seconds, outcome = within(10, lambda: load_config(path))
    assert outcome.startswith("ConfigError:"), outcome
    assert str(path) in outcome and "more than 10000 values" in outcome and len(outcome) < SHORT
    assert seconds < 1.0


def test_file_over_one_mib_is_refused_unparsed(tmp_path):
    path = write(tmp_path, "l2:\n  write: '" + "x" * (3 << 19) + "'\n")  # 1.5 MiB
    seconds, outcome = within(10, lambda: load_config(path))
    assert outcome.startswith("ConfigError:") and str(path) in outcome, outcome[:300]
    assert "limit" in outcome and str(1 << 20) in outcome and len(outcome) < SHORT
    assert seconds < 1.0


def test_long_bad_value_is_cut_in_the_message(tmp_path):
    path = write(tmp_path, "l2:\n  write: '" + "sometimes " * 50_000 + "'\n")  # 500 KB, under the limit
    msg = error_of(path)
    assert str(path) in msg and "l2.write" in msg and "'sometimes sometimes" in msg and len(msg) < SHORT


def test_many_unknown_keys_are_counted_not_all_listed(tmp_path):
    path = write(tmp_path, "".join(f"key{i}: {i}\n" for i in range(3000)))
    msg = error_of(path)
    assert "key0: unknown key" in msg and "key19: unknown key" in msg and "key20:" not in msg
    assert "and 2980 more" in msg and msg.count("\n") == 21  # a header, 20 errors and the count


def test_more_values_than_any_config_needs_are_refused(tmp_path):
    path = write(tmp_path, "".join(f"key{i}: [1, 2, 3]\n" for i in range(3000)))  # 12001 values
    msg = error_of(path)
    assert str(path) in msg and "more than 10000 values" in msg and len(msg) < SHORT


def test_long_unknown_key_is_cut_in_the_message(tmp_path):
    path = write(tmp_path, "l1:\n  ? " + "k" * 200_000 + "\n  : 1\n")  # an explicit key: no length limit
    msg = error_of(path)
    assert str(path) in msg and "l1.'kkkk" in msg and "unknown key" in msg and len(msg) < SHORT


def test_integer_of_thousands_of_digits_is_a_message(tmp_path):
    msg = error_of(write(tmp_path, "l1:\n  size: " + "9" * 5000 + "\n"))
    assert "line 2" in msg and "digits" in msg and len(msg) < SHORT


def test_size_with_hundreds_of_digits_is_a_message(tmp_path):
    msg = error_of(write(tmp_path, "l1:\n  size: " + "9" * 400 + "TiB\n"))
    assert "l1.size" in msg and "8GiB" in msg and len(msg) < SHORT


def test_nul_byte_in_a_path_is_a_message(tmp_path):
    msg = error_of(write(tmp_path, 'l2:\n  path: "/tmp/a\\0b"\n'))
    assert "l2.path" in msg and "NUL" in msg


def test_config_file_that_is_a_fifo_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "kvstrata.yaml"
    os.mkfifo(fifo)
    seconds, outcome = within(10, lambda: load_config(fifo))
    assert outcome.startswith("ConfigError:") and str(fifo) in outcome and "regular file" in outcome, outcome
    assert seconds < 1.0


def test_config_check_changes_nothing_on_disk(tmp_path):
    from kvstrata.cli.main import main

    l2 = tmp_path / "not" / "yet" / "l2"
    path = write(tmp_path, f"l2:\n  path: {l2}\n")
    before = sorted((str(p), p.stat().st_mtime_ns) for p in tmp_path.rglob("*"))
    assert main(["config", "check", str(path)]) == 0
    assert not (tmp_path / "not").exists()
    assert sorted((str(p), p.stat().st_mtime_ns) for p in tmp_path.rglob("*")) == before


# ----------------------------------------------------------------------------- engine overrides
def nested(depth: int) -> dict[str, Any]:
    node: dict[str, Any] = {"x": 1}
    for _ in range(depth):
        node = {"k": node}
    return node


def test_engine_overrides_have_the_file_limits(tmp_path):
    l2 = {"l2.path": str(tmp_path / "l2")}
    for bad, expected in [
        ({"l2.write": "sometimes " * 50_000}, "'sometimes sometimes"),
        ({"l1": nested(5000)}, "nested deeper than 32 levels"),
        ({f"l1.key{i}": i for i in range(20_000)}, "more than 10000 values"),
        ({1: "x"}, "expected a key name like l1.size"),
        ({"l1": 5, "l1.size": "1GiB"}, "'l1' is also given a value"),
        ({"config_file": 5}, "expected a file name"),
    ]:
        with pytest.raises(ConfigError) as e:
            load_engine_config({**l2, **bad})
        assert expected in str(e.value) and len(str(e.value)) < SHORT


def test_engine_override_alias_bomb_is_refused_fast(tmp_path):
    bomb: Any = ["lol"] * 9
    for _ in range(8):
        bomb = [bomb] * 9  # shared lists: 9^9 strings once expanded, as a YAML alias bomb is
    seconds, outcome = within(10, lambda: load_engine_config({"l2.path": str(tmp_path), "l2.write": bomb}))
    assert outcome.startswith("ConfigError:") and "more than 10000 values" in outcome, outcome[:300]
    assert len(outcome) < SHORT and seconds < 1.0


# ---------------------------------------------------------------------------------------- sizes
def test_l1_size_above_the_machine_memory_is_an_error(tmp_path):
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    path = write(tmp_path, f"l1:\n  size: 1000000TiB\nl2:\n  path: {tmp_path / 'l2'}\n")
    msg = error_of(path)
    assert str(path) in msg and "l1.size" in msg and "memory" in msg
    assert str(1_000_000 * 2**40) in msg and str(memory) in msg


def test_l2_size_above_its_filesystem_is_a_warning(tmp_path, caplog):
    fs = os.statvfs(tmp_path)
    path = write(tmp_path, f"l2:\n  path: {tmp_path / 'a' / 'l2'}\n  size: 1000000TiB\n")
    with caplog.at_level(logging.WARNING):
        cfg = load_config(path)
    assert cfg.l2.size == 1_000_000 * 2**40
    text = "\n".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert "l2.size" in text and "filesystem" in text and str(path) in text
    assert str(1_000_000 * 2**40) in text and str(fs.f_blocks * fs.f_frsize) in text


@pytest.mark.parametrize("content", ["", "# nothing set yet\n"], ids=["empty", "comments-only"])
def test_empty_config_file_logs_a_note(tmp_path, caplog, content):
    path = write(tmp_path, content)
    with caplog.at_level(logging.INFO):
        cfg = load_config(path, {"l2.path": str(tmp_path / "l2")})
    assert cfg.l1.size == 4 * 2**30
    notes = [r.getMessage() for r in caplog.records if "empty" in r.getMessage()]
    assert len(notes) == 1 and str(path) in notes[0] and "defaults" in notes[0]


def test_tier_below_one_block_names_key_value_file_and_block_size(tmp_path):
    from kvstrata.config import check_fits_one_block

    path = write(tmp_path, f"l1:\n  size: 1KiB\nl2:\n  path: {tmp_path / 'l2'}\n  size: 2KiB\n")
    cfg = load_config(path)
    assert cfg.source == str(path)
    with pytest.raises(ConfigError) as e:
        check_fits_one_block(cfg, 4096)
    msg = str(e.value)
    assert f"{path}: l1.size: must hold at least one block of 4096 bytes" in msg and "got 1024 bytes" in msg
    assert f"{path}: l2.size: must hold at least one block of 4096 bytes" in msg and "got 2048 bytes" in msg
    check_fits_one_block(cfg, 1024)  # exactly one block fits in L1, and two on disk
    cfg = load_config(path, {"l2.enabled": False})
    with pytest.raises(ConfigError, match=r"l1\.size") as e:
        check_fits_one_block(cfg, 2048)
    assert "l2.size" not in str(e.value) and "engine overrides" in str(e.value)
