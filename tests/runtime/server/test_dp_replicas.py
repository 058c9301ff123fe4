"""The front end's view of --dp replicas (no model, no processes): assignment of a call's
prompts, load counting, dead replicas, merged stats, the router registry."""

from __future__ import annotations

import pytest
import zmq

from spruce.runtime.protocol.ipc import StepOutput, decode, encode
from spruce.runtime.scheduler.router import RoundRobinRouter, make_router
from spruce.runtime.server.replicas import Replicas, SchedulerUnavailable, merge_stats

PREFIX = list(range(100, 160))


@pytest.fixture()
def sockets():
    """Two connected PUSH / PULL pairs over inproc: the replicas' inboxes."""
    context = zmq.Context()
    pairs = []
    for i in range(2):
        pull = context.socket(zmq.PULL)
        pull.bind(f"inproc://replica-{i}")
        push = context.socket(zmq.PUSH)
        push.connect(f"inproc://replica-{i}")
        pairs.append((push, pull))
    yield pairs
    for push, pull in pairs:
        push.close(linger=0)
        pull.close(linger=0)
    context.term()


def test_equal_prompts_of_a_call_share_a_replica_and_prefixes_follow(sockets):
    replicas = Replicas([push for push, _ in sockets])
    same = replicas.assign([PREFIX + [1]] * 4)  # n = 4 choices
    assert len(set(same)) == 1
    other = replicas.assign([list(range(500, 560))])  # a new prompt goes to the emptier replica
    assert other != [same[0]]
    follow = replicas.assign([PREFIX + [2], PREFIX + [3]])  # fork branches over the prefix
    assert follow == [same[0]] * 2
    busy = [0, 0]
    busy[same[0]], busy[other[0]] = 6, 1
    assert [r.in_flight for r in replicas.all] == busy
    replicas.finished(same[0])
    assert replicas.all[same[0]].in_flight == 5


def test_a_dead_replica_gets_nothing_and_refuses_sends(sockets):
    replicas = Replicas([push for push, _ in sockets])
    first = replicas.assign([PREFIX])[0]
    replicas.mark_dead(first, "gone")
    assert replicas.assign([PREFIX, PREFIX + [9]]) == [1 - first] * 2
    with pytest.raises(SchedulerUnavailable, match="gone"):
        replicas.send(first, StepOutput([], 0, 0))
    replicas.send(1 - first, StepOutput([], 3, 1))
    assert decode(sockets[1 - first][1].recv()).num_running == 3


def test_replica_index_travels_in_the_scheduler_messages():
    msg = decode(encode(StepOutput([], 1, 0, replica=1)))
    assert msg.replica == 1 and decode(encode(StepOutput([], 1, 0))).replica == 0


def test_merged_stats_sum_counts_and_keep_each_replica():
    one, two = (
        {"kv_slots_used": 3, "time": 5.0, "name": "a"},
        {"kv_slots_used": 4, "time": 7.0, "name": "a"},
    )
    merged = merge_stats({0: one, 1: two})
    assert merged["kv_slots_used"] == 7 and merged["time"] == 7.0 and merged["name"] == "a"
    assert [r["replica"] for r in merged["replicas"]] == [0, 1]
    assert merged["replicas"][1]["kv_slots_used"] == 4


def test_round_robin_skips_dead_replicas_and_unknown_policies_are_named():
    router = RoundRobinRouter(3)
    router.mark_dead(1)
    assert [router.route([], [0, 0, 0]) for _ in range(4)] == [0, 2, 0, 2]
    with pytest.raises(ValueError, match="cache-aware, round-robin"):
        make_router("random", 2)
