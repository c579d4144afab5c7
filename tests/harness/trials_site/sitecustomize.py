"""On the ``PYTHONPATH`` of an engine the tests or the benchmarks start with test-only trials
(``trials.environment``): plants the trials of ``$KVSTRATA_TRIALS`` (JSON) into kvstrata at
interpreter start, in every process of that engine, spawned ones included (vLLM's CPU platform
spawns its EngineCore and workers: nothing planted in the parent reaches them). Nothing here
ships in the wheel; no setting reaches it."""

import json
import os

if os.environ.get("KVSTRATA_TRIALS"):
    from tests.harness.trials import plant

    plant(json.loads(os.environ["KVSTRATA_TRIALS"]))
