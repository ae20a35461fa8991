"""The one canonical form of an object address and of a namespace.

What names an S3 object: a bucket and a key. A key is a sequence of characters taken literally
(S3 does not fold case, ``.``, ``//`` or escapes in keys); bucket names are lower case (S3 does
not allow upper case, and hosts are case-insensitive), and the scheme is a spelling, not a
part of the name. So:

* **The same object**: ``s3://``, ``S3://``, ``s3a://``, ``s3n://`` (Hadoop's), any case of
  the bucket, and a key relative to the namespace. :func:`canonical_address` writes all of
  them as ``s3://<bucket>/<key>``.
* **Different objects**: keys that differ in any character, case included
  (``data/A`` and ``data/a``), and keys that differ only by ``.`` or ``//`` segments.
* **Cannot be resolved**: a key holding a ``%XX`` escape may be URL-encoded (``%2F`` meaning
  ``/``) or literal (an S3 key may hold ``%``). :func:`spelling` reports both objects it may
  mean; every path keeps both.

**The wire form is canonical.** The tracker admits an event only when each address it names
is already canonical and a plain key of its repository's namespace (:func:`spelling` says
``problem`` is None); any other spelling is dead-lettered with the canonical form in its
reason, every object it could mean is held, and an incident says so. So the mirror holds
exactly one record per object, and the reaper, which only deletes recorded addresses, can
never miss a reference under another spelling. The offline path reads manifests, service
exports and inventories with :func:`address_forms` (every form a row may mean is protected),
so online and offline answer alike: a spelling that cannot be resolved keeps every object it
may mean, on both paths.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from schemas.layout import OutsideNamespace, namespace_key

_ESCAPE = re.compile(r"%[0-9A-Fa-f]{2}")


def canonical_namespace(namespace: str) -> str:
    """``s3://bucket/prefix/`` with a lower-case scheme and bucket, exactly one trailing slash.

    Raises :class:`OutsideNamespace` for anything that is not an ``s3://bucket[/prefix]``.
    """
    if not isinstance(namespace, str) or namespace[:5].lower() != "s3://":
        raise OutsideNamespace(f"namespace {namespace!r} must be s3://bucket/prefix/")
    rest = namespace[5:]
    bucket, _, prefix = rest.partition("/")
    if not bucket or any(part in ("", ".", "..") for part in prefix.rstrip("/").split("/")
                         if prefix.rstrip("/")):
        raise OutsideNamespace(f"namespace {namespace!r} must be s3://bucket/prefix/")
    prefix = prefix.rstrip("/")
    return f"s3://{bucket.lower()}/" + (prefix + "/" if prefix else "")


_SCHEMES = ("s3://", "s3a://", "s3n://")


def has_scheme(raw: str) -> bool:
    """Whether ``raw`` is spelled as an absolute address (any case of ``s3://``, ``s3a://``,
    ``s3n://``), not relative to a namespace."""
    return raw[:6].lower().startswith(_SCHEMES)


def canonical_address(namespace: str, raw: str, *, decode: bool = False) -> str:
    """The canonical ``s3://bucket/prefix/key`` of an address of ``namespace``, else raise.

    Accepted spellings: any case of ``s3://``, ``s3a://`` and ``s3n://`` (Hadoop's), a bucket
    in any case (S3 bucket names are lower case), and a key relative to the namespace (no
    scheme, no leading ``/``). ``decode=True`` also decodes ``%XX`` escapes (URL-encoded
    forms). The key itself is kept byte for byte (S3 keys are literal: no ``.``/``//``
    folding). Raises :class:`OutsideNamespace` when the address is not inside the namespace
    or cannot be read as an address at all: a caller building a live set must then fail,
    never drop the row.
    """
    from urllib.parse import unquote

    ns = canonical_namespace(namespace)
    if not isinstance(raw, str) or not raw:
        raise OutsideNamespace(f"address {raw!r} is empty or not text")
    text = unquote(raw, errors="strict") if decode and "%" in raw else raw
    lower = text[:6].lower()
    scheme = next((s for s in _SCHEMES if lower.startswith(s)), None)
    if scheme is not None:
        rest = text[len(scheme):]
        bucket, sep, key = rest.partition("/")
        if not bucket or not sep:
            raise OutsideNamespace(f"address {raw!r} has no bucket or key")
        full = f"s3://{bucket.lower()}/{key}"
    elif "://" in text or text.startswith("/"):
        raise OutsideNamespace(f"address {raw!r} is neither s3:// nor namespace-relative")
    else:
        full = ns + text
    if not full.startswith(ns) or full == ns:
        raise OutsideNamespace(f"address {raw!r} is outside namespace {ns!r}")
    return full


def address_forms(namespace: str, raw: str) -> tuple[str, ...]:
    """Every canonical address ``raw`` may name (for live sets: each form is protected).

    An address with ``%`` escapes may be URL-encoded or a key that really holds ``%``: both
    the literal and the decoded form are returned (doubt keeps both). Raises
    :class:`OutsideNamespace` when no form lies inside the namespace.
    """
    forms: list[str] = []
    errors: list[str] = []
    for decode in (False, True) if "%" in raw else (False,):
        try:
            form = canonical_address(namespace, raw, decode=decode)
        except (OutsideNamespace, UnicodeDecodeError) as exc:
            errors.append(str(exc))
            continue
        if form not in forms:
            forms.append(form)
    if not forms:
        raise OutsideNamespace(errors[0] if errors else f"address {raw!r}")
    return tuple(forms)


def canonical_uri(raw: str) -> str:
    """``raw`` with the scheme and bucket in canonical form and the rest kept literally (an
    operator's address or prefix: ``S3://Bucket/repo/`` -> ``s3://bucket/repo/``). Raises
    :class:`OutsideNamespace` when it is not an ``s3://``-like URI with a bucket."""
    lower = raw[:6].lower() if isinstance(raw, str) else ""
    scheme = next((s for s in _SCHEMES if lower.startswith(s)), None)
    if scheme is None:
        raise OutsideNamespace(f"expected an s3:// address or prefix, got {raw!r}")
    bucket, sep, rest = raw[len(scheme):].partition("/")
    if not bucket:
        raise OutsideNamespace(f"{raw!r} names no bucket")
    return f"s3://{bucket.lower()}{sep}{rest}"


@dataclass(frozen=True, slots=True)
class Spelling:
    """What an address spelling names in a namespace.

    ``problem``: None when ``raw`` is the canonical spelling of one deletable object of the
    namespace, else why not. ``meant``: every canonical address of a plain key of the
    namespace that ``raw`` could name (what a hold must cover); empty when it names nothing
    there. ``readable``: False when ``raw`` cannot be read as an address at all (then nothing
    can be said about what it names: a caller that must keep what it meant holds the whole
    namespace)."""

    problem: str | None
    meant: tuple[str, ...]
    readable: bool = True


def spelling(namespace: str, raw: object) -> Spelling:
    """Judge one address spelling against a (canonical) namespace; see :class:`Spelling`."""
    if not isinstance(raw, str) or not raw:
        return Spelling(f"address {raw!r} is empty or not text", (), False)
    escaped = _ESCAPE.search(raw) is not None
    if not escaped and raw.startswith(namespace):  # the canonical spelling (the hot case)
        try:
            namespace_key(namespace, raw)
        except OutsideNamespace as exc:
            return Spelling(f"rejected address: {exc}", ())
        return Spelling(None, (raw,))
    lower = raw[:6].lower()
    if not lower.startswith(_SCHEMES) and ("://" in raw or raw.startswith("/")):
        return Spelling(f"address {raw!r} is neither s3:// nor namespace-relative", (), False)
    try:
        forms = address_forms(namespace, raw)
    except (OutsideNamespace, UnicodeDecodeError) as exc:
        return Spelling(f"rejected address: {exc}", ())
    meant = []
    for form in forms:
        try:
            namespace_key(namespace, form)
        except OutsideNamespace:
            continue
        meant.append(form)
    if escaped:
        return Spelling(f"rejected address: {raw!r} holds %XX escapes: URL-encoded or literal, "
                        "it may name " + " or ".join(repr(m) for m in meant or forms)
                        + " (ambiguous: both are kept)", tuple(meant))
    canonical = forms[0]
    try:
        namespace_key(namespace, canonical)
    except OutsideNamespace as exc:
        return Spelling(f"rejected address: {exc}", ())
    if canonical != raw:
        return Spelling(f"rejected address: {raw!r} is not canonical (the object is "
                        f"{canonical!r}: publish that spelling)", (canonical,))
    return Spelling(None, (canonical,))
