"""The strict evidence readers (reconciler/evidence.py), without servers: every malformed input
is read exactly or stops the run; none shrinks the keep-set."""

from __future__ import annotations

import gzip
import hashlib
import io
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from reconciler.evidence import (
    EvidenceError,
    KeepSetProof,
    Source,
    check_export_binding,
    export_keys,
    inventory_rows,
    manifest_keys,
    parse_export_meta,
)
from schemas.address import address_forms

NS = "s3://bucket/repo/"


def parquet(columns: dict[str, Any]) -> bytes:
    buf = io.BytesIO()
    pq.write_table(pa.table(columns), buf)
    return buf.getvalue()


# --------------------------------------------------------------------------- manifests

def test_a_binary_address_column_is_read_as_text_not_as_its_repr() -> None:
    """Parquet BYTE_ARRAY without the UTF8 annotation (Go and Java writers): before, the row
    read as bytes and ``str(b"data/x")`` protected the key ``b'data/x'``; the real object was
    swept."""
    data = parquet({"address": pa.array([b"s3://bucket/repo/data/x", b"data/y"], pa.binary())})
    assert list(manifest_keys(data, NS, "m")) == ["data/x", "data/y"]


@pytest.mark.parametrize(("column", "match"), [
    (pa.array([b"data/\xff"], pa.binary()), "not UTF-8"),
    (pa.array([1, 2], pa.int64()), "expected text"),
    (pa.array(["data/x", None], pa.string()), "null"),
    (pa.array(["s3://other/repo/data/x"], pa.string()), "not an address of"),
    (pa.array(["/abs/path"], pa.string()), "not an address of"),
])
def test_a_manifest_that_cannot_be_read_exactly_stops_the_run(column: Any, match: str) -> None:
    with pytest.raises(EvidenceError, match=match) as info:
        list(manifest_keys(parquet({"address": column}), NS, "manifest s3://b/m.parquet"))
    assert "manifest s3://b/m.parquet" in str(info.value) and "\n" not in str(info.value)


def test_a_manifest_without_its_column_or_truncated_stops_the_run() -> None:
    with pytest.raises(EvidenceError, match="no column 'address'"):
        list(manifest_keys(parquet({"path": ["data/x"]}), NS, "m"))
    whole = parquet({"address": [f"data/{i}" for i in range(1000)]})
    for cut in (len(whole) // 2, len(whole) - 9, 7):
        with pytest.raises(EvidenceError):
            list(manifest_keys(whole[:cut], NS, "m"))


_SEGMENT = st.text(alphabet="abcXYZ09-_. %+", min_size=1, max_size=6).filter(
    lambda s: s not in (".", ".."))
_KEYS = st.lists(_SEGMENT, min_size=1, max_size=3).map(lambda parts: "data/" + "/".join(parts))
_SPELLINGS = st.sampled_from(["s3://bucket/repo/", "S3://Bucket/repo/", "s3a://bucket/repo/",
                              "s3n://BUCKET/repo/", ""])
_TYPES = st.sampled_from(["string", "large_string", "binary", "dictionary"])


def _column(values: list[str], kind: str) -> Any:
    if kind == "binary":
        return pa.array([v.encode() for v in values], pa.binary())
    if kind == "dictionary":
        return pa.array(values, pa.string()).dictionary_encode()
    return pa.array(values, pa.large_string() if kind == "large_string" else pa.string())


def _expected(rows: list[str]) -> list[str]:
    return [f[len(NS):] for row in rows for f in address_forms(NS, row)]


@hsettings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(_SPELLINGS, _KEYS), min_size=1, max_size=30), _TYPES,
       st.sampled_from(["none", "null", "foreign", "truncate", "retype"]))
