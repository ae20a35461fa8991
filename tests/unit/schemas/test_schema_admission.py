"""Schemas and admission from one source (issue 8, item 7): over a generated corpus of valid and
mutated events of every type, the JSON Schema files (what publishers in other languages
validate against) accept exactly what the tracker admits (``schemas.events.decode`` and the
tracker's fast ``codec.parse``). The rules no JSON Schema can state, a reference replacing
itself (``replaces_ref_id == ref_id``) and a ``range_gone`` whose ``from_seq`` is above its
``to_seq``, are checked separately: admission refuses them."""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

import orjson
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from schemas import events as ev
from schemas.export import SCHEMA_DIR
from tracker import codec

jsonschema = pytest.importorskip("jsonschema")

VALIDATORS = {
    t: jsonschema.Draft202012Validator(
        orjson.loads((SCHEMA_DIR / f"{t}.schema.json").read_bytes()))
    for t in ev.EVENT_TYPES
}

# Values a mutation puts into a field: range edges, near-misses of every rule, wrong types.
NASTY: list[Any] = [
    None, True, False, 0, 1, -1, 3.0, 0.5, -0.5, 2**53 - 1, 2**53, 2**63 - 1, -(2**63),
    9e15, 1e11, 1e11 + 1, -1e11, -1e11 - 1, 1e15, 1e15 + 2, 366 * 86400.0, 366 * 86400.0 + 1,
    36_600.0, 36_601.0, 1e300, -1e300, 63, 64, "", "x", "r1", "y" * 128, "y" * 129,
    "s3://b/r", "s3://b/r/", "s3://b/r/\n",
    "s3://b/r/data/x", "S3://b/r/", "s3:/", [], ["a"], [""], [1], {}, {"a": 1},
    {"a": -1.0}, {"a": 1e5}, {"a": "x"}, {"": 2.5}, {"a": {"b": 1}},
]


def _valid_value(name: str, tp: Any, draw: Any, etype: str = "") -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, __import__("types").UnionType):
        inner = next(a for a in typing.get_args(tp) if a is not type(None))
        return None if draw(st.booleans()) else _valid_value(name, inner, draw, etype)
    if origin is list and name in ev.ADDRESS_FIELDS:
        return draw(st.lists(st.sampled_from(["s3://b/r/data/x", "s3://b/r/data/y"]),
                             min_size=1, max_size=3))
    if origin is list and typing.get_args(tp) == (int,):
        return draw(st.lists(st.integers(0, ev.MAX_EXACT_INT), max_size=3))
    if origin is list:
        return draw(st.lists(st.sampled_from(["t1", "t2", "c1"]), max_size=3))
    if origin is dict:
        return draw(st.dictionaries(st.sampled_from(["main", "dev", ""]),
                                    st.floats(0, ev.MAX_RETENTION_DAYS), max_size=2))
    if tp is int:
        rng = ev.field_range(name, int, etype)
        return draw(st.integers(int(rng.lo), int(rng.hi)))
    if tp is float:
        rng = ev.field_range(name, float)
        return draw(st.floats(rng.lo, rng.hi, exclude_min=rng.lo_exclusive))
    if tp is str:
        if name == "storage_namespace":
            return draw(st.sampled_from(["s3://b/r/", "s3://b/", "s3://b/a/b/"]))
        if name in ev.ADDRESS_FIELDS:
            return draw(st.sampled_from(["s3://b/r/data/x", "s3://b/r/data/y"]))
        if name == "path":
            return draw(st.sampled_from(["", "a/b"]))
        return draw(st.text(min_size=1, max_size=4))
    raise AssertionError(f"no generator for {name}: {tp}")


