"""The README's promise: its test and image commands are what CI runs, and its config table is
complete."""

from __future__ import annotations

from pathlib import Path

from core.settings import describe

ROOT = Path(__file__).resolve().parents[3]


def test_ci_runs_the_readme_test_command() -> None:
    """The suite, then the image built and run (issue 36: no test built it before)."""
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci/run").read_text()
    assert "./dev test" in readme and "./dev demo" in readme and "./dev image" in readme
    commands = [ln.strip() for ln in ci.splitlines() if ln.strip() and not ln.startswith("#")]
    assert commands[-2:] == ["./dev test", "./dev image"]


def test_readme_documents_every_setting() -> None:
    readme = (ROOT / "README.md").read_text()
    missing = [name for name, _, _ in describe() if f"`{name}`" not in readme]
    assert not missing
