"""Holds as claims (schemas/holds.py): the pure specification, and holds.lua agreeing with it on
the real Redis for random sequences of claims added and removed."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from schemas import holds
from schemas.holds import LEGACY_CLAIM, dlq_claim

# Every check holds on one Redis and on a real three-node Redis Cluster (issue 19 item 9).
BOTH_TOPOLOGIES = pytest.mark.parametrize("topology", ["single", "cluster"], indirect=True)


def test_a_hold_is_lifted_with_its_last_claim_only() -> None:
    a, b = dlq_claim("events", 0, 7), dlq_claim("events", 1, 3)
    v = holds.add(None, a, {"reason": "bad size", "source": "dlq", "at_ms": 10})
    v = holds.add(orjson.dumps(v), b, {"reason": "bad type", "source": "dlq", "at_ms": 5})
    assert set(v["claims"]) == {a, b}
    assert v["reason"] == "bad type (+1 more)" and v["at_ms"] == 5  # the oldest claim
    removal, v2 = holds.remove(orjson.dumps(v), [a])
    assert removal == holds.Removal("kept", (a,), (b,)) and v2 is not None
    removal, _ = holds.remove(orjson.dumps(v2), [a])  # resolving twice removes nothing
    assert removal == holds.Removal("kept", (), (b,))
    removal, v4 = holds.remove(orjson.dumps(v2), [b])
    assert removal.status == "lifted" and v4 is None
    assert holds.remove(None, [a])[0].status == "none"


def test_an_old_shape_hold_is_one_claim_only_force_lifts() -> None:
    old = orjson.dumps({"reason": "dead-lettered", "source": "dlq", "at_ms": 1, "partition": 0})
    assert holds.claims_of(old) == {LEGACY_CLAIM: orjson.loads(old)}
    assert holds.claims_of("legal hold") == {LEGACY_CLAIM: {"reason": "legal hold",
                                                            "source": "?"}}
    removal, value = holds.remove(old, [LEGACY_CLAIM, holds.OPERATOR_CLAIM])
    assert removal == holds.Removal("kept", (), (LEGACY_CLAIM,)) and value is not None
    v = holds.add(old, holds.OPERATOR_CLAIM, {"reason": "legal", "source": "operator"})
    assert set(v["claims"]) == {LEGACY_CLAIM, holds.OPERATOR_CLAIM}
    removal, value = holds.remove(orjson.dumps(v), [], force=True)
    assert removal.status == "lifted" and removal.removed == (LEGACY_CLAIM, "operator")


# --- holds.lua == the specification, on the real Redis ---------------------------------------

IDS = ["operator", "restore", "legacy", dlq_claim("e", 0, 1), dlq_claim("e", 0, 2),
       dlq_claim("e", 3, 1)]
TARGETS = ["s3://b/r/data/a", "s3://b/r/data/b", "s3://b/r/"]
claim_st = st.fixed_dictionaries({"reason": st.sampled_from(["", "bad", "legal hold", "é"]),
                                  "source": st.sampled_from(["dlq", "operator", "", "restore"]),
                                  "at_ms": st.one_of(st.none(), st.integers(0, 2**41))})
op_st = st.one_of(
    st.tuples(st.just("add"), st.booleans(),
              st.lists(st.tuples(st.sampled_from(TARGETS), st.sampled_from(IDS), claim_st),
                       min_size=1, max_size=4)),
    st.tuples(st.just("remove"), st.sampled_from(TARGETS), st.booleans(),
              st.lists(st.sampled_from(IDS), max_size=3)),
    st.tuples(st.just("old"), st.sampled_from(TARGETS),
              st.sampled_from([b'{"reason": "x", "source": "dlq", "at_ms": 3}', b"plain text",
                               b'{"reason": "y"}'])),
)


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@BOTH_TOPOLOGIES
@given(ops=st.lists(op_st, max_size=12))
@pytest.mark.integration
def test_the_script_agrees_with_the_specification(redis_client: Any, ops: list[Any]) -> None:
    key = "hd:{holdtest}:holds"
    redis_client.delete(key)
    model: dict[str, bytes] = {}
    for op in ops:
        if op[0] == "add":
            _, replace, items = op
            want = 0
            for target, cid, claim in items:
                before = holds.claims_of(model.get(target))
                want += cid not in before
                model[target] = orjson.dumps(holds.add(model.get(target), cid, claim, replace))
            assert holds.add_claims(redis_client, key, items, replace) == want
        elif op[0] == "remove":
            _, target, force, ids = op
            removal, value = holds.remove(model.get(target), ids, force)
            if value is None:
                model.pop(target, None)
            elif removal.removed:  # (nothing removed: the stored value is left as it was)
                model[target] = orjson.dumps(value)
            assert holds.remove_claims(redis_client, key, target, ids, force) == removal
        else:
            _, target, raw = op
            model[target] = raw
            redis_client.hset(key, target, raw)  # a hold stored by an older version
        stored = {t: v.encode() for t, v in redis_client.hgetall(key).items()}
        assert set(stored) == set(model)
        for target, raw in model.items():  # as written by an older version, or the same json
            assert stored[target] == raw or orjson.loads(stored[target]) == orjson.loads(raw)
