"""The tracker's fast decoding path agrees with the contract's validator: it never accepts what
``schemas.events.decode`` rejects and never changes a value; the fast admission check agrees
with ``layout.namespace_key``."""

from __future__ import annotations

import random

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas import events as ev
from schemas.layout import OutsideNamespace, namespace_key
from sim.gen import workload
from tracker import codec

SAMPLES = workload(5, 400, repos=2)
NASTY = [None, True, False, 0, -1, 1.5, float(2**60), "", "x", "s3://b/r/data/x", [], ["a"],
         [""], {}, {"a": 1}, {"a": "x"}, {"a": -1.0}, 2**63 - 1]


def full(value: bytes) -> dict | str:
    try:
        return codec.event_body(ev.decode(value))
    except ev.EventError as exc:
        return f"ERR {exc}"


def fast(value: bytes) -> dict | None:
    try:
        return codec.fast_body(orjson.loads(value))
    except orjson.JSONDecodeError:
        return None


def strip_generated(body: dict) -> dict:
    return {k: v for k, v in body.items() if k != "event_id"}


@settings(max_examples=500, deadline=None)
@given(i=st.integers(0, len(SAMPLES) - 1), data=st.data())
def test_fast_path_never_disagrees_with_decode(i, data):
    body = orjson.loads(ev.encode(SAMPLES[i]))
    for _ in range(data.draw(st.integers(0, 3))):
        action = data.draw(st.sampled_from(["set", "drop", "add", "type", "v"]))
        key = data.draw(st.sampled_from(sorted(body)))
        if action == "set":
            body[key] = data.draw(st.sampled_from(NASTY))
        elif action == "drop":
            body.pop(key, None)
        elif action == "add":
            body[data.draw(st.sampled_from(["extra", "path", "replaces_ref_id"]))] = \
                data.draw(st.sampled_from(NASTY))
        elif action == "type":
            body["type"] = data.draw(st.sampled_from([*sorted(ev.EVENT_TYPES), "nope"]))
        else:
            body["v"] = data.draw(st.sampled_from([1, 2, 1.0, True, "1", None]))
    value = orjson.dumps(body)
    slow, quick = full(value), fast(value)
    if quick is not None:
        assert isinstance(slow, dict), (slow, body)
        if "event_id" in body:
            assert quick == slow
        else:
            assert strip_generated(quick) == strip_generated(slow)
    # parse() is the fast path with decode's verdict as the fallback
    try:
        parsed = codec.parse(value)
    except ev.EventError as exc:
        assert slow == f"ERR {exc}"
    else:
        assert isinstance(slow, dict)
        assert strip_generated(parsed) == strip_generated(slow)


@pytest.mark.parametrize("event", SAMPLES[:60], ids=lambda e: e.TYPE)
def test_well_formed_events_take_the_fast_path(event):
    body = fast(ev.encode(event))
    assert body == codec.event_body(event)


SEQUENCED = [
    ev.ObjectWritten(repository="r", branch="m", staging_token="t", path="p",
                     address="s3://b/r/data/x", size=1, ref_id="a", seq=5, incarnation="i",
                     stripe=3),
    ev.TagDeleted(repository="r", tag="v", ref_version=2, seq=1, incarnation="i"),
    ev.RepositoryCreated(repository="r", storage_namespace="s3://b/r/", default_branch="m",
                         default_retention_days=1.0, stripes=4, seq=1, incarnation="i"),
    ev.Watermark(repository="r", stripe=1, incarnation="i", seq=0, tick_ms=5,
                 tick_applied=[0], tick_id="t", tick_sig="s"),
    ev.RangeGone(repository="r", stripe=0, incarnation="i", from_seq=2, to_seq=2,
                 reason="trimmed"),
    ev.Watermark(repository="r", stripe=2, incarnation="i", seq=3, tick_ms=5,
                 tick_applied=[0, 0, 3], tick_id="t", tick_sig="s",
                 broken="an event without a seq"),
]


@pytest.mark.parametrize("event", SEQUENCED, ids=lambda e: e.TYPE)
def test_continuity_fields_take_the_fast_path(event):
    assert fast(ev.encode(event)) == codec.event_body(event)
    assert codec.parse(ev.encode(event)) == codec.event_body(event)


def test_a_watermark_carries_its_stripes_applied_seq_and_the_services_break_last():
    plain, broken = SEQUENCED[3], SEQUENCED[5]
    assert codec.compact(codec.parse(ev.encode(plain)), 9) == [
        9, codec.OP_WATERMARK, 1, "i", 0, 5, 0, "", 0]
    assert codec.compact(codec.parse(ev.encode(broken)), 9)[-3:] == [
        3, "an event without a seq", 0]
    beyond = {**codec.event_body(plain), "stripe": 3}  # a stripe the tick did not know
    assert codec.compact(beyond, 9)[6] == 0
    # too long a reason, or an empty one, is not a watermark the fast path admits
    for bad in ("", "x" * 1001):
        body = {**codec.event_body(broken), "broken": bad}
        assert codec.fast_body(body) is None
        with pytest.raises(ev.EventError, match="broken"):
            ev.decode(orjson.dumps(body))


def test_empty_record_is_an_error():
    with pytest.raises(ev.EventError):
        codec.parse(None)


KEY_PARTS = ["data", "x", ".", "..", "", "_hardelete", "_lakefs", "a.b", "..x", "/"]


@settings(max_examples=1000, deadline=None)
@given(parts=st.lists(st.sampled_from(KEY_PARTS), max_size=5),
       prefix=st.sampled_from(["s3://b/r/", "s3://b/other/", "s3://b/r", ""]))
def test_fast_admission_agrees_with_namespace_key(parts, prefix):
    ns = "s3://b/r/"
    address = prefix + "/".join(parts)
    try:
        namespace_key(ns, address)
        expected = True
    except OutsideNamespace:
        expected = False
    assert codec._plain_key_fast(ns, address) is expected, address


def test_gate_rejects_like_the_spec():
    from tracker.references import admission_problem

    gate = codec.Gate()
    rng = random.Random(3)
    ns = "s3://b/r/"
    body = codec.event_body(ev.RepositoryCreated(repository="r", storage_namespace=ns,
                                                 default_branch="main",
                                                 default_retention_days=1.0))
    assert gate.check(body) is None
    for _ in range(300):
        address = ns + "/".join(rng.choice(KEY_PARTS) for _ in range(rng.randint(0, 3)))
        if rng.random() < 0.2:
            address = "s3://x/" + address[7:]
        b = codec.event_body(ev.ObjectDeleted(repository="r", branch="m", staging_token="t",
                                              path="p", address=address, ref_id="r1"))
        assert gate.check(b) == admission_problem("r", b["type"], [address], ns)
