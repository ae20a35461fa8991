"""Continuity in Redis: ``continuity.lua`` (the state machine of :mod:`core.continuity`, in the
repository's slot) and the calls that run it.

- :func:`compose`: a script that uses the continuity functions is ``continuity.lua`` followed by
  its own body (the tracker's apply script, the claim script: the same script and slot as the
  records the horizon certifies).
- :class:`ContinuityStore` (synchronous client) and :class:`AsyncContinuityStore`: one op per
  call (``continuity_ops.lua``), read back as :class:`core.continuity.Domain`. Redis Cluster
  too: every key of a call shares the repository's hash tag.

Bad input (a seq or tick out of 0..2^53-1, seq 0, an empty incarnation, a stripe out of
0..63) raises ``ValueError`` as the pure functions do; the script checks it before writing.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
from redis.exceptions import ResponseError

from core.continuity import Admission, Domain, Watermark
from schemas.layout import RepoKeys

LIBRARY = Path(__file__).with_name("continuity.lua").read_text()
_ERROR = "hardelete continuity:"


def compose(body: str) -> str:
    """The script ``body`` with the continuity functions before it (``local C =
    continuity(P)`` in the body; see the head of ``continuity.lua``)."""
    return LIBRARY + "\n" + body


OPS = compose(Path(__file__).with_name("continuity_ops.lua").read_text())


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _num(v: object) -> str:
    """A number as the script reads it; anything else goes as text and the script refuses it
    (``True`` and ``1.5`` are not seqs)."""
    return str(v)


def _domain(raw: Any) -> Domain:
    fields_raw, above, pending = raw
    flat = [_text(v) for v in fields_raw]
    f = dict(zip(flat[::2], flat[1::2], strict=True))
    marks = []
    for m in pending:
        seq, tick = _text(m).split(":")
        marks.append(Watermark(int(seq), int(tick)))
    return Domain(
        incarnation=f.get("inc"),
        prefix=int(f.get("prefix", "0")),
        above=frozenset(int(_text(s)) for s in above),
        pending=tuple(marks),
        horizon_ms=int(f["horizon"]) if "horizon" in f else None,
        broken=f.get("broken"),
        retired=frozenset(orjson.loads(f["retired"])) if "retired" in f else frozenset(),
        epoch=int(f.get("epoch", "0")),
    )


def _gaps(raw: Any) -> list[tuple[int, int]]:
    vals = [int(_text(v)) for v in raw]
    return list(zip(vals[::2], vals[1::2], strict=True))


def _horizon(raw: Any) -> int | None:
    text = _text(raw)
    return int(text) if text else None


@dataclass(frozen=True, slots=True)
class _Call:
    keys: list[str]
    args: list[str]
    parse: Callable[[Any], Any]


def _call(repo: str, stripe: int, op: str, *args: str, parse: Callable[[Any], Any]) -> _Call:
    keys = RepoKeys(repo)
    return _Call([keys.continuity(stripe)], [keys.tag + ":", op, *args], parse)


def _admit(repo: str, stripe: int, incarnation: str, seq: int) -> _Call:
    return _call(repo, stripe, "admit", str(stripe), incarnation, _num(seq),
                 parse=lambda v: Admission(_text(v)))


def _certify(repo: str, stripe: int, incarnation: str, w: Watermark) -> _Call:
    return _call(repo, stripe, "certify", str(stripe), incarnation, _num(w.seq),
                 _num(w.tick_ms), _num(w.applied), parse=lambda v: None)


def _break(repo: str, stripe: int, reason: str) -> _Call:
    return _call(repo, stripe, "break", str(stripe), reason, parse=lambda v: None)


def _rebuild(repo: str, stripe: int, incarnation: str, counter: int) -> _Call:
    return _call(repo, stripe, "rebuild", str(stripe), incarnation, _num(counter),
                 parse=lambda v: None)


def _read(repo: str, stripe: int) -> _Call:
    return _call(repo, stripe, "read", str(stripe), parse=_domain)


def _gaps_call(repo: str, stripe: int, limit: int) -> _Call:
    return _call(repo, stripe, "gaps", str(stripe), str(max(limit, 0)), parse=_gaps)


def _horizon_call(repo: str, stripes: int) -> _Call:
    return _call(repo, 0, "horizon", _num(stripes), parse=_horizon)


def _refused(exc: ResponseError) -> Exception:
    """The script's refusal of bad input as the pure functions give it (without the
    server's " script: on @user_script:<line>." tail)."""
    text = str(exc)
    if _ERROR not in text:
        return exc
    return ValueError(text[text.index(_ERROR):].split(" script: ")[0])


