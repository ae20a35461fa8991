"""Hypothesis strategies shared by tests: random raw address records (contract violations,
unreadable fields and all) for the record codec, the judgment and the scripts that read them."""

from __future__ import annotations

from hypothesis import strategies as st

from schemas.records import AddressRecord

REFS = ["r0", "r1", "r2"]
TOKENS = ["t0", "t1", "t2"]
TIMES = st.one_of(st.none(), st.integers(0, 20).map(lambda k: k * 10_000))


@st.composite
def records(draw: st.DrawFn) -> AddressRecord:
    adds = draw(st.dictionaries(st.sampled_from(REFS), st.sampled_from(TOKENS), max_size=3))
    removes = draw(st.dictionaries(st.sampled_from(REFS), st.sampled_from(TOKENS), max_size=3))
    flag = draw(st.sampled_from([None, None, "1", "c7"]))
    return AddressRecord(
        adds=adds, removes=removes,
        state=draw(st.sampled_from([None, "staged", "committed", "issued", "unreferenced",
                                    "reaping", "reaped", "martian"])),
        since=draw(TIMES), committed=flag is not None, committed_value=flag,
        issued_until=draw(TIMES), size=draw(st.none() | st.integers(0, 10)),
        lease_until=draw(TIMES), claimer=draw(st.sampled_from([None, "a", "b"])),
        reaped_at=draw(TIMES), doubt=draw(st.sampled_from([False, False, False, True])))
