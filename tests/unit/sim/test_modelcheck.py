"""The model check of the continuity protocol (sim/modelcheck.py) at small bounds: the correct
protocol is safe over every reachable state, without faults and under each fault kind, and
each seeded bug and each limit of the contract is found with a counterexample trace.

Budget: every test here runs well under 20 s, and all of them in about 25 s of CPU on this
2-core machine (``./dev modelcheck`` runs the larger bounds)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from schemas import events as ev
from sim.modelcheck import (
    BOUNDS,
    BUG_FAULTS,
    LIMITS,
    Bug,
    Case,
    Fault,
    Result,
    check,
    main,
    make_event,
)

TINY = BOUNDS["tiny"]
# A store restored re-runs the service from its backup: one change fewer keeps it small.
CORRECT = {None: TINY, Fault.LOSE: TINY, Fault.REPLACE: TINY, Fault.DUP: TINY,
           Fault.REDIS: replace(TINY, log=1), Fault.STORE: replace(TINY, seqs=2),
           Fault.STEP: replace(TINY, skew=1), Fault.BACK: TINY}


def found(r: Result) -> str:
    assert r.trace is not None, f"not found in {r.states} states"
    text = "\n".join(r.trace)
    print(text)  # the counterexample, shown with -s or on failure
    assert r.trace[-1].startswith("VIOLATION: ")
    assert "reaper: deletes" in text
    return text


@pytest.mark.parametrize("fault", list(CORRECT), ids=lambda f: f or "none")
def test_the_correct_protocol_is_safe(fault: Fault | None) -> None:
    r = check(CORRECT[fault], None, [fault] if fault else [])
    assert r.complete and r.safe, r.trace
    assert r.states > 4000  # the bound is not empty: writes, copies, deletes, faults


@pytest.mark.parametrize("bug", list(Bug), ids=lambda b: b.value)
def test_each_seeded_bug_is_found(bug: Bug) -> None:
    text = found(check(replace(TINY, skew=1) if bug is Bug.RAW_TICK else TINY, bug,
                       BUG_FAULTS.get(bug, ())))
    # Each counterexample goes through what the bug breaks.
    needs = {Bug.APPLY_TIME: "consumes watermark", Bug.NO_PREFIX: "consumes watermark",
             Bug.PUBLISHED_M: "answers tick", Bug.SLOW_COPY: "object_copied",
             Bug.SEQ_REUSE: "incarnation i0 (fault)", Bug.BROKER_PROGRESS: "log: replaced",
             Bug.RAW_TICK: "clock steps forward", Bug.NODE_CLOCK: "clock steps back"}
    assert needs[bug] in text


def test_the_broker_progress_proof_holds_while_the_log_is_intact() -> None:
    """Bug f needs the log replaced: it is today's proof, sound over the log it reads."""
    r = check(TINY, Bug.BROKER_PROGRESS)
    assert r.complete and r.safe


@pytest.mark.parametrize("case", LIMITS, ids=lambda c: c.name.split(": ")[1])
def test_the_limits_of_the_contract_are_counterexamples(case: Case) -> None:
    """A4 must be strict (a copy commits *less* than grace after its read), and a restored
    store brings back references to objects reaped since its copy if the copy is older than
    grace."""
    found(check(case.bounds(TINY), case.bug, case.faults))


def test_two_branches_commits_and_resets_are_safe() -> None:
    r = check(replace(TINY, branches=2, commits=True, resets=True, log=1))
    assert r.complete and r.safe
    assert r.states > 50_000


def test_stripes_the_horizon_is_the_least_of_theirs() -> None:
    """A branch per stripe; a copy into the other stripe is certified by that stripe's
    watermark, which a wrong M of one stripe lets through."""
    stripes = replace(TINY, branches=2, stripes=2, seqs=2, clock=1)
    r = check(stripes)
    assert r.complete and r.safe
    text = found(check(stripes, Bug.PUBLISHED_M))
    assert "stripe 1" in text


def test_a_state_limit_is_reported_incomplete() -> None:
    r = check(TINY, max_states=100)
    assert not r.complete and r.safe and r.verdict.startswith("safe so far")


def test_the_model_s_events_are_valid_contract_events() -> None:
    """Every kind of change the model service makes decodes as the contract says."""
    descs = [("w", "main", "main1", "s3://bkt/r/a0"), ("y", "dev", "dev1", "s3://bkt/r/a0", 2),
             ("d", "main", "main1", "s3://bkt/r/a0", "w0.1.0"), ("c", "main", "main1", "main2", 2),
             ("x", "main", "main2", "main3", 3)]
    for desc in descs:
        e = make_event(desc, "0.1.0")
        assert ev.decode(ev.encode(e)) == e


def test_the_command_prints_a_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--bound", "tiny", "--only", "bug b"]) == 0
    out = capsys.readouterr().out
    assert "bug b: watermark taken without prefix >= M" in out
    assert "1 of 1 as expected" in out
