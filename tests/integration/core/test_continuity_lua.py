"""Differential test: ``core/continuity.lua`` (the continuity state in the repository's slot)
against ``core/continuity.py`` (the specification), on one Redis and on a real three-node
Redis Cluster.

Random sequences of admit / certify / break over 1-3 stripes and two incarnations go through
both; after every step the verdict, the stripe's state read back, its gaps and the
repository's horizon must be equal. Seqs and ticks near 2^53 - 1 check that no number loses a
digit on the way; ladders of watermarks pass ``PENDING_MAX``."""

from __future__ import annotations

import asyncio
import itertools
import json
import uuid
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from core.clients import redis_async
from core.clock import redis_time_ms
from core.continuity import (
    PENDING_MAX,
    SEQ_MAX,
    Admission,
    Domain,
    Watermark,
    admit,
    break_domain,
    certify,
    gaps,
    horizon,
    rebuilt,
    slot_clock,
)
from core.continuity_store import AsyncContinuityStore, ContinuityStore, compose
from schemas.layout import RepoKeys

BOTH_TOPOLOGIES = pytest.mark.parametrize("topology", ["single", "cluster"], indirect=True)
HC = [HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large]

# A fresh repository per example (the servers are flushed per test, not per example); some
# ids need the key encoding (a brace or a colon must not move the hash tag).
_REPOS = (f"{name}{n}" for n, name in zip(itertools.count(), itertools.cycle(
    ["r", "re}po:{x} ", "%41é"]), strict=False))


@dataclass(frozen=True)
class Admit:
    stripe: int
    inc: str
    seq: int


@dataclass(frozen=True)
class Certify:
    stripe: int
    inc: str
    seq: int
    tick: int
    applied: int = 0  # the seq applied at the tick: above seq, the watermark lies


@dataclass(frozen=True)
class Break:
    stripe: int
    reason: str


@dataclass(frozen=True)
class Rebuild:
    stripe: int
    inc: str
    counter: int


Step = Admit | Certify | Break | Rebuild

BIG = st.integers(SEQ_MAX - 3, SEQ_MAX)  # no digit may be lost on the way
INCS = st.sampled_from(["i1"] * 15 + ["i2"])  # a second incarnation now and then


@st.composite
def histories(draw: st.DrawFn) -> tuple[int, list[Step]]:
    stripes = draw(st.integers(1, 3))
    stripe = st.integers(0, stripes - 1)
    mark = st.one_of(st.integers(0, 16), BIG)
    tick = st.one_of(st.integers(1, 80), BIG)
    steps: list[Step] = []
    ladder = True  # at most one per history: it is 30-odd steps
    for _ in range(draw(st.integers(1, 40))):
        kind = draw(st.sampled_from(["admit"] * 6 + ["run"] * 2 + ["certify"] * 5
                                    + ["big", "ladder", "break", "rebuild"]))
        if kind == "ladder" and not ladder:
            continue
        if kind == "admit":
            steps.append(Admit(draw(stripe), draw(INCS), draw(st.integers(1, 10))))
        elif kind == "big":
            steps.append(Admit(draw(stripe), draw(INCS), draw(BIG)))
        elif kind == "run":  # a range delivered out of order: the prefix jumps over it
            k, a, n = draw(stripe), draw(st.integers(1, 10)), draw(st.integers(2, 8))
            order = draw(st.permutations(range(a, a + n)))
            steps.extend(Admit(k, "i1", seq) for seq in order)
        elif kind == "certify":
            m = draw(mark)
            applied = draw(st.sampled_from([0, 0, 0, m, max(m - 1, 0), m + 1]))
            steps.append(Certify(draw(stripe), draw(INCS), m, draw(tick), min(applied, SEQ_MAX)))
        elif kind == "ladder":  # more watermarks pending than PENDING_MAX keeps
            k, m, t = draw(stripe), draw(st.integers(0, 6)), draw(st.integers(1, 40))
            n = draw(st.integers(PENDING_MAX - 2, PENDING_MAX + 4))
            dm, dt = draw(st.integers(1, 3)), draw(st.integers(1, 3))
            steps.extend(Certify(k, "i1", m + i * dm, t + i * dt) for i in range(n))
            ladder = False
        elif kind == "rebuild":
            steps.append(Rebuild(draw(stripe), draw(st.sampled_from(["i1", "i2", "i3", "é"])),
                                 draw(st.integers(0, 12))))
        else:
            steps.append(Break(draw(stripe), draw(st.text(st.characters(codec="utf-8"),
                                                          max_size=4))))
    return stripes, steps


def _pure(d: Domain, s: Step) -> tuple[Domain, Admission | None]:
    if isinstance(s, Admit):
        return admit(d, s.inc, s.seq)
    if isinstance(s, Certify):
        return certify(d, s.inc, Watermark(s.seq, s.tick, s.applied)), None
    if isinstance(s, Rebuild):
        return rebuilt(d, s.inc, s.counter), None
    return break_domain(d, s.reason), None


