"""config: the typed configuration (``schema``), loaded from one YAML file and the engines'
overrides (``load_config``, ``load_engine_config``), validated at start-up with one clear message
per mistake. Reading the input is ``reading``; the checks against the machine are ``machine``.

Where the config comes from, first match wins: an explicit path (the engines' ``config_file``),
then ``$KVSTRATA_CONFIG``, then the embedded default (the defaults of these models, identical to
``configs/default.yaml``). Engines may override single keys with dotted names (``l1.size``).
Errors name the file, the key path, what was expected and the value found.

The file and the engines' override dicts are untrusted input, so every way through is bounded:
the file is read as bytes (a regular file of at most ``MAX_FILE_BYTES``, UTF-8), parsed by a
SafeLoader that stops at ``MAX_DEPTH`` levels, and the file and the overrides may each hold at
most ``MAX_VALUES`` values, a YAML alias counting at every use (a "billion laughs" stops after
``MAX_VALUES`` steps). Messages quote keys and values cut to about ``SHOWN_CHARS`` characters and
list at most ``MAX_ERRORS`` errors. Loading changes nothing on disk: ``l2.path`` is checked (the
nearest existing folder must be writable), not created; sizes are checked against the machine.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Mapping

from pydantic import ValidationError

from kvstrata.config.machine import check_fits_one_block, check_machine
from kvstrata.config.reading import (ENV_VAR, MAX_DEPTH, MAX_ERRORS, MAX_FILE_BYTES, MAX_VALUES, SHOWN_CHARS, check_shape, explain,
                      expand_dotted, merge, parse, read_text, shown)
from kvstrata.config.schema import (_SOURCE_KEY, EMBEDDED, BreakerConfig, ConfigError, KeysConfig, L1Config, L2Config,
                     NamespaceConfig, RemoteConfig, SaveConfig, Size, StrataConfig, TenantsConfig, VerifyConfig)
from kvstrata.config.values import parse_size

__all__ = [
    "EMBEDDED", "ENV_VAR", "MAX_DEPTH", "MAX_ERRORS", "MAX_FILE_BYTES", "MAX_VALUES", "SHOWN_CHARS",
    "BreakerConfig", "ConfigError", "KeysConfig", "L1Config", "L2Config", "NamespaceConfig", "RemoteConfig",
    "SaveConfig", "Size", "StrataConfig", "TenantsConfig", "VerifyConfig", "check_fits_one_block", "check_shape", "load_config",
    "load_engine_config", "parse_size",
]


def load_config(path: str | os.PathLike[str] | None = None,
                overrides: Mapping[str, Any] | None = None) -> StrataConfig:
    """Load, merge overrides, validate. Raises ConfigError with a message naming file and key.
    Changes nothing on disk."""
    path = path or os.environ.get(ENV_VAR) or None
    if path is not None and not isinstance(path, (str, os.PathLike)):
        raise ConfigError(f"kvstrata config_file: expected a file name (got {shown(path)})")
    source = EMBEDDED if not path else str(path) if len(str(path)) <= 4096 else shown(str(path))
    data: dict[str, Any] = parse(read_text(path, source), source) if path else {}
    if overrides:
        source += " (with engine overrides)"
        check_shape(overrides, source)
        data = merge(data, expand_dotted(overrides, source))
    try:
        cfg = StrataConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(explain(source, e)) from None
    check_machine(source, cfg)
    cfg.__dict__[_SOURCE_KEY] = source
    return cfg


def load_engine_config(extra: Mapping[str, Any] | None, engine_keys: frozenset[str] = frozenset()) -> StrataConfig:
    """kvstrata's part of an engine's extra-config dict: ``config_file`` (else ``$KVSTRATA_CONFIG``,
    else the embedded default) with the other keys, dotted or nested, as overrides; the engine's
    own keys are left out. A bad config is logged as one clear line (so it stands out in the
    engine's log) and raised."""
    ours = {k: v for k, v in (extra or {}).items() if k not in engine_keys}
    path = ours.pop("config_file", None)
    try:
        return load_config(path, ours)
    except ConfigError as e:
        logging.getLogger("kvstrata").error("%s", e)
        raise
