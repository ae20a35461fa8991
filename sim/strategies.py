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


ClockReading = tuple[int, int, int | None]  # (real time, node TIME, the reading it went back to)


@st.composite
def clock_traces(draw: st.DrawFn, go_back: bool = False) -> tuple[int, list[ClockReading]]:
    """A skew and readings of one repository slot's clock in real-time order (schemas/README.md,
    A7): node errors may fall by any amount (a clock stepping back, a failover to a replica
    behind) but never rise more than ``skew`` above the lowest seen so far (the forward gain).
    With ``go_back``, before a reading the slot may go back to its state just after an earlier
    reading (a failover to a replica that lags, a restore); else the third field is None."""
    skew = draw(st.integers(0, 5_000))
    t, lowest, out = 0, draw(st.integers(-50_000, 50_000)), []
    for i in range(draw(st.integers(2, 12))):
        t += draw(st.integers(0, 20_000))
        if draw(st.booleans()):
            lowest -= draw(st.integers(0, 60_000))
        error = lowest + draw(st.integers(0, skew))
        back = draw(st.one_of(st.none(), st.integers(0, i - 1))) if go_back and i else None
        out.append((t, 10**9 + t + error, back))  # (epoch ms: positive)
    return skew, out