def _lua(store: ContinuityStore, repo: str, s: Step) -> Admission | None:
    if isinstance(s, Admit):
        return store.admit(repo, s.stripe, s.inc, s.seq)
    if isinstance(s, Certify):
        store.certify(repo, s.stripe, s.inc, Watermark(s.seq, s.tick, s.applied))
    elif isinstance(s, Rebuild):
        store.rebuild(repo, s.stripe, s.inc, s.counter)
    else:
        store.break_domain(repo, s.stripe, s.reason)
    return None


@hsettings(max_examples=35, deadline=None, suppress_health_check=HC)
@given(history=histories(), limit=st.sampled_from([0, 1, 2, 16]))
@BOTH_TOPOLOGIES
def test_lua_agrees_with_the_pure_machine(settings, redis_client, history, limit):
    stripes, steps = history
    repo = next(_REPOS)
    store = ContinuityStore(redis_client)
    model = {k: Domain() for k in range(stripes)}
    for i, s in enumerate(steps):
        model[s.stripe], verdict = _pure(model[s.stripe], s)
        where = f"step {i}: {s}"
        assert _lua(store, repo, s) == verdict, where
        assert store.read(repo, s.stripe) == model[s.stripe], where
        assert store.gaps(repo, s.stripe, limit) == gaps(model[s.stripe], limit), where
        assert store.horizon(repo, stripes) == horizon(model.values()), where
        assert store.applied_max(repo, s.stripe) == model[s.stripe].applied_max, where
    for k in range(stripes):  # the stripes no step touched last
        assert store.read(repo, k) == model[k]


@hsettings(max_examples=60, deadline=None, suppress_health_check=HC)
@given(incs=st.lists(st.text(st.characters(max_codepoint=0xFF, codec="utf-8"), min_size=1,
                             max_size=6), min_size=2, max_size=2, unique=True))
def test_a_changed_incarnation_gives_the_pure_reason(settings, redis_client, incs):
    """The reason quotes both incarnations as Python's repr does (ASCII and Latin-1)."""
    repo = next(_REPOS)
    store = ContinuityStore(redis_client)
    d, _ = admit(Domain(), incs[0], 1)
    d, verdict = admit(d, incs[1], 2)
    assert store.admit(repo, 0, incs[0], 1) is Admission.APPLY
    assert store.admit(repo, 0, incs[1], 2) is verdict is Admission.REFUSED
    assert store.read(repo, 0) == d


@BOTH_TOPOLOGIES
def test_bad_input_is_refused_as_the_pure_machine_refuses_it(settings, redis_client):
    store = ContinuityStore(redis_client)
    for bad in (0, -1, SEQ_MAX + 1, True, 1.5):
        with pytest.raises(ValueError):
            admit(Domain(), "i1", bad)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match=r"^hardelete continuity: .*seq"):
            store.admit("r", 0, "i1", bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="incarnation"):
        store.admit("r", 0, "", 1)
    with pytest.raises(ValueError, match="watermark seq"):
        store.certify("r", 0, "i1", Watermark(-1, 5))
    with pytest.raises(ValueError, match="stripe"):
        store.admit("r", 64, "i1", 1)
    assert store.read("r", 0) == Domain()  # nothing was written
    assert not redis_client.keys("*")


@BOTH_TOPOLOGIES
def test_the_async_store_and_a_composed_script(settings, redis_client):
    """The asyncio adapter runs the same ops; another script composed with the library (as
    apply.lua and claims.lua will be) sees the state in the same slot."""
    async def run() -> tuple[Admission, Domain, int | None]:
        r = redis_async(settings)
        try:
            store = AsyncContinuityStore(r)
            await store.certify("r", 1, "i1", Watermark(3, 50))
            for seq in (3, 1):
                await store.admit("r", 1, "i1", seq)
            await store.certify("r", 0, "i1", Watermark(0, 40))
            verdict = await store.admit("r", 1, "i1", 2)
            return verdict, await store.read("r", 1), await store.horizon("r", 2)
        finally:
            await r.aclose()

    verdict, d, h = asyncio.run(run())
    assert verdict is Admission.APPLY and d.prefix == 3 and d.horizon_ms == 50 and h == 40
    assert ContinuityStore(redis_client).read("r", 1) == d
    body = "local C = continuity(ARGV[1]) return {C.admit(1, 'i1', 4), C.horizon(2)}"
    script = redis_client.register_script(compose(body))
    keys = RepoKeys("r")
    assert script(keys=[keys.continuity(1)], args=[keys.tag + ":"]) == ["apply", 40]


@BOTH_TOPOLOGIES
def test_the_slot_clock_never_goes_back(settings, redis_client):
    """``C.clock`` is ``core.continuity.slot_clock`` over the node's TIME: a high-water mark
    ahead of the node (a clock stepped back) is returned as is; one behind is moved on."""
    keys = RepoKeys("r")
    script = redis_client.register_script(compose(
        "local C = continuity(ARGV[1]) return string.format('%.0f', C.clock())"))
    now = redis_time_ms(redis_client)
    ahead = now + 3_600_000
    redis_client.set(keys.clock, str(ahead))
    assert int(script(keys=[keys.clock], args=[keys.tag + ":"])) == slot_clock(ahead, now)
    redis_client.set(keys.clock, "1000")
    read = int(script(keys=[keys.clock], args=[keys.tag + ":"]))
    assert read >= now and int(redis_client.get(keys.clock)) == read


