"""Adversarial: the obstore listing against the boto3 listing on keys object_store might
spell differently. Each test asserts the SAFE outcome."""

from __future__ import annotations

import unicodedata

import pytest

from reconciler.listing import discover_units, list_unit, list_unit_fast
from reconciler.s3io import Namespace

pytestmark = [pytest.mark.spark]

NFC = unicodedata.normalize("NFC", "café")
NFD = unicodedata.normalize("NFD", "café")
ODDER = [f"data/s01/{NFC}", f"data/s01/{NFD}", "data/s01/~x", "data/s01/#h", "data/s01/q?x",
         "data/s01/back\\slash", "data/s01/{b}", "data/s01/ lead", "data/s01/trail ",
         "data/s01/x.", "data/s01/.x", "data/s01/=", "data/s01/\U0001F600", "data/s01/del\x7f",
         "data/s01/dir2/", "data/s%41/x", "data/s 8/x", "data/s 8/", "data/s01/dot./y",
         "data/s01/a%252F", "data/s01/^caret", "data/s01/[br]", "data/s01/`bt`",
         "data/s01/pipe|x", "data/s01/quote\"x", "data/s01/nb\u00a0sp", "data/s01/zw\u200bj",
         f"{NFD}/top", f"{NFC}/top", "data/.s9/x", "data/s=1/x", "x~/y", "data/s01/\u2028ls"]


def test_the_obstore_listing_spells_every_odd_key_as_boto3(settings, s3, bucket):
    ns = Namespace(f"s3://{bucket}/odd/r/")
    stored = []
    for rel in ODDER:
        try:
            s3.put_object(Bucket=ns.bucket, Key=ns.key(rel), Body=b"" if rel.endswith("/")
                          else b"xy")
            stored.append(rel)
        except Exception as exc:  # MinIO refuses some names
            print("refused", repr(rel), type(exc).__name__)
    units = discover_units(s3, ns)
    serial = sorted(row for unit in units for row in list_unit(s3, ns, unit))
    fast = sorted(row for unit in units for row in list_unit_fast(settings, s3, ns, unit))
    print(len(stored), len(serial), [r[0] for r in serial])
    assert fast == serial
