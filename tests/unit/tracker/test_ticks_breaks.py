"""The Ticker tells the service's relay of every stripe it reads as broken (pure parts: which
incarnation, how often)."""

from __future__ import annotations

from typing import Any

from core.continuity import Domain
from core.settings import Settings
from schemas import control
from tracker.ticks import Ticker, break_incarnation


class _Redis:
    def register_script(self, _: str) -> Any:
        return None


def ticker(resend_interval: float) -> Ticker:
    settings = Settings().replace(resend_interval_seconds=resend_interval)
    return Ticker(settings, _Redis(), None, b"k", None, None)  # type: ignore[arg-type]


def test_a_break_is_reported_under_the_stripes_incarnation_or_the_repositorys() -> None:
    bound = Domain(incarnation="i2", broken="x")
    unbound = Domain(broken="an event of stripe 5, which the repository did not declare")
    assert break_incarnation([bound, Domain()], 0) == "i2"
    assert break_incarnation([unbound, Domain(incarnation="i1")], 0) == "i1"
    assert break_incarnation([unbound, Domain()], 0) is None


def test_a_broken_stripe_is_told_once_per_interval_for_as_long_as_it_stays_broken() -> None:
    t = ticker(3600.0)
    domains = [Domain(incarnation="i", broken="gone " * 400), Domain(incarnation="i")]
    first = t._breaks("r", domains)
    assert first == [control.broken("r", 0, "i", "gone " * 400)]
    assert len(first[0].reason) == control.MAX_REASON
    assert t._breaks("r", domains) == []  # within the interval
    assert t._breaks("q", domains) == [control.broken("q", 0, "i", "gone " * 400)]
    assert t._breaks("r", [Domain(incarnation="i"), domains[1]]) == []  # unbroken: forgotten
    assert t._breaks("r", domains) == first  # broken again: told at once
    again = ticker(1e-9)
    assert again._breaks("r", domains) == again._breaks("r", domains) == first  # it repeats
    assert again._breaks("r", [Domain(broken="x"), Domain()]) == []  # no incarnation known
