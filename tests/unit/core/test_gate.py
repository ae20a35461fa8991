"""One gate (``core/gate.py``): every S3 delete and quarantine copy of the product.

Issue 19 finding: ``quarantine purge`` deleted the last copy of an object a commit references
(it checked holds only) and deleted while the repository was paused or fail-closed; restore and
purge called ``delete_object`` outside the one deleter; the deleter's boto3 client retried on
its own, so a throttled request could be re-sent without the re-check.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
GATE = ROOT / "core" / "gate.py"
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


def test_no_module_but_the_gate_sends_a_delete_or_a_copy() -> None:
    offenders = []
    for package in ("schemas", "core", "tracker", "reaper", "reconciler", "hardelete"):
        for path in sorted((ROOT / package).rglob("*.py")):
            if path == GATE:
                continue
            offenders += [f"{path.relative_to(ROOT)}:{line} {what}"
                          for line, what in _calls(path)]
    assert offenders == [], "S3 deletes and copies go through core/gate.py only"
    assert {what for _, what in _calls(GATE)} == {"delete_objects", "copy_object"}  # (seen)




# ------------------------------------------------------- quarantine purge through the gate





