"""Holds mean what the delete paths mean (issue 33 item 5): an operator's hold on any spelling of
an address or a prefix keeps every object that spelling may name, against the real tracker,
reaper and gate (``schemas.holds.resolve_target``).

Found by the review of issue 33: ``hold add`` stored a percent-escaped spelling literally while
the reaper compares the decoded object too (it was reaped), refused a namespace-relative key,
held an escaped directory given without ``--prefix`` as one address (what lay under it was
reaped), and placed a hold spelled through another repository's escaped namespace on that
repository only, never on the owner of the object (reaped).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import orjson
import pytest

from core.gate import read_gate
from schemas.layout import RepoKeys
from sim.model import Model
from sim.operations import make_garbage, publish_and_track, reap_until, run, stored

# The service certifies its history (schemas/README.md, "Continuity").
pytestmark = pytest.mark.usefixtures("sequenced")

BUCKET = "spellb"
NS = f"s3://{BUCKET}/repo/"
FREE_NS = "s3://spellfree/other/"  # the marker's repository: under no hold of these tests


def _tail(a: str) -> str:
    return a.removeprefix(f"s3://{BUCKET}/")


def _dir(a: str) -> str:
    return a.rsplit("/", 1)[0]


# how an operator may spell a hold on the address ``a`` (the victim): the CLI's arguments
SPELLINGS: dict[str, Callable[[str], list[str]]] = {
    "canonical": lambda a: [a],
    "upper-case scheme and bucket": lambda a: [f"S3://{BUCKET.upper()}/" + _tail(a)],
    "s3a": lambda a: ["s3a://" + a.removeprefix("s3://")],
    "s3n, bucket in mixed case": lambda a: ["s3n://SpellB/" + _tail(a)],
    "escaped slash": lambda a: ["%2F".join(a.rsplit("/", 1))],
    "escaped letter": lambda a: [a[:-1] + f"%{ord(a[-1]):02X}"],
    "escaped bucket": lambda a: ["s3://spell%62/" + _tail(a)],
    "namespace-relative key": lambda a: [a.removeprefix(NS), "--repo", "repo"],
    "directory without --prefix": lambda a: [_dir(a) + "/"],
    "escaped directory without --prefix": lambda a: [_dir(a) + "%2F"],
    "prefix under another scheme": lambda a: [f"S3A://{BUCKET.upper()}/" + _tail(_dir(a)) + "/",
                                              "--prefix"],
    "prefix without its slash": lambda a: [_dir(a), "--prefix"],
    "namespace-relative prefix": lambda a: ["data/", "--prefix", "--repo", "repo"],
    "escaped prefix": lambda a: [NS + "data%2F", "--prefix"],
    "a bucket-wide prefix": lambda a: [f"s3://{BUCKET.upper()}/", "--prefix"],
}


def _garbage(s: Any, s3: Any, extra: dict[str, str] | None = None) -> tuple[str, str]:
    """The victim (in ``repo``) and a marker (in ``other``) made garbage in that order: once the
    reaper took the marker it has judged the victim (unreferenced earlier)."""
    model = Model.from_settings(s)

    async def go() -> tuple[str, str]:
        for repo, ns in (extra or {}).items():
            await make_garbage(s, s3, model, repo, [], namespace=ns)
        (held,) = await make_garbage(s, s3, model, "repo", ["held"], namespace=NS)
        (free,) = await make_garbage(s, s3, model, "other", ["free"], namespace=FREE_NS)
        assert held and free
        return held, free
    held, free = asyncio.run(go())
    asyncio.run(publish_and_track(s))  # the tracker has the namespaces the hold is placed in
    return held, free


@pytest.mark.parametrize("how", sorted(SPELLINGS))
def test_a_hold_on_any_spelling_keeps_the_object_from_every_delete_path(
        cli, capsys, s3, redis_client, how: str) -> None:
    s = cli.replace(lease_seconds=1.0, upload_ttl_seconds=1.0)
    held, free = _garbage(s, s3)
    code, out, err = run(capsys, "hold", "add", *SPELLINGS[how](held), "--reason", "case 33")
    assert code == 0, err
    # the gate the reconciler's sweep, the quarantine purge and the reaper's delete re-read
    gate = read_gate(redis_client, "repo", [held])
    asyncio.run(reap_until(s, lambda rep: not stored(s3, free)))
    assert stored(s3, held), f"the reaper deleted {held}, held as {SPELLINGS[how](held)}: {out}"
    assert gate.guards("repo", NS, held).held


def test_a_hold_through_another_repositorys_escaped_namespace_holds_the_objects_owner(
        cli, capsys, s3, redis_client) -> None:
    """``s3://spellb/rep%6F/`` (a repository whose prefix holds a literal ``%``) and
    ``s3://spellb/repo/`` do not overlap, but ``s3://spellb/rep%6F/data/x`` may name an object of
    either: the hold goes on both, not only on the repository the literal spelling finds."""
    s = cli.replace(lease_seconds=1.0, upload_ttl_seconds=1.0)
    held, free = _garbage(s, s3, {"esc": f"s3://{BUCKET}/rep%6F/"})
    spelled = f"s3://{BUCKET}/rep%6F/" + held.removeprefix(NS)
    code, out, err = run(capsys, "hold", "add", spelled, "--reason", "case 33")
    assert code == 0, err
    asyncio.run(reap_until(s, lambda rep: not stored(s3, free)))
    assert stored(s3, held), f"the reaper deleted {held}: {out}"
    assert f"held address {held} in repo" in out and f"held address {spelled} in esc" in out
    # ...and with --repo naming the other owner: still both (--repo only says whose namespace
    # a relative key is in, and which repository must own one of the objects)
    code, out, err = run(capsys, "hold", "remove", spelled, "--repo", "esc")
    assert code == 0 and out.count("lifted the hold") == 2, (out, err)
    assert not redis_client.hlen(RepoKeys("repo").holds)


def test_hold_list_and_remove_find_a_hold_by_any_spelling(cli, capsys, redis_client) -> None:
    s = cli
    model = Model.from_settings(s)
    from core.clients import s3_client

    asyncio.run(make_garbage(s, s3_client(s), model, "repo", [], namespace=NS))
    asyncio.run(publish_and_track(s))
    a = NS + "data/a b"
    code, out, err = run(capsys, "hold", "add", NS + "data/a%20b", "--reason", "both")
    assert code == 0, err
    assert set(redis_client.hkeys(RepoKeys("repo").holds)) == {a, NS + "data/a%20b"}
    for spelled in ("S3A://SPELLB/repo/data/a b", "data/a b", "s3://spellb/repo/data/a%20b"):
        argv = ["hold", "list", spelled, "--json"] + (["--repo", "repo"] if "://" not in spelled
                                                      else [])
        code, out, err = run(capsys, *argv)
        assert code == 0, err
        assert a in {h["target"] for h in orjson.loads(out)}, spelled
    # a prefix hold keeps what lies under it: `hold list ADDRESS` shows it too
    assert run(capsys, "hold", "add", "s3a://spellb/repo/data/", "--reason", "dir")[0] == 0
    code, out, _ = run(capsys, "hold", "list", "s3://SPELLB/repo/data/a b", "--json")
    assert {(h["target"], h["kind"]) for h in orjson.loads(out)} == {
        (a, "address"), (NS + "data/", "prefix")}
    code, out, err = run(capsys, "hold", "remove", "S3N://spellb/repo/data/a b")
    assert code == 0 and f"lifted the hold on {a}" in out, err
    assert set(redis_client.hkeys(RepoKeys("repo").holds)) == {NS + "data/a%20b"}
    code, out, err = run(capsys, "hold", "remove", "s3://spellb/repo/data%2F")
    assert code == 0 and f"lifted the hold on {NS}data/" in out, err
    code, out, err = run(capsys, "hold", "remove", "data/a%20b", "--repo", "repo")
    assert code == 0 and "lifted the hold on s3://spellb/repo/data/a%20b" in out, err
    assert not redis_client.hlen(RepoKeys("repo").holds)


@pytest.mark.parametrize(("argv", "says"), [
    (["s3://elsewhere/x"], "inside no tracked repository"),
    (["data/x"], "--repo"),
    (["https://spellb/repo/data/x"], "s3:// URI"),
    (["s3://spellb/repo/_hardelete/quarantine/data/x"], "reserved"),
    (["s3://spellb/repo/_hardelete/", "--prefix"], "reserved"),
    (["s3://spellb/repo/a//b"], "plain object key"),
    (["data/x", "--repo", "nobody"], "nobody"),
    (["s3://spellb/repo/data/x", "--repo", "nobody"], "nobody"),
])
def test_a_spelling_that_names_nothing_deletable_is_refused_in_one_line(
        cli, capsys, redis_client, argv: list[str], says: str) -> None:
    from core.clients import s3_client

    asyncio.run(make_garbage(cli, s3_client(cli), Model.from_settings(cli), "repo", [],
                             namespace=NS))
    asyncio.run(publish_and_track(cli))
    code, _, err = run(capsys, "hold", "add", *argv, "--reason", "r")
    assert code == 2 and says in err and err.count("\n") == 1, err
    assert not redis_client.hlen(RepoKeys("repo").holds)
    assert not redis_client.hlen(RepoKeys("repo").hold_prefixes)


def test_explain_reads_any_spelling(cli, capsys, s3, redis_client) -> None:
    """explain answers for the object a spelling names (its record, its hold), not for a
    string no record is kept under."""
    s = cli.replace(lease_seconds=1.0, upload_ttl_seconds=1.0)
    held, _free = _garbage(s, s3)
    assert run(capsys, "hold", "add", held, "--reason", "case 33")[0] == 0
    code, out, err = run(capsys, "explain", "S3A://SPELLB/" + _tail(held), "--json",
                         "--no-reports")
    assert code == 0, err
    ex = orjson.loads(out)
    assert ex["address"] == held and ex["repository"] == "repo"
    # its record (not "untracked": no record is kept under the spelling) and its hold
    assert ex["state"] in ("issued", "unreferenced") and "held" in ex["verdict"], ex
    code, out, err = run(capsys, "explain", held.replace("/repo/", "/rep%6F/"), "--json",
                         "--no-reports")
    assert code == 0 and orjson.loads(out)["address"] == held, (out, err)
