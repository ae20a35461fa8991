"""The mark's listing, in parallel Spark tasks through obstore (``reconciler.obstoreio``), is the
serial boto3 listing exactly, and a listing that fails part-way fails the run.

Real stack: MinIO (behind the fault proxy where a listing must fail), Redis with the tracker's
apply script, local Spark.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from reconciler.job import RunOptions, reconcile
from reconciler.listing import discover_units, list_unit, list_unit_fast, listing_df
from reconciler.s3io import Namespace
from sim.faultproxy import FaultProxy
from sim.model import Model as M
from sim.worlds import BUCKET, boundary, call, make

pytestmark = [pytest.mark.spark]

# Keys object_store would get wrong or cannot spell, beside plain ones: a directory marker
# ("dir/", which object_store lists as "dir") with keys under it, a key that is also a prefix
# of others, percent signs, pluses, spaces, XML metacharacters, non-ASCII, a tab (object_store
# refuses it: that directory goes through boto3), a top-level prefix obstore is not given as
# it is, nested directories, objects directly under data/ and the namespace root.
ODD = ["data/s05/dir/", "data/s05/dir/x", "data/s05/dir/deeper/y", "data/s05/r",
       "data/s05/r-1", "data/s05/a b", "data/s05/a+b", "data/s05/a%2Fb", "data/s05/x&y<z>",
       "data/s05/ü", "data/s06/tab\tkey", "data/s06/next", "data/loose", "rootobj",
       "other dir/p/q", "other/a/b/c", "other/a/b/", "other/z", "data/s07/"]


def _put_all(s3: Any, ns: Namespace, rels: list[str]) -> None:
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda rel: s3.put_object(Bucket=ns.bucket, Key=ns.key(rel),
                                                Body=b"" if rel.endswith("/") else b"xy"),
                      rels))


def test_the_parallel_listing_is_exactly_the_serial_one(spark, settings, s3, bucket):
    ns = Namespace(f"s3://{bucket}/par/r/")
    # 24 slices, one of them over two pages (1,000 keys a page)
    plain = [f"data/s{i:02d}/obj-{j:04d}" for i in range(24) for j in range(40)]
    plain += [f"data/s03/more-{j:04d}" for j in range(1_100)]
    _put_all(s3, ns, plain + ODD)
    # metadata the listing never enters, and another namespace beside this one
    _put_all(s3, ns, ["_hardelete/reports/x/summary.json", "_lakefs/x"])
    _put_all(s3, Namespace(f"s3://{bucket}/par/r2/"), ["data/s00/elsewhere"])

    units = discover_units(s3, ns)
    serial = [row for unit in units for row in list_unit(s3, ns, unit)]
    assert len(serial) == len(set(serial))
    keys = {rel for rel, _, _ in serial}
    assert {*plain, "data/s05/dir/", "data/s05/dir/x", "data/s06/tab\tkey", "rootobj",
            "other dir/p/q", "other/a/b/"} <= keys
    assert not {k for k in keys if k.startswith(("_hardelete/", "_lakefs/"))}

    fast = [row for unit in units for row in list_unit_fast(settings, s3, ns, unit)]
    assert sorted(fast) == sorted(serial)  # key, size and age, byte for byte; no duplicate
    rows = listing_df(spark, settings, ns, units).collect()
    assert sorted((r["key"], r["size"], r["last_modified"]) for r in rows) == sorted(serial)


def _world(rsettings: Any, s3: Any, redis_client: Any) -> tuple[Any, Namespace]:
    w = make(rsettings, s3, redis_client)
    ns = Namespace(f"s3://{BUCKET}/failing/r/")
    call(w, M.create_repository, "r", ns.uri)
    w.track(None)
    # leaked objects in four slices; slice s2 is listed in two pages
    _put_all(s3, ns, [f"data/s{i}/leak-{j:04d}" for i in range(4)
                      for j in range(1_200 if i == 2 else 30)])
    return w, ns


@pytest.mark.parametrize("how", ["denied", "truncated"])
def test_a_listing_that_fails_part_way_in_one_task_fails_the_run_and_deletes_nothing(
        spark, settings, s3, redis_client, how):
    rsettings = settings.replace(reconcile_min_age_seconds=0.0)
    w, ns = _world(rsettings, s3, redis_client)
    cutoff = boundary()
    before = w.data("r")
    with FaultProxy(rsettings.s3_endpoint_url) as proxy:
        # the second page of slice s2's listing fails: the other slices list whole
        proxy.faults.fail_listing = (ns.key("data/s2/"), how)
        res = reconcile(spark, rsettings.replace(s3_endpoint_url=proxy.url),
                        RunOptions("r", cutoff_ms=cutoff, allow_large_sweep=True))
        assert proxy.faults.listings_failed > 0
    assert not res["success"], res["mark"]
    assert res["sweep"]["status"] == "not_run"
    assert w.data("r") == before  # nothing deleted, the listed slices' leaks neither
    # the same world, the listing whole: every leak is marked and swept
    res = reconcile(spark, rsettings, RunOptions("r", cutoff_ms=cutoff, allow_large_sweep=True))
    assert res["success"], res.get("error")
    assert res["mark"]["marked"] == len(before) == 1_290
    assert w.data("r") == set()
