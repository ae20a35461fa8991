"""The one deleter's logic against a store double (the real server: tests/integration/core/
test_deleter.py, tests/integration/reaper/test_reaper_deleter.py)."""

from __future__ import annotations

import random
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from core.deleter import (
    DATA,
    DELETE_MARKER,
    MIN_LEFT_SECONDS,
    NO_ANSWER,
    QUARANTINE,
    REWRITTEN,
    S3_MAX_KEYS,
    Copy,
    Deleter,
    Plan,
    RetryPolicy,
    copy_problem,
    guard_problem,
    signature_window,
    versions_to_delete,
)

NS = "s3://bucket/repo/"
FAST = RetryPolicy(base_delay=0.0)


class FakeS3:
    """A store double for the retry and confirmation logic."""

    def __init__(self, script: list[str], versioning: str = "",
                 versions: dict[str, tuple[list[str], list[str]]] | None = None) -> None:
        self.script = list(script)
        self.calls: list[list[dict[str, str]]] = []
        self.versioning = versioning
        self.versions = versions or {}
        self.status_reads = 0

    def get_bucket_versioning(self, Bucket: str) -> dict[str, Any]:
        self.status_reads += 1
        return {"Status": self.versioning} if self.versioning else {}

    def list_object_versions(self, Bucket: str, Prefix: str, **_: Any) -> dict[str, Any]:
        data, markers = self.versions.get(Prefix, ([], []))
        return {"Versions": [{"Key": Prefix, "VersionId": v} for v in data]
                + [{"Key": Prefix + "-longer", "VersionId": "x"}],
                "DeleteMarkers": [{"Key": Prefix, "VersionId": m} for m in markers],
                "IsTruncated": False}

    def delete_objects(self, Bucket: str, Delete: dict[str, Any]) -> dict[str, Any]:
        objects = Delete["Objects"]
        assert len(objects) <= S3_MAX_KEYS and Delete["Quiet"] is False
        self.calls.append(objects)
        keys = [o["Key"] for o in objects]
        step = self.script.pop(0) if self.script else "ok"
        if step == "boom":
            raise ConnectionError("reset by peer")
        if step == "slowdown-first":
            return {"Deleted": [{"Key": k} for k in keys[1:]],
                    "Errors": [{"Key": keys[0], "Code": "SlowDown", "Message": "slow"}]}
        if step == "denied-first":
            return {"Deleted": [{"Key": k} for k in keys[1:]],
                    "Errors": [{"Key": keys[0], "Code": "AccessDenied", "Message": "no"}]}
        if step == "expired":
            return {"Errors": [{"Key": k, "Code": "AccessDenied",
                                "Message": "Request has expired"} for k in keys]}
        if step == "silent-first":
            return {"Deleted": [{"Key": k} for k in keys[1:]]}
        if step == "marker":  # versioning was turned on: a plain delete writes a marker
            return {"Deleted": [{"Key": k, "DeleteMarker": True, "DeleteMarkerVersionId": "m"}
                                for k in keys]}
        return {"Deleted": [{"Key": o["Key"], **({"VersionId": o["VersionId"]}
                                                 if "VersionId" in o else {})}
                            for o in objects]}


def addrs(n: int) -> list[str]:
    return [f"{NS}data/s/{i}" for i in range(n)]


def deleter(s3: FakeS3) -> Deleter:
    return Deleter(s3, sleep=lambda _: None, rng=random.Random(0))


def test_confirms_only_what_the_store_says() -> None:
    s3 = FakeS3(["boom", "slowdown-first", "denied-first"])
    res = deleter(s3).delete(Plan(NS, retry=FAST), addrs(5))
    # boom: retried whole; slowdown: key 0 retried; denied on the retry: reported
    assert sorted(res.deleted) == sorted(addrs(5)[1:])
    assert res.failed == {addrs(1)[0]: "AccessDenied: no"} and res.codes == {
        addrs(1)[0]: "AccessDenied"}
    assert res.requests == 3 and res.retries == 2


def test_guard_batches_and_limits() -> None:
    s3 = FakeS3([])
    res = deleter(s3).delete(Plan(NS), [f"{NS}_hardelete/reports/r/summary.json",
                                        "s3://bucket/other/x", f"{NS}data/s/1"])
    assert set(res.refused) == {f"{NS}_hardelete/reports/r/summary.json", "s3://bucket/other/x"}
    assert s3.calls == [[{"Key": "repo/data/s/1"}]]
    s3 = FakeS3([])
    res = deleter(s3).delete(Plan(NS, batch_keys=2), addrs(5))
    assert [len(c) for c in s3.calls] == [2, 2, 1] and len(res.deleted) == 5
    with pytest.raises(ValueError, match="at most 1000"):
        deleter(s3).delete_batch(Plan(NS), "bucket", {str(i): str(i) for i in range(1001)})
    s3 = FakeS3(["silent-first"] * 10)
    res = deleter(s3).delete(Plan(NS, retry=RetryPolicy(attempts=3, base_delay=0)), addrs(3))
    assert res.failed == {addrs(1)[0]: f"{NO_ANSWER}: no answer from the store"}
    s3 = FakeS3(["boom"] * 10)
    res = deleter(s3).delete(Plan(NS, retry=RetryPolicy(attempts=2, base_delay=0)), addrs(2))
    assert not res.deleted and set(res.failed) == set(addrs(2))