def test_prop_a_manifest_is_read_exactly_or_stops_the_run(
        rows: list[tuple[str, str]], kind: str, fault: str) -> None:
    """Any spelling, any text encoding: every form of every row comes back. A null, a foreign
    row, a truncated file or a non-text column: the reader raises (never fewer keys)."""
    addresses = [prefix + key for prefix, key in rows]
    if fault == "null":
        data = parquet({"address": pa.array([*addresses, None], pa.string())})
    elif fault == "foreign":
        data = parquet({"address": _column([*addresses, "s3://other/repo/data/x"], kind)})
    elif fault == "retype":
        data = parquet({"address": pa.array(list(range(len(addresses))), pa.int32())})
    else:
        data = parquet({"address": _column(addresses, kind)})
        if fault == "truncate":
            data = data[: len(data) // 2]
    if fault == "none":
        assert list(manifest_keys(data, NS, "m")) == _expected(addresses)
    else:
        with pytest.raises(EvidenceError):
            list(manifest_keys(data, NS, "m"))


# ------------------------------------------------------------------- the service's export

def meta(**changes: Any) -> bytes:
    d: dict[str, Any] = {"format": 2, "repository": "r", "namespace": NS,
                         "exported_at": 2 * 10**12, "files": [{"name": "p.parquet", "rows": 2}]}
    d.update(changes)
    return orjson.dumps({k: v for k, v in d.items() if v is not None})


def test_export_meta_is_read_strictly() -> None:
    m = parse_export_meta(meta(), "e")
    assert (m.repository, m.namespace, m.exported_at_ms, m.rows) == ("r", NS, 2 * 10**12, 2)
    assert parse_export_meta(meta(exported_at="2033-05-18T03:33:20+00:00"), "e") \
        .exported_at_ms == 2 * 10**12
    for bad, match in [
        (meta(format=1), "format 1"),
        (meta(repository=None), "names no repository"),  # shared location: anyone's
        (meta(repository=""), "names no repository"),
        (meta(namespace=None), "names no namespace"),
        (meta(namespace="bucket/repo"), "not s3://"),
        (meta(files=None), "declares no files"),
        (meta(files=[]), "declares no files"),
        (meta(files=[{"name": "p.parquet"}]), "file entry"),
        (meta(files=[{"name": "../p.parquet", "rows": 1}]), "file entry"),
        (meta(files=[{"name": "p.parquet", "rows": -1}]), "file entry"),
        (meta(files=[{"name": "p.parquet", "rows": 1}] * 2), "declared twice"),
        (meta(exported_at=1_700_000_000), "seconds"),  # would read as 1970: stale, but say so
        (meta(exported_at="2026-01-01T00:00:00"), "time zone"),  # a guess of the zone
        (meta(exported_at=1.5e12), "epoch milliseconds"),
        (b"[]", "not a JSON object"),
        (b"{", "not JSON"),
    ]:
        with pytest.raises(EvidenceError, match=match):
            parse_export_meta(bad, "e")


def test_an_export_is_bound_to_its_repository_namespace_and_the_cutoff() -> None:
    m = parse_export_meta(meta(), "e")
    ok = {"repo": "r", "ns_uri": NS, "cutoff_ms": 2 * 10**12 - 1, "now_ms": 2 * 10**12}
    check_export_binding(m, "e", **ok)  # type: ignore[arg-type]
    for change, match in [({"repo": "q"}, "of repository 'r', not 'q'"),
                          ({"ns_uri": "s3://bucket/other/"}, "namespace"),
                          ({"cutoff_ms": 2 * 10**12}, "not after the run's cutoff"),
                          ({"now_ms": 2 * 10**12 - 61_000}, "in the future")]:
        with pytest.raises(EvidenceError, match=match):
            check_export_binding(m, "e", **{**ok, **change})  # type: ignore[arg-type]


@hsettings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(_SPELLINGS, _KEYS), min_size=1, max_size=30), _TYPES,
       st.sampled_from(["parquet", "csv", "csv.gz"]),
       st.sampled_from(["none", "foreign_repo", "foreign_ns", "short", "long", "null"]))
def test_prop_an_export_is_read_exactly_or_stops_the_run(
        rows: list[tuple[str, str]], kind: str, fmt: str, fault: str) -> None:
    addresses = [prefix + key for prefix, key in rows]
    owners = ["r"] * len(addresses)
    declared = len(addresses)
    if fault == "foreign_repo":
        owners[-1] = "q"
    elif fault == "foreign_ns":
        addresses[-1] = "s3://bucket/other/data/x"
    elif fault == "short":
        declared += 1  # a row lost in transit
    elif fault == "long":
        declared -= 1
    if fmt == "parquet":
        col = pa.array([*addresses, None], pa.string()) if fault == "null" \
            else _column(addresses, kind)
        data = parquet({"address": col,
                        "repository": pa.array(owners + (["r"] if fault == "null" else []))})
        name = "p.parquet"
    else:
        import csv

        out = io.StringIO()
        w = csv.writer(out)
        w.writerow(["address", "repository"])
        w.writerows(zip(addresses, owners, strict=True))
        if fault == "null":
            w.writerow(["", "r"])  # an empty address is not an address of the namespace
        data = out.getvalue().encode()
        name = "p.csv"
        if fmt == "csv.gz":
            data, name = gzip.compress(data), "p.csv.gz"
    read = lambda: list(export_keys(data, name, declared, repo="r", ns_uri=NS,  # noqa: E731
                                    where="e"))
    if fault == "none":
        assert read() == _expected(addresses)
    else:
        with pytest.raises(EvidenceError):
            read()


# --------------------------------------------------------------------------- inventories

