"""The reconciler's run summary (reconciler/report.py: RunSummary): one typed record, written
once as summary.json; a stored one reads back to the same record, keys of other versions kept."""

from __future__ import annotations

import orjson

from reconciler.evidence import KeepSetProof, Source
from reconciler.mark import CATEGORIES, MARKED_CATEGORIES, Tally
from reconciler.report import (
    BlastRadiusSection,
    CrossCheck,
    Divergence,
    FailClosedSection,
    ListingSection,
    MarkSection,
    RetentionSection,
    Revalidation,
    RunSummary,
    ServiceExportSection,
    SweepOutcome,
    TrackerView,
    UncommittedSection,
)
from reconciler.sweep import SweepStats


def _full() -> RunSummary:
    s = RunSummary("20260101T000000Z-abc123", "r", "s3://b/r/", "clean", False,
                   "2026-01-01T00:00:00.000+00:00", 1_767_225_600_000)
    s.timings = {"mark_s": 1.5}
    s.cutoff_ms, s.cutoff, s.cutoff_source = 1_000, "c", "tracker_watermark"
    s.tracker = TrackerView(900, "w", False, export_started_ms=950, grace_ms=2_000,
                            grace_horizon_ms=900)
    tally = Tally()
    tally.add(sorted(MARKED_CATEGORIES)[0], 30, 3)
    tally.add(sorted(set(CATEGORIES) - set(MARKED_CATEGORIES))[0], 70, 7)
    s.uncommitted = UncommittedSection(
        {"parts": 1, "addresses": 5, "live": 2, "outside_namespace": 0, "extra_forms": 0,
         "live_by_reason": {"staged": 2}, "by_kind": {}}, ["reports/r/uncommitted/0.parquet"])
    s.listing = ListingSection("s3", "2026/01/01", {"units": 2, "units_total": 3,
                                                    "baseline_run": "b",
                                                    "baseline_last_read_slice": "2025/12/31"})
    s.mark = MarkSection(tally, ["p0"])
    s.retention = RetentionSection(
        {"commits": 4, "retained": 2, "manifests": 2, "expired_commits": 0,
         "refs_pointing_to_expired": []}, {"default_days": 7.0, "branch_days": {}}, None,
        "seed", False, "f00d", "reports/r/retained.json", committed_keys=12)
    s.marked_at_ms = 1_100
    s.crosscheck = CrossCheck({"marked_but_referenced_online": Divergence(0, []),
                               "committed_missing_from_store": Divergence(error="boom")})
    s.service_export = ServiceExportSection(True, "s3://b/r/_hardelete/exports/e/", 990, 1, 4,
                                            False)
    s.fail_closed = FailClosedSection("redis went back", fresh_export=False)
    s.keepset = KeepSetProof([Source("tracker_export", 1, 5), Source("manifests", 2, keys=12)],
                             complete=True)
    s.revalidation = Revalidation(True, "f00d", "beef", newly_retained_commits=1,
                                  new_manifests=1, skipped_retained=0, parts=["p1"],
                                  changed_after_mark=Divergence(1, ["data/y"]))
    s.blast_radius = BlastRadiusSection(3, 10, [2, 4], 3.0, 1000, 0.5, 10.0, [], False)
    stats = SweepStats(marked=3, confirmed=2, skipped_guard=1)
    stats.sample("skipped_guard", "data/x: held")
    s.sweep = SweepOutcome("done", stats=stats, seconds=0.5, at="a")
    s.success, s.status = True, "done"
    return s


def test_a_summary_reads_back_as_it_was_written() -> None:
    s = _full()
    stored = orjson.loads(orjson.dumps(s.to_dict()))
    assert RunSummary.from_dict(stored) == s
    # The sweep's counts sit in "sweep" itself, as the readers (status, metrics, the UI) expect.
    assert stored["sweep"]["confirmed"] == 2 and stored["sweep"]["status"] == "done"
    assert stored["sweep"]["samples"] == {"skipped_guard": ["data/x: held"]}
    assert stored["tracker"]["grace_horizon_ms"] == 900
    # what an optimized run reads back from its baseline, in the JSON as before
    assert stored["uncommitted"]["part_keys"] == ["reports/r/uncommitted/0.parquet"]
    assert stored["uncommitted"]["live_by_reason"] == {"staged": 2}
    assert list(stored["listing"]) == ["source", "units", "units_total", "baseline_run",
                                       "baseline_last_read_slice", "last_read_slice"]
    assert stored["listing"]["last_read_slice"] == "2026/01/01"
    # the mark section as before: the tally's counts beside the parts the sweep reads
    assert (stored["mark"]["marked"], stored["mark"]["listed"]) == (3, 10)
    assert stored["mark"]["marked_bytes"] == 30 and stored["mark"]["parts"] == ["p0"]
    assert (s.marked, s.listed) == (3, 10)
    # the typed sections keep the JSON the readers (status, metrics, the UI) know
    assert stored["crosscheck"] == {
        "marked_but_referenced_online": {"count": 0, "sample": []},
        "committed_missing_from_store": {"error": "boom"}}
    assert stored["revalidation"]["changed_after_mark"] == {"count": 1, "sample": ["data/y"]}
    assert stored["service_export"]["found"] and stored["service_export"]["rows"] == 4
    assert stored["fail_closed"]["withheld"] and stored["blast_radius"]["history"] == [2, 4]
    assert stored["keepset"]["complete"]