def test_the_recheck_runs_before_every_request_and_a_failing_one_keeps_all() -> None:
    seen: list[list[str]] = []

    def recheck(batch: list[str]) -> dict[str, str]:
        seen.append(batch)
        return {addrs(2)[1]: "held"} if len(seen) > 1 else {}

    s3 = FakeS3(["boom"])
    res = deleter(s3).delete(Plan(NS, recheck=recheck, retry=FAST), addrs(3))
    assert seen == [addrs(3), addrs(3)]
    assert res.kept == {addrs(2)[1]: "held"} and len(res.deleted) == 2

    def broken(batch: list[str]) -> dict[str, str]:
        raise ConnectionError("redis down")

    s3 = FakeS3([])
    res = deleter(s3).delete(Plan(NS, recheck=broken), addrs(2))
    assert s3.calls == [] and all(v.startswith("recheck failed") for v in res.kept.values())


def test_an_expired_request_is_judged_again_and_sent_again() -> None:
    seen: list[list[str]] = []
    s3 = FakeS3(["expired"])
    res = deleter(s3).delete(Plan(NS, recheck=lambda b: seen.append(b) or {}, retry=FAST),
                             addrs(2))
    assert len(seen) == 2 and len(res.deleted) == 2 and res.retries == 1


def test_a_delete_marker_is_not_a_delete_the_status_is_read_again() -> None:
    # The status was read as unversioned; then versioning was turned on: the plain delete
    # writes markers. Not confirmed: the status is read again and the versions are deleted.
    s3 = FakeS3(["marker"], versions={"repo/data/s/0": (["v1"], ["m"])})
    d = deleter(s3)
    d._status("bucket")
    s3.versioning = "Enabled"
    res = d.delete(Plan(NS, retry=FAST), addrs(1))
    assert s3.status_reads == 2
    assert s3.calls[1] == [{"Key": "repo/data/s/0", "VersionId": "v1"},
                           {"Key": "repo/data/s/0", "VersionId": "m"}]
    assert res.deleted == (addrs(1)[0],) and res.versions == {addrs(1)[0]: ("v1", "m")}
    s3 = FakeS3(["marker"] * 10)
    res = deleter(s3).delete(Plan(NS, retry=RetryPolicy(attempts=1)), addrs(1))
    assert not res.deleted and res.code(addrs(1)[0]) == DELETE_MARKER


def test_versioned_bucket_deletes_every_version_keeps_a_rewritten_data_key() -> None:
    s3 = FakeS3([], versioning="Suspended", versions={
        "repo/data/s/0": (["null"], []), "repo/data/s/1": (["v1", "v2"], []),
        "repo/_hardelete/quarantine/data/s/1": (["q1", "q2"], ["qm"])})
    res = deleter(s3).delete(Plan(NS), addrs(3))
    assert set(res.deleted) == {addrs(3)[0], addrs(3)[2]}  # (the third has no version)
    assert res.versions == {addrs(3)[0]: ("null",), addrs(3)[2]: ()}
    assert res.kept[addrs(3)[1]].startswith(REWRITTEN)
    res = deleter(s3).delete(Plan(NS, area=QUARANTINE),
                             [f"{NS}_hardelete/quarantine/data/s/1"])
    assert res.versions == {f"{NS}_hardelete/quarantine/data/s/1": ("q1", "q2", "qm")}


def test_the_rules_of_the_guard_and_the_versions() -> None:
    assert guard_problem(NS, f"{NS}data/a", DATA) is None
    assert guard_problem(NS, f"{NS}_hardelete/quarantine/data/a", DATA) is not None
    assert guard_problem(NS, f"{NS}_hardelete/quarantine/data/a", QUARANTINE) is None
    assert guard_problem(NS, f"{NS}_hardelete/quarantine/_lakefs/x", QUARANTINE) is not None
    assert guard_problem(NS, f"{NS}data/a", QUARANTINE) is not None
    q = f"{NS}_hardelete/quarantine/data/a"
    assert copy_problem(NS, Copy(f"{NS}data/a", q)) is None
    assert copy_problem(NS, Copy(q, f"{NS}data/a")) is None
    assert copy_problem(NS, Copy(f"{NS}data/a", f"{NS}data/b")) is not None
    assert copy_problem(NS, Copy(q, f"{NS}data/b")) is not None
    assert versions_to_delete(["a", "b"], [], QUARANTINE) == (["a", "b"], None)
    assert versions_to_delete(["a"], ["m"], DATA) == (["a", "m"], None)
    assert versions_to_delete(["a", "b"], [], DATA)[1] is not None


@given(seconds=st.integers(1, 600), anchor=st.floats(1e9, 2e9),
       elapsed=st.floats(0, 700))
def test_a_request_is_void_before_its_recheck_plus_its_bound(seconds: int, anchor: float,
                                                            elapsed: float) -> None:
    now = anchor + elapsed
    window = signature_window(seconds, anchor, now)
    if window is None:
        assert anchor + seconds - now < MIN_LEFT_SECONDS + 1
        return
    date, expires = window
    assert date <= now and expires >= 1  # valid when sent: dated no later than now
    assert date + expires <= anchor + seconds  # void no later than the bound
    assert date + expires - now >= MIN_LEFT_SECONDS


def test_the_deleter_refuses_a_client_that_retries_and_a_fractional_bound() -> None:
    class Retrying:
        class meta:
            class config:
                retries = {"max_attempts": 4}

    with pytest.raises(ValueError, match="does not retry by itself"):
        Deleter(Retrying())
    with pytest.raises(ValueError, match="whole number"):
        Deleter(FakeS3([]), request_seconds=0)