@st.composite
def valid_body(draw: Any) -> dict[str, Any]:
    etype = draw(st.sampled_from(sorted(ev.EVENT_TYPES)))
    cls = ev.EVENT_TYPES[etype]
    hints = typing.get_type_hints(cls)
    body: dict[str, Any] = {"type": etype, "v": 1}
    for f in dataclasses.fields(cls):
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        if required or draw(st.booleans()):
            body[f.name] = _valid_value(f.name, hints[f.name], draw, etype)
    optional = {f.name for f in dataclasses.fields(cls)} - set(ev.required_fields(cls))
    for a, b in ev.TOGETHER:  # a valid body keeps the pair together
        if a not in optional or b not in optional:
            continue
        if (a in body or b in body) and (body.get(a) is None or body.get(b) is None):
            body.pop(a, None)
            body.pop(b, None)
    if issubclass(cls, ev.ServiceEvent):
        for a, b in ev.ONLY_WITH:
            if body.get(b) is None:
                body.pop(a, None)
    if body.get("replaces_ref_id") is not None and body["replaces_ref_id"] == body.get("ref_id"):
        body["replaces_ref_id"] += "-old"
    if etype == "range_gone" and body["from_seq"] > body["to_seq"]:
        body["from_seq"], body["to_seq"] = body["to_seq"], body["from_seq"]
    return body


@st.composite
def mutated_body(draw: Any) -> dict[str, Any]:
    body = draw(valid_body())
    for _ in range(draw(st.integers(0, 3))):
        action = draw(st.sampled_from(["set", "set", "drop", "add", "type", "v", "pair"]))
        if action == "set":
            body[draw(st.sampled_from(sorted(body)))] = draw(st.sampled_from(NASTY))
        elif action == "drop":
            body.pop(draw(st.sampled_from(sorted(body))), None)
        elif action == "add":
            name = draw(st.sampled_from(["extra", "path", "replaces_ref_id", "replaces_address",
                                         "ref_id", "size", "ttl_seconds", "seq", "incarnation",
                                         "stripe", "stripes", "from_seq", "to_seq"]))
            body[name] = draw(st.sampled_from(NASTY))
        elif action == "type":
            body["type"] = draw(st.sampled_from([*sorted(ev.EVENT_TYPES), "nope", 1]))
        elif action == "v":
            body["v"] = draw(st.sampled_from([1, 2, 1.0, True, "1", None, 0]))
        else:
            body["replaces_ref_id"] = draw(st.sampled_from(["r0", None, body.get("ref_id")]))
            body["replaces_address"] = draw(st.sampled_from(["s3://b/r/data/z", None, ""]))
    return body


def admitted(value: bytes) -> bool:
    try:
        decoded = ev.decode(value)
    except ev.EventError:
        decoded = None
    try:
        codec.parse(value)
        parsed = True
    except ev.EventError:
        parsed = False
    assert parsed == (decoded is not None), value  # the fast path and the contract agree
    return parsed


def schema_accepts(value: bytes) -> bool:
    body = orjson.loads(value)
    validator = VALIDATORS.get(body.get("type")) if isinstance(body.get("type"), str) else None
    return validator is not None and bool(validator.is_valid(body))


def _self_replacing(body: dict[str, Any]) -> bool:
    rr = body.get("replaces_ref_id")
    return rr is not None and rr == body.get("ref_id")


def _inverted_range(body: dict[str, Any]) -> bool:
    a, b = body.get("from_seq"), body.get("to_seq")
    return (body.get("type") == "range_gone" and type(a) in (int, float)
            and type(b) in (int, float) and a > b)


@settings(max_examples=300, deadline=None)
@given(body=valid_body())
def test_generated_valid_events_are_admitted_and_schema_valid(body: dict[str, Any]) -> None:
    value = orjson.dumps(body)
    assert admitted(value), body
    assert schema_accepts(value), body


@settings(max_examples=2000, deadline=None)
@given(body=mutated_body())
# Found by this test: a retirement's namespace without its trailing slash was admitted.
@example(body={"type": "repository_deleted", "v": 1, "repository": "0", "event_id": "0",
               "storage_namespace": "s3://b/r"})
def test_json_schema_verdict_equals_admission_verdict(body: dict[str, Any]) -> None:
    value = orjson.dumps(body)
    verdict = admitted(value)
    if _self_replacing(body) or _inverted_range(body):  # rules a JSON Schema cannot state
        assert not verdict
        return
    assert schema_accepts(value) == verdict, (body, verdict)


