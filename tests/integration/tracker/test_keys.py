"""Keys no id can escape (issue 19 item 5): repository ids are encoded in Redis keys.

Finding: ids were put into keys unescaped, so an id like ``<victim>}:a:x`` wrote hashes, sets
and sorted sets inside the victim's address prefix, and the victim's reconciler failed on every
run from then on.
"""

from __future__ import annotations

from typing import Any

from schemas import events as ev
from schemas.layout import RepoKeys
from sim.testing import publish, wait_horizon
from tracker.daemon import running_tracker
from tracker.state import read_repo_state

HOSTILE = ["victim}:a:x", "victim}", "{victim", "vic:tim", "victim%7D", "répo☃", "v" * 1024,
           "victim}:repo", "victim}:tokens"]
async def test_hostile_ids_write_only_under_their_own_keys(settings: Any,
                                                           redis_client: Any) -> None:
    events: list[ev.Event] = []
    for i, repo in enumerate(["victim", *HOSTILE]):
        ns = f"s3://keys/r{i}/"
        events += [
            ev.RepositoryCreated(repository=repo, storage_namespace=ns, default_branch="main",
                                 default_retention_days=7.0),
            ev.BranchCreated(repository=repo, branch="main", staging_token=f"tok{i}",
                             ref_version=1),
            ev.ObjectWritten(repository=repo, branch="main", staging_token=f"tok{i}",
                             path="p", address=f"{ns}data/x", size=1, ref_id=f"ref{i}"),
        ]
    async with running_tracker(settings):
        await wait_horizon(settings, await publish(settings, events))
    victim = RepoKeys("victim")
    keys = {k for k in redis_client.scan_iter(match="hd:{*", count=1000)}
    mine = {k for k in keys if k.startswith(victim.tag + ":")}
    assert all(k.startswith(victim.tag + ":") for k in mine)
    addresses = [k[len(victim.address_prefix):] for k in mine
                 if k.startswith(victim.address_prefix)]
    assert addresses == ["s3://keys/r0/data/x"]  # nothing of "victim}:a:x" in its prefix
    assert set(read_repo_state(redis_client, "victim").addresses) == {"s3://keys/r0/data/x"}
    # and every hostile repository's state reads back whole, under its own keys
    for i, repo in enumerate(HOSTILE, start=1):
        state = read_repo_state(redis_client, repo)
        assert set(state.addresses) == {f"s3://keys/r{i}/data/x"}, repo
