"""The examples of ``docs/testing.md``, run as written (keep the two in step)."""

from __future__ import annotations

from lmcache_rc.testing import SimEngine
from lmcache_rc.testing.pytest_plugin import (  # noqa: F401  (fixtures)
    lmcache_rc_client,
    lmcache_rc_server,
    lmcache_rc_server_config,
    sim_engine_factory,
)


def test_second_replica_restores(sim_engine_factory):  # noqa: F811
    prompt = list(range(100, 140))
    producer = sim_engine_factory(world_size=2)
    first = producer.generate("turn-1", prompt, max_new_tokens=4)
    producer.assert_idle()

    consumer = sim_engine_factory(world_size=2)  # a fresh replica
    turn2 = prompt + first.output_tokens + [7, 8, 9]
    second = consumer.generate("turn-2", turn2, max_new_tokens=4)

    assert second.restored_tokens == len(prompt) + 4 - 1  # turn 1's response boundary
    assert second.recomputed_tokens == 4  # only the new tokens
    assert second.output_tokens == consumer.model.reference_generate(turn2, 4)
    consumer.assert_idle()


def test_rank_failure_is_never_a_partial_restore(sim_engine_factory):  # noqa: F811
    prompt = list(range(100, 140))
    sim_engine_factory(world_size=2).generate("p", prompt, 4)

    consumer = sim_engine_factory(world_size=2)
    consumer.inject_fault("reject", rank=1, direction="RETRIEVE")
    r = consumer.generate("c", [*prompt, 1, 2], 3)
    assert r.output_tokens == consumer.model.reference_generate([*prompt, 1, 2], 3)
    consumer.assert_idle()


def test_cancel_mid_copy(sim_engine_factory):  # noqa: F811
    prompt = list(range(100, 140))
    sim_engine_factory(world_size=2).generate("p", prompt, 4)

    consumer = sim_engine_factory(world_size=2)
    consumer.inject_fault("hold", rank=0, direction="RETRIEVE")
    consumer.add_request("c", [*prompt, 5], 3)
    while consumer.held_tasks() == 0:
        consumer.step()
    consumer.abort_request("c")
    consumer.release_held()
    consumer.run_until_idle()
    assert len(consumer.manager.boundary_checkpoints) == 0
    consumer.assert_idle()


def test_without_a_sidecar():
    with SimEngine(None, connector=None) as engine:
        r = engine.generate("a", list(range(100, 140)), 3)
        assert r.output_tokens == engine.model.reference_generate(list(range(100, 140)), 3)
        assert "<table>" in r._repr_html_()
        assert "SimEngine" in engine.status()._repr_html_()
        engine.assert_idle()