class ContinuityStore:
    """The continuity ops on one synchronous Redis (or Redis Cluster) client."""

    def __init__(self, redis: Any) -> None:
        self._redis = redis
        self._script = redis.register_script(OPS)

    def sequenced_horizon(self, repo: str) -> tuple[bool, int | None]:
        """(is the repository sequenced, its continuity horizon over its declared stripes)."""
        sequenced, stripes = self._redis.hmget(RepoKeys(repo).meta, "sequenced", "stripes")
        if sequenced is None or _text(sequenced) != "1":
            return False, None
        return True, self.horizon(repo, 1 if stripes is None else int(_text(stripes)))

    def _run(self, c: _Call) -> Any:
        try:
            raw = self._script(keys=c.keys, args=c.args)
        except ResponseError as exc:
            raise _refused(exc) from None
        return c.parse(raw)

    def admit(self, repo: str, stripe: int, incarnation: str, seq: int) -> Admission:
        result: Admission = self._run(_admit(repo, stripe, incarnation, seq))
        return result

    def certify(self, repo: str, stripe: int, incarnation: str, w: Watermark) -> None:
        self._run(_certify(repo, stripe, incarnation, w))

    def break_domain(self, repo: str, stripe: int, reason: str) -> None:
        self._run(_break(repo, stripe, reason))

    def rebuild(self, repo: str, stripe: int, incarnation: str, counter: int) -> None:
        self._run(_rebuild(repo, stripe, incarnation, counter))

    def applied_max(self, repo: str, stripe: int) -> int:
        """The highest seq applied in the stripe (what a tick read now would carry)."""
        result: int = self._run(_call(repo, stripe, "applied", str(stripe),
                                      parse=lambda v: int(_text(v))))
        return result

    def read(self, repo: str, stripe: int) -> Domain:
        result: Domain = self._run(_read(repo, stripe))
        return result

    def gaps(self, repo: str, stripe: int, limit: int = 16) -> list[tuple[int, int]]:
        result: list[tuple[int, int]] = self._run(_gaps_call(repo, stripe, limit))
        return result

    def horizon(self, repo: str, stripes: int) -> int | None:
        """The repository's horizon over stripes 0..stripes-1 (None if any has none)."""
        result: int | None = self._run(_horizon_call(repo, stripes))
        return result


class AsyncContinuityStore:
    """The continuity ops on one asyncio Redis (or Redis Cluster) client."""

    def __init__(self, redis: Any) -> None:
        self._script: Callable[..., Awaitable[Any]] = redis.register_script(OPS)

    async def _run(self, c: _Call) -> Any:
        try:
            raw = await self._script(keys=c.keys, args=c.args)
        except ResponseError as exc:
            raise _refused(exc) from None
        return c.parse(raw)

    async def admit(self, repo: str, stripe: int, incarnation: str, seq: int) -> Admission:
        result: Admission = await self._run(_admit(repo, stripe, incarnation, seq))
        return result

    async def certify(self, repo: str, stripe: int, incarnation: str, w: Watermark) -> None:
        await self._run(_certify(repo, stripe, incarnation, w))

    async def break_domain(self, repo: str, stripe: int, reason: str) -> None:
        await self._run(_break(repo, stripe, reason))

    async def read(self, repo: str, stripe: int) -> Domain:
        result: Domain = await self._run(_read(repo, stripe))
        return result

    async def gaps(self, repo: str, stripe: int, limit: int = 16) -> list[tuple[int, int]]:
        result: list[tuple[int, int]] = await self._run(_gaps_call(repo, stripe, limit))
        return result

    async def horizon(self, repo: str, stripes: int) -> int | None:
        """The repository's horizon over stripes 0..stripes-1 (None if any has none)."""
        result: int | None = await self._run(_horizon_call(repo, stripes))
        return result
