"""Holds as claims (schemas/holds.py): the pure specification, and holds.lua agreeing with it on
the real Redis for random sequences of claims added and removed."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from schemas import holds
from schemas.holds import dlq_claim

# Every check holds on one Redis and on a real three-node Redis Cluster (issue 19 item 9).
BOTH_TOPOLOGIES = pytest.mark.parametrize("topology", ["single", "cluster"], indirect=True)






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


# --- restore's claim: placed only while no reaper claims the address ----------------------------

RAW_HOLDS = [None, b"plain text", orjson.dumps(holds.add(None, "operator", {"reason": "legal"})),
             orjson.dumps(holds.add(None, "restore", {"reason": "restored", "at_ms": 1}))]


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@BOTH_TOPOLOGIES
@given(raw=st.sampled_from(RAW_HOLDS),
       state=st.sampled_from([None, "", "reaped", "reaping", "unreferenced", "staged"]),
       in_claims=st.booleans(), lease=st.sampled_from([None, "1764000000000", "x"]),
       claimer=st.sampled_from([None, "reaper-1"]))
def test_the_restore_claim_script_agrees_with_the_specification(
        redis_client: Any, raw: bytes | None, state: str | None, in_claims: bool,
        lease: str | None, claimer: str | None) -> None:
    from schemas.layout import RepoKeys

    address = "s3://b/r/data/g"
    k = RepoKeys("holdtest")
    redis_client.delete(k.holds, k.claims, k.address(address))
    if raw is not None:
        redis_client.hset(k.holds, address, raw)
    fields = {n: v for n, v in (("state", state), ("lease_until", lease),
                                ("claimer", claimer)) if v is not None}
    if fields:
        redis_client.hset(k.address(address), mapping=fields)
    if in_claims:
        redis_client.zadd(k.claims, {address: 1})
    claim = {"reason": "restored from quarantine", "source": "restore", "at_ms": 7}
    want, value = holds.restore_claim(raw, claim, state=state if fields else None,
                                      in_claims=in_claims, lease_until=lease, claimer=claimer)
    got = holds.place_restore_claim(redis_client, "holdtest", address, claim)
    assert got == want
    stored = redis_client.hget(k.holds, address)
    if value is None:  # nothing written
        assert (stored.encode() if stored is not None else None) == raw
    else:
        assert orjson.loads(stored) == value
    assert got.status == ("claimed" if in_claims or state == "reaping" else "held")
