"""The blast-radius guard: is this sweep far larger than this repository's usual?

Pure: a function of what the sweep would delete, what the run listed and the confirmed deletes
of the repository's recent completed sweeps. The guard exists to stop a wrong mark (a lost
listing, a broken retention input) from emptying a repository; it must not stop the ordinary
sweeps of a small or young repository, which can never be swept if every run needs an override.

The rules (each is a problem; any problem refuses the sweep unless ``--allow-large-sweep``):

* at most ``floor`` objects: never refused (a small sweep cannot be a disaster worth a page);
* with history (completed sweeps of this repository): refused above ``max_growth`` times the
  median of the last ``history_runs`` of them (the median, not the last run, so one quiet
  night does not make the next ordinary one look huge);
* without history (a first sweep): refused above ``max_share`` of the listed objects.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from statistics import median


@dataclass(frozen=True, slots=True)
class BlastRadius:
    would_delete: int
    listed: int
    history: tuple[int, ...]  # confirmed deletes of recent completed sweeps, newest first
    usual: float | None  # the median of ``history``; None without history
    problems: tuple[str, ...]

    @property
    def refused(self) -> bool:
        return bool(self.problems)


def judge_blast_radius(would_delete: int, listed: int, history: Sequence[int], *,
                       max_share: float, max_growth: float, floor: int,
                       history_runs: int) -> BlastRadius:
    """The guard's verdict for one sweep (see the module docstring)."""
    recent = tuple(history[:history_runs]) if history_runs > 0 else ()
    usual = float(median(recent)) if recent else None
    problems: list[str] = []
    if would_delete > floor:
        if usual is not None:
            if would_delete > max_growth * usual:
                problems.append(
                    f"it would delete {would_delete:,} objects, more than {max_growth:g}x the "
                    f"median {usual:,g} of this repository's last {len(recent)} completed "
                    f"sweep(s) (and more than sweep_growth_floor {floor:,})")
        elif listed and would_delete / listed > max_share:
            problems.append(
                f"this repository's first sweep would delete {would_delete:,} of {listed:,} "
                f"listed objects ({would_delete / listed:.0%} > sweep_max_share "
                f"{max_share:.0%}, and more than sweep_growth_floor {floor:,})")
    return BlastRadius(would_delete, listed, recent, usual, tuple(problems))
