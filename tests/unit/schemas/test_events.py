"""The event contract (pure, no servers): round trips, field-by-field rejection, schema files."""

from __future__ import annotations

import types
import typing
from dataclasses import fields
from typing import Any, get_args, get_origin

import orjson
import pytest

from schemas import events as ev
from schemas.events import EVENT_TYPES, Event, EventError, decode, encode, required_fields
from schemas.export import SCHEMA_DIR, rendered

NS = "s3://bucket/ns/"


def _sample_value(name: str, tp: Any) -> Any:
    """A valid value for a field; distinct per field name (ref_id != replaces_ref_id)."""
    if get_origin(tp) in (typing.Union, types.UnionType):
        tp = next(a for a in get_args(tp) if a is not type(None))
    if name == "storage_namespace":
        return NS
    if name in ev.ADDRESS_FIELDS and get_origin(tp) is list:
        return [f"{NS}data/0000000001/{name}-1", f"{NS}data/0000000002/{name}-2"]
    if name in ev.ADDRESS_FIELDS:
        return f"{NS}data/0000000001/{name}"
    if tp is str:
        return f"{name}-value"
    if tp is int:
        return 7
    if tp is float:
        return 1.5
    if get_origin(tp) is list and get_args(tp) == (int,):
        return [7, 8]
    if get_origin(tp) is list:
        return [f"{name}-1", f"{name}-2"]
    if get_origin(tp) is dict:
        return {"main": 30.0}
    raise AssertionError(f"no sample for {name}: {tp}")


def sample(cls: type[Event], *, optional: bool = True) -> Event:
    """A valid event of ``cls``; with ``optional`` every optional field is filled too."""
    hints = typing.get_type_hints(cls)
    wanted = set(required_fields(cls))
    kwargs = {
        f.name: _sample_value(f.name, hints[f.name])
        for f in fields(cls)
        if f.name in wanted or (optional and f.name not in ("event_id", "emitted_at"))
    }
    return cls(**kwargs)


def _wrong_value(tp: Any) -> Any:
    """A JSON value of the wrong type for ``tp`` (None for required fields counts as wrong)."""
    origin = get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        tp = next(a for a in get_args(tp) if a is not type(None))
        origin = get_origin(tp)
    if origin is list:
        return "not-a-list"
    if origin is dict:
        return ["not", "an", "object"]
    if tp is str:
        return 12345
    if tp in (int, float):
        return "12"
    raise AssertionError(tp)


def _body(event: Event) -> dict[str, Any]:
    body: dict[str, Any] = orjson.loads(encode(event))
    return body


REQUIRED = [(t, f) for t, cls in EVENT_TYPES.items() for f in required_fields(cls)]


@pytest.mark.parametrize("etype", sorted(EVENT_TYPES))
@pytest.mark.parametrize("optional", [True, False], ids=["all-fields", "required-only"])
def test_round_trip(etype: str, optional: bool) -> None:
    event = sample(EVENT_TYPES[etype], optional=optional)
    data = encode(event)
    assert decode(data) == event
    assert decode(data.decode()) == event  # str input too
    body = orjson.loads(data)
    assert body["type"] == etype and body["v"] == ev.SCHEMA_VERSION
    assert event.key == event.repository.encode()


def test_every_type_has_required_fields_beyond_the_envelope() -> None:
    # The parametrised rejection tests below are only as good as this list.
    for cls in EVENT_TYPES.values():
        req = required_fields(cls)
        assert "repository" in req
        assert "event_id" not in req and "emitted_at" not in req
        assert len(req) >= 2, cls.TYPE


@pytest.mark.parametrize(("etype", "name"), REQUIRED)
def test_missing_required_field_is_rejected_by_name(etype: str, name: str) -> None:
    body = _body(sample(EVENT_TYPES[etype]))
    del body[name]
    with pytest.raises(EventError) as info:
        decode(orjson.dumps(body))
    assert info.value.field == name
    assert repr(name) in str(info.value) and "missing" in str(info.value)
    assert etype in str(info.value)


@pytest.mark.parametrize(("etype", "name"), REQUIRED)
@pytest.mark.parametrize("kind", ["wrong-type", "null"])
def test_ill_typed_required_field_is_rejected_by_name(etype: str, name: str, kind: str) -> None:
    cls = EVENT_TYPES[etype]
    body = _body(sample(cls))
    body[name] = None if kind == "null" else _wrong_value(typing.get_type_hints(cls)[name])
    with pytest.raises(EventError) as info:
        decode(orjson.dumps(body))
    assert info.value.field == name
    assert repr(name) in str(info.value)


@pytest.mark.parametrize(("etype", "name"), [
    (t, f.name) for t, cls in EVENT_TYPES.items() for f in fields(cls)
    if f.name not in required_fields(cls) and f.name not in ("event_id", "emitted_at")
    and get_origin(typing.get_type_hints(cls)[f.name]) is not dict
])
def test_ill_typed_optional_field_is_rejected_by_name(etype: str, name: str) -> None:
    cls = EVENT_TYPES[etype]
    body = _body(sample(cls))
    body[name] = _wrong_value(typing.get_type_hints(cls)[name])
    with pytest.raises(EventError) as info:
        decode(orjson.dumps(body))
    assert info.value.field == name


