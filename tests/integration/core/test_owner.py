"""One owner lookup (core.registry.find_owner): the operator commands find an address's
repository in the registry the delete paths check, whatever the address's spelling."""

from __future__ import annotations

from typing import Any

import pytest

from core.errors import UserError
from core.facts import RepoFacts
from core.gate import read_gate
from core.registry import find_owner
from hardelete.holds import add_hold, find_repository
from hardelete.status import explain_address
from schemas.layout import NAMESPACES, REPOS, RepoKeys


def _refused_overlap(r: Any) -> None:
    """``b`` owns s3://bkt/x/; ``a0`` asked for s3://bkt/x/y/ inside it and was refused (its
    metadata names the namespace, the registry does not). ``a0`` sorts first."""
    r.sadd(REPOS, "b", "a0")
    r.hset(RepoKeys("b").meta, mapping={"namespace": "s3://bkt/x/"})
    r.hset(RepoKeys("a0").meta, mapping={"namespace": "s3://bkt/x/y/"})
    r.hset(NAMESPACES, "s3://bkt/x/", "b")
def test_holds_and_explain_find_the_owner_the_gate_checks(redis_client: Any, s3: Any,
                                                           settings: Any) -> None:
    r = redis_client
    _refused_overlap(r)
    s3.create_bucket(Bucket="bkt")  # (the durable facts' home)
    address = "s3://bkt/x/y/k"
    gate = read_gate(r, "b", [address], facts=RepoFacts(r, s3, "b", "s3://bkt/x/").prove())
    assert gate.repo_problem("b", "s3://bkt/x/") is None
    assert gate.repo_problem("a0", "s3://bkt/x/y/") is not None  # not the owner
    # A scan of metadata in name order found a0, and its hold went on a repository whose
    # objects no delete path considers: the owner's reaper went on deleting it.
    assert find_repository(r, address) == ("b", "s3://bkt/x/")
    assert find_repository(r, "S3://BKT/x/y/k") == ("b", "s3://bkt/x/")
    (hold,) = add_hold(r, address, "keep it", s3=s3)
    assert r.hexists(RepoKeys("b").holds, address) and not r.exists(RepoKeys("a0").holds)
    assert hold.repository == "b" and hold.target == address
    with pytest.raises(UserError, match="repository 'b' owns it"):
        find_repository(r, address, repo="a0")
    assert explain_address(r, settings, address).repository == "b"
    assert find_owner(r, "s3://elsewhere/k") is None


def test_without_a_registry_the_repositories_namespaces_stand_in(redis_client: Any) -> None:
    r = redis_client
    r.sadd(REPOS, "old")
    r.hset(RepoKeys("old").meta, mapping={"namespace": "S3://Old-Bucket/ns"})
    assert find_owner(r, "s3://old-bucket/ns/k") == ("old", "s3://old-bucket/ns/")


async def test_a_repositorys_namespace_and_retirement_are_read_one_way(redis_client: Any,
                                                                        settings: Any) -> None:
    """core.registry's lifecycle reads (the tracker's admission, its registry backfill and
    cache, the rebuild): a retired repository keeps its namespace; an unknown one has none."""
    from core.clients import redis_async
    from core.registry import arepo_lifecycles, repo_lifecycle

    r = redis_client
    r.hset(RepoKeys("live").meta, mapping={"namespace": "s3://bkt/l/"})
    r.hset(RepoKeys("old").meta, mapping={"namespace": "s3://bkt/o/", "retired_at": "7"})
    expected = {"live": ("s3://bkt/l/", False), "old": ("s3://bkt/o/", True),
                "never": (None, False)}
    assert {repo: repo_lifecycle(r, repo) for repo in expected} == expected
    ar = redis_async(settings)
    try:
        assert await arepo_lifecycles(ar, sorted(expected)) == expected
    finally:
        await ar.aclose()
