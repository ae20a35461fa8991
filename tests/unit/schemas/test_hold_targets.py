"""Where an operator's hold is stored (``schemas.holds.resolve_target``): in the canonical form
the delete paths compare, in every form an ambiguous spelling may take (issue 33 item 5).

The property: for any object and any spelling of it that ``address_forms`` accepts, a hold
placed through that spelling keeps the object in the gate every delete path asks
(``core.gate.Gate.guards``, what ``reaper/claims.lua`` does too), and any other spelling of it
finds that hold (``hold list``/``hold remove``)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from urllib.parse import quote

import orjson
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from core.gate import Gate
from schemas.address import address_forms
from schemas.holds import Target, TargetError, related, resolve_target
from schemas.layout import RESERVED_PREFIXES
from tracker import codec

NS = "s3://bucket/repo/"
REGISTRY = {NS: "repo", "s3://bucket/repo2/": "other", "s3://elsewhere/x/": "far"}

segment = st.text(st.characters(blacklist_categories=["Cs"], blacklist_characters="/"),
                  min_size=1, max_size=8).filter(lambda p: p not in (".", ".."))
keys = st.lists(segment, min_size=1, max_size=4).map("/".join).filter(
    lambda k: not k.startswith(RESERVED_PREFIXES))
schemes = st.sampled_from(["s3://", "S3://", "s3a://", "S3A://", "s3n://", "S3n://"])
buckets = st.sampled_from(["bucket", "BUCKET", "Bucket", "bUcKeT", "bucke%74", "%62ucket"])
# how the key is written: literally, or %XX-escaped (its slashes kept, or escaped too)
encodings = st.sampled_from([lambda k: k, lambda k: quote(k, safe="/"),
                             lambda k: quote(k, safe="")])


@st.composite
def spellings(draw: st.DrawFn, key: str) -> tuple[str, str | None]:
    """(a spelling of the object ``NS + key``, the repository a relative one needs)."""
    rel = draw(encodings)(key)
    if draw(st.booleans()):
        return rel, "repo"
    return f"{draw(schemes)}{draw(buckets)}/repo/{rel}", None


def _gate(targets: Iterable[Target]) -> Gate:
    """The gate of ``repo`` with these holds stored (what the delete paths read)."""
    mine = [t for t in targets if t.repository == "repo"]
    return Gate(registry={ns: r for ns, r in REGISTRY.items()},
                holds={t.key: "held" for t in mine if not t.prefix},
                hold_prefixes={t.key: "held" for t in mine if t.prefix})


@given(st.data(), keys)
def test_a_hold_through_any_spelling_keeps_the_object_and_any_spelling_finds_it(
        data: st.DataObject, key: str) -> None:
    address = NS + key
    placed, repo = data.draw(spellings(key))
    assume(address in address_forms(NS, placed))  # a spelling of this object
    assume(placed.strip())  # (all whitespace names nothing: refused with one line)
    targets = resolve_target(REGISTRY, placed, repo=repo)
    assert _gate(targets).guards("repo", NS, address).held
    # every stored form is canonical: what a delete path would compare
    assert all(t.key == t.key.lower()[:5] + t.key[5:] and t.key.startswith(t.namespace)
               for t in targets)
    again, repo2 = data.draw(spellings(key))
    assume(address in address_forms(NS, again))
    assume(again.strip())
    found = resolve_target(REGISTRY, again, repo=repo2)
    assert any(related(t, s.key, s.prefix) for t in found for s in targets
               if t.repository == s.repository)


@given(st.data(), keys, keys)
def test_a_prefix_hold_through_any_spelling_keeps_everything_under_it(
        data: st.DataObject, directory: str, key: str) -> None:
    spelled, repo = data.draw(spellings(directory + "/"))
    flag = data.draw(st.booleans()) or spelled.endswith("/")
    targets = resolve_target(REGISTRY, spelled, repo=repo, prefix=flag)
    assert _gate(targets).guards("repo", NS, NS + directory + "/" + key).held


@given(keys, schemes, buckets, encodings)
def test_an_operators_hold_is_where_a_dead_letter_naming_the_spelling_holds(
        key: str, scheme: str, bucket: str, encode: Callable[[str], str]) -> None:
    """The same objects the tracker holds for a dead-lettered event naming that spelling
    (``tracker.codec.hold_targets``), in the same repositories."""
    raw = f"{scheme}{bucket}/repo/{encode(key)}"
    body = {"type": "object_copied", "repository": "repo", "address": raw}
    tracker = set(codec.hold_targets(orjson.dumps(body), b"repo", {"repo": NS}, REGISTRY))
    try:
        ours = {(t.repository, t.key) for t in resolve_target(REGISTRY, raw)}
    except TargetError:
        ours = set()
    assert ours == tracker - {("repo", NS)}  # (the tracker holds the namespace when unreadable)


def test_an_escaped_spelling_is_held_in_both_forms_and_a_slash_form_as_a_prefix() -> None:
    got = resolve_target(REGISTRY, "s3://BUCKET/repo/a%20b")
    assert [(t.key, t.prefix) for t in got] == [(NS + "a%20b", False), (NS + "a b", False)]
    got = resolve_target(REGISTRY, "s3a://bucket/repo/dir%2F")
    assert [(t.key, t.prefix) for t in got] == [(NS + "dir%2F", False), (NS + "dir/", True)]
    got = resolve_target(REGISTRY, "s3://bucket/repo/dir%2F", prefix=True)
    assert [(t.key, t.prefix) for t in got] == [(NS + "dir%2F", True), (NS + "dir/", True)]


def test_an_escaped_namespace_holds_every_repository_it_may_name() -> None:
    registry = {"s3://b/rep%6F/": "esc", "s3://b/repo/": "repo"}
    got = resolve_target(registry, "s3://b/rep%6F/k")
    assert {(t.repository, t.key) for t in got} == {("esc", "s3://b/rep%6F/k"),
                                                    ("repo", "s3://b/repo/k")}
    # --repo says which repository must own one; it does not drop the other's object
    assert resolve_target(registry, "s3://b/rep%6F/k", repo="esc") == got
    with pytest.raises(TargetError, match="'third'"):
        resolve_target({**registry, "s3://c/": "third"}, "s3://b/rep%6F/k", repo="third")


def test_a_prefix_is_held_in_every_namespace_it_lies_in_or_contains() -> None:
    got = resolve_target(REGISTRY, "S3://Bucket/", prefix=True)
    assert {(t.repository, t.key) for t in got} == {("repo", "s3://bucket/"),
                                                     ("other", "s3://bucket/")}
    got = resolve_target(REGISTRY, "s3://bucket/repo", prefix=True)  # no slash: repo2 too
    assert {t.repository for t in got} == {"repo", "other"}
    got = resolve_target(REGISTRY, "data/", repo="repo")
    assert got == (Target("repo", NS, NS + "data/", True),)


@pytest.mark.parametrize(("raw", "kw", "says"), [
    ("", {}, "no target"),
    ("s3://nowhere/x", {}, "inside no tracked repository"),
    ("data/x", {}, "--repo"),
    ("https://bucket/repo/x", {}, "s3:// URI"),
    ("/repo/x", {"repo": "repo"}, "s3:// URI"),
    ("data/x", {"repo": "nobody"}, "unknown repository 'nobody'"),
    ("s3://bucket/repo/x", {"repo": "far"}, "repository 'repo' owns it"),
    ("s3://bucket/repo/_hardelete/quarantine/k", {}, "reserved"),
    ("s3://bucket/repo/_lakefs/", {}, "reserved"),
    ("s3://bucket/repo/a//b", {}, "plain object key"),
    ("s3://bucket/repo/./a/", {}, "plain object key"),
    ("s3://", {"prefix": True}, "inside no tracked repository"),
])
def test_a_spelling_naming_nothing_deletable_is_refused(raw: str, kw: dict[str, object],
                                                        says: str) -> None:
    with pytest.raises(TargetError) as exc:
        resolve_target(REGISTRY, raw, **kw)  # type: ignore[arg-type]
    assert says in str(exc.value) and "\n" not in str(exc.value)


def test_related_holds() -> None:
    a = Target("repo", NS, NS + "d/k", False)
    p = Target("repo", NS, NS + "d/", True)
    assert related(a, NS + "d/k", False) and related(a, NS + "d/", True)
    assert related(a, NS + "d/k", True)  # a prefix hold keeps the object of its own key
    assert not related(a, NS + "d/kk", False) and not related(a, NS + "e/", True)
    assert related(p, NS + "d/k", False) and related(p, NS + "d/x/", True)
    assert related(p, NS, True) and not related(p, NS + "e/", True)
