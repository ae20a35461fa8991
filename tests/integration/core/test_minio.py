"""Where MinIO is not S3, and what hardelete does there (issue 24; reconciler/README.md, "MinIO
is not S3"). Both differences err on the safe side: nothing is deleted that S3 would keep.

1. MinIO refuses names S3 accepts (a path segment over 255 bytes, an empty segment ``//``,
   ``..``) with ``XMinioInvalidObjectName``: such an object cannot exist there, and a delete
   that names one is answered for that key alone ("deleted", or that code, reported and not
   retried as a throttle would be) while the rest of the request is confirmed.
2. Where a key is also a prefix (``r`` and ``r/x`` both exist), the longer key can be read but
   never appears in a listing: the reconciler's mark and sweep cannot see it (it stays, however
   leaked) until the shorter key is gone.
"""

from __future__ import annotations

from typing import Any

import pytest
from botocore.exceptions import ClientError

from core.clients import s3_client
from core.deleter import Deleter, Plan
from core.settings import Settings
from reconciler.listing import Unit, discover_units, list_unit
from reconciler.s3io import Namespace

REFUSED = {"a segment over 255 bytes": "ns/data/" + "a" * 300 + "/x",
           "an empty segment": "ns/data//x"}


@pytest.mark.parametrize("what", sorted(REFUSED))
def test_minio_refuses_a_name_s3_accepts_and_the_gate_fails_that_key_alone(
        settings: Settings, s3: Any, bucket: str, what: str) -> None:
    bad = REFUSED[what]
    with pytest.raises(ClientError) as refused:
        s3.put_object(Bucket=bucket, Key=bad, Body=b"x")
    assert refused.value.response["Error"]["Code"] == "XMinioInvalidObjectName"
    s3.put_object(Bucket=bucket, Key="ns/data/ok", Body=b"x")

    deleter = Deleter(s3_client(settings, retries=False))
    ok, bad = f"s3://{bucket}/ns/data/ok", f"s3://{bucket}/{bad}"
    # (through the batch, not the guard: the guard refuses "//" before any store sees it)
    out = deleter.delete_batch(Plan(f"s3://{bucket}/ns/"), bucket,
                               {a[len(f"s3://{bucket}/"):]: a for a in (ok, bad)})
    assert ok in out.deleted
    # MinIO answers for the name it refuses either "deleted" (nothing can be there: 300 bytes)
    # or XMinioInvalidObjectName ("//"): reported for that key, never taken for a throttle.
    assert bad in out.deleted or out.codes == {bad: "XMinioInvalidObjectName"}, out
    assert out.requests < 4, out  # (a throttle is re-sent up to the policy's 6 attempts)
    assert s3.list_objects_v2(Bucket=bucket, Prefix="ns/").get("KeyCount") == 0


def test_a_key_that_is_also_a_prefix_is_invisible_to_the_listing_until_the_shorter_goes(
        s3: Any, bucket: str) -> None:
    ns = Namespace(f"s3://{bucket}/repo/")
    for key in ("repo/data/s1/r", "repo/data/s1/r/x", "repo/data/s1/other"):
        s3.put_object(Bucket=bucket, Key=key, Body=b"x")
    assert s3.get_object(Bucket=bucket, Key="repo/data/s1/r/x")["ContentLength"] == 1

    def listed() -> set[str]:
        return {rel for unit in discover_units(s3, ns) for rel, _, _ in list_unit(s3, ns, unit)}

    # What the mark sees: the longer key is not there (on S3 it would be: a leak the sweep
    # takes; on MinIO it stays, the safe direction).
    assert listed() == {"data/s1/r", "data/s1/other"}
    assert "data/s1/r/x" not in {rel for rel, _, _ in list_unit(s3, ns, Unit("data/s1/"))}
    s3.delete_object(Bucket=bucket, Key="repo/data/s1/r")  # (the sweep took the shorter key)
    assert listed() == {"data/s1/r/x", "data/s1/other"}  # the next run sees it
