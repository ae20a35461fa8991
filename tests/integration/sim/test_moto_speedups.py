"""The embedded S3 server with ``sim.moto_speedups`` answers as moto does.

Two real servers, one plain moto and one patched, get the same writes, overwrites, deletes
and (in a versioned bucket) delete markers; every ListObjectsV2 query, paginated to the end,
must return the same pages from both. The queries run before and after further changes, so
the patched server's index is checked while it is kept in step, not only when it is built.
"""

from __future__ import annotations

import random
import re
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

# moto is a stand-in now (the embedded S3 server is MinIO): only in the 'standins' extra.
pytest.importorskip("moto", reason="moto is in the 'standins' extra: pip install -e '.[standins]'")

from core.clients import s3_client
from core.settings import load_settings
from sim.stack import Server, moto_server

SEGMENTS = ["a", "ab", "a-b", "b", "c.d", "é", "z", "a b"]


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, Any]]:
    wd: Path = tmp_path_factory.mktemp("moto-speedups")
    started: list[Server] = []
    clients = []
    try:
        for speedups in (False, True):
            server = moto_server(wd, speedups=speedups)
            server.start()
            started.append(server)
            settings = load_settings(env={}, s3_endpoint_url=f"http://127.0.0.1:{server.port}")
            clients.append(s3_client(settings))
        yield clients[0], clients[1]
    finally:
        for server in started:
            server.stop()


def _name(rng: random.Random) -> str:
    return "/".join(rng.choice(SEGMENTS) for _ in range(rng.randint(1, 4)))


def _query(rng: random.Random, names: list[str]) -> dict[str, Any]:
    q: dict[str, Any] = {"MaxKeys": rng.choice([1, 2, 3, 7, 1000])}
    pick = rng.choice(names)
    prefix = rng.choice(["", pick[: rng.randint(0, len(pick))], pick.rsplit("/", 1)[0] + "/",
                         "nothing/"])
    if prefix:
        q["Prefix"] = prefix
    delimiter = rng.choice([None, "/", "/", "-", "b"])
    if delimiter:
        q["Delimiter"] = delimiter
    if rng.random() < 0.3:
        q["StartAfter"] = rng.choice([rng.choice(names), rng.choice(names)[:2], "a/", "zz"])
    return q


def _pages(s3: Any, bucket: str, query: dict[str, Any]) -> list[dict[str, Any]]:
    pages: list[dict[str, Any]] = []
    token: str | None = None
    while True:
        q = dict(query, Bucket=bucket)
        if token:
            q["ContinuationToken"] = token
        r = s3.list_objects_v2(**q)
        pages.append({
            "keys": [(o["Key"], o["ETag"], o["Size"]) for o in r.get("Contents", [])],
            "prefixes": [p["Prefix"] for p in r.get("CommonPrefixes", [])],
            "truncated": r["IsTruncated"],
            "count": r["KeyCount"],
            "token": r.get("NextContinuationToken"),
        })
        token = r.get("NextContinuationToken")
        if not r["IsTruncated"]:
            return pages
        assert token, "a truncated page without a continuation token"
        assert len(pages) < 2000


def _same_listings(plain: Any, fast: Any, bucket: str, rng: random.Random,
                   names: list[str], queries: int) -> int:
    listed = 0
    for _ in range(queries):
        q = _query(rng, names)
        want = _pages(plain, bucket, q)
        assert _pages(fast, bucket, q) == want, q
        listed += sum(len(p["keys"]) + len(p["prefixes"]) for p in want)
    return listed


_STAMPS = re.compile(rb"<LastModified>\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.000Z</LastModified>")
_ANY_STAMP = re.compile(rb"<LastModified>[^<]*</LastModified>")


def _raw(s3: Any, bucket: str, query: dict[str, Any]) -> bytes:
    params = {"list-type": "2"} | {k: str(v) for k, v in query.items()}
    url = f"{s3.meta.endpoint_url}/{bucket}?{urllib.parse.urlencode(params)}"
    with urllib.request.urlopen(url, timeout=30) as r:
        body: bytes = r.read()
    return body


def _same_bytes(plain: Any, fast: Any, bucket: str, rng: random.Random,
                names: list[str], queries: int) -> None:
    """The response bodies themselves are equal (the patched server renders each object's
    element apart from the page and splices it in)."""
    for _ in range(queries):
        q = _query(rng, names)
        raw = {"max-keys": q["MaxKeys"]}
        raw |= {"prefix": q["Prefix"]} if "Prefix" in q else {}
        raw |= {"delimiter": q["Delimiter"]} if "Delimiter" in q else {}
        raw |= {"start-after": q["StartAfter"]} if "StartAfter" in q else {}
        if rng.random() < 0.3:
            raw["encoding-type"] = "url"
        if rng.random() < 0.3:
            raw["fetch-owner"] = "true"
        got, want = _raw(fast, bucket, raw), _raw(plain, bucket, raw)
        # The two servers stored each object at their own moment: compare the timestamps'
        # form, and everything else byte for byte.
        assert len(_STAMPS.findall(got)) == len(_ANY_STAMP.findall(got)), got[:300]
        assert _ANY_STAMP.sub(b"", got) == _ANY_STAMP.sub(b"", want), raw


@pytest.mark.parametrize("seed,versioned", [(1, False), (2, False), (3, True)])
def test_listings_equal_moto_while_the_bucket_changes(servers: tuple[Any, Any], seed: int,
                                                     versioned: bool) -> None:
    plain, fast = servers
    rng = random.Random(seed)
    bucket = f"eq-{seed}"
    for s3 in servers:
        s3.create_bucket(Bucket=bucket)
        if versioned:
            s3.put_bucket_versioning(Bucket=bucket,
                                     VersioningConfiguration={"Status": "Enabled"})
    names: list[str] = []
    listed = 0
    for _round in range(3):
        for _ in range(60):
            name = _name(rng)
            body = rng.choice([b"", b"x", b"xy" * rng.randint(1, 50)])
            for s3 in servers:
                s3.put_object(Bucket=bucket, Key=name, Body=body)
            names.append(name)
        for name in rng.sample(names, k=len(names) // 5):
            for s3 in servers:
                s3.delete_object(Bucket=bucket, Key=name)
        listed += _same_listings(plain, fast, bucket, rng, names, queries=25)
        _same_bytes(plain, fast, bucket, rng, names, queries=25)
    # The comparison means something only if the queries listed keys and folders.
    assert listed > 100