@pytest.mark.parametrize("field,value", [
    ("ttl_seconds", 9e15), ("ttl_seconds", 0), ("size", 2**53), ("size", -1),
    ("default_retention_days", 1e300), ("committed_at", 1e300),
])
def test_out_of_range_numbers_are_refused_with_the_range(field: str, value: float) -> None:
    etype = next(t for t, cls in ev.EVENT_TYPES.items()
                 if field in {f.name for f in dataclasses.fields(cls)})
    draw_free = {
        "address_issued": {"address": "s3://b/r/data/x", "ttl_seconds": 10.0},
        "object_written": {"branch": "m", "staging_token": "t", "path": "p", "size": 1,
                           "address": "s3://b/r/data/x", "ref_id": "r"},
        "repository_created": {"storage_namespace": "s3://b/r/", "default_branch": "m",
                               "default_retention_days": 1.0},
        "commit_created": {"branch": "m", "commit_id": "c", "parents": [], "sealed_tokens": [],
                           "staging_token": "t", "committed_at": 1.0, "manifest": "m",
                           "ref_version": 1},
    }[etype]
    body = {"type": etype, "v": 1, "repository": "r", **draw_free, field: value}
    with pytest.raises(ev.EventError, match=f"field '{field}': must be"):
        ev.decode(orjson.dumps(body))
    assert not schema_accepts(orjson.dumps(body))


_TAG = {"type": "tag_deleted", "v": 1, "repository": "r", "tag": "v1", "ref_version": 2}
_MARK = {"type": "watermark", "v": 1, "repository": "r", "stripe": 0, "incarnation": "i1",
         "seq": 0, "tick_ms": 1, "tick_applied": [0], "tick_id": "t", "tick_sig": "s"}
_GONE = {"type": "range_gone", "v": 1, "repository": "r", "stripe": 3, "incarnation": "i1",
         "from_seq": 4, "to_seq": 9, "reason": "trimmed"}


@pytest.mark.parametrize(("body", "ok"), [
    (_TAG, True),
    ({**_TAG, "seq": 1, "incarnation": "i"}, True),
    ({**_TAG, "seq": 1, "incarnation": "i", "stripe": 63}, True),
    ({**_TAG, "seq": None, "incarnation": None}, True),  # null: absent
    ({**_TAG, "seq": 1}, False),  # seq without incarnation
    ({**_TAG, "incarnation": "i"}, False),
    ({**_TAG, "stripe": 0}, False),  # stripe only with seq
    ({**_TAG, "stripe": 2, "seq": None, "incarnation": None}, False),
    ({**_TAG, "seq": 0, "incarnation": "i"}, False),  # seqs start at 1
    ({**_TAG, "seq": 2**53, "incarnation": "i"}, False),
    ({**_TAG, "seq": 1, "incarnation": "i", "stripe": 64}, False),
    ({**_TAG, "seq": 1, "incarnation": "i", "stripe": None}, False),
    ({**_TAG, "seq": 1, "incarnation": "x" * 128}, True),
    ({**_TAG, "seq": 1, "incarnation": "x" * 129}, False),
    ({**_TAG, "seq": 1, "incarnation": ""}, False),
    ({"type": "repository_created", "v": 1, "repository": "r", "storage_namespace": "s3://b/",
      "default_branch": "m", "default_retention_days": 1, "stripes": 64}, True),
    ({"type": "repository_created", "v": 1, "repository": "r", "storage_namespace": "s3://b/",
      "default_branch": "m", "default_retention_days": 1, "stripes": 0}, False),
    (_MARK, True),  # a watermark's M may be 0
    ({**_MARK, "seq": -1}, False),
    ({k: v for k, v in _MARK.items() if k != "tick_sig"}, False),
    ({**_MARK, "tick_sig": "s" * 129}, False),
    (_GONE, True),
    ({**_GONE, "from_seq": 9}, True),
    ({**_GONE, "from_seq": 0}, False),
    ({**_GONE, "reason": ""}, False),
    ({"type": "addresses_reaped", "v": 1, "repository": "r", "addresses": ["s3://b/r/x"],
      "reaper": "x", "seq": 1, "incarnation": "i"}, False),  # the reaper's are not sequenced
])
def test_continuity_fields_one_verdict(body: dict[str, Any], ok: bool) -> None:
    value = orjson.dumps(body)
    assert admitted(value) is ok
    assert schema_accepts(value) is ok


def test_inverted_range_is_refused_by_admission() -> None:
    value = orjson.dumps({**_GONE, "from_seq": 10})
    with pytest.raises(ev.EventError, match="from_seq"):
        ev.decode(value)
    assert not admitted(value)