def test_bool_is_not_a_number_and_numbers_must_be_finite() -> None:
    body = _body(sample(ev.ObjectWritten))
    with pytest.raises(EventError, match="'size'"):
        decode(orjson.dumps({**body, "size": True}))
    body = _body(sample(ev.AddressIssued))
    # orjson cannot emit an infinity, so spell the JSON by hand: it must be refused, whether
    # by the parser or by the field check.
    raw = encode(sample(ev.AddressIssued)).replace(b'"ttl_seconds":1.5', b'"ttl_seconds":1e999')
    assert raw != encode(sample(ev.AddressIssued))
    with pytest.raises(EventError):
        decode(raw)
    assert decode(orjson.dumps({**body, "ttl_seconds": 2})).ttl_seconds == 2.0  # type: ignore[attr-defined]


def test_list_items_are_checked() -> None:
    body = _body(sample(ev.CommitCreated))
    body["parents"] = ["a", 3]
    with pytest.raises(EventError, match=r"parents\[1\]"):
        decode(orjson.dumps(body))


@pytest.mark.parametrize("etype", [None, 5, "object_written_v2", "", "OBJECT_WRITTEN"])
def test_unknown_or_missing_type_is_rejected(etype: Any) -> None:
    body = _body(sample(ev.ObjectWritten))
    if etype is None:
        del body["type"]
    else:
        body["type"] = etype
    with pytest.raises(EventError) as info:
        decode(orjson.dumps(body))
    assert info.value.field == "type"


@pytest.mark.parametrize("version", [None, 0, 2, "1", 1.5, True])
def test_unknown_version_is_rejected(version: Any) -> None:
    body = _body(sample(ev.ObjectWritten))
    if version is None:
        del body["v"]
    else:
        body["v"] = version
    with pytest.raises(EventError) as info:
        decode(orjson.dumps(body))
    assert info.value.field == "v"
    assert "version" in str(info.value)


@pytest.mark.parametrize("etype", sorted(EVENT_TYPES))
def test_unknown_extra_field_is_rejected(etype: str) -> None:
    body = _body(sample(EVENT_TYPES[etype]))
    body["surprise"] = 1
    with pytest.raises(EventError) as info:
        decode(orjson.dumps(body))
    assert info.value.field == "surprise"


ADDRESS_CASES = [
    (t, f.name) for t, cls in EVENT_TYPES.items() for f in fields(cls)
    if f.name in ev.ADDRESS_FIELDS
]


@pytest.mark.parametrize(("etype", "name"), ADDRESS_CASES)
@pytest.mark.parametrize("bad", ["bucket/key", "/abs/path", "gs://bucket/key", "S3:/bucket/k"])
def test_non_s3_address_is_rejected(etype: str, name: str, bad: str) -> None:
    body = _body(sample(EVENT_TYPES[etype]))
    listed = isinstance(body[name], list)  # a list of addresses: each item is checked
    body[name] = [*body[name], bad] if listed else bad
    with pytest.raises(EventError) as info:
        decode(orjson.dumps(body))
    assert info.value.field == (f"{name}[2]" if listed else name)
    assert "s3://" in str(info.value)


def test_address_fields_cover_every_type_that_carries_addresses() -> None:
    assert {t for t, _ in ADDRESS_CASES} >= {
        "repository_created", "address_issued", "object_written", "object_copied",
        "object_deleted", "addresses_reaped"}


@pytest.mark.parametrize("data", [b"", b"{", b"[1, 2]", b'"text"', b"null", b"\xff"])
def test_garbage_input_is_rejected(data: bytes) -> None:
    with pytest.raises(EventError):
        decode(data)


def test_empty_strings_are_rejected_except_path() -> None:
    body = _body(sample(ev.ObjectWritten))
    with pytest.raises(EventError, match=r"'branch'.*empty"):
        decode(orjson.dumps({**body, "branch": ""}))
    assert decode(orjson.dumps({**body, "path": ""})).path == ""  # type: ignore[attr-defined]


