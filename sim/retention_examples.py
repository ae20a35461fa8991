"""Worked examples of retention (commit graphs, refs, thresholds), shared by the retention and
the mark tests."""

from __future__ import annotations

from schemas.records import CommitRecord

# ---------------------------------------------------------------- seed 001 (Icechunk)
#
# gitGraph of the seed: ids are commit order, one hour apart; REVERSE-marked 1..7 are older
# than the threshold, 8..14 newer; 0 (HIGHLIGHT) is the root and also old - it is the "B" of
# the algorithm that every editable commit is re-parented to.
PARENTS_001: dict[str, tuple[str, ...]] = {
    "0": (),
    "1": ("0",),  # main
    "2": ("1",),  # main; develop branches here
    "3": ("2",),  # develop, tag1
    "4": ("2",),  # main
    "5": ("4",),  # main, tag2
    "6": ("3",),  # develop; test branches here
    "7": ("6",),  # test; qa branches here
    "8": ("7",),  # qa
    "9": ("7",),  # test
    "10": ("6",),  # develop
    "11": ("10",),  # develop
    "12": ("5",),  # main
    "13": ("12",),  # main
    "14": ("13",),  # main
}
G001 = {k: CommitRecord(ps, 1000.0 + 3600.0 * int(k)) for k, ps in PARENTS_001.items()}
THRESHOLD_001 = 1000.0 + 3600.0 * 7.5
BRANCHES_001 = {"main": "14", "develop": "11", "test": "9", "qa": "8"}
TAGS_001 = {"tag1": "3", "tag2": "5"}
ORDER_001 = [
    ("branch", "main"),
    ("branch", "develop"),
    ("branch", "test"),
    ("branch", "qa"),
    ("tag", "tag1"),
    ("tag", "tag2"),
]
