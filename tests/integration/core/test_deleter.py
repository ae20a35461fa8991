"""The one deleter on the real MinIO: versioned buckets (SPEC safety 6, issue 34 finding 5) and
requests the store refuses once late (finding 3's bound).

MinIO (single drive, ``xl-single``) supports bucket versioning: ``put_bucket_versioning``
works, a plain delete writes a delete marker and keeps the bytes, exactly as S3 does.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from core.clients import s3_client
from core.deleter import DELETE_MARKER, REWRITTEN, Deleter, Plan, RetryPolicy
from core.settings import Settings
from sim.faultproxy import FaultProxy


def _versions(s3: Any, bucket: str, key: str) -> list[str]:
    page = s3.list_object_versions(Bucket=bucket, Prefix=key)
    return [v["VersionId"] for name in ("Versions", "DeleteMarkers")
            for v in page.get(name, []) if v["Key"] == key]


def _versioning(s3: Any, bucket: str, status: str) -> None:
    s3.put_bucket_versioning(Bucket=bucket, VersioningConfiguration={"Status": status})


def test_a_versioned_bucket_loses_every_version_and_only_that_counts(
        settings: Settings, s3: Any, bucket: str) -> None:
    ns = f"s3://{bucket}/repo/"
    _versioning(s3, bucket, "Enabled")
    s3.put_object(Bucket=bucket, Key="repo/data/a", Body=b"a")
    s3.put_object(Bucket=bucket, Key="repo/data/twice", Body=b"1")
    s3.put_object(Bucket=bucket, Key="repo/data/twice", Body=b"2")
    deleter = Deleter(s3_client(settings, retries=False))
    out = deleter.delete(Plan(ns), [f"{ns}data/a", f"{ns}data/twice"])
    assert out.deleted == (f"{ns}data/a",) and len(out.versions[f"{ns}data/a"]) == 1
    assert _versions(s3, bucket, "repo/data/a") == []  # the bytes are gone, no marker left
    # Written twice: which version was judged is unknown; kept whole.
    assert out.kept[f"{ns}data/twice"].startswith(REWRITTEN)
    assert len(_versions(s3, bucket, "repo/data/twice")) == 2


def test_versioning_turned_on_after_the_status_was_read(
        settings: Settings, s3: Any, bucket: str) -> None:
    ns = f"s3://{bucket}/repo/"
    deleter = Deleter(s3_client(settings, retries=False))
    s3.put_object(Bucket=bucket, Key="repo/data/first", Body=b"x")
    assert deleter.delete(Plan(ns), [f"{ns}data/first"]).deleted  # unversioned: cached ''
    _versioning(s3, bucket, "Enabled")
    s3.put_object(Bucket=bucket, Key="repo/data/b", Body=b"b")
    # One attempt: the plain delete writes a marker, which is not a delete.
    once = deleter.delete(Plan(ns, retry=RetryPolicy(attempts=1)), [f"{ns}data/b"])
    assert not once.deleted and once.code(f"{ns}data/b") == DELETE_MARKER
    assert len(_versions(s3, bucket, "repo/data/b")) == 2  # the bytes and the marker
    # The marker made the deleter read the status again: the next call deletes both.
    again = deleter.delete(Plan(ns), [f"{ns}data/b"])
    assert again.deleted == (f"{ns}data/b",) and len(again.versions[f"{ns}data/b"]) == 2
    assert _versions(s3, bucket, "repo/data/b") == []
    # Within one call too: a marker is retried the versioned way.
    fresh = Deleter(s3_client(settings, retries=False))
    _versioning(s3, bucket, "Suspended")
    fresh._versioning[bucket] = ""  # (as if read before versioning was turned on)
    s3.put_object(Bucket=bucket, Key="repo/data/c", Body=b"c")
    out = fresh.delete(Plan(ns, retry=RetryPolicy(base_delay=0.0)), [f"{ns}data/c"])
    assert out.deleted == (f"{ns}data/c",) and out.retries == 1
    assert _versions(s3, bucket, "repo/data/c") == []


def test_a_late_request_is_refused_by_the_store(settings: Settings, s3: Any,
                                               bucket: str) -> None:
    """A delete held on its way (a slow store) past its bound never lands."""
    ns = f"s3://{bucket}/repo/"
    s3.put_object(Bucket=bucket, Key="repo/data/late", Body=b"x")
    with FaultProxy(settings.s3_endpoint_url) as proxy:
        proxy.faults.hold_deletes = threading.Event()
        client = s3_client(settings.replace(s3_endpoint_url=proxy.url, s3_request_seconds=2),
                           retries=False)
        deleter = Deleter(client, request_seconds=2, skew_seconds=0.0)
        result: list[Any] = []
        t = threading.Thread(target=lambda: result.append(deleter.delete(
            Plan(ns, retry=RetryPolicy(attempts=1)), [f"{ns}data/late"])))
        t.start()
        assert proxy.faults.deletes_waiting.wait(30)
        # The held request's bound passes on the store's clock (a real wait: time is the
        # condition), then the proxy lets it go.
        deadline = time.time() + 3.0
        while time.time() < deadline:
            time.sleep(0.1)
        proxy.faults.hold_deletes.set()
        t.join(30)
        await_forwarded = time.time() + 30
        while proxy.faults.deletes_forwarded < 1 and time.time() < await_forwarded:
            time.sleep(0.05)  # (polls the condition: the server answered the late request)
        assert proxy.faults.deletes_forwarded == 1
    assert s3.head_object(Bucket=bucket, Key="repo/data/late")["ContentLength"] == 1
    assert not result[0].deleted
    # the deleter's client gave up first (read timeout), or the store refused it expired
    assert f"{ns}data/late" in result[0].failed
    # and a request on time is signed the same way and lands
    ok = Deleter(s3_client(settings, retries=False)).delete(Plan(ns), [f"{ns}data/late"])
    assert ok.deleted == (f"{ns}data/late",)
