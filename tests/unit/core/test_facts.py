"""The durable facts' pure parts (core/facts.py): names, strict reading, the currency judgment
and adoption."""

from __future__ import annotations

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from core.facts import (
    HOLD_ADD,
    HOLD_REMOVE,
    PAUSE,
    FactError,
    FactsProof,
    adoption,
    decode_fact,
    fact_name,
    facts_home,
    judge,
    make_fact,
    seq_of,
)


def test_names_sort_in_seq_order_and_read_back() -> None:
    assert fact_name(7) == "000000000007.json"
    assert sorted(fact_name(s) for s in (10, 9, 100)) == [fact_name(s) for s in (9, 10, 100)]
    assert seq_of(fact_name(42)) == 42
    for other in ("000000000000.json", "7.json", "000000000007.txt", "x", "00000000000a.json"):
        assert seq_of(other) is None
    assert facts_home("s3://b/ns/", "r/1") == "s3://b/ns/_hardelete/facts/r%2F1/"


def test_a_fact_is_read_strictly() -> None:
    f = make_fact("r", 3, HOLD_ADD, {"hash": "holds", "replace": True,
                                     "items": [["s3://b/ns/a", "operator", {"reason": "x"}]]},
                  at_ms=5, by="me")
    assert decode_fact(f.encode(), repository="r", seq=3) == f
    with pytest.raises(FactError, match="names repository"):
        decode_fact(f.encode(), repository="other", seq=3)
    with pytest.raises(FactError, match="names repository"):
        decode_fact(f.encode(), repository="r", seq=4)  # a fact copied under another name
    d = orjson.loads(f.encode())
    for bad in ({**d, "format": 2}, {**d, "kind": "lift_all"}, {**d, "body": {"hash": "x"}},
                {**d, "at_ms": "5"}, {k: v for k, v in d.items() if k != "by"}):
        with pytest.raises(FactError):
            decode_fact(orjson.dumps(bad), repository="r", seq=3)
    with pytest.raises(FactError, match="not json"):
        decode_fact(b"{", repository="r", seq=3)
    with pytest.raises(ValueError, match="pause"):
        make_fact("r", 1, PAUSE, {"op": "add", "who": "me"}, at_ms=1, by="me")
    make_fact("r", 1, HOLD_REMOVE, {"hash": "hold_prefixes", "target": "s3://b/ns/p/",
                                    "claim_ids": ["operator"], "force": False}, at_ms=1, by="me")


@given(st.integers(0, 50), st.integers(0, 20))
def test_a_copy_behind_a_gapless_home_misses_exactly_the_rest(mirrored: int, more: int) -> None:
    listed = ([mirrored] if mirrored else []) + list(range(mirrored + 1, mirrored + 1 + more))
    cur = judge(mirrored, listed)
    assert cur.problem is None
    assert cur.missing == tuple(range(mirrored + 1, mirrored + 1 + more))
    assert cur.durable == mirrored + more


@given(st.integers(1, 50), st.sets(st.integers(1, 80), max_size=10))
def test_a_home_without_the_copys_last_fact_proves_nothing(mirrored: int,
                                                           others: set[int]) -> None:
    listed = sorted(s for s in others if s != mirrored)
    cur = judge(mirrored, listed)
    assert cur.problem is not None and f"lacks fact {mirrored}" in cur.problem
    assert cur.missing == ()


def test_a_gap_proves_nothing() -> None:
    cur = judge(2, [2, 3, 5])
    assert cur.problem == "the durable home has a gap at fact 4" and cur.missing == ()
    assert judge(0, [2]).problem == "the durable home has a gap at fact 1"


def test_the_gate_trusts_a_copy_only_at_or_past_the_proof() -> None:
    proof = FactsProof("r", 5)
    assert proof.copy_problem("r", 5) is None and proof.copy_problem("r", 6) is None
    assert "went back" in (proof.copy_problem("r", 4) or "")
    assert "went back" in (proof.copy_problem("r", None) or "")
    assert "repository 'r'" in (proof.copy_problem("s", 5) or "")
    assert "not proven" in (FactsProof("r", 0, "the home is gone").copy_problem("r", 9) or "")


def test_adoption_records_every_claim_as_it_is() -> None:
    hold = orjson.dumps({"claims": {"operator": {"reason": "legal", "at_ms": 1},
                                    "dlq:e:0:1": {"reason": "dead letter", "at_ms": 2}},
                         "reason": "legal", "source": "operator", "at_ms": 1})
    facts = adoption("r", {b"s3://b/ns/a": hold}, {"s3://b/ns/p/": "old text hold"},
                     orjson.dumps({"claims": {"ann@h": {"reason": "incident", "at_ms": 3}}}))
    assert facts[0] == (HOLD_ADD, {"hash": "holds", "replace": False, "items": [
        ["s3://b/ns/a", "operator", {"reason": "legal", "at_ms": 1}],
        ["s3://b/ns/a", "dlq:e:0:1", {"reason": "dead letter", "at_ms": 2}]]})
    assert facts[1] == (HOLD_ADD, {"hash": "hold_prefixes", "replace": False, "items": [
        ["s3://b/ns/p/", "legacy", {"reason": "old text hold", "source": "?"}]]})
    assert facts[2] == (PAUSE, {"op": "add", "who": "ann@h", "reason": "incident",
                                "at_ms": 3})
    assert adoption("r", {}, {}, None) == []
    for kind, body in facts:
        make_fact("r", 1, kind, body, at_ms=0, by="adoption")  # each is a valid fact


def test_a_fact_is_signed_over_everything_it_says() -> None:
    from dataclasses import replace

    from core.facts import sign, verified

    f = make_fact("r", 2, HOLD_REMOVE, {"hash": "holds", "target": "s3://b/ns/a",
                                        "claim_ids": ["operator"], "force": False},
                  at_ms=5, by="me")
    signed = sign(b"k", f)
    assert verified(b"k", signed) and not verified(b"other", signed)
    assert not verified(b"k", f) and not verified(None, signed)
    for changed in (replace(signed, seq=3), replace(signed, repository="s"),
                    replace(signed, by="you"), replace(signed, at_ms=6),
                    replace(signed, body={**signed.body, "force": True})):
        assert not verified(b"k", changed)
    assert decode_fact(signed.encode(), repository="r", seq=2) == signed
