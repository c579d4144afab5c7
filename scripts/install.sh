# Sourced by scripts/setup.sh and scripts/setup_sglang.sh: `install VENV ARGS...` installs packages
# into the virtual environment VENV with uv (pip's resolution, several times faster: parallel
# downloads, a shared cache), else with pip; `uninstall VENV NAMES...` removes them.
#
# uv goes into ./.venv once, with pip. It reads neither pip's configuration nor its environment,
# so the package sources pip is set up with (index, extra indexes, find-links: a machine's local
# wheel mirror, such as this one's file of torch's CPU build) are handed to it, and it picks the
# best version across all of them as pip does. KVSTRATA_NO_UV=1 installs with pip alone.

UV=.venv/bin/uv

# pip warns about every package missing from the machine's local mirrors, and (setup_sglang.sh)
# about each CUDA requirement of sglang left out on purpose; keep its real errors.
_pip_quiet() {
  grep -v -e "is ignored: it is neither" -e "dependency resolver does not currently" \
    -e "^sglang 0.5.23 \(requires\|has requirement\)" >&2
}

_pip_setting() {  # the value pip uses for a global option: its environment variable, else its config
  local env=$1 key=$2
  if [ -n "${!env:-}" ]; then echo "${!env}"; else python3 -m pip config get "global.$key" 2>/dev/null || true; fi
}

_uv_sources() {
  local url
  UV_SOURCES=(--index-strategy unsafe-best-match)
  url=$(_pip_setting PIP_INDEX_URL index-url)
  [ -n "$url" ] && UV_SOURCES+=(--index-url "$url")
  for url in $(_pip_setting PIP_EXTRA_INDEX_URL extra-index-url); do UV_SOURCES+=(--extra-index-url "$url"); done
  for url in $(_pip_setting PIP_FIND_LINKS find-links); do UV_SOURCES+=(--find-links "$url"); done
}

_have_uv() {
  [ "${KVSTRATA_NO_UV:-0}" = 1 ] && return 1
  if [ ! -x "$UV" ] && [ -x .venv/bin/python ]; then
    .venv/bin/python -m pip -q install uv 2> >(_pip_quiet) || return 1
  fi
  [ -x "$UV" ]
}

install() {
  local venv=$1
  shift
  if _have_uv; then
    [ -n "${UV_SOURCES+x}" ] || _uv_sources
    "$UV" pip install -q --python "$venv/bin/python" "${UV_SOURCES[@]}" "$@"
  else
    "$venv/bin/python" -m pip -q install "$@" 2> >(_pip_quiet)
  fi
}

uninstall() {
  local venv=$1
  shift
  if _have_uv; then
    "$UV" pip uninstall -q --python "$venv/bin/python" "$@"
  else
    "$venv/bin/python" -m pip -q uninstall -y "$@" 2> >(_pip_quiet)
  fi
}

# Byte-compile a venv's packages once, at install (pip does it by default, uv does not). The tests
# run under PYTHONDONTWRITEBYTECODE=1 (CI sets it), so without .pyc files every process compiles
# what it imports from source: a vLLM start then takes 23 s of CPU instead of 10, a kvstrata
# command 5 s instead of 2. compileall skips files whose .pyc is current, so a rerun is quick.
compile_venv() {
  local venv=$1 site
  site=$("$venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  "$venv/bin/python" -m compileall -q -j 0 "$site" >/dev/null 2>&1 || true
}
