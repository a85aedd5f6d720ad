"""Consistent hashing with bounded loads: stability, balance, bounds, affinity reasons."""

from __future__ import annotations

import collections
import json
import math
import os
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chatfleet.errors import ConfigError
from chatfleet.gateway.routing import Affinity, HashRing, make_routing_policy

REPLICAS = [f"http://10.0.0.{i}:8000" for i in range(1, 5)]
KEYS = [f"session-{i}" for i in range(2000)]


def test_placement_is_identical_in_another_process():
    here = {k: HashRing(REPLICAS).home(k) for k in KEYS[:300]}
    code = (
        "import json,sys; from chatfleet.gateway.routing import HashRing; "
        "r=HashRing(json.loads(sys.argv[1])[::-1]); "  # same set, other order
        "print(json.dumps({k: r.home(k) for k in json.loads(sys.argv[2])}))"
    )
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run([sys.executable, "-c", code, json.dumps(REPLICAS), json.dumps(KEYS[:300])],
                         capture_output=True, text=True, env=env, check=True)
    assert json.loads(out.stdout) == here


def test_keys_spread_evenly_over_replicas():
    ring = HashRing(REPLICAS, virtual_nodes=160)
    counts = collections.Counter(ring.home(k) for k in KEYS)
    mean = len(KEYS) / len(REPLICAS)
    assert set(counts) == set(REPLICAS)
    assert all(0.7 * mean < c < 1.3 * mean for c in counts.values()), counts


def test_removing_a_replica_moves_only_its_sessions():
    policy = make_routing_policy("bounded_load", REPLICAS)
    before = {k: policy.route(k, REPLICAS, {}).replica for k in KEYS}
    survivors = REPLICAS[1:]
    after = {k: policy.route(k, survivors, {}) for k in KEYS}
    for key, decision in after.items():
        if before[key] != REPLICAS[0]:
            assert decision.replica == before[key] and decision.affinity is Affinity.KEPT
        else:
            assert decision.affinity is Affinity.BROKEN and decision.reason == "home_down"
            assert decision.home == REPLICAS[0]
    moved = collections.Counter(after[k].replica for k in KEYS if before[k] == REPLICAS[0])
    assert len(moved) == len(survivors)  # the dead replica's sessions spread, not pile up


def test_one_hot_session_spills_at_the_bound():
    policy = make_routing_policy("bounded_load", REPLICAS, load_factor=1.25)
    loads = collections.Counter()
    for _ in range(400):
        decision = policy.route("hot", REPLICAS, loads)
        loads[decision.replica] += 1
    mean = 400 / len(REPLICAS)
    assert max(loads.values()) <= math.ceil(1.25 * mean)
    home = HashRing(REPLICAS).home("hot")
    assert loads[home] == max(loads.values())


@settings(max_examples=200, deadline=None)
@given(key=st.text(min_size=1, max_size=20),
       loads=st.lists(st.integers(0, 50), min_size=4, max_size=4),
       down=st.sets(st.integers(0, 3), max_size=3),
       full=st.sets(st.integers(0, 3), max_size=4))
def test_bounded_load_rule(key, loads, down, full):
    policy = make_routing_policy("bounded_load", REPLICAS, load_factor=1.25)
    load_of = dict(zip(REPLICAS, loads, strict=True))
    candidates = [r for i, r in enumerate(REPLICAS) if i not in down]
    full_set = {REPLICAS[i] for i in full}
    decision = policy.route(key, candidates, load_of, full_set)
    bound = math.ceil(1.25 * (sum(load_of[c] for c in candidates) + 1) / len(candidates))
    open_ = [c for c in candidates if c not in full_set] or candidates
    assert decision.replica in open_
    home = HashRing(REPLICAS).home(key)
    assert decision.home == home
    if all(load_of[c] >= bound for c in open_):  # only replicas over the bound have room
        assert load_of[decision.replica] == min(load_of[c] for c in open_)
        return
    assert load_of[decision.replica] < bound
    if home in open_ and load_of[home] < bound:
        assert decision.replica == home and decision.affinity is Affinity.KEPT
    else:
        assert decision.affinity is Affinity.BROKEN
        expected = ("home_down" if home not in candidates else
                    "home_full" if home not in open_ else "over_bound")
        assert decision.reason == expected


def test_a_full_home_is_passed_over_only_while_another_replica_has_room():
    policy = make_routing_policy("bounded_load", REPLICAS)
    home = HashRing(REPLICAS).home("k")
    spill = policy.route("k", REPLICAS, {}, full={home})
    assert spill.replica != home and spill.reason == "home_full"
    assert policy.route("k", REPLICAS, {}, full=set(REPLICAS)).replica == home  # all full: queue at home


def test_keyless_requests_go_to_the_least_loaded():
    policy = make_routing_policy("bounded_load", REPLICAS)
    decision = policy.route(None, REPLICAS, {REPLICAS[0]: 3, REPLICAS[1]: 1, REPLICAS[2]: 0, REPLICAS[3]: 2})
    assert decision.replica == REPLICAS[2] and decision.affinity is Affinity.NONE


def test_plain_consistent_hash_never_spills():
    policy = make_routing_policy("consistent_hash", REPLICAS)
    home = HashRing(REPLICAS).home("k")
    assert policy.route("k", REPLICAS, {home: 10_000}).replica == home


def test_unknown_policy_lists_the_valid_ones():
    with pytest.raises(ConfigError, match="bounded_load.*consistent_hash.*least_loaded"):
        make_routing_policy("random", REPLICAS)
