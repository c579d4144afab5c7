"""``python -m benchmarks image-keys``: what keying an image by its content costs kvstrata, beside
what vLLM already spends on the same image.

kvstrata keys a multimodal item on its processed tensors (``kvstrata.adapters.vllm.mm_items``:
BLAKE3 over every tensor's bytes, once per item object, in the EngineCore), never on vLLM's name
for it. vLLM, when any of its caches is on, hashes the raw item in its renderer
(``MultiModalHasher.hash_kwargs``, ``vllm/multimodal/processing/inputs.py``): that is the baseline.
Per image size, with RGB noise images:

- ``vllm_hash_ms``: ``MultiModalHasher.hash_kwargs(blake3, model_id=..., image=PIL image)``, what
  the renderer computes per item;
- ``ours_ms``: ``item_digest`` of the processed ``MultiModalKwargsItem`` (a fresh object each
  repeat, so nothing is cached); ``ratio`` = ours / vLLM's hash;
- ``ours_cached_us``: the same object again (vLLM's LRU receiver cache hands one object to every
  request that reuses the image);
- ``process_ms``: vLLM's processor on the image (resize, split, normalize), for scale;
- ``processed_mb``: the bytes ours hashes.

The processor is vLLM's own Idefics3 processor (``Idefics3MultiModalProcessor``) on a copy of the
``vlm`` preset of examples/make_tiny_model.py whose image settings are Idefics3-8B's
(``do_image_splitting``, ``size.longest_edge`` 1456, ``max_image_size.longest_edge`` 364,
``image_seq_len`` 169), so an image becomes the tiles a real model of that family sees (it scales
every image to 1456 pixels, then cuts 4x4 tiles and a global one); and the same without splitting
(one 364x364 tile, as single-tile encoders such as SigLIP or CLIP see an image). What ours costs
follows the processed bytes, not the raw image's. Medians of ``--repeats`` runs; one thread
(vLLM's hasher and ours both hash on one core).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
# Idefics3-8B's image processing (HuggingFaceM4/Idefics3-8B-Llama3 processor_config.json), and one tile
IDEFICS3_8B = {"do_image_splitting": True, "size": {"longest_edge": 4 * 364}, "max_image_size": {"longest_edge": 364}}
PROCESSINGS = {"idefics3-8b": IDEFICS3_8B,
               "one tile": {**IDEFICS3_8B, "do_image_splitting": False, "size": {"longest_edge": 364}}}
IDEFICS3_8B_SEQ_LEN = 169


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="a vlm preset folder (examples/make_tiny_model.py --preset vlm); default: build one")
    parser.add_argument("--sizes", default="224,448,1024", help="square image sizes in pixels (default %(default)s)")
    parser.add_argument("--repeats", type=int, default=9, help="runs per figure; the median is printed")
    parser.add_argument("--json", action="store_true", help="one JSON line instead of a table")


def run(args: argparse.Namespace) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with tempfile.TemporaryDirectory(prefix="kvstrata-image-keys-") as tmp:
        model = args.model or _build(Path(tmp) / "built")
        rows = []
        for i, (name, settings) in enumerate(PROCESSINGS.items()):
            folder = _realistic_copy(model, Path(tmp) / f"vlm-{i}", settings)
            rows += [{"processing": name, **_measure(folder, int(s), args.repeats)} for s in args.sizes.split(",")]
    if args.json:
        print(json.dumps({"repeats": args.repeats, "rows": rows}))
    else:
        _print_table(rows, args.repeats)
    return 0


def _build(folder: Path) -> str:
    """The vlm preset, built into ``folder``."""
    subprocess.run([sys.executable, str(ROOT / "examples" / "make_tiny_model.py"), str(folder), "--preset", "vlm"],
                   check=True, stdout=subprocess.DEVNULL)
    return str(folder)


def _realistic_copy(model: str, folder: Path, settings: dict[str, Any]) -> Path:
    """A copy of the vlm preset with Idefics3-8B's image settings (``settings``)."""
    shutil.copytree(model, folder)
    path = folder / "processor_config.json"
    config = json.loads(path.read_text())
    config["image_processor"].update(settings)
    config["image_seq_len"] = IDEFICS3_8B_SEQ_LEN
    path.write_text(json.dumps(config))
    return folder


_PROCESSORS: dict[Path, Any] = {}


def _processor(folder: Path) -> Any:
    if folder not in _PROCESSORS:
        from vllm.config import ModelConfig
        from vllm.multimodal import MULTIMODAL_REGISTRY

        _PROCESSORS[folder] = MULTIMODAL_REGISTRY.create_processor(ModelConfig(model=str(folder), dtype="float32"))
    return _PROCESSORS[folder]


def _measure(folder: Path, size: int, repeats: int) -> dict[str, float]:
    import numpy as np
    from PIL import Image
    from vllm.multimodal.hasher import MultiModalHasher
    from vllm.multimodal.inputs import MultiModalKwargsItem
    from vllm.multimodal.processing import TimingContext
    from vllm.multimodal.processing.inputs import ProcessorInputs

    from kvstrata.adapters.vllm.mm_items import item_digest

    proc = _processor(folder)
    image = Image.fromarray(np.random.default_rng(size).integers(0, 256, (size, size, 3), dtype=np.uint8))
    image_token = json.loads((folder / "config.json").read_text())["image_token_id"]

    def process() -> MultiModalKwargsItem:
        items = proc.info.parse_mm_data({"image": [image]})
        out = proc.apply(ProcessorInputs([1, image_token, 5], items), TimingContext(enabled=False))
        return out["mm_kwargs"]["image"][0]

    item = process()  # warm: the processor's first call loads its HF processor
    process_ms = _median_ms(process, max(3, repeats // 3))
    vllm_ms = _median_ms(lambda: MultiModalHasher.hash_kwargs("blake3", model_id=str(folder), image=image), repeats)
    ours_ms = _median_ms(lambda: item_digest(MultiModalKwargsItem(item.data)), repeats)  # a new object: not cached
    item_digest(item)
    cached_us = _median_ms(lambda: item_digest(item), repeats) * 1000
    nbytes = sum(e.data.numel() * e.data.element_size() for e in item.values())
    return {"size": size, "tiles": int(item["num_patches"].data), "processed_mb": nbytes / 2**20,
            "vllm_hash_ms": vllm_ms, "ours_ms": ours_ms, "ratio": ours_ms / vllm_ms, "ours_cached_us": cached_us,
            "process_ms": process_ms}


def _median_ms(fn: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def _print_table(rows: list[dict[str, Any]], repeats: int) -> None:
    print(f"image keys: vLLM's hash of the raw image vs kvstrata's digest of the processed item "
          f"(medians of {repeats})")
    head = ("processing", "image", "tiles", "processed MB", "vLLM hash ms", "ours ms", "ours/vLLM", "ours cached us",
            "process ms")
    print("  ".join(f"{h:>14}" for h in head))
    for r in rows:
        cells = (r["processing"], f"{r['size']}x{r['size']}", f"{r['tiles']}", f"{r['processed_mb']:.1f}",
                 f"{r['vllm_hash_ms']:.2f}", f"{r['ours_ms']:.2f}", f"{r['ratio']:.2f}", f"{r['ours_cached_us']:.1f}",
                 f"{r['process_ms']:.1f}")
        print("  ".join(f"{c:>14}" for c in cells))