def test_an_inventory_is_read_strictly() -> None:
    import datetime as dt

    when = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    ms = int(when.timestamp() * 1000)
    good = parquet({"key": pa.array([b"repo/data/x"], pa.binary()), "size": [3],
                    "last_modified": pa.array([when], pa.timestamp("ms", "UTC"))})
    assert list(inventory_rows(good, "i.parquet", "i")) == [("repo/data/x", 3, ms)]
    csv_ok = b"key,size,last_modified\nrepo/data/x,3,2026-01-01T00:00:00.000Z\n"
    assert list(inventory_rows(csv_ok, "i.csv", "i")) == [("repo/data/x", 3, ms)]
    assert list(inventory_rows(f"key,size,last_modified\nk,3,{ms}\n".encode(), "i.csv",
                               "i")) == [("k", 3, ms)]
    for data, name, match in [
        # seconds read as milliseconds would make a fresh object 56 years old
        (b"key,size,last_modified\nk,3,1767225600\n", "i.csv", "seconds"),
        (parquet({"key": ["k"], "size": [3], "last_modified": [1_767_225_600]}), "i.parquet",
         "seconds"),
        (b"key,size,last_modified\nk,3,2026-01-01T00:00:00\n", "i.csv", "time zone"),
        (parquet({"key": ["k"], "size": [3],
                  "last_modified": pa.array([when.replace(tzinfo=None)], pa.timestamp("ms"))}),
         "i.parquet", "without a time zone"),
        (b"key,size,last_modified\nk,,2026-01-01T00:00:00Z\n", "i.csv", "null"),
        (b"key,size,last_modified\nk,-1,2026-01-01T00:00:00Z\n", "i.csv", "negative"),
        (parquet({"key": [1], "size": [3], "last_modified": [ms]}), "i.parquet", "expected text"),
        (parquet({"key": ["k"], "size": ["3"], "last_modified": [ms]}), "i.parquet",
         "expected integer"),
        (parquet({"key": ["k", None], "size": [3, 4], "last_modified": [ms, ms]}), "i.parquet",
         "null"),
    ]:
        with pytest.raises(EvidenceError, match=match):
            list(inventory_rows(data, name, "i"))
    other = b"bucket,key,size,last_modified\nother,k,3,2026-01-01T00:00:00Z\n"
    with pytest.raises(EvidenceError, match="rows of bucket 'other'"):
        list(inventory_rows(other, "i.csv", "i", bucket="bucket"))


def test_an_inventory_manifest_names_its_files_bucket_and_checksums(tmp_path: Any) -> None:
    from reconciler.listing import named_inventory

    data = b"key,size,last_modified\nrepo/data/x,3,2026-01-01T00:00:00Z\n"
    (tmp_path / "a.csv").write_bytes(data)

    def manifest(**changes: Any) -> None:
        d = {"sourceBucket": "bucket",
             "files": [{"key": "inv/a.csv", "MD5checksum": hashlib.md5(data).hexdigest()}]}
        (tmp_path / "manifest.json").write_bytes(orjson.dumps({**d, **changes}))

    manifest()
    assert [f.md5 for f in named_inventory(None, str(tmp_path), "bucket")] == [
        hashlib.md5(data).hexdigest()]
    with pytest.raises(EvidenceError, match="bucket 'bucket', the namespace's bucket is 'b2'"):
        named_inventory(None, str(tmp_path), "b2")
    manifest(files=[{"key": "inv/b.csv", "MD5checksum": "0" * 32}])
    with pytest.raises(EvidenceError, match=r"inv/b\.csv is missing"):
        named_inventory(None, str(tmp_path), "bucket")
    manifest(files=[{"key": "inv/a.csv", "MD5checksum": "0" * 32}])
    with pytest.raises(EvidenceError, match="MD5"):
        named_inventory(None, str(tmp_path), "bucket")


# ----------------------------------------------------------------------- keep-set proof

def test_a_keepset_proof_is_complete_only_with_every_required_source() -> None:
    proof = KeepSetProof([Source("tracker_export", 1, 10)])
    assert "incomplete" in str(proof.problem())
    proof.complete = True
    assert "lacks manifests" in str(proof.problem())
    proof.add(Source("manifests", 2, keys=5))
    assert proof.problem() is None
    again = KeepSetProof.from_dict(orjson.loads(orjson.dumps(proof.as_dict())))
    assert again == proof
    assert KeepSetProof.from_dict({"complete": "yes", "sources": []}).problem() is not None


_PLAIN = st.text(alphabet="abcé€0-_.%+ /", min_size=1, max_size=8).filter(
    lambda s: s.strip("/") not in ("", ".", ".."))


@hsettings(max_examples=150, deadline=None)
@given(st.lists(_PLAIN, min_size=0, max_size=40), _TYPES,
       st.sampled_from(["s3://bucket/repo/", "s3://bucket/ré/", "s3://bucket/"]),
       st.sampled_from(["canonical", "mixed"]))
def test_prop_the_columnar_manifest_reading_is_the_row_reading(
        keys: list[str], kind: str, ns: str, spelling: str) -> None:
    """A batch of canonical addresses is cut in Arrow; it gives exactly the keys, in the
    order, that the row by row reading gives (every form of every row), and so does a batch
    that mixes spellings (read row by row)."""
    from reconciler.evidence import manifest_key_batches, namespace_keys

    rows = [ns + k for k in keys]
    if spelling == "mixed" and rows:
        rows[0] = rows[0].replace("s3://bucket/", "S3://Bucket/", 1)
    data = parquet({"address": _column(rows, kind)})
    expected = [key for row in rows for key in namespace_keys(ns, row, "m")]
    assert [k for batch in manifest_key_batches(data, ns, "m") for k in batch] == expected
