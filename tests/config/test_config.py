"""Configuration: defaults, overrides, and one clear message per class of mistake."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvstrata.config import ConfigError, StrataConfig, load_config, parse_size

ROOT = Path(__file__).resolve().parents[2]


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "kvstrata.yaml"
    path.write_text(text)
    return path


def error_of(path, overrides=None) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(path, overrides)
    return str(e.value)


def test_shipped_default_yaml_is_the_embedded_default(monkeypatch):
    monkeypatch.delenv("KVSTRATA_CONFIG", raising=False)
    assert load_config(ROOT / "configs" / "default.yaml") == StrataConfig()
    assert load_config(None) == StrataConfig()


@pytest.mark.parametrize("text,expected", [
    ("2GiB", 2 * 2**30), ("512MiB", 512 * 2**20), ("1.5GB", 1_500_000_000), ("4096", 4096),
    (123, 123), ("8 kib", 8192),
])
def test_sizes_parse(text, expected):
    assert parse_size(text) == expected


def test_unknown_key_names_file_and_key_path(tmp_path):
    path = write(tmp_path, "l1:\n  size: 1GiB\n  sise: 2GiB\n")
    msg = error_of(path)
    assert str(path) in msg and "l1.sise" in msg and "unknown key" in msg


@pytest.mark.parametrize("via_override", [False, True])
def test_a_renamed_key_names_file_old_key_and_new_name(tmp_path, via_override):
    """remote.allow_stale_generation is now remote.allow_stale_epoch: a config (or an engine
    override) that still uses the old name is refused with the new one, not as a typo."""
    if via_override:
        path = write(tmp_path, "l1:\n  size: 1GiB\n")
        msg = error_of(path, {"remote.allow_stale_generation": True})
    else:
        path = write(tmp_path, "remote:\n  allow_stale_generation: true\n")
        msg = error_of(path)
    assert str(path) in msg and "remote.allow_stale_generation: renamed to remote.allow_stale_epoch" in msg, msg
    assert "unknown key" not in msg, msg


@pytest.mark.parametrize("key,value", [("identity_hole", "lora_version"), ("key_bits", 16),
                                       ("l2_write_delay_ms", 1000)])
@pytest.mark.parametrize("via_override", [False, True])
def test_the_removed_testing_section_is_refused_naming_the_key(tmp_path, key, value, via_override):
    """Scenario: an operator's YAML (or a ``kv_connector_extra_config`` override) sets a test-only
    switch of the old ``testing:`` section, one of which planted a key hole (a LoRA keyed by name
    alone) and another forced index collisions. No setting reaches them any more: the config is
    refused, naming the file, the key and its value, and why; the engine never starts with it."""
    if via_override:
        path = write(tmp_path, "l1:\n  size: 1GiB\n")
        msg = error_of(path, {f"testing.{key}": value})
    else:
        path = write(tmp_path, f"testing:\n  {key}: {value}\n")
        msg = error_of(path)
    assert str(path) in msg and f"testing.{key} = {value!r}: removed: test-only settings" in msg, msg
    assert "unknown key" not in msg, msg
    assert "testing" not in StrataConfig.model_fields


def test_wrong_type_names_key_expectation_and_value(tmp_path):
    path = write(tmp_path, "saves:\n  threads: many\n")
    msg = error_of(path)
    assert str(path) in msg and "saves.threads" in msg and "'many'" in msg and "integer" in msg


def test_negative_size_is_rejected(tmp_path):
    msg = error_of(write(tmp_path, "l2:\n  size: -5\n"))
    assert "l2.size" in msg and "non-negative" in msg and "-5" in msg


def test_impossible_size_is_rejected(tmp_path):
    msg = error_of(write(tmp_path, "l1:\n  size: 0\n"))
    assert "l1.size" in msg and "positive" in msg
    msg = error_of(write(tmp_path, "l1:\n  size: lots\n"))
    assert "l1.size" in msg and "8GiB" in msg and "'lots'" in msg


def test_bad_enum_lists_choices(tmp_path):
    msg = error_of(write(tmp_path, "l2:\n  write: sometimes\n"))
    assert "l2.write" in msg and "'through'" in msg and "'sometimes'" in msg


def test_unwritable_path_fails_at_start(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    msg = error_of(write(tmp_path, f"l2:\n  path: {blocker}/sub\n"))
    assert "l2.path" in msg and "writable" in msg and str(blocker) in msg


@pytest.mark.parametrize("folder", ["/proc", "/proc/self/fd", "/proc/self/fd/sub"])
def test_a_pseudo_filesystem_path_is_refused_by_the_check_and_by_the_store(tmp_path, folder):
    """Scenario: l2.path on /proc (root may "write" there by its mode bits, yet nothing can be
    created). The config check names the file, key and value; a store opened without the check
    fails with an error naming the folder, never a RecursionError."""
    if not Path("/proc/self/fd").is_dir():
        pytest.skip("no /proc on this machine")
    path = write(tmp_path, f"l2:\n  path: {folder}\n")
    msg = error_of(path)
    assert str(path) in msg and "l2.path" in msg and folder in msg and "stores no files" in msg
    from kvstrata.store import BlockStore

    with pytest.raises(OSError) as e:
        BlockStore(StrataConfig.model_validate({"l2": {"path": folder}}))
    assert folder in str(e.value)


def test_invalid_yaml_and_non_mapping(tmp_path):
    assert "not valid YAML" in error_of(write(tmp_path, "l1: [unclosed\n"))
    assert "expected a mapping" in error_of(write(tmp_path, "- just\n- a list\n"))
    missing = error_of(tmp_path / "missing.yaml")  # the message a vLLM or SGLang start fails with
    assert "cannot read kvstrata config" in missing and str(tmp_path / "missing.yaml") in missing


def test_env_var_names_the_file_and_overrides_win(tmp_path, monkeypatch):
    path = write(tmp_path, f"l1:\n  size: 1GiB\nl2:\n  path: {tmp_path}/l2\n")
    monkeypatch.setenv("KVSTRATA_CONFIG", str(path))
    assert load_config().l1.size == 2**30
    cfg = load_config(None, {"l1.size": "2GiB", "l2": {"fsync": True}})
    assert cfg.l1.size == 2 * 2**30 and cfg.l2.fsync and cfg.l2.path == tmp_path / "l2"
    msg = error_of(None, {"l1.bogus": 1})
    assert str(path) in msg and "engine overrides" in msg and "l1.bogus" in msg


def test_path_expands_home_and_variables(tmp_path, monkeypatch):
    monkeypatch.setenv("KVS_TEST_DIR", str(tmp_path))
    cfg = load_config(write(tmp_path, "l2:\n  path: $KVS_TEST_DIR/cache\n"))
    assert cfg.l2.path == tmp_path / "cache" and not cfg.l2.path.exists()  # checked, not created


def test_cli_config_check_exit_codes(tmp_path):
    good = write(tmp_path, f"l2:\n  path: {tmp_path}/l2\n")
    ok = subprocess.run([sys.executable, "-m", "kvstrata.cli.main", "config", "check", str(good)],
                        capture_output=True, text=True)
    assert ok.returncode == 0 and "ok" in ok.stdout
    bad = tmp_path / "bad.yaml"
    bad.write_text("l1:\n  size: -1\n")
    res = subprocess.run([sys.executable, "-m", "kvstrata.cli.main", "config", "check", str(bad)],
                         capture_output=True, text=True)
    assert res.returncode != 0 and str(bad) in res.stderr and "l1.size" in res.stderr


@pytest.mark.parametrize("name", ["Chat", "chat ", " chat", "team a", "team\tA", "équipe", "-a", ".a", "a/b",
                                  "x" * 65, "*"])
@pytest.mark.parametrize("where", ["namespace.tenant", "tenants.shares"])
def test_a_tenant_name_has_one_spelling_else_it_is_refused(tmp_path, name, where):
    """Scenario (issue 50): names that differ only by case or spaces would be two tenants (two
    namespaces, two shares), so a tenant's name in ``namespace.tenant`` or ``tenants.shares`` is
    lower case, without spaces (``TENANT_NAME``); any other spelling is refused at config read, the
    message naming the key and the value, never merged into another tenant in silence."""
    if where == "tenants.shares" and name == "*":
        return  # there, "*" is the share of the tenants not named
    value = name if where == "namespace.tenant" else {"l2": {name: 0.5}}
    msg = error_of(None, {"l2.path": str(tmp_path / "l2"), where: value})
    assert where in msg and f"tenant name {name!r}" in msg, msg


@pytest.mark.parametrize("name", ["", "b", "default", "team-a.1_x", "0", "x" * 64])
def test_a_tenant_name_of_one_spelling_is_kept_as_written(tmp_path, name):
    """A name that was valid keeps its exact value, hence its namespace seed and its blocks."""
    cfg = load_config(None, {"l2.path": str(tmp_path / "l2"), "namespace.tenant": name})
    assert cfg.namespace.tenant == name
    if name:
        assert load_config(None, {"l2.path": str(tmp_path / "l2"),
                                  "tenants.shares": {"l2": {name: 0.5}}}).tenants.shares == {"l2": {name: 0.5}}


def test_the_star_share_counts_once_in_the_sum_that_must_fit_the_tier(tmp_path):
    """``"*"`` is one share for all the tenants not named: with the named ones it must fit the
    tier, fractions (at read) and sizes (against the tier's size) alike."""
    path = write(tmp_path, f'l2:\n  path: {tmp_path}/l2\n  size: 1GiB\n'
                           f'tenants:\n  shares:\n    l2: {{b: 40%, "*": 70%}}\n')
    msg = error_of(path)
    assert str(path) in msg and "tenants.shares" in msg and "('b': 0.4, '*': 0.7) add up to 1.1" in msg, msg
    path = write(tmp_path, f'l2:\n  path: {tmp_path}/l2\n  size: 1GiB\n'
                           f'tenants:\n  shares:\n    l2: {{b: 40%, "*": 700MiB}}\n')
    msg = error_of(path)
    assert "tenants.shares.l2: the shares ('b': 0.4, '*': 734003200 bytes) take 1163499929 bytes, more than the " \
           "tier (l2.size: 1073741824 bytes)" in msg, msg
    base = {"l2.path": str(tmp_path / "l2"), "l1.size": "1GiB"}
    msg = error_of(None, {**base, "tenants.shares": {"l1": {"a": "512MiB", "*": "600MiB"}}})
    assert "tenants.shares.l1" in msg and "l1.size: 1073741824 bytes" in msg, msg
    msg = error_of(None, {**base, "remote.enabled": True, "remote.backend": "fs", "remote.path": str(tmp_path / "s"),
                          "remote.size": "1GiB", "tenants.shares": {"remote": {"a": "2GiB"}}})
    assert "tenants.shares.remote" in msg and "remote.size: 1073741824 bytes" in msg, msg
    fits = load_config(None, {**base, "tenants.shares": {"l2": {"b": 0.6, "*": "40%"}, "l1": {"a": "512MiB", "*": 0.5}}})
    assert fits.tenants.shares["l2"] == {"b": 0.6, "*": 0.4}
    # a tier that is off holds nothing to share: its shares are not measured against its size
    load_config(None, {**base, "l2.enabled": False, "l2.size": "1MiB", "tenants.shares": {"l2": {"a": "1GiB"}}})
