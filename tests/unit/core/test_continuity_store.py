"""The continuity library is prepended to other scripts (apply.lua, claims.lua): it must define
one name and run nothing, so it neither shadows their locals nor spends their 200 locals."""

from __future__ import annotations

import re

import pytest

from core.continuity_store import LIBRARY, OPS, compose
from schemas.layout import RepoKeys


def _top_level(lua: str) -> list[str]:
    code = re.sub(r"--\[\[.*?\]\]", "", lua, flags=re.S)
    return [line for line in code.splitlines()
            if line and not line[0].isspace() and not line.startswith("--")]


def test_the_library_defines_one_local_and_runs_nothing() -> None:
    assert _top_level(LIBRARY) == ["local function continuity(P)", "end"]


def test_compose_puts_the_library_first() -> None:
    body = "local C = continuity(ARGV[1])\nreturn C.horizon(1)\n"
    script = compose(body)
    assert script.startswith(LIBRARY) and script.endswith(body)
    assert OPS.startswith(LIBRARY) and "C.admit(ARGV[3], ARGV[4], ARGV[5])" in OPS


def test_the_keys_of_a_stripe() -> None:
    k = RepoKeys("re}po")
    assert (k.continuity(3), k.continuity_above(3), k.continuity_watermarks(63)) == (
        "hd:{re%7Dpo}:cont:3", "hd:{re%7Dpo}:above:3", "hd:{re%7Dpo}:wm:63")
    for bad in (-1, 64, True, "1"):
        with pytest.raises(ValueError, match="stripe"):
            k.continuity(bad)  # type: ignore[arg-type]
