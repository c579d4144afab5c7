"""TEST SCAFFOLDING ONLY: an import hook that lets upstream SGLang run HiCache on a CPU machine.

``install()`` is called at start-up of every server process by ``sitecustomize.py`` beside this
file (when ``SGLANG_USE_CPU_ENGINE=1``), and by tests that import SGLang in-process. It

- defines the ``torchvision::nms``/``qnms`` op schemas just before torchvision is imported (the only
  torchvision wheel reachable here is a CUDA build whose ``_C`` cannot load, and its pure-Python
  parts register fake kernels for those two ops unconditionally);
- patches SGLang's HiCache host pool right after its modules are imported
  (``sglang_cpu_patches``): no host-memory registration, no pinned memory, and torch-indexing
  host<->device copies;
- lowers the host memory HiCache leaves free beside its pool from 10 GiB to 1 GiB: the tests'
  pools are a few tens of MB, and two engines share a 24 GiB machine, where the upstream reserve
  made a server start fail ("Not enough host memory available") whenever the other one was busy;
- makes the CPU attention backend attend only the new tokens of an extend over a cached prefix,
  as GPU backends do (upstream recomputes attention over the whole sequence, a floor that hides
  every cache path).

One more gap, the ``sgl_kernel`` package, is the pure-torch stand-in beside this file.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from types import ModuleType
from typing import Callable, Sequence

_BEFORE: dict[str, Callable[[], None]] = {}
_AFTER: dict[str, Callable[[ModuleType], None]] = {}
_LIBS: list[object] = []  # a torch Library unregisters its definitions when collected


def _define_torchvision_schemas() -> None:
    import torch

    lib = torch.library.Library("torchvision", "FRAGMENT")
    for op in ("nms", "qnms"):
        try:
            lib.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        except RuntimeError:
            pass  # already defined (a real torchvision _C loaded first)
    _LIBS.append(lib)


class _Hook(importlib.abc.MetaPathFinder):
    """Runs ``_BEFORE[name]`` before a module is imported and ``_AFTER[name]`` right after."""

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None):
        before = _BEFORE.pop(fullname, None)
        if before is not None:
            before()
        after = _AFTER.pop(fullname, None)
        if after is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        exec_module = loader.exec_module

        def exec_and_patch(module: ModuleType) -> None:
            exec_module(module)
            after(module)

        loader.exec_module = exec_and_patch  # type: ignore[method-assign]
        return spec


def install() -> None:
    """Install the import hook (idempotent). Patches apply to modules imported from now on."""
    if any(isinstance(f, _Hook) for f in sys.meta_path):
        return
    _BEFORE["torchvision"] = _define_torchvision_schemas

    def _patch(name: str) -> Callable[[ModuleType], None]:
        def apply(module: ModuleType) -> None:
            import sglang_cpu_patches

            getattr(sglang_cpu_patches, name)(module)

        return apply

    _AFTER["sglang.srt.mem_cache.pool_host.base"] = _patch("patch_reserve")
    _AFTER["sglang.srt.mem_cache.pool_host.common"] = _patch("patch_common")
    _AFTER["sglang.srt.mem_cache.pool_host.mha"] = _patch("patch_mha")
    _AFTER["sglang.srt.mem_cache.pool_host.mla"] = _patch("patch_mla")
    _AFTER["sglang.srt.layers.attention.torch_native_backend"] = _patch("patch_torch_native")
    _AFTER["sglang.srt.disaggregation.mooncake.conn"] = _patch("patch_mooncake_sender")
    sys.meta_path.insert(0, _Hook())
