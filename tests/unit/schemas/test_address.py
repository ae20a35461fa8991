"""One canonical address (``schemas/address.py``): property tests, and the tracker end to end.

Issue 19 finding: ``S3://``, ``s3a://``, an upper-case bucket or a percent-escaped key went to
the dead-letter topic without a hold, or were applied to a second record, and the real object
was reaped while a reference to it existed.
"""

from __future__ import annotations

from urllib.parse import quote

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from schemas.address import address_forms, canonical_address, canonical_namespace, spelling
from schemas.layout import RESERVED_PREFIXES
from tracker import codec

NS = "s3://bucket/repo/"

segment = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="/%"),
                  min_size=1, max_size=8).filter(lambda p: p not in (".", ".."))
keys = st.lists(segment, min_size=1, max_size=4).map("/".join).filter(
    lambda k: not k.startswith(RESERVED_PREFIXES))
schemes = st.sampled_from(["s3://", "S3://", "s3a://", "S3A://", "s3n://", "S3n://"])
buckets = st.sampled_from(["bucket", "BUCKET", "Bucket", "bUcKeT"])


@given(keys)
def test_the_canonical_spelling_is_admitted_as_itself(key: str) -> None:
    address = NS + key
    seen = spelling(NS, address)
    assert seen.problem is None and seen.meant == (address,)
    assert canonical_address(NS, address) == address  # idempotent
    assert canonical_address(NS, key) == address  # namespace-relative


@given(keys, schemes, buckets)
def test_every_spelling_of_one_object_means_that_object_and_only_canonical_is_admitted(
        key: str, scheme: str, bucket: str) -> None:
    raw = f"{scheme}{bucket}/repo/{key}"
    canonical = NS + key
    assert canonical_address(NS, raw) == canonical
    seen = spelling(NS, raw)
    assert seen.meant == (canonical,)
    assert (seen.problem is None) == (raw == canonical)
    if seen.problem:
        assert repr(canonical) in seen.problem  # the reason names the object


@given(keys, keys)
def test_different_keys_are_different_objects(a: str, b: str) -> None:
    assert (canonical_address(NS, NS + a) == canonical_address(NS, NS + b)) == (a == b)
    assert (canonical_address(NS, NS + a) == canonical_address(NS, NS + a.swapcase())) == (
        a == a.swapcase())


@given(keys)
def test_an_escaped_key_is_ambiguous_and_means_both_objects(key: str) -> None:
    encoded = NS + quote(key, safe="") + "%41"  # at least one escape
    seen = spelling(NS, encoded)
    assert seen.problem is not None and "ambiguous" in seen.problem
    assert set(seen.meant) == set(address_forms(NS, encoded))
    assert NS + key + "A" in seen.meant  # the decoded object
    assert encoded in seen.meant  # and the literal one


@given(keys, st.sampled_from(["s3://other/repo/", "s3://bucket/repo2/", "s3://bucket/"]))
def test_containment_follows_the_canonical_keys(key: str, other: str) -> None:
    seen = spelling(NS, other + key)
    if (other + key).startswith(NS):
        assert seen.meant
    else:
        assert seen.problem is not None and seen.meant == ()


def test_namespaces_are_canonical_with_a_lower_case_bucket() -> None:
    assert canonical_namespace("S3://Bucket/Repo") == "s3://bucket/Repo/"
    with pytest.raises(Exception, match="must be"):
        canonical_namespace("https://bucket/repo/")


def test_unreadable_spellings_hold_the_whole_namespace() -> None:
    for raw in ("https://bucket.s3.amazonaws.com/repo/x", "/repo/x", ""):
        assert not spelling(NS, raw).readable
    body = {"type": "object_copied", "repository": "r", "address": "https://x/y"}
    assert codec.hold_targets(orjson.dumps(body), b"r", {"r": NS}) == [("r", NS)]
    body = {"type": "object_copied", "repository": "r", "address": "S3://BUCKET/repo/k"}
    assert codec.hold_targets(orjson.dumps(body), b"r", {"r": NS}) == [("r", NS + "k")]
    lost = {"type": "object_written", "repository": "r"}  # lost its address
    assert codec.hold_targets(orjson.dumps(lost), b"r", {"r": NS}) == [("r", NS)]


# ------------------------------------------------------------ end to end on the real stack