@pytest.mark.parametrize(("cls", "changes", "culprit"), [
    (ev.ObjectWritten, {"size": -1}, "size"),
    (ev.ObjectCopied, {"size": -1}, "size"),
    (ev.ObjectWritten, {"replaces_address": None}, "replaces_address"),
    (ev.ObjectWritten, {"replaces_ref_id": None}, "replaces_address"),
    (ev.ObjectCopied, {"replaces_ref_id": "ref_id-value"}, "replaces_ref_id"),
    (ev.AddressIssued, {"ttl_seconds": 0}, "ttl_seconds"),
    (ev.AddressIssued, {"ttl_seconds": -5}, "ttl_seconds"),
    (ev.RepositoryCreated, {"storage_namespace": "s3://bucket/ns"}, "storage_namespace"),
    (ev.RepositoryCreated, {"default_retention_days": -1}, "default_retention_days"),
    (ev.RepositoryCreated, {"branch_retention_days": {"dev": -1}}, "branch_retention_days.dev"),
    (ev.AddressesReaped, {"addresses": []}, "addresses"),
    (ev.AddressesReaped, {"addresses": [f"{NS}k{i}" for i in range(ev.MAX_REAPED_PER_EVENT + 1)]},
     "addresses"),
])
def test_semantic_checks(cls: type[Event], changes: dict[str, Any], culprit: str) -> None:
    body = {**_body(sample(cls)), **changes}
    with pytest.raises(EventError) as info:
        decode(orjson.dumps(body))
    assert info.value.field == culprit


def test_committed_json_schema_files_are_current() -> None:
    expected = rendered()
    on_disk = {p.name: p.read_bytes() for p in SCHEMA_DIR.glob("*.schema.json")}
    assert sorted(on_disk) == sorted(expected), "run: python -m schemas.export"
    for name, body in expected.items():
        assert on_disk[name] == body, f"{name} is stale: run python -m schemas.export"


def test_encoded_events_validate_against_their_json_schema() -> None:
    jsonschema = pytest.importorskip("jsonschema")
    for etype, cls in EVENT_TYPES.items():
        schema = orjson.loads((SCHEMA_DIR / f"{etype}.schema.json").read_bytes())
        validator = jsonschema.Draft202012Validator(schema)
        for optional in (True, False):
            body = _body(sample(cls, optional=optional))
            errors = list(validator.iter_errors(body))
            assert not errors, (etype, [e.message for e in errors])
        # The schema must also refuse what decode refuses, or it is no contract at all.
        body = _body(sample(cls))
        for bad in (
            {k: v for k, v in body.items() if k != required_fields(cls)[-1]},
            {**body, "surprise": 1},
            {**body, "v": 2},
            {**body, "repository": 5},
        ):
            assert list(validator.iter_errors(bad)), (etype, bad)
        for name in (f.name for f in fields(cls) if f.name in ev.ADDRESS_FIELDS):
            assert list(validator.iter_errors({**body, name: "gs://x/y"})), (etype, name)
            if isinstance(body[name], list):
                for bad_list in ([], [*body[name], "gs://x/y"]):
                    assert list(validator.iter_errors({**body, name: bad_list})), (etype, name)


def test_every_address_field_but_the_namespace_is_a_named_address() -> None:
    """Admission checks, and holds cover, the fields in NAMED_ADDRESS_FIELDS: an event type
    that gains an address field must name it there, or its address escapes the namespace
    check."""
    for cls in EVENT_TYPES.values():
        for f in fields(cls):
            if f.name in ev.ADDRESS_FIELDS and f.name != "storage_namespace":
                assert f.name in ev.NAMED_ADDRESS_FIELDS, (cls.TYPE, f.name)
            if "address" in f.name:
                assert f.name in ev.ADDRESS_FIELDS, (cls.TYPE, f.name)


def test_named_addresses_of_an_event_and_of_its_body_agree() -> None:
    a, b = "s3://b/r/x", "s3://b/r/y"
    events = [
        ev.ObjectWritten(repository="r", branch="main", staging_token="t", path="p",
                         address=a, size=1, ref_id="p", replaces_address=b,
                         replaces_ref_id="q"),
        ev.ObjectDeleted(repository="r", branch="main", staging_token="t", path="p",
                         address=a, ref_id="p"),
        ev.AddressesReaped(repository="r", addresses=[a, b], reaper="reaper-1"),
        ev.BranchCreated(repository="r", branch="main", staging_token="t", ref_version=1),
    ]
    expected = [[a, b], [a], [a, b], []]
    for e, want in zip(events, expected, strict=True):
        body = orjson.loads(encode(e))
        assert ev.named_addresses(body.get) == want
        assert ev.named_addresses(lambda n, e=e: getattr(e, n, None)) == want


def test_a_watermark_without_a_break_is_what_it_was_before_the_field() -> None:
    plain = ev.Watermark(repository="r", stripe=0, incarnation="i", seq=3, tick_ms=5,
                         tick_applied=[3], tick_id="t", tick_sig="s", event_id="e",
                         emitted_at=1.0)
    assert b"broken" not in encode(plain)
    assert decode(encode(plain)) == plain
    broken = ev.Watermark(repository="r", stripe=0, incarnation="i", seq=3, tick_ms=5,
                          tick_applied=[3], tick_id="t", tick_sig="s", broken="why",
                          event_id="e")
    assert decode(encode(broken)) == broken
    body = orjson.loads(encode(broken))
    for bad, problem in (("", "must not be empty"), ("x" * 1001, "at most 1000"),
                         (5, "expected string")):
        with pytest.raises(EventError, match=problem) as info:
            decode(orjson.dumps({**body, "broken": bad}))
        assert info.value.field == "broken"
