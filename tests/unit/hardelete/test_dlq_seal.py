"""The tracker's signature on its dead letters (pure): what the tracker writes verifies under its
key; an unsigned one, one with any signed field changed, one signed under another key, and a
reaper's signature do not (schemas/reaper_auth.py, hardelete/dlq.py)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import orjson
from hypothesis import given
from hypothesis import strategies as st

from hardelete.dlq import DeadLetter, from_record
from schemas import reaper_auth
from tracker.deadletters import dlq_message

KEY = b"k" * 32
HELD = [("r", "s3://b/r/data/a"), ("other", "s3://b/o/")]


@dataclass
class Rec:
    value: bytes | None
    key: bytes | None
    topic: str = "events"
    partition: int = 2
    offset: int = 17
    timestamp: int = 1
    headers: list[tuple[str, bytes]] | None = None


def written(rec: Rec, *, key: bytes | None = KEY, claim: str = "dlq:events:2:17:e:abc",
            max_value: int = 900_000) -> DeadLetter:
    """The dead letter the tracker writes for ``rec``, as ``dlq`` reads it back."""
    k, v, headers = dlq_message(rec, "bad size", max_value, claim, HELD, key)
    return from_record(Rec(v, k, "events.dlq", 0, 5, 1, headers))


def test_the_trackers_dead_letter_verifies_and_names_what_it_held() -> None:
    dl = written(Rec(b'{"repository": "r"}', b"r"))
    assert dl.seal_problem(KEY) is None
    assert set(dl.held() or ()) == set(HELD)
    # cut to fit the topic: the signature covers what was written
    dl = written(Rec(b"x" * 5000, b"r"), max_value=1000)
    assert dl.size == 1000 and dl.seal_problem(KEY) is None


def test_unsigned_forged_and_other_key_are_refused_with_their_reason() -> None:
    rec = Rec(b'{"repository": "r"}', b"r")
    unsigned = written(rec, key=None)
    assert "no tracker signature" in (unsigned.seal_problem(KEY) or "")
    genuine = written(rec)
    assert "no tracker key" in (genuine.seal_problem(None) or "")
    assert "re-minted" in (genuine.seal_problem(b"another key") or "")
    # the key id left out: a wrong key is a signature that does not verify
    anon = replace(genuine, headers={k: v for k, v in genuine.headers.items()
                                     if k != "signed_by"})
    assert "does not verify" in (anon.seal_problem(b"another key") or "")


SIGNED_HEADERS = ("claim", "topic", "partition", "offset", "reason", "held")


@given(field=st.sampled_from([*SIGNED_HEADERS, "value", "key"]), text=st.text(max_size=20))
def test_changing_any_signed_field_breaks_the_signature(field: str, text: str) -> None:
    genuine = written(Rec(b'{"repository": "r"}', b"r"))
    if field == "value":
        forged = replace(genuine, value=genuine.value + text.encode() + b" ")
    elif field == "key":
        forged = replace(genuine, raw_key=b"r" + text.encode() + b"!")
    elif field == "held":
        held = [*HELD, ["victim", "s3://b/v/" + text]]
        forged = replace(genuine, headers={**genuine.headers, "held": orjson.dumps(held).decode()})
    else:
        forged = replace(genuine, headers={**genuine.headers,
                                           field: genuine.headers[field] + text + "x"})
    assert forged.seal_problem(KEY) is not None


@given(repo=st.text(), reaper=st.text(), eid=st.text(), addresses=st.lists(st.text()))
def test_a_reaper_message_is_never_a_dead_letter_message(repo: str, reaper: str, eid: str,
                                                         addresses: list[str]) -> None:
    """Domain separation: a reaper message starts with its first field's length, never with
    the mark every other domain's starts with."""
    msg = reaper_auth.message(repo, reaper, eid, addresses)
    assert not msg.startswith(reaper_auth.DOMAIN_MARK)
    fields = reaper_auth.DeadLetterFields(repo, reaper, eid, "", "", "", ())
    assert fields.message().startswith(reaper_auth.DOMAIN_MARK) and fields.message() != msg


def test_signatures_do_not_cross_domains() -> None:
    genuine = written(Rec(b'{"repository": "r"}', b"r"))
    # a reaper's signature over the dead letter's fields, as an adversary could hope for
    h = genuine.headers
    stolen = reaper_auth.sign(KEY, h["claim"], h["topic"], h["partition"],
                              [h["offset"], h["reason"]])
    forged = replace(genuine, headers={**h, "signature": stolen})
    assert "does not verify" in (forged.seal_problem(KEY) or "")
    # and the dead letter's signature on an addresses_reaped body
    body = {"repository": h["claim"], "reaper": h["topic"], "event_id": h["partition"],
            "addresses": [h["offset"]], "signature": h["signature"]}
    assert not reaper_auth.verify(KEY, body)
