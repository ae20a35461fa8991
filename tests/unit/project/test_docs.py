"""docs/ADOPTING.md and docs/DEPLOYING.md: the README links both, and what they name exists (every
file a link or a code span names, every HARDELETE_* variable), so that they cannot drift from
the tree silently."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from core.settings import ENV_PREFIX, describe

ROOT = Path(__file__).resolve().parents[3]
DOCS = [ROOT / "docs/ADOPTING.md", ROOT / "docs/DEPLOYING.md"]
TOP = {p.name for p in ROOT.iterdir() if not p.name.startswith(".")}


def test_the_readme_links_both_documents() -> None:
    readme = (ROOT / "README.md").read_text()
    for doc in DOCS:
        assert f"]({doc.relative_to(ROOT)})" in readme, doc.name


def named_paths(text: str, folder: Path) -> set[str]:
    """The repository paths a document in ``folder`` names: its relative links (resolved from
    its folder) and its code spans that start with a top-level entry of the tree
    (`core/deleter.py`)."""
    out = set()
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if "://" in target or target.startswith("#"):
            continue
        out.add(str((folder / target.split("#")[0]).resolve().relative_to(ROOT)))
    for span in re.findall(r"`([^`\s]+)`", text):
        if "/" in span and span.split("/")[0] in TOP:
            out.add(span.rstrip("/"))
    return out


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_path_a_document_names_exists(doc: Path) -> None:
    paths = named_paths(doc.read_text(), doc.parent)
    assert len(paths) >= 10
    missing = sorted(p for p in paths if not (ROOT / p).exists())
    assert not missing, f"{doc.name} names paths that do not exist: {missing}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_variable_a_document_names_is_a_setting(doc: Path) -> None:
    known = {name for name, _, _ in describe()} | {ENV_PREFIX + "CONFIG"}
    named = set(re.findall(r"HARDELETE_[A-Z_]+[A-Z]", doc.read_text()))
    assert named - known == set()


def test_the_path_check_reads_links_and_code_spans() -> None:
    text = ("see [it](../core/nope.py#x), [web](https://x/y) and `tracker/gone.lua`, not "
            "`_hardelete/x/`, `s3://b/k` nor `hd:{R}:holds`; [the runbook](../deploy/RUNBOOK.md)")
    paths = named_paths(text, ROOT / "docs")
    assert paths == {"core/nope.py", "tracker/gone.lua", "deploy/RUNBOOK.md"}
    assert [p for p in sorted(paths) if not (ROOT / p).exists()] == ["core/nope.py",
                                                                   "tracker/gone.lua"]
