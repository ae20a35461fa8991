"""``hardelete facts list`` / ``facts reseal``: the way back for a repository whose durable facts
no longer verify (the fact key lost with Redis, or a fact forged into its home): it deletes
nothing until an operator has judged what ``list`` shows and resealed."""

from __future__ import annotations

from typing import Any

import orjson

from core.facts import FactLog, RepoFacts
from schemas.layout import FACT_KEY, RepoKeys
from sim.operations import run, setup_repo

NS = "s3://opsb/ns/"


def test_a_lost_key_stops_the_repository_until_an_operator_reseals(cli, capsys, s3: Any,
                                                                   redis_client: Any) -> None:
    setup_repo(cli)
    assert run(capsys, "hold", "add", NS + "x", "--reason", "legal")[0] == 0
    assert run(capsys, "pause", "ops", "--reason", "incident 9")[0] == 0
    code, out, _ = run(capsys, "facts", "list", "ops", "--json")
    rows = orjson.loads(out)
    assert code == 0 and [(r["seq"], r["kind"], r["verified"]) for r in rows] == [
        (1, "hold_add", True), (2, "pause", True)]
    # Redis loses everything, the key with it (restored from a copy older than the product)
    redis_client.delete(FACT_KEY, RepoKeys("ops").facts_seq, RepoKeys("ops").holds,
                        RepoKeys("ops").paused)
    proof = RepoFacts(redis_client, s3, "ops", NS).prove()
    assert proof.problem is not None and "does not verify" in proof.problem
    assert not redis_client.hexists(RepoKeys("ops").holds, NS + "x")  # not applied unverified
    code, out, _ = run(capsys, "facts", "list", "ops")
    assert code == 0 and "NO" in out
    digest = out.split("--digest ")[1].split("`")[0]  # what the operator judged
    code, _, err = run(capsys, "facts", "reseal", "ops")  # not without the operator's word
    assert code == 2 and "--digest" in err and err.count("\n") == 1
    code, _, err = run(capsys, "facts", "reseal", "ops", "--digest", "0" * 16)
    assert code == 2 and "changed since" in err
    code, out, _ = run(capsys, "facts", "reseal", "ops", "--digest", digest)
    assert code == 0 and "resealed 2 fact(s)" in out and "current" in out, out
    assert redis_client.hexists(RepoKeys("ops").holds, NS + "x")
    assert redis_client.exists(RepoKeys("ops").paused)
    assert RepoFacts(redis_client, s3, "ops", NS).prove().problem is None
    assert FactLog(s3, NS, "ops").seqs_from(1) == [1, 2]