@BOTH_TOPOLOGIES
def test_a_slot_holds_the_ticks_it_read_the_newest_64(settings, redis_client):
    """``C.issue``/``C.issued``: a watermark certifies only a tick the slot holds."""
    keys = RepoKeys("r")
    script = redis_client.register_script(compose(
        "local C = continuity(ARGV[1]) for i = 2, #ARGV do C.issue(ARGV[i]) end "
        "return {C.issued(1) and 1 or 0, C.issued(6) and 1 or 0, C.issued(70) and 1 or 0, "
        "C.issued(71) and 1 or 0}"))
    ticks = [str(r) for r in range(1, 71)]  # 70 ticks: the 6 oldest go
    assert script(keys=[keys.tag + ":ticks"], args=[keys.tag + ":", *ticks]) == [0, 0, 1, 0]
    assert redis_client.zcard(keys.tag + ":ticks") == 64


@BOTH_TOPOLOGIES
def test_long_runs_cross_the_scripts_read_chunks(settings, redis_client):
    """The prefix jumps over, and the gaps walk, more seqs than one read of the script takes."""
    store = ContinuityStore(redis_client)
    d = Domain()
    for seq in [*range(2, 301), 420, 1]:
        d, verdict = admit(d, "i1", seq)
        assert store.admit("r", 0, "i1", seq) is verdict
        if seq == 420:
            assert store.gaps("r", 0, 16) == gaps(d, 16) == [(1, 1), (301, 419)]
    assert d.prefix == 300 and store.read("r", 0) == d
    for seq in range(302, 420):
        d, _ = admit(d, "i1", seq)
        store.admit("r", 0, "i1", seq)
    assert store.gaps("r", 0, 16) == gaps(d, 16) == [(301, 301)]
    assert store.read("r", 0) == d
    store.certify("r", 0, "i1", Watermark(500, 7))
    keys = RepoKeys("r")  # the script writes the keys schemas/layout.py names
    assert [redis_client.type(k) for k in (keys.continuity(0), keys.continuity_above(0),
                                           keys.continuity_watermarks(0))] == [
        "hash", "zset", "zset"]
    marks = redis_client.zrange(keys.continuity_watermarks(0), 0, -1, withscores=True)
    assert [tuple(m) for m in marks] == [("500:7", 500.0)]


_BATCH = """
local C = continuity(ARGV[1])
if ARGV[3] == '1' then C.defer_prefix() end
local steps = cjson.decode(ARGV[2])
local out = {}
for _, s in ipairs(steps) do
  if s[1] == 'a' then out[#out + 1] = C.admit(s[2], s[3], s[4])
  elseif s[1] == 'c' then C.certify(s[2], s[3], s[4], s[5], s[6]); out[#out + 1] = ''
  elseif s[1] == 'r' then C.rebuild(s[2], s[3], s[4]); out[#out + 1] = ''
  else C.break_domain(s[2], s[3]); out[#out + 1] = '' end
end
C.flush()
return out
"""


@hsettings(max_examples=60, deadline=None, suppress_health_check=HC)
@given(history=histories(), defer=st.booleans())
@BOTH_TOPOLOGIES
def test_a_whole_history_in_one_script_agrees_with_the_pure_machine(settings, redis_client,
                                                                     history, defer):
    """apply.lua runs many events in one call: the library's state cached for the script (the
    stripe's hash, its watermarks, the count of seqs above the prefix) must stay true across
    the steps of one call, not only from one call to the next; with ``C.defer_prefix()`` (as
    apply.lua calls it) the prefix lives in that cache until ``C.flush()``."""
    stripes, steps = history
    repo = f"b{uuid.uuid4().hex[:6]}"
    keys = RepoKeys(repo)
    wire: list[list[object]] = []
    for s in steps:
        if isinstance(s, Admit):
            wire.append(["a", s.stripe, s.inc, str(s.seq)])
        elif isinstance(s, Certify):
            wire.append(["c", s.stripe, s.inc, str(s.seq), str(s.tick), str(s.applied)])
        elif isinstance(s, Rebuild):
            wire.append(["r", s.stripe, s.inc, str(s.counter)])
        else:
            wire.append(["b", s.stripe, s.reason])
    script = redis_client.register_script(compose(_BATCH))
    got = script(keys=[keys.continuity(0)],
                 args=[keys.tag + ":", json.dumps(wire), "1" if defer else "0"])
    pure = {k: Domain() for k in range(stripes)}
    want = []
    for s in steps:
        pure[s.stripe], verdict = _pure(pure[s.stripe], s)
        want.append("" if verdict is None else verdict.value)
    assert got == want
    store = ContinuityStore(redis_client)
    for k in range(stripes):
        assert store.read(repo, k) == pure[k], k
