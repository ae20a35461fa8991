"""Refs on the real stack (Tansu, Redis, the tracker daemon): a duplicate never moves a ref, and
a ref event without its version is dead-lettered and holds the repository's namespace (issue 19
item 8, the finding "refs still move on duplicates")."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson

from schemas import events as ev
from schemas.layout import RepoKeys
from schemas.publisher import Publisher, ensure_topics
from sim.testing import dead_letters
from tracker.daemon import Tracker

NS = "s3://refs/repo/"


async def track(settings: Any, *values: bytes) -> None:
    """Publish raw values keyed by the repository, then run the real tracker to the end."""
    await ensure_topics(settings)
    async with Publisher(settings) as pub:
        for value in values:
            await pub.publish_raw(value, b"repo")
    await Tracker(settings).run_until_caught_up()


def created() -> bytes:
    return ev.encode(ev.RepositoryCreated(repository="repo", storage_namespace=NS,
                                          default_branch="main", default_retention_days=7.0))


def test_a_retried_tag_created_or_a_late_tag_deleted_never_moves_the_tag(settings, redis_client):
    tag = ev.encode(ev.TagCreated(repository="repo", tag="v1", commit_id="c1", ref_version=1))
    untag = ev.encode(ev.TagDeleted(repository="repo", tag="v1", ref_version=2))
    again = ev.encode(ev.TagCreated(repository="repo", tag="v1", commit_id="c2", ref_version=3))
    k = RepoKeys("repo")
    # the publisher retries tag_created (same bytes, same event id) after the tag's deletion
    asyncio.run(track(settings, created(), tag, untag, tag))
    assert redis_client.hgetall(k.tags) == {}
    # created again, then a late duplicate of the delete
    asyncio.run(track(settings, again, untag))
    assert redis_client.hgetall(k.tags) == {"v1": "c2"}
    assert redis_client.hget(k.stats, "ref_duplicates") == "2"
    assert redis_client.hlen(k.ref_seen) == 3  # the window: one id per ref event


def test_an_unversioned_ref_event_is_dead_lettered_and_holds_the_namespace(settings,
                                                                           redis_client):
    """Before ref_version was required, these three (a retried publish of the create after
    the delete) left the tag resurrected."""
    def unversioned(e: ev.Event) -> bytes:
        body = orjson.loads(ev.encode(e))
        del body["ref_version"]
        return orjson.dumps(body)

    tag = unversioned(ev.TagCreated(repository="repo", tag="v1", commit_id="c1", ref_version=1))
    untag = unversioned(ev.TagDeleted(repository="repo", tag="v1", ref_version=2))
    asyncio.run(track(settings, created(), tag, untag, tag))
    k = RepoKeys("repo")
    assert redis_client.hgetall(k.tags) == {}
    reasons = asyncio.run(dead_letters(settings, 2))
    assert len(reasons) == 2 and all("ref_version" in r for r in reasons.values())
    held = orjson.loads(redis_client.hget(k.hold_prefixes, NS))
    assert len(held["claims"]) == 3  # one claim per dead letter (the retry is a record too)
    assert all(c["source"] == "dlq" and "ref_version" in c["reason"]
               for c in held["claims"].values())
