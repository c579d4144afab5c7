"""vLLM's weight updates made in memory as the scheduler side sees them
(``kvstrata.adapters.vllm.weights``), without an engine: ``WeightUpdates``' rule, ``Admission``
acting on it, and the hook on vLLM's real ``EngineCore.collective_rpc`` called with stand-ins of the
engine core's executor and scheduler. On two real engines: tests/engines/test_vllm_join.py."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from kvstrata.adapters.vllm.pending import Admission, Pending
from kvstrata.adapters.vllm.weights import WeightUpdates, changes_weights, hook, watch
from kvstrata.keys import NO_EXTRA


def test_an_update_after_steps_takes_the_engine_off_the_store_until_its_reset():
    """Scenario: the old order, update then reset, on a server: engine steps ran since the engine
    started (or last reset), the weights change, steps run on the new weights, then the reset."""
    w = WeightUpdates()
    w.stepped(512)
    w.updated("reload_weights")
    assert w.off
    w.stepped(64)  # computed on the new weights: nothing of it served or saved
    w.updated("finish_weight_update")
    assert w.off
    w.reset()
    assert not w.off


def test_an_update_right_after_a_reset_is_covered_by_it():
    """Scenario: vLLM's order, pause_generation(clear_cache=True) (the reset, while paused), the
    update, resume: the engine stays on the store. Steps that compute nothing (a paused engine)
    keep the cover; one that computes a token ends it."""
    w = WeightUpdates()
    w.reset()
    w.stepped(0)
    w.updated("start_weight_update")
    w.updated("update_weights")
    assert not w.off
    w.stepped(1)
    w.updated("update_weights")
    assert w.off


def test_an_update_before_any_reset_is_not_covered_by_the_start():
    """The epoch an engine joins at start is the one of the weights it loaded; new weights without
    a reset are not of it, even before the first step."""
    w = WeightUpdates()
    w.updated("reload_weights")
    assert w.off


@pytest.mark.parametrize("method, writes", [
    ("reload_weights", True), ("update_weights", True), ("start_weight_update", True),
    ("finish_weight_update", True), ("reset_weights", True), ("load_model", True), ("apply_model", True),
    ("update_weight", True), ("update_named_param", True), ("update_weights_from_ipc_handles", True),
    (lambda worker: None, True),
    ("compute_weight_checksums", False), ("init_weight_transfer_engine", False),
    ("shutdown_weight_transfer_engine", False), ("get_model_inspection", False), ("update_max_model_len", False),
    ("release_late_interaction_query_cache", False), ("synchronize_device", False)])
def test_which_collective_rpcs_count_as_weight_updates(method, writes):
    assert changes_weights(method) is writes


def pending(saves: bool = True) -> Pending:
    request = SimpleNamespace(request_id="r", num_computed_tokens=0)
    return Pending(request, np.zeros(64, np.uint32), NO_EXTRA, saves=saves)  # type: ignore[arg-type]


def test_admission_stores_nothing_while_off_and_nothing_of_requests_live_at_the_reset():
    admission = Admission(block_size=32)
    before, after = pending(), pending()
    admission.new_step(96)
    assert admission.may_save(before, "r", None, 32)
    admission.weights.updated("reload_weights")
    assert not admission.may_save(before, "r", None, 32)
    admission.reset([before], None)
    assert not admission.may_save(before, "r", None, 32)  # running at the reset: may hold the old weights' KV
    assert admission.may_save(after, "r", None, 32)


class _Executor:
    def __init__(self, updates: WeightUpdates) -> None:
        self.updates = updates
        self.calls: list[tuple[object, bool]] = []

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        self.calls.append((method, self.updates.off))  # off already when the workers get the call
        return [None]


def engine_core(connector: object, updates: WeightUpdates) -> SimpleNamespace:
    """What ``EngineCore.collective_rpc`` and the hook read of an engine core."""
    return SimpleNamespace(model_executor=_Executor(updates), scheduler=SimpleNamespace(connector=connector))


@pytest.fixture
def real_engine_core(monkeypatch: pytest.MonkeyPatch) -> type:
    """vLLM's ``EngineCore``, its ``collective_rpc`` put back after the test."""
    pytest.importorskip("vllm")
    from vllm.v1.engine.core import EngineCore

    monkeypatch.setattr(EngineCore, "collective_rpc", EngineCore.collective_rpc)
    return EngineCore


def test_the_hook_on_vllms_engine_core_tells_the_engines_connector_before_the_workers_run_it(real_engine_core):
    """Scenario: ``LLM.collective_rpc("reload_weights")`` ends in ``EngineCore.collective_rpc``
    (vllm/v1/engine/core.py); the connector of that engine is told first, a read-only RPC tells
    nothing, another engine's connector is not told, and a second install is a no-op."""
    assert watch() and watch()
    updates, other = WeightUpdates(), WeightUpdates()
    core = engine_core(SimpleNamespace(weight_updates=updates), updates)
    engine_core(SimpleNamespace(weight_updates=other), other)
    real_engine_core.collective_rpc(core, "compute_weight_checksums")
    assert not updates.off
    real_engine_core.collective_rpc(core, "reload_weights", None, (), {"weights_iterator": []})
    assert core.model_executor.calls == [("compute_weight_checksums", False), ("reload_weights", True)]
    assert not other.off


def test_the_hook_finds_kvstrata_inside_a_multi_connector_and_ignores_other_connectors():
    class Core:
        def __init__(self, connector: object, updates: WeightUpdates) -> None:
            self.scheduler = SimpleNamespace(connector=connector)
            self.model_executor = _Executor(updates)

        def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
            return self.model_executor.collective_rpc(method, timeout, args, kwargs)

    assert hook(Core) and hook(Core)
    updates = WeightUpdates()
    multi = SimpleNamespace(sub_connectors=[SimpleNamespace(), SimpleNamespace(weight_updates=updates)])
    Core(multi, updates).collective_rpc("update_weights", kwargs={"update_info": {}})
    assert updates.off
    Core(SimpleNamespace(), WeightUpdates()).collective_rpc("reload_weights")  # no kvstrata: nothing to tell
    Core(None, WeightUpdates()).collective_rpc("reload_weights")  # no connector at all (before the scheduler)
