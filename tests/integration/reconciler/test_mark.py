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


@pytest.mark.spark
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_crosscheck_counts_what_each_divergence_query_counts(spark, seed):
    """The cross-check's three counts, taken in one job, are the counts of its three queries:
    export rows (an address form each, duplicates counted) staged and live but not listed,
    retained keys not listed, unreferenced rows whose object is kept."""
    from reconciler.job import _crosscheck
    from reconciler.mark import classify_df

    rng = random.Random(seed)
    pool = [f"data/s{rng.randrange(3)}/{i}" for i in range(200)] + ["_hardelete/x", "data//w"]
    listed = rng.sample(pool, 150)
    listing = [(k, 1, CUTOFF + rng.randrange(-50, 50)) for k in listed]
    committed = set(rng.sample(pool, 50))
    reasons = [(True, "staged", "staged"), (True, "issued", "issued"),
               (False, "unreferenced", ""), (False, "committed", ""), (True, "staged", "doubt")]
    rows = [(k, *rng.choice(reasons)) for k in rng.sample(pool, 120)]
    rows += [(k, *rng.choice(reasons)) for k in rng.sample([r[0] for r in rows], 20)]
    ldf = spark.createDataFrame(listing, "key string, size long, last_modified long")
    cdf = spark.createDataFrame([(k,) for k in committed], "key string")
    kdf = spark.createDataFrame([(k, live, kind, reason, None, None)
                                 for k, live, kind, reason in rows],
                                "key string, live boolean, kind string, reason string, "
                                "commit string, digest string")
    classified = classify_df(ldf, cdf, kdf, CUTOFF)
    category = {r["key"]: r["category"] for r in classified.collect()}
    got = _crosscheck(classified, cdf, kdf)
    kept = ("reserved", "committed", "uncommitted")
    want = {
        "live_in_redis_missing_from_store": sum(
            1 for k, live, _, reason in rows if live and reason == "staged"
            and k not in category),
        "committed_missing_from_store": len(committed - set(category)),
        "unreferenced_online_not_marked": sum(
            1 for k, live, kind, _ in rows if not live and kind == "unreferenced"
            and category.get(k) in kept)}
    assert {name: got[name].count for name in want} == want
    assert all(want.values())  # every divergence present in these worlds, each sampled
    assert all(len(got[name].sample) == min(20, n) for name, n in want.items())






# ------------------------------------------------------------------- grace binds the mark



# ---------------------------------------------------------------- one canonical address