def test_what_a_phase_did_not_reach_is_absent_not_null() -> None:
    s = RunSummary("id", "r", "s3://b/r/", "clean", True, None, 5)
    s.sweep = SweepOutcome("refused", "blast-radius guard", skipped_retained=0, samples={})
    d = s.to_dict()
    for absent in ("mark", "crosscheck", "revalidation", "tracker", "timings", "blast_radius"):
        assert absent not in d, absent
    assert d["sweep"] == {"status": "refused", "reason": "blast-radius guard",
                          "skipped_retained": 0, "samples": {}}
    assert d["error"] is None and d["status"] == "running"  # always written, as before


def test_keys_of_another_version_are_kept() -> None:
    stored = _full().to_dict()
    stored = {**stored, "future_section": {"x": 1},
              "mark": {**stored["mark"], "future_count": 4}}
    s = RunSummary.from_dict(stored)
    s.status = "done"
    assert s.to_dict()["future_section"] == {"x": 1}
    assert s.to_dict()["mark"]["future_count"] == 4


def test_the_retention_the_sweep_reads_back_is_the_marks() -> None:
    stored = orjson.loads(orjson.dumps(_full().to_dict()))
    ret = stored["retention"]
    assert (ret["retained"], ret["fingerprint"], ret["retained_key"]) == (
        2, "f00d", "reports/r/retained.json")
    assert ret["expiration_mode"] == "seed" and ret["delete_expired_refs"] is False
    assert ret["committed_keys"] == 12 and ret["expire_older_than_days"] is None
    # A mark written before the options were recorded: they read back as "not recorded" (the
    # sweep then uses the defaults) and are not written back as nulls.
    del ret["expiration_mode"], ret["delete_expired_refs"]
    old = RunSummary.from_dict(stored)
    assert old.retention is not None and old.retention.expiration_mode is None
    assert "expiration_mode" not in old.to_dict()["retention"]
    assert old.to_dict()["retention"] == ret


def _other_version_mark() -> dict:
    """A stored summary whose mark was written by another version (same report format): it
    counts a marked category this version does not know (here 9,000 of its 9,003 marked)."""
    stored = _full().to_dict()
    mark = stored["mark"]
    mark["categories"]["future_marked_category"] = {"count": 9_000, "bytes": 90_000}
    mark["marked"] += 9_000
    mark["marked_bytes"] += 90_000
    mark["listed"] += 9_000
    mark["listed_bytes"] += 90_000
    return stored


def test_the_sweep_counts_what_the_marking_version_marked() -> None:
    # The blast-radius guard of --sweep-only judges RunSummary.marked / .listed (job.py
    # _blast_radius): recomputing them from only the categories this version knows would
    # show 3 marked where the mark holds 9,003 keys, and a sweep the guard must refuse would
    # go through (the old reader took the stored "marked" and "listed").
    stored = _other_version_mark()
    s = RunSummary.from_dict(orjson.loads(orjson.dumps(stored)))
    assert s.marked >= stored["mark"]["marked"] == 9_003
    assert s.listed == stored["mark"]["listed"] == 9_010
    from reconciler.blast_radius import judge_blast_radius
    verdict = judge_blast_radius(s.marked, s.listed, [100], max_share=0.5, max_growth=10,
                                 floor=1_000, history_runs=5)
    assert verdict.refused


def test_a_mark_of_another_version_is_written_back_as_it_was() -> None:
    # --sweep-only saves the summary again: the mark's counts and categories of another
    # version stay as they were stored (a retried sweep reads them again).
    stored = _other_version_mark()
    s = RunSummary.from_dict(orjson.loads(orjson.dumps(stored)))
    again = s.to_dict()["mark"]
    assert again["categories"]["future_marked_category"] == {"count": 9_000, "bytes": 90_000}
    for k in ("marked", "marked_bytes", "listed", "listed_bytes"):
        assert again[k] == stored["mark"][k], k


def test_a_mark_whose_delete_expired_refs_dropped_live_refs_is_judged_again() -> None:
    # issue 33: a mark of a version whose --delete-expired-refs made retention ignore refs at
    # expired snapshots recorded the option but no list of refs; the sweep re-judges it
    stored = orjson.loads(orjson.dumps(_full().to_dict()))
    ret = stored["retention"]
    assert not RetentionSection.from_dict(ret).dropped_live_refs()  # option off
    listed = {**ret, "delete_expired_refs": True, "refs_to_delete": ["tag:v1"],
              "expired_refs_key": "reports/r/expired_refs.json"}
    section = RetentionSection.from_dict(listed)
    assert section.expired_refs_key == "reports/r/expired_refs.json"
    assert section.counts["refs_to_delete"] == ["tag:v1"] and section.as_dict() == listed
    assert not section.dropped_live_refs()  # this version: refs listed, none dropped
    del listed["expired_refs_key"], listed["refs_to_delete"]
    assert RetentionSection.from_dict(listed).dropped_live_refs()


def test_an_earlier_run_is_read_strictly() -> None:
    """The blast-radius history and an optimized run's baseline: a summary of another folder or
    namespace, or with counts that are not whole numbers, stops the run (it would move the
    guard's usual size, or the baseline, without a word)."""
    import pytest

    from reconciler.evidence import EvidenceError
    from reconciler.report import _earlier_run
    from reconciler.s3io import Namespace

    ns = Namespace("s3://b/r/")
    good = _full().to_dict()
    rid = good["run_id"]
    assert _earlier_run(good, ns, rid).sweep is not None
    for bad, says in [({**good, "run_id": "other"}, "holds run"),
                      ({**good, "namespace": "s3://b/q/"}, "a run of namespace"),
                      ({**good, "sweep": {**good["sweep"], "confirmed": "9999"}},
                       "whole numbers"),
                      ({**good, "sweep": {**good["sweep"], "confirmed": 1e9}}, "whole numbers")]:
        with pytest.raises(EvidenceError, match=says):
            _earlier_run(bad, ns, rid)
