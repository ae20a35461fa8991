"""One canonical address (``schemas/address.py``): property tests, and the tracker end to end.

Issue 19 finding: ``S3://``, ``s3a://``, an upper-case bucket or a percent-escaped key went to
the dead-letter topic without a hold, or were applied to a second record, and the real object
was reaped while a reference to it existed.
"""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from core.clients import split_s3_uri
from core.settings import Settings
from reaper.daemon import Reaper
from schemas import events as ev
from schemas.layout import INCIDENTS, RepoKeys
from schemas.publisher import Publisher, ensure_topics
from sim.model import Model
from sim.reaping import _service, _settings
from sim.testing import dead_letters, listed, publish, wait_horizon
from tracker.daemon import running_tracker

NS = "s3://bucket/repo/"

















# ------------------------------------------------------------ end to end on the real stack

SPELLINGS = {
    "upper scheme": lambda a: "S3://" + a[len("s3://"):],
    "s3a": lambda a: "s3a://" + a[len("s3://"):],
    "upper bucket": lambda a: "s3://" + a[len("s3://"):].replace("spell", "SPELL", 1),
    "escaped slash": lambda a: a.rsplit("/", 1)[0] + "%2F" + a.rsplit("/", 1)[1],
}
@pytest.mark.parametrize("how", sorted(SPELLINGS))
async def test_a_reference_under_another_spelling_keeps_the_object(
        settings: Settings, s3: Any, redis_client: Any, how: str) -> None:
    s = _settings(settings)
    await ensure_topics(s)
    async with Publisher(s) as pub, running_tracker(s):
        svc = await _service(s, s3, pub)
        await svc.call(Model.create_repository, "repo", "s3://spell/repo/")
        victim = (await svc.call(Model.write, "repo", "main", "v", 10)).address
        token = svc.model.branch("repo", "main").staging_token
        assert victim
        # (escaped slash: the escape replaces the last "/", so the decoded form is the victim)
        copy = ev.ObjectCopied(repository="repo", branch="main", staging_token=token,
                               path="copy", address=SPELLINGS[how](victim), size=10,
                               ref_id="copy-ref", source_read_at=0.0)
        await wait_horizon(s, await publish(s, [copy]))
        reasons = await dead_letters(s, 1)
        assert "address" in reasons[copy.event_id]
        holds = redis_client.hgetall(RepoKeys("repo").holds)
        assert victim in holds, (holds, victim)  # the real object is held
        incidents = [orjson.loads(i) for i in redis_client.lrange(INCIDENTS, 0, -1)]
        assert any(i["kind"] == "address_spelling" and i["event_id"] == copy.event_id
                   for i in incidents)
        # The only recorded reference ends: unreferenced, but held past its grace.
        await svc.call(Model.delete, "repo", "main", "v")
        await wait_horizon(s, await publish(s, []) + int(s.grace_seconds * 1000) + 500)
        reaper = Reaper(s)
        try:
            report = await reaper.run_once()
            assert report.total("deleted") == 0
        finally:
            await reaper.close()
    assert victim in listed(s3, "spell")


def test_an_operators_hold_under_another_spelling_holds_the_canonical_object(
        redis_client: Any, s3: Any) -> None:
    from hardelete.holds import add_hold, held_by, remove_hold
    from schemas.layout import REPOS

    redis_client.sadd(REPOS, "repo")
    redis_client.hset(RepoKeys("repo").meta, "namespace", NS)
    s3.create_bucket(Bucket=split_s3_uri(NS)[0])  # (the durable facts' home)
    (hold,) = add_hold(redis_client, "S3A://BUCKET/repo/data/x", "legal", s3=s3)
    assert hold.target == NS + "data/x"
    assert redis_client.hexists(RepoKeys("repo").holds, NS + "data/x")
    assert held_by(NS + "data/x", redis_client.hgetall(RepoKeys("repo").holds), {})
    remove_hold(redis_client, "s3://Bucket/repo/data/x", s3=s3)
    assert not redis_client.hlen(RepoKeys("repo").holds)
