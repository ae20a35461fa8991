"""Holds as claims (schemas/holds.py): the pure specification, and holds.lua agreeing with it on
the real Redis for random sequences of claims added and removed."""

from __future__ import annotations

import orjson

from schemas import holds
from schemas.holds import LEGACY_CLAIM, dlq_claim


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





def test_each_party_lifts_only_its_own_claim() -> None:
    """`hold remove` (operator) and `hold remove --restore` (restore) each name one claim: a
    legal hold on a restored object outlives the restore's release, and the reverse."""
    assert holds.RELEASABLE == {holds.OPERATOR: holds.OPERATOR_CLAIM,
                                holds.RESTORE: holds.RESTORE_CLAIM}
    v = holds.add(None, holds.RESTORE_CLAIM, {"reason": "restored", "source": "restore"})
    v = holds.add(orjson.dumps(v), holds.OPERATOR_CLAIM, {"reason": "legal", "source": "operator"})
    for party, other in ((holds.RESTORE, holds.OPERATOR_CLAIM),
                         (holds.OPERATOR, holds.RESTORE_CLAIM)):
        removal, after = holds.remove(orjson.dumps(v), [holds.RELEASABLE[party]])
        assert removal == holds.Removal("kept", (holds.RELEASABLE[party],), (other,))
        assert after is not None and set(after["claims"]) == {other}


def test_restore_claims_an_address_only_while_no_reaper_does() -> None:
    """A reaper's claim (in the claims set, or a record saying reaping, whatever its lease)
    refuses restore's claim with nothing written; otherwise restore's claim joins the others."""
    claim = {"reason": "restored from quarantine", "source": "restore", "at_ms": 5}
    legal = orjson.dumps(holds.add(None, holds.OPERATOR_CLAIM, {"reason": "legal"}))
    for state, in_claims in (("reaping", False), ("reaped", True), (None, True),
                             ("reaping", True)):
        got, value = holds.restore_claim(legal, claim, state=state, in_claims=in_claims,
                                         lease_until="1700", claimer="reaper-1")
        assert got == holds.RestoreClaim("claimed", False, state or "", 1700, "reaper-1")
        assert value is None
    for state in (None, "reaped", "unreferenced", "staged", "committed"):
        got, value = holds.restore_claim(legal, claim, state=state, in_claims=False)
        assert got == holds.RestoreClaim("held", True, state or "")
        assert value is not None and set(value["claims"]) == {"operator", "restore"}
        again, _ = holds.restore_claim(orjson.dumps(value), claim, state=state, in_claims=False)
        assert again.status == "held" and not again.added  # a second restore: no new claim
    assert holds.restore_claim(None, claim, state="reaping", in_claims=False,
                               lease_until="soon")[0].lease_until is None
