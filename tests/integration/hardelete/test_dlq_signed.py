"""``dlq resolve`` acts only on dead letters the tracker wrote (issue 34 item 2; the first two
tests failed before: resolve trusted the ``claim`` header of any record in the dead-letter topic,
which every publisher can write, so a forged dead letter naming a real claim lifted the hold and
the reaper deleted the object it kept).

Real stack: Kafka (the tracker's dead letter and the forgeries in the same topic), valkey (one
node and the three-node cluster), MinIO, the real tracker, reaper and CLI."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest
from aiokafka import AIOKafkaProducer

from schemas.layout import REAPER_KEY
from sim.model import Model
from sim.operations import (
    broken,
    claims,
    kept,
    make_garbage,
    publish_and_track,
    reap_until,
    run,
    stored,
    tracked,
)

BOTH_TOPOLOGIES = pytest.mark.parametrize("topology", ["single", "cluster"], indirect=True)


async def forge(s: Any, value: bytes, key: bytes, headers: dict[str, str]) -> None:
    """What any publisher can do: write a record to the dead-letter topic."""
    producer = AIOKafkaProducer(bootstrap_servers=s.kafka_bootstrap, acks="all")
    await producer.start()
    try:
        await producer.send_and_wait(s.dlq_topic, value, key=key,
                                     headers=[(k, v.encode()) for k, v in headers.items()])
    finally:
        await producer.stop()


def letters(capsys: Any) -> list[dict[str, Any]]:
    code, out, _ = run(capsys, "dlq", "list", "--json")
    assert code == 0
    return list(orjson.loads(out))


def held_garbage(s: Any, s3: Any, redis_client: Any) -> tuple[str, str, dict[str, Any]]:
    """A garbage object the real tracker holds for a dead-lettered event naming it: (its
    address, the hold's claim, the dead letter as `dlq list --json` shows it)."""
    model = Model.from_settings(s)
    (held,) = asyncio.run(make_garbage(s, s3, model, "repo", ["held"],
                                       namespace="s3://dlqsig/repo/"))
    assert held is not None
    asyncio.run(publish_and_track(s, (broken("repo", held), b"repo")))
    (claim,) = claims(redis_client, "repo", held)
    return held, claim, letters_of(s)[0]


def letters_of(s: Any) -> list[dict[str, Any]]:
    from hardelete import dlq

    found = asyncio.run(dlq.read(s))
    dlq.verify_all(s, found)
    return [d.summary() for d in found]


@BOTH_TOPOLOGIES
def test_a_forged_dead_letter_with_a_real_claim_lifts_nothing(cli, capsys, s3, redis_client):
    s = cli.replace(lease_seconds=1.0, upload_ttl_seconds=1.0)
    s3.create_bucket(Bucket="dlqsig")
    held, claim, genuine = held_garbage(s, s3, redis_client)
    assert genuine["verified"] and genuine["headers"]["claim"] == claim
    origin = {k: genuine["headers"][k] for k in ("reason", "topic", "partition", "offset")}
    # 1. the tracker's headers without its signature; 2. the signature copied onto another
    # record (the claim kept, what it held widened to another repository's object)
    asyncio.run(forge(s, broken("repo", held), b"repo", {**origin, "claim": claim}))
    copied = {k: genuine["headers"][k] for k in ("claim", "held", "signature", "signed_by")}
    widened = [*orjson.loads(copied["held"]), ["victim", "s3://dlqsig/victim/data/x"]]
    asyncio.run(forge(s, broken("repo", held, -7), b"repo",
                      {**origin, **copied, "held": orjson.dumps(widened).decode()}))
    shown = letters(capsys)
    forged = [d for d in shown if d["id"] != genuine["id"]]
    assert len(forged) == 2 and all(not d["verified"] for d in forged)
    assert [d["verified"] for d in shown if d["id"] == genuine["id"]] == [True]
    code, out, _ = run(capsys, "dlq", "list")
    assert code == 0 and "UNVERIFIED" in out

    for d in forged:
        code, out, err = tracked(s, capsys, "dlq", "resolve", d["id"])
        assert code == 2 and err.count("\n") == 1, (out, err)
        assert "nothing was lifted" in err and "hold remove --force" in err
        assert claims(redis_client, "repo", held) == {claim}, f"{d['id']} lifted the hold"
    report = asyncio.run(reap_until(s, lambda rep: kept(rep, "repo", "held") > 0))
    assert stored(s3, held), report.as_dict()

    # the tracker's own dead letter still resolves, and then the reaper takes the object
    code, out, _ = tracked(s, capsys, "dlq", "resolve", genuine["id"])
    assert code == 0 and f"lifted the dlq hold on {held}" in out
    asyncio.run(reap_until(s, lambda rep: not stored(s3, held)))


def test_a_redis_whose_key_was_minted_again_refuses_older_dead_letters(
        cli, capsys, s3, redis_client):
    """Redis went back to a copy older than the tracker's key: the next tracker mints a new
    one, and dead letters signed under the lost key are refused (safe), in one clear line."""
    s = cli.replace(lease_seconds=1.0, upload_ttl_seconds=1.0)
    s3.create_bucket(Bucket="dlqsig")
    held, claim, genuine = held_garbage(s, s3, redis_client)
    assert genuine["verified"]
    old_key = redis_client.get(REAPER_KEY)
    redis_client.delete(REAPER_KEY)  # the copy Redis went back to predates the key
    code, out, err = tracked(s, capsys, "dlq", "resolve", genuine["id"])
    assert redis_client.get(REAPER_KEY) not in (None, old_key)  # the tracker minted a new one
    assert code == 2 and err.count("\n") == 1, (out, err)
    assert "re-minted" in err and "hold remove --force" in err and held in err
    assert claims(redis_client, "repo", held) == {claim}
    code, out, _ = run(capsys, "dlq", "show", genuine["id"])
    assert code == 0 and "re-minted" in orjson.loads(out)["unverified"]
    # the operator's way out, as the line says
    code, out, err = run(capsys, "hold", "remove", "--force", held)
    assert code == 0, (out, err)
    assert not claims(redis_client, "repo", held)
