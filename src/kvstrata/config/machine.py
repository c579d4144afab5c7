"""config/machine.py: a config checked against this machine, changing nothing on it: ``l1.size``
against its memory, ``l2.path`` writable (judged from its nearest existing folder, never created),
``l2.size`` against that filesystem (``check_machine``); and every enabled tier against the size of
one block, once the engine knows it (``check_fits_one_block``).
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

from kvstrata.config.reading import human, invalid, shown
from kvstrata.config.schema import StrataConfig

log = logging.getLogger(__name__)


def _nearest_existing(path: Path) -> tuple[Path, os.stat_result]:
    """``path`` or its nearest existing ancestor, with its stat (what ``mkdir -p`` would start from)."""
    p = path.absolute()
    while True:
        try:
            return p, os.stat(p)
        except (FileNotFoundError, NotADirectoryError):
            if p.parent == p:
                raise
            p = p.parent


def _check_l2_folder(source: str, cfg: StrataConfig) -> None:
    """``l2.path`` can be created and written, judged without creating or writing anything: its
    nearest existing ancestor must be a writable folder. Warns when ``l2.size`` is larger than
    that folder's whole filesystem."""
    path = cfg.l2.path
    try:
        found, info = _nearest_existing(path)
        if not stat.S_ISDIR(info.st_mode):
            problem = f"{found} is not a folder"
        elif not os.access(found, os.W_OK | os.X_OK):
            problem = f"{found} is not writable"
        else:
            fs = os.statvfs(found)
            # No blocks and no inodes: a kernel's pseudo-filesystem (/proc, /sys), where nothing
            # can be created whatever the mode bits say.
            problem = f"{found} is on a filesystem that stores no files (like /proc)" if not (
                fs.f_blocks or fs.f_files) else ""
    except OSError as e:
        problem = f"{e.filename or path}: {e.strerror or e}"
    if problem:
        raise invalid(f"{source}: l2.path: expected a writable folder (got {shown(str(path))}: {problem})")
    fs_bytes = fs.f_blocks * fs.f_frsize
    if 0 < fs_bytes < cfg.l2.size:
        log.warning("kvstrata config %s: l2.size: %s is more than the whole filesystem of %s, "
                    "%s: the disk fills up before the tier does", source, human(cfg.l2.size),
                    found, human(fs_bytes))


def _memory_bytes() -> int | None:
    """Physical memory (``MemTotal``), or ``None`` where the system does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def check_machine(source: str, cfg: StrataConfig) -> None:
    memory = _memory_bytes()
    if memory and cfg.l1.size > memory:
        raise invalid(f"{source}: l1.size: {human(cfg.l1.size)} is more than this machine's "
                       f"memory, {human(memory)}")
    if cfg.l2.enabled:
        _check_l2_folder(source, cfg)


def check_fits_one_block(cfg: StrataConfig, block_bytes: int) -> None:
    """Raise ConfigError when a tier cannot hold even one block of ``block_bytes`` (the payload
    bytes of one block, known once the engine has laid out its KV cache). Call it before
    allocating anything: the message names the key, its value, the file and the block size."""
    tiers = [("l1.size", cfg.l1.size, "the CPU tier (L1) holds every block on its way in and out")]
    if cfg.l2.enabled:
        tiers.append(("l2.size", cfg.l2.size, "the disk tier (L2) is enabled"))
    if cfg.remote.enabled and cfg.remote.backend == "fs":
        tiers.append(("remote.size", cfg.remote.size, "the shared folder tier is enabled"))
    problems = [f"{cfg.source}: {key}: must hold at least one block of {human(block_bytes)}, as "
                f"{why} (got {human(size)})" for key, size, why in tiers if size < block_bytes]
    if problems:
        raise invalid(*problems)
