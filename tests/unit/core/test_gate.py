"""One deleter (``core/deleter.py``): every S3 delete and copy request of the product.

Issue 19 finding: ``quarantine purge`` deleted the last copy of an object a commit references
(it checked holds only) and deleted while the repository was paused or fail-closed; restore and
purge called ``delete_object`` outside the one deleter; the deleter's boto3 client retried on
its own, so a throttled request could be re-sent without the re-check.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
DELETER = ROOT / "core" / "deleter.py"
# The benchmarks' raw boto3 loops: the physical limit the reaper and the reconciler's sweep
# are measured against (on the benchmark's own bucket).
NOT_A_DELETE_PATH = {ROOT / "sim" / "bench_reaper.py", ROOT / "sim" / "bench_reconciler.py"}
REQUESTS = {"delete_object", "delete_objects", "copy_object"}


def _calls(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in REQUESTS:
            out.append((node.lineno, node.attr))
        elif isinstance(node, ast.Constant) and node.value in REQUESTS:  # getattr(s3, "...")
            out.append((node.lineno, str(node.value)))
    return out


def offenders(root: Path) -> list[str]:
    out = []
    for package in ("schemas", "core", "tracker", "reaper", "reconciler", "hardelete", "sim"):
        for path in sorted((root / package).rglob("*.py")):
            if path == root / "core" / "deleter.py" or path in NOT_A_DELETE_PATH:
                continue
            out += [f"{path.relative_to(root)}:{line} {what}" for line, what in _calls(path)]
    return out


def test_no_module_but_the_deleter_sends_a_delete_or_a_copy() -> None:
    assert offenders(ROOT) == [], "S3 deletes and copies go through core/deleter.py only"
    assert {what for _, what in _calls(DELETER)} == {"delete_objects", "copy_object"}  # (seen)


def test_the_scan_sees_a_delete_elsewhere(tmp_path: Path) -> None:
    for package, body in {"reaper": "def f(s3):\n    s3.delete_object(Bucket='b', Key='k')\n",
                          "hardelete": "def g(s3):\n    getattr(s3, 'copy_object')()\n",
                          "core": "def deleter(s3):\n    s3.list_objects_v2()\n"}.items():
        (tmp_path / package).mkdir()
        (tmp_path / package / "m.py").write_text(body)
    assert offenders(tmp_path) == ["reaper/m.py:2 delete_object",
                                   "hardelete/m.py:2 copy_object"]




# ------------------------------------------------------- quarantine purge through the gate







def test_a_sequenced_repository_is_judged_no_later_than_its_continuity_horizon() -> None:
    from core.gate import UNSEQUENCED, Evidence, Gate

    def ev(cont: object) -> Evidence:
        return Evidence(Gate(), {}, {}, {}, 0, cont)  # type: ignore[arg-type]

    assert ev(UNSEQUENCED).horizon(500) == 500  # only the tracker's horizon over the log
    assert ev(UNSEQUENCED).horizon(None) is None
    assert ev(300).horizon(500) == 300
    assert ev(900).horizon(500) == 500
    assert ev(None).horizon(500) is None  # a gap, a broken stripe, no watermark yet
    # a caller without a horizon (the reconciler's sweep) is still bound by the service's
    assert ev(300).horizon(None) == 300
    assert ev(None).uncertified and not ev(300).uncertified and not ev(UNSEQUENCED).uncertified


def test_nothing_of_a_sequenced_repository_without_a_continuity_horizon_is_deleted_on_any_path(
        ) -> None:
    """On the reconciler path "no horizon" means "the cutoff alone": a sequenced repository
    without a continuity horizon must be kept there too, not judged by the cutoff."""
    from core.gate import UNSEQUENCED, Evidence, Gate, keep_reasons
    from schemas.records import AddressRecord

    rec = AddressRecord(state="unreferenced", since=100)
    for cont, kept in ((None, True), (UNSEQUENCED, False)):
        evidence = Evidence(Gate(), {"s3://b/r/a": rec}, {}, {}, 10_000, cont)  # type: ignore[arg-type]
        keep = keep_reasons(evidence, "r", "s3://b/r/", path="reconciler", horizon_ms=None,
                            grace_ms=1000, cutoff_ms=5_000)
        assert ("s3://b/r/a" in keep) is kept, (cont, keep)
    evidence = Evidence(Gate(), {"s3://b/r/a": rec}, {}, {}, 10_000, 600)
    keep = keep_reasons(evidence, "r", "s3://b/r/", path="reconciler", horizon_ms=None,
                        grace_ms=1000, cutoff_ms=5_000)
    assert keep == {"s3://b/r/a": "young"}  # 100 > 600 - 1000: within grace of the horizon
