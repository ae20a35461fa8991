"""``hardelete facts list REPO`` / ``facts reseal REPO --digest D``: a repository's durable facts
(``core/facts.py``: its holds and pauses, signed, in ``<namespace>_hardelete/facts/``).

A fact that does not verify under the fact key stops the repository's copy before it, and the
repository deletes nothing: it was forged or overwritten by someone who writes the namespace,
or the key was lost with Redis. ``list`` shows each fact and whether it verifies; ``reseal``
signs every fact of the home anew under the current key, for an operator who has judged what
``list`` shows (it makes the unverified ones the product's own)."""

from __future__ import annotations

import argparse
import datetime as dt
from dataclasses import asdict, dataclass
from typing import Any

import orjson

from core.errors import UserError
from core.facts import RepoFacts, decode_fact, sign, verified
from core.settings import Settings
from hardelete.holds import namespace_of, operator_s3


def _facts(settings: Settings, repo: str) -> tuple[Any, RepoFacts]:
    from core.clients import redis_sync

    r = redis_sync(settings)
    return r, RepoFacts(r, operator_s3(settings), repo, namespace_of(r, repo))


def _when(ms: int) -> str:
    return dt.datetime.fromtimestamp(ms / 1000, dt.UTC).isoformat(timespec="seconds")


@dataclass(frozen=True)
class FactRow:
    """One durable fact as ``facts list`` shows it."""

    seq: int
    kind: str
    by: str
    at: str
    verified: bool
    applied: bool  # the Redis copy has it
    body: dict[str, Any]

    @property
    def what(self) -> str:
        b = self.body
        items = ", ".join(f"{i[0]} ({i[1]})" for i in b.get("items", []))
        return items or str(b.get("target") or f"{b.get('op')} {b.get('who')}")


class list_:
    @staticmethod
    def configure(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("repository")
        parser.add_argument("--json", action="store_true")

    @staticmethod
    def run_cli(settings: Settings, args: argparse.Namespace) -> int:
        r, facts = _facts(settings, args.repository)
        try:
            key, applied = facts.key(), facts.applied()
            digest, _ = facts.log.snapshot()
            rows = []
            for seq in facts.log.seqs_from(1):
                f = facts.log.read(seq)
                rows.append(FactRow(seq, f.kind, f.by, _when(f.at_ms), verified(key, f),
                                    seq <= applied, dict(f.body)))
        finally:
            r.close()
        if args.json:
            print(orjson.dumps([asdict(row) for row in rows],
                               option=orjson.OPT_INDENT_2).decode())
            return 0
        from rich.console import Console
        from rich.table import Table

        t = Table(title=f"facts of {args.repository} ({len(rows)}; Redis applied {applied}; "
                        f"digest {digest})")
        for col in ("seq", "kind", "by", "at", "verified", "what"):
            t.add_column(col)
        for row in rows:
            t.add_row(str(row.seq), row.kind, row.by, row.at,
                      "yes" if row.verified else "[red]NO", row.what)
        Console().print(t)
        if not all(row.verified for row in rows):
            print(f"once judged: `hardelete facts reseal {args.repository} --digest {digest}` "
                  "(refused if the home changes before it)")
        return 0


class reseal:
    @staticmethod
    def configure(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("repository")
        parser.add_argument("--digest", default="",
                            help="the digest `facts list` showed for the home you judged")

    @staticmethod
    def run_cli(settings: Settings, args: argparse.Namespace) -> int:
        if not args.digest:
            raise UserError("reseal makes every fact of the home the product's own, the "
                            "unverified ones too: judge them with `hardelete facts list "
                            f"{args.repository}`, then run it with the --digest it shows")
        r, facts = _facts(settings, args.repository)
        try:
            digest, judged = facts.log.snapshot()  # one read: what is signed is what was judged
            if digest != args.digest:
                raise UserError(f"the facts of {args.repository} changed since `facts list` "
                                f"showed digest {args.digest}: nothing was resealed; judge "
                                "them again")
            key, n = facts.key(), 0
            for seq, raw in judged.items():
                f = decode_fact(raw, repository=args.repository, seq=seq)
                if not verified(key, f):
                    facts.log.s3.put_object(Bucket=facts.log.bucket,
                                            Key=facts.log.prefix + f"{seq:012d}.json",
                                            Body=sign(key, f).encode(),
                                            ContentType="application/json")
                    n += 1
            proof = facts.prove(by="reseal")
        finally:
            r.close()
        print(f"resealed {n} fact(s) of {args.repository}; "
              + ("its copy is current" if proof.problem is None else
                 f"still not proven: {proof.problem}"))
        return 0 if proof.problem is None else 1
