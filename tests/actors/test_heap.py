"""The serving process's heap (actors/heap.py): frozen at the end of an engine's start-up, so a
full collection scans only what serving made since; what the engine lets go of on purpose (a
closed rank and its guests, which hold device memory on a GPU) still collected; the collector's
pauses counted for /metrics."""

from __future__ import annotations

import gc
import weakref

import pytest

from actors import heap
from actors.engine.config import EngineConfig
from actors.engine.coordinator import Engine
from actors.engine.sequence import SamplingParams


class Node:
    def __init__(self) -> None:
        self.other = self  # a cycle: only the cyclic collector frees it


@pytest.fixture
def thawed():
    heap.thaw()  # whatever an earlier test left frozen
    threshold = gc.get_threshold()
    yield
    heap.thaw()
    gc.set_threshold(*threshold)


def test_a_frozen_cycle_survives_a_collection_but_not_collect_everything(thawed):
    node = Node()
    ref = weakref.ref(node)
    heap.freeze()  # alive then: frozen
    assert gc.get_freeze_count() > 0 and gc.get_threshold()[0] == heap.YOUNG
    del node  # garbage now, but only a collection that reaches frozen objects finds it
    gc.collect()
    assert ref() is not None  # frozen: out of the collector's reach (why the engine thaws on purpose)
    heap.collect_everything()
    assert ref() is None
    assert gc.get_freeze_count() > 0  # what is still alive is frozen again


def test_collect_everything_freezes_nothing_in_a_process_that_froze_nothing(thawed):
    heap.collect_everything()
    assert gc.get_freeze_count() == 0


def test_pauses_count_collections_while_installed(thawed):
    pauses = heap.Pauses().install()
    pauses.install()  # once only
    try:
        gc.collect()
        gc.collect(0)
        assert pauses.count[2] == 1 and pauses.count[0] >= 1
        assert 0 < pauses.longest_s <= sum(pauses.seconds)
        stats = pauses.stats()
        assert stats["gc_full_collections"] == 1 and stats["gc_collections"] == sum(pauses.count)
    finally:
        pauses.remove()
    before = list(pauses.count)
    gc.collect()
    assert pauses.count == before


@pytest.mark.usefixtures("local_ray")
@pytest.mark.parametrize("freeze", [True, False])
def test_an_engine_freezes_its_heap_at_start_and_thaws_it_at_shutdown(tiny_bundle, tmp_path, thawed, freeze):
    cfg = EngineConfig(target_dir=f"{tiny_bundle}/target", drafter="ngram", block=4, policy="dcut",
                       cost_model_cache=str(tmp_path), freeze_heap=freeze)
    threshold = gc.get_threshold()
    eng = Engine(cfg)
    assert (gc.get_freeze_count() > 0) == freeze
    assert gc.get_threshold() == ((heap.YOUNG, *threshold[1:]) if freeze else threshold)
    eng.generate([[5, 6, 7, 5, 6, 7]], [SamplingParams(max_tokens=8)])
    assert eng.gc_pauses._on in gc.callbacks
    rank = weakref.ref(eng.target.local)
    eng.shutdown()
    assert gc.get_freeze_count() == 0 and gc.get_threshold() == threshold
    assert eng.gc_pauses._on not in gc.callbacks
    del eng
    gc.collect()
    assert rank() is None  # the closed rank (model, KV cache, guests) is collectable


@pytest.mark.usefixtures("local_ray")
def test_two_engines_in_one_process_leave_the_collector_as_they_found_it(tiny_bundle, tmp_path, thawed):
    threshold = gc.get_threshold()
    cfg = EngineConfig(target_dir=f"{tiny_bundle}/target", drafter="ngram", block=4, policy="ar",
                       cost_model_cache=str(tmp_path))
    first, second = Engine(cfg), Engine(cfg)
    first.shutdown()
    second.shutdown()
    assert gc.get_threshold() == threshold and gc.get_freeze_count() == 0
