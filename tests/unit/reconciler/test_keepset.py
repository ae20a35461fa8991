"""The optimized run's keep-set algebra (reconciler/keepset.py), without servers: reusing a
baseline's keep-set gives exactly the keep-set of a clean read, and the common case (new
manifests on top of the baseline's) is reused."""

from __future__ import annotations

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from reconciler.keepset import (
    KEEPSET_FORMAT,
    KeepSetPart,
    KeepSetUnusable,
    StoredKeepSet,
    plan_incremental,
    unit_of,
)

NS = "s3://b/ns/"
DAY_MS = 86_400_000

manifest_names = st.integers(0, 11).map(lambda i: ("b", f"ns/_hardelete/m/{i}.parquet"))
contents = st.dictionaries(manifest_names, st.frozensets(st.integers(0, 30).map(str),
                                                         max_size=8), min_size=1)


def keys_of(content: dict[tuple[str, str], frozenset[str]], manifests: set[tuple[str, str]],
            ) -> frozenset[str]:
    out: set[str] = set()
    for m in manifests:
        out |= content[m]
    return frozenset(out)


def stored(manifests: dict[tuple[str, str], str], keys: int = 0, *, made_at_ms: int = 0,
           repository: str = "r", namespace: str = NS, fmt: int = KEEPSET_FORMAT,
           ) -> StoredKeepSet:
    return StoredKeepSet("20260101T000000Z-aaaaaa", repository, namespace, made_at_ms,
                         manifests, (), (KeepSetPart("ns/_hardelete/reports/x/keepset/p.parquet",
                                                     keys, "e"),), keys, fmt)


@settings(max_examples=300, deadline=None)
@given(before=contents, data=st.data())
def test_a_reused_keep_set_is_exactly_the_clean_one(before, data):
    """World: manifests with contents (an ETag is its content), the baseline retained M_b;
    between the runs manifests are added, some leave retention (reset, expiration, shorter
    retention), some may be rewritten. Whenever the plan reuses the baseline, baseline keys |
    keys of the new manifests == keys of every manifest retained now, read as it is now."""
    names = sorted(before)
    m_b = set(data.draw(st.lists(st.sampled_from(names), unique=True)))
    after = dict(before)
    after.update(data.draw(st.dictionaries(manifest_names, st.frozensets(
        st.integers(0, 30).map(str), max_size=8))))  # new manifests, or some rewritten
    m_n = set(data.draw(st.lists(st.sampled_from(sorted(after)), unique=True)))
    etag_b = {m: ",".join(sorted(before[m])) for m in m_b}
    etag_n = {m: ",".join(sorted(after[m])) for m in m_n}
    baseline = stored(etag_b)
    plan = plan_incremental(baseline, repository="r", namespace=NS, now_ms=DAY_MS,
                            max_age_ms=7 * DAY_MS, manifests_now=etag_n)
    clean = keys_of(after, m_n)
    if plan.reuse:
        got = keys_of(before, m_b) | keys_of(after, set(plan.new_manifests))
        assert got == clean
        assert set(plan.new_manifests) == m_n - m_b
    # the fast path is taken whenever the baseline's manifests are all retained, unchanged
    unchanged = all(m in m_n and etag_n[m] == etag_b[m] for m in m_b)
    assert plan.reuse == unchanged, plan.reason


def test_a_manifest_leaving_retention_falls_back_to_a_clean_run():
    """K = {a} from m1 and {a, x} from m2: m2 leaves retention (x is garbage now, a is not),
    which a keep-set of keys alone cannot tell: a clean run, with the reason."""
    m1, m2 = ("b", "ns/m1"), ("b", "ns/m2")
    plan = plan_incremental(stored({m1: "1", m2: "2"}), repository="r", namespace=NS,
                            now_ms=DAY_MS, max_age_ms=7 * DAY_MS, manifests_now={m1: "1"})
    assert not plan.reuse and "not retained now" in (plan.reason or "")


@pytest.mark.parametrize(("kw", "words"), [
    ({"made_at_ms": -8 * DAY_MS}, "h old"),
    ({"made_at_ms": 2 * DAY_MS}, "after now"),
    ({"repository": "other"}, "not 'r'"),
    ({"namespace": "s3://b/other/"}, "not 'r'"),
    ({"fmt": KEEPSET_FORMAT + 1}, "format"),
])
def test_a_baseline_of_another_kind_falls_back(kw, words):
    m1 = ("b", "ns/m1")
    plan = plan_incremental(stored({m1: "1"}, **kw), repository="r", namespace=NS, now_ms=0,
                            max_age_ms=7 * DAY_MS, manifests_now={m1: "1"})
    assert not plan.reuse and words in (plan.reason or "")


def test_no_baseline_and_a_rewritten_manifest_fall_back():
    m1 = ("b", "ns/m1")
    assert not plan_incremental(None, repository="r", namespace=NS, now_ms=0,
                                max_age_ms=DAY_MS, manifests_now={m1: "1"}).reuse
    plan = plan_incremental(stored({m1: "1"}), repository="r", namespace=NS, now_ms=0,
                            max_age_ms=DAY_MS, manifests_now={m1: "2"})
    assert not plan.reuse and "changed since" in (plan.reason or "")


def test_the_descriptor_is_read_strictly():
    m1 = ("b", "ns/m1")
    good = stored({m1: "1"}, 3).to_dict()
    assert StoredKeepSet.from_dict(good, "w") == stored({m1: "1"}, 3)
    for broken in ({**good, "keys": "3"}, {**good, "manifests": [["b", "ns/m1"]]},
                   {**good, "parts": [{"key": "k", "rows": -1, "etag": "e"}]},
                   {k: v for k, v in good.items() if k != "made_at_ms"}, [good]):
        with pytest.raises(KeepSetUnusable):
            StoredKeepSet.from_dict(broken, "w")


@given(st.text(alphabet="ab/%.-_ ", max_size=8), st.text(alphabet="ab/%.-_ ", max_size=12))
def test_a_listed_slice_key_belongs_to_the_part_of_its_slice(slice_id, rest):
    """The listing's unit ``data/<slice>/`` (a delimited prefix: the id holds no ``/``) and
    the part group of each key it lists agree: a part read for a slice holds its keys."""
    assume(slice_id and "/" not in slice_id)
    assert unit_of(f"data/{slice_id}/{rest}") == slice_id
    assert unit_of(f"other/{slice_id}/{rest}") == ""
    assert unit_of(f"data/{slice_id}") == ""
