"""The mark decisions, pure (no servers): classify/compute_mark, the tracker-record verdict,
the cutoff, the retention plan, and the sweep's guard and bulk delete logic."""

from __future__ import annotations

import random

import pytest

from reconciler.mark import (
    Listed,
    classify,
    compute_mark,
)

CUTOFF = 1_000_000




# ------------------------------------------------------------------------------ classify









# -------------------------------------------------------------------------- the verdict









# ------------------------------------------------------------------------------- cutoff



# ------------------------------------------------------------------------ retention plan











# -------------------------------------------------------------------- guard and deletes











# ------------------------------------------------------------- the same decision on Spark

@pytest.mark.spark
@pytest.mark.parametrize("seed", [1, 2])
def test_spark_classification_agrees_with_the_pure_one(spark, seed):
    from reconciler.mark import classify_df, mark_df, tally_df

    rng = random.Random(seed)
    pool = [f"data/s{rng.randrange(3)}/{i}" for i in range(300)] + [
        "_hardelete/reports/x", "_lakefs/y", "top", "other/z", "data/./q", "data//w"]
    listing = [Listed(k, rng.randrange(100), CUTOFF + rng.randrange(-50, 50)) for k in pool]
    committed = set(rng.sample(pool, 60)) | {"_hardelete/reports/x"}
    uncommitted = set(rng.sample(pool, 60))
    kinds = ["unreferenced", "issued", "committed", "reaped", "staged"]
    known = {k: rng.choice(kinds) for k in rng.sample(pool, 120)}
    for k in uncommitted:
        known[k] = "staged"
    pure = compute_mark(listing, cutoff_ms=CUTOFF, committed=committed, uncommitted=uncommitted,
                        known=known)

    ldf = spark.createDataFrame([(o.key, o.size, o.last_modified_ms) for o in listing],
                                "key string, size long, last_modified long")
    cdf = spark.createDataFrame([(k,) for k in committed] * 2, "key string")  # duplicates
    kdf = spark.createDataFrame([(k, k in uncommitted, v, "", None) for k, v in known.items()],
                                "key string, live boolean, kind string, reason string, "
                                "commit string")
    classified = classify_df(ldf, cdf, kdf, CUTOFF)
    got = {r["key"]: r["category"] for r in classified.collect()}
    want = {o.key: classify(o, cutoff_ms=CUTOFF, committed=committed, uncommitted=uncommitted,
                            known=known) for o in listing}
    assert got == want
    unique = classify_df(ldf, cdf, kdf, CUTOFF, known_unique=True)
    assert {r["key"]: r["category"] for r in unique.collect()} == want
    # the service's export is live too; withheld leaks/unreferenced when fail-closed
    service = set(rng.sample(pool, 40))
    sdf = spark.createDataFrame([(k,) for k in service], "key string")
    for withhold in (False, True):
        got = {r["key"]: r["category"] for r in classify_df(ldf, cdf, kdf, CUTOFF, service=sdf,
                                                            withhold=withhold).collect()}
        want = {o.key: classify(o, cutoff_ms=CUTOFF, committed=committed,
                                uncommitted=uncommitted | service, known=known,
                                withhold=withhold) for o in listing}
        assert got == want
    assert tally_df(classified).as_dict() == pure.tally.as_dict()
    anti = {r["key"] for r in mark_df(ldf, cdf, kdf.filter("live"), CUTOFF).collect()}
    assert anti == pure.marked_keys






# ------------------------------------------------------------------- grace binds the mark



# ---------------------------------------------------------------- one canonical address













