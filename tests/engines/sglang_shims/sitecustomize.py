"""TEST SCAFFOLDING ONLY: start-up hook of SGLang server processes started by the kvstrata tests.

``tests/engines/test_sglang.py`` (and ``examples/serve_sglang.sh`` without CUDA) put this folder on the
server's ``PYTHONPATH``; Python imports ``sitecustomize`` at start-up in every process, and with
``SGLANG_USE_CPU_ENGINE=1`` this installs ``sglang_cpu_hook`` (see there). Never installed, never
imported by kvstrata itself.
"""

import os

if os.environ.get("SGLANG_USE_CPU_ENGINE") == "1":
    import sglang_cpu_hook

    sglang_cpu_hook.install()
