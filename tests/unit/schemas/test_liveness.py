"""The one judgment of liveness (``schemas.liveness``) and the one record codec
(``schemas.records``): examples for every reason, and properties over random records."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reconciler.records import verdict
from schemas.liveness import Guards, Keep, judge
from schemas.records import (
    BranchRecord,
    CommitRecord,
    RecordError,
    decode_address,
    decode_branch,
    decode_commit,
    decode_token,
    encode_address,
    encode_branch,
    encode_commit,
    encode_token,
    token_state,
)
from sim.strategies import TOKENS, records

NOW, H, G = 100_000, 90_000, 5_000  # now, horizon, grace: the bound is 85_000


def J(fields: dict[str, str], tokens: dict[str, str | None] | None = None, **kw: Any) -> Any:
    args: dict[str, Any] = {"now_ms": NOW, "horizon_ms": H, "grace_ms": G}
    args.update(kw)
    return judge(decode_address(fields) if fields is not None else None, tokens or {}, **args)


UNREF = {"+r": "t", "-r": "t", "state": "unreferenced"}


def test_every_reason_online():
    old = {**UNREF, "since": "80000"}
    assert J(old, {"t": "dropped"}).may_delete
    assert J({**UNREF, "since": "86000"}, {"t": "dropped"}).reason == Keep.YOUNG
    assert J({**UNREF, "since": "86000"}, {"t": "dropped"}).eligible_at_ms == 91_000
    assert J(old, {"t": "dropped"}, horizon_ms=None).reason == Keep.NO_HORIZON
    assert J({"+r": "t", "state": "staged"}, {"t": "open:5"}).reason == Keep.STAGED
    assert J({"+r": "t", "state": "staged"}, {}).reason == Keep.STAGED  # unknown token keeps
    assert J({"+r": "t", "state": "committed", "committed": "1"},
             {"t": "committed"}).reason == Keep.COMMITTED
    assert J({**old, "committed": "c7"}, {"t": "dropped"}).reason == Keep.COMMITTED
    assert J({"+r": "t", "state": "unreferenced", "since": "1"},
             {"t": "weird"}).reason == Keep.DOUBT
    assert J({**old, "state": "reaping", "lease_until": str(NOW + 1), "claimer": "a"},
             {"t": "dropped"}).reason == Keep.CLAIMED
    # its own claim does not keep the reaper; an expired lease does not keep anyone
    assert J({**old, "state": "reaping", "lease_until": str(NOW + 1), "claimer": "a"},
             {"t": "dropped"}, claimer="a").may_delete
    assert J({**old, "state": "reaping", "lease_until": str(NOW - 1), "claimer": "a"},
             {"t": "dropped"}).may_delete
    assert J({**old, "state": "reaped"}, {"t": "dropped"}).reason == Keep.REAPED
    assert J({**old, "state": "staged"}, {"t": "dropped"}).reason == Keep.DOUBT
    assert J({**old, "state": "martian"}, {"t": "dropped"}).reason == Keep.DOUBT
    assert J({"state": "issued", "since": "1"}).reason == Keep.DOUBT  # issued without iu
    assert J({"state": "issued", "iu": str(NOW + 1), "since": str(NOW + 1)}).reason == \
        Keep.ISSUED
    assert J({"state": "issued", "iu": "86000", "since": "86000"}).reason == Keep.ISSUED
    assert J({"state": "issued", "iu": "85000", "since": "85000"}).may_delete
    assert J({**UNREF}, {"t": "dropped"}).reason == Keep.DOUBT  # no since
    assert J({**old, "since": "abc"}, {"t": "dropped"}).reason == Keep.DOUBT
    assert J({"size": "3"}).reason == Keep.DOUBT  # no state
    assert judge(None, {}, now_ms=NOW, horizon_ms=H, grace_ms=G).reason == Keep.GONE


def test_guards_keep_first():
    old = {**UNREF, "since": "1"}
    for name, reason in (("held", Keep.HELD), ("paused", Keep.PAUSED),
                         ("fail_closed", Keep.FAIL_CLOSED), ("not_owner", Keep.NOT_OWNER)):
        for path in ("online", "reconciler"):
            j = J(old, {"t": "dropped"}, path=path, guards=Guards(**{name: "why"}))
            assert j.reason == reason and j.detail == "why"
    assert judge(None, {}, now_ms=NOW, horizon_ms=H, grace_ms=G, path="reconciler",
                 guards=Guards(held="x")).reason == Keep.HELD


def test_reconciler_path():
    committed = {"+r": "t", "state": "committed", "committed": "1"}
    j = J(committed, {"t": "committed"}, path="reconciler")
    assert j.may_delete and j.kind == "committed"  # retention decides
    j = J({"+r": "t", "+s": "u", "committed": "1"}, {"t": "committed", "u": "open"},
          path="reconciler")
    assert j.reason == Keep.STAGED  # a shallow copy staged elsewhere keeps it
    assert J({**UNREF, "since": "1", "state": "reaped"}, {"t": "dropped"},
             path="reconciler").may_delete
    assert J({**UNREF, "since": "1"}, {"t": "dropped"}, path="reconciler",
             claimed=True).reason == Keep.CLAIMED
    # grace binds the reconciler too (issue 9 item 2)
    assert J({**UNREF, "since": "86000"}, {"t": "dropped"}, path="reconciler").reason == \
        Keep.YOUNG
    # the run's cutoff is an extra, earlier bound on an issued upload's expiry; the end of the
    # last reference is bound by the grace before the horizon only (the cutoff bounds the
    # object's age, in the listing)
    assert J({**UNREF, "since": "80000", "iu": "75000"}, {"t": "dropped"}, path="reconciler",
             cutoff_ms=70_000).reason == Keep.ISSUED
    assert J({**UNREF, "since": "80000", "iu": "65000"}, {"t": "dropped"}, path="reconciler",
             cutoff_ms=70_000).may_delete
    # without a horizon (legacy callers) only the cutoff bounds an issued upload
    j = J({**UNREF, "since": "99999"}, {"t": "dropped"}, path="reconciler", horizon_ms=None,
          cutoff_ms=50_000)
    assert j.may_delete and j.kind == "unreferenced"
    assert judge(None, {}, now_ms=NOW, horizon_ms=H, grace_ms=G, path="reconciler").may_delete


# --- random records -----------------------------------------------------------------------------

TOKEN_STATES = st.sampled_from([None, "open", "sealed", "committed", "dropped", "weird",
                                "open:17", "dropped:3"])
token_maps = st.dictionaries(st.sampled_from(TOKENS), TOKEN_STATES)
horizons = st.one_of(st.none(), st.integers(0, 22).map(lambda k: k * 10_000))
graces = st.sampled_from([0, 5_000, 10_000, 60_000])
paths = st.sampled_from(["online", "reconciler"])


@given(records())
def test_codec_round_trip(rec):
    assert decode_address(encode_address(rec)) == rec
    raw = {k.encode(): v.encode() for k, v in encode_address(rec).items()}
    assert decode_address(raw) == rec  # bytes from a client without decode_responses


def test_codec_tokens_branches_commits():
    assert decode_token(encode_token("sealed", 12)) == ("sealed", 12)
    assert token_state("open:5") == "open" and token_state(None) is None
    with pytest.raises(RecordError):
        decode_token("open")
    b = BranchRecord("c1", "t1", ("t0",))
    assert decode_branch(encode_branch(b)) == b
    c = CommitRecord(("p",), 1.5, "main", "s3://b/m")
    assert decode_commit(encode_commit(c)) == c
    with pytest.raises(RecordError, match="branch 'x'"):
        decode_branch("{", "x")
    with pytest.raises(RecordError, match="commit 'y'"):
        decode_commit('{"parents": []}', "y")
    bad = decode_address({"since": "x", "iu": "", "size": "nan"})
    assert set(bad.malformed) == {"since", "iu", "size"}


@settings(max_examples=400)
@given(records(), token_maps, horizons, graces, paths)
def test_live_references_and_guards_always_keep(rec, tokens, horizon, grace, path):
    j = judge(rec, tokens, now_ms=NOW, horizon_ms=horizon, grace_ms=grace, path=path)
    live = any(tokens.get(t) is None or str(tokens[t]).split(":")[0] in ("open", "sealed")
               for r, t in rec.adds.items() if rec.removes.get(r) != t)
    if rec.doubt:  # a ref id named with two tokens: kept on every path
        assert j.reason == Keep.DOUBT
    elif live:  # (a removal naming another token than the add's ends nothing)
        assert j.reason == Keep.STAGED
    guarded = judge(rec, tokens, now_ms=NOW, horizon_ms=horizon, grace_ms=grace, path=path,
                    guards=Guards(held="h"))
    assert not guarded.may_delete


@settings(max_examples=400)
@given(records(), token_maps, horizons, graces)
def test_online_deletes_only_proven_garbage_past_grace(rec, tokens, horizon, grace):
    j = judge(rec, tokens, now_ms=NOW, horizon_ms=horizon, grace_ms=grace)
    if j.may_delete:
        assert horizon is not None and rec.since is not None
        assert rec.since + grace <= horizon  # SPEC safety 2 on the tracker's clock
        assert not rec.committed and rec.state in ("unreferenced", "issued", "reaping")
        assert rec.issued_until is None or rec.issued_until <= min(NOW, horizon - grace)
        assert not rec.doubt
        assert all(str(tokens.get(t)).split(":")[0] == "dropped"
                   for r, t in rec.adds.items() if rec.removes.get(r) != t)


@settings(max_examples=400)
@given(records(), token_maps, horizons, horizons, graces, graces, paths)
def test_more_progress_or_less_grace_never_keeps_more(rec, tokens, h1, h2, g1, g2, path):
    lo_h, hi_h = sorted([h1, h2], key=lambda h: -1 if h is None else h)
    lo_g, hi_g = sorted([g1, g2])
    strict = judge(rec, tokens, now_ms=NOW, horizon_ms=lo_h, grace_ms=hi_g, path=path)
    loose = judge(rec, tokens, now_ms=NOW, horizon_ms=hi_h, grace_ms=lo_g, path=path)
    if lo_h is None and hi_h is not None and path == "reconciler":
        return  # no horizon on the reconciler path is the legacy reading, not a stricter one
    if strict.may_delete:
        assert loose.may_delete


@settings(max_examples=300)
@given(records(), token_maps, horizons, graces, st.booleans())
def test_records_verdict_is_the_judgment(rec, tokens, horizon, grace, claimed):
    fields = encode_address(rec)
    v = verdict(fields, token_states=tokens, cutoff_ms=150_000, now_ms=NOW, claimed=claimed,
                horizon_ms=horizon, grace_ms=grace)
    j = judge(rec, tokens, now_ms=NOW, horizon_ms=horizon, grace_ms=grace, path="reconciler",
              cutoff_ms=150_000, claimed=claimed)
    assert v.live == (not j.may_delete) and v.kind == j.kind
    assert v.reason == j.reason


def test_gate_guards_and_the_legacy_registry():
    from core.gate import Gate

    ns, inner = "s3://b/p/", "s3://b/p/r/"
    legacy = Gate()
    assert legacy.guards("P", ns, ns + "r/x") == Guards()  # no registry: namespace only
    assert legacy.guards("P", ns, "s3://b/q/x").not_owner
    assert legacy.guards("P", ns, ns + "_hardelete/m").not_owner
    reg = Gate(registry={ns: "P", inner: "R"})
    assert reg.repo_problem("P", ns) is None
    assert reg.guards("P", ns, ns + "r/x").not_owner  # inside R's namespace
    assert reg.guards("P", ns, ns + "x") == Guards()
    assert reg.repo_problem("R", "s3://b/p/r") is None  # spelled without the slash
    assert reg.repo_problem("Q", "s3://b/q/")[0] == "not_owner"  # type: ignore[index]
    held = Gate(holds={ns + "x": "legal"}, hold_prefixes={ns + "d/": "dlq"},
                global_fail_closed="lost", paused="ops")
    g = held.guards("P", ns, ns + "d/1")
    assert g.held == f"dlq (prefix {ns}d/)" and g.fail_closed == "all repositories: lost"
    assert g.paused == "ops"
    assert held.guards("P", ns, ns + "x").held == "legal"
    assert held.repo_problem("P", ns)[0] == "fail_closed"  # type: ignore[index]
