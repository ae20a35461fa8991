"""The one codec of the mirror's records (schemas/records.py): repository metadata and the one
commit shape, read the same way by the tracker, the reconciler and the rebuild."""

from __future__ import annotations

import math

import pytest

from reconciler.errors import ReconcileError
from reconciler.state import _meta
from schemas.records import CommitRecord, RecordError, RepoMeta, decode_meta
from tracker.state import _assemble


def test_metadata_as_repository_created_writes_it() -> None:
    raw = {"namespace": "s3://b/r/", "default_branch": "main",
           "default_retention_days": "7", "branch_retention": '{"dev": 1.5}'}
    assert decode_meta(raw, "r") == RepoMeta("s3://b/r/", "main", 7.0, {"dev": 1.5})


def test_older_spellings_and_the_operators_expiration_are_read() -> None:
    raw = {"storage_namespace": "s3://b/r/", "branch_retention_days": '{"dev": 2}',
           "expire_older_than_days": "30"}
    meta = decode_meta(raw, "r")
    assert meta is not None and meta.namespace == "s3://b/r/"
    assert meta.branch_retention_days == {"dev": 2.0} and meta.expire_older_than_days == 30.0
    # no retention configured is None, not 0 (the reconciler then keeps everything)
    assert meta.default_retention_days is None


def test_a_repository_without_a_namespace_has_no_metadata() -> None:
    assert decode_meta({}, "r") is None
    assert decode_meta({"retired_at": "1"}, "r") is None


@pytest.mark.parametrize(("field", "value", "named"), [
    ("default_retention_days", "seven", "default_retention_days"),
    ("default_retention_days", "nan", "default_retention_days"),
    ("branch_retention", "{", "branch_retention"),
    ("branch_retention", "[1]", "branch_retention"),
    ("branch_retention", '{"dev": "x"}', "branch_retention.dev"),
    ("expire_older_than_days", "soon", "expire_older_than_days"),
    # negative days: refused as the CLI refuses --expire-older-than-days < 0 (the stored
    # field used to be taken: "-1" put the expiration threshold a day in the future)
    ("expire_older_than_days", "-1", "expire_older_than_days"),
    ("expire_older_than_days", "-inf", "expire_older_than_days"),
    # 0 days counts every branch and tag head as expired (issue 33): refused as the CLI does
    ("expire_older_than_days", "0", "expire_older_than_days is 0"),
    ("expire_older_than_days", "-0.0", "expire_older_than_days is 0"),
    ("default_retention_days", "-2", "default_retention_days"),
    ("branch_retention", '{"dev": -1}', "branch_retention.dev"),
])
def test_a_garbled_field_is_named(field: str, value: str, named: str) -> None:
    raw = {"namespace": "s3://b/r/", field: value}
    with pytest.raises(RecordError, match=named):
        decode_meta(raw, "r")
    # the reconciler fails the run with the same words; the tracker's reader raises them
    with pytest.raises(ReconcileError, match=named):
        _meta(raw, "r")
    with pytest.raises(RecordError, match=named):
        _assemble("r", raw, {}, {}, {}, {}, {}, {}, [], [])


def test_the_tracker_and_the_reconciler_read_the_same_metadata() -> None:
    raw = {"namespace": "s3://b/r/", "default_branch": "main",
           "default_retention_days": "3", "branch_retention": '{"x": 0}'}
    assert _assemble("r", raw, {}, {}, {}, {}, {}, {}, [], []).meta == _meta(raw, "r")


def test_one_commit_shape() -> None:
    c = CommitRecord(["a", "b"], 10.0)  # type: ignore[arg-type]
    assert c.parents == ("a", "b") and c.branch == "" and c.manifest == ""
    with pytest.raises(RecordError, match="NaN"):
        CommitRecord((), math.nan)
