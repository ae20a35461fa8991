"""The one deleter: every S3 delete and copy request of the product goes out here.

Its callers (the reaper, plain and quarantine; the quarantine copy and restore; the reconciler's
sweep; the quarantine purge; the retired-repository purge) hand it **addresses** of one
namespace and a :class:`Plan`, and get back one typed :class:`Report`:

- **guard**: each address must lie in the plan's namespace and area (``data``: a plain key
  outside the reserved metadata prefixes, ``schemas.layout.namespace_key``; ``quarantine``: a
  copy under ``<namespace>_hardelete/quarantine/`` of such a key). Others are ``refused``,
  never sent. A copy goes only between an address and its own quarantine copy.
- **batches** of at most 1,000 keys per request (real S3's limit; moto accepts more).
- **recheck** right before every request, retries included: the caller's judgment (addresses
  -> reason to keep); what it keeps is ``kept`` and never sent. If it raises, every pending
  address is kept (doubt keeps).
- **confirmation only from the store's ``Deleted`` entries** (never quiet mode): an address
  the store does not mention is asked again, then ``failed``; transient codes are retried
  with jittered exponential backoff; the client itself never retries (a retry it sent alone
  would skip the recheck).

Versioned buckets (SPEC safety 6)
---------------------------------
On a bucket whose versioning is Enabled or Suspended, deleting a key writes a delete marker
and keeps the bytes. The deleter reads each bucket's versioning status once
(``get_bucket_versioning``, cached per deleter; an unreadable status takes the versioned way,
which is right on any bucket) and reads it again whenever a ``Deleted`` entry shows a
``DeleteMarker`` it did not ask to remove. On a versioned bucket, right before each request
(after the recheck) it lists the key's versions and delete markers (``list_object_versions``)
and deletes each **by its VersionId**: a hard delete is every version of the address gone. An
address is confirmed only when the store lists each of those versions under ``Deleted`` and no
delete marker came of it. A data address is written once: if its key holds more than one
version, which one was judged is unknown, so the address is **kept** (``rewritten``), never
deleted; a version written after the listing is not in the request and stays. A key with no
version left is confirmed as it stands (the listing is the store's word that nothing is
there, as its ``Deleted`` for a missing key is on an unversioned bucket). Quarantine copies
are rewritten by design (each quarantine overwrites the copy), so every version of a
quarantine key goes.

Bounded requests: nothing lands after what justified it
-------------------------------------------------------
A request the client gave up on may still reach the store later (a slow store, a proxy that
holds it): a client timeout bounds how long the client waits, not when the store acts. So
every request is signed with query-string SigV4 (a presigned request, body and headers
unchanged) whose ``X-Amz-Date`` is the moment its recheck **started** and whose
``X-Amz-Expires`` is at most ``request_seconds``: the store itself refuses it afterwards
(``AccessDenied: Request has expired``, reported as ``RequestExpired`` and retried after a
new recheck). With ``skew_seconds`` the largest clock difference between the hosts involved
(deleter, store, Redis, the operator's):

1. *No request takes effect later than* ``request_seconds + skew_seconds`` *after its recheck
   started.* Its void moment is the whole second at or before ``recheck start +
   request_seconds`` (``X-Amz-Date`` + ``X-Amz-Expires``, both whole seconds); one that
   would have less than 0.2 s left is not sent but judged again. The store checks the
   expiry when it receives the request and applies a delete it accepted within that request
   (S3 and MinIO do); the clocks differ by at most ``skew_seconds``.
2. *So every fact that keeps an address stops every delete of it that can land more than*
   ``request_seconds + skew_seconds`` *after the fact was written*: a recheck that started
   after it keeps the address, one that started before it justified requests void by then.
   This holds for every path (reaper, sweep, purges) whatever became of the claim or lease
   it worked under: a reaper whose lease ran out mid-request, its claim since taken and
   finished by another, is bounded the same way.
3. *A restore cannot race a delete.* ``hardelete restore`` places its hold (a claim every
   recheck keeps) and then waits ``request_seconds + skew_seconds`` (:attr:`settle_seconds`,
   measured from after the hold was written) before it copies the object back: by (2) no
   delete request of the address sent before the hold can land on the restored object.

The client's connect and read timeouts are ``request_seconds`` too (``core.clients``): it
stops waiting about when the store would refuse anyway.

:class:`Deleter` is the synchronous core (Spark tasks, the CLI's purges); :class:`AsyncDeleter`
runs its batches in threads with a concurrency limit (the reaper, restore).
"""

from __future__ import annotations

import asyncio
import math
import random
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from botocore.auth import S3SigV4QueryAuth

from core.clients import split_s3_uri
from schemas.layout import QUARANTINE_PREFIX, OutsideNamespace, namespace_key

S3_MAX_KEYS = 1000
TRANSIENT_CODES = frozenset({
    "SlowDown", "InternalError", "ServiceUnavailable", "RequestTimeout", "503", "500",
    "Throttling", "ThrottlingException", "RequestLimitExceeded"})
NO_ANSWER = "NoAnswer"  # the store did not mention the key (neither Deleted nor Errors)
EXPIRED = "RequestExpired"  # the store refused a request whose signature expired: retried
DELETE_MARKER = "DeleteMarker"  # the store wrote a delete marker: not a delete, retried
REWRITTEN = "rewritten"  # a data key holds several versions: which one was judged is unknown
RETRIED = TRANSIENT_CODES | {NO_ANSWER, EXPIRED, DELETE_MARKER}
DATA, QUARANTINE = "data", "quarantine"
_MISSING = frozenset({"NoSuchKey", "404", "NotFound"})
_VERSIONED_UNKNOWN = "?"  # the status could not be read: deleted as a versioned bucket

Recheck = Callable[[list[str]], Mapping[str, str]]  # addresses -> {address: reason to keep}


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    attempts: int = 6  # requests per batch at most (the first included)
    base_delay: float = 0.05
    max_delay: float = 5.0

    def backoff(self, retry: int, rng: random.Random) -> float:
        # Full jitter: spreads the retries of many deleters hitting one throttled prefix.
        return rng.uniform(0, min(self.max_delay, self.base_delay * 2 ** retry))


@dataclass(frozen=True, slots=True)
class Plan:
    """What one call deletes or copies, and how (see the module docstring).

    ``namespace``: ``s3://bucket/prefix/``, every address must lie in it. ``area``: ``data``
    (plain keys outside the reserved prefixes) or ``quarantine`` (quarantine copies).
    ``recheck``: run right before every request.
    """

    namespace: str
    area: str = DATA
    recheck: Recheck | None = None
    retry: RetryPolicy = RetryPolicy()
    batch_keys: int = S3_MAX_KEYS

    def __post_init__(self) -> None:
        if not 1 <= self.batch_keys <= S3_MAX_KEYS:
            raise ValueError(f"batch_keys must be 1..{S3_MAX_KEYS} (got {self.batch_keys})")
        if self.area not in (DATA, QUARANTINE):
            raise ValueError(f"area must be {DATA!r} or {QUARANTINE!r} (got {self.area!r})")


@dataclass(frozen=True, slots=True)
class Copy:
    """One copy: an address to its quarantine copy, or a quarantine copy back to its address.
    ``metadata`` replaces the object's (a quarantine copy's provenance); None keeps it."""

    source: str
    target: str
    metadata: Mapping[str, str] | None = None


@dataclass(frozen=True, slots=True)
class Report:
    """What the store confirmed, and why everything else was not (addresses throughout)."""

    deleted: tuple[str, ...] = ()  # the store listed it (each of its versions) under Deleted
    failed: Mapping[str, str] = field(default_factory=dict)  # address -> "Code: text"
    refused: Mapping[str, str] = field(default_factory=dict)  # address -> why never sent
    kept: Mapping[str, str] = field(default_factory=dict)  # address -> why the recheck kept it
    copied: tuple[str, ...] = ()  # copies: sources the store copied to their target
    absent: tuple[str, ...] = ()  # copies: sources that were not there (nothing to copy)
    versions: Mapping[str, tuple[str, ...]] = field(default_factory=dict)  # versioned bucket:
    # deleted address -> the version ids (delete markers included) the store confirmed gone
    requests: int = 0
    retries: int = 0

    def code(self, address: str) -> str:
        """The failure code of ``address`` (``failed`` holds "Code: text")."""
        return self.failed[address].split(":", 1)[0]

    @property
    def codes(self) -> dict[str, str]:
        return {a: self.code(a) for a in self.failed}

    def __add__(self, other: Report) -> Report:
        return Report(deleted=self.deleted + other.deleted,
                      failed={**self.failed, **other.failed},
                      refused={**self.refused, **other.refused},
                      kept={**self.kept, **other.kept},
                      copied=self.copied + other.copied, absent=self.absent + other.absent,
                      versions={**self.versions, **other.versions},
                      requests=self.requests + other.requests,
                      retries=self.retries + other.retries)


# --- the guard (pure) ----------------------------------------------------------------------------

def guard_problem(namespace: str, address: str, area: str) -> str | None:
    """Why ``address`` may not be deleted in ``area`` of ``namespace``, or None (pure)."""
    try:
        if area == QUARANTINE:
            qprefix = namespace + QUARANTINE_PREFIX
            if not address.startswith(qprefix):
                return f"{address!r} is not a quarantine copy of namespace {namespace!r}"
            namespace_key(namespace, namespace + address[len(qprefix):])
        else:
            namespace_key(namespace, address)
    except OutsideNamespace as exc:
        return str(exc)
    return None


def copy_problem(namespace: str, order: Copy) -> str | None:
    """Why ``order`` may not be sent, or None (pure): a copy goes only between an address of
    the namespace and its own quarantine copy, either way."""
    for data, quarantine in ((order.source, order.target), (order.target, order.source)):
        if guard_problem(namespace, data, DATA) is None and \
                quarantine == namespace + QUARANTINE_PREFIX + data[len(namespace):]:
            return None
    return (f"a copy goes only between an address of {namespace!r} and its quarantine copy "
            f"({order.source!r} -> {order.target!r})")


MIN_LEFT_SECONDS = 0.2  # a request with less validity left is not sent (judged again)


def signature_window(request_seconds: int, anchor: float, now: float
                     ) -> tuple[int, int] | None:
    """(``X-Amz-Date``, ``X-Amz-Expires``) in whole seconds of a request whose recheck started
    at wall time ``anchor``, signed at ``now``: void at the whole second at or before
    ``anchor + request_seconds``; None when less than :data:`MIN_LEFT_SECONDS` would be left.
    Pure."""
    void_at = math.floor(anchor + request_seconds)
    date = math.floor(now)
    if void_at - now < MIN_LEFT_SECONDS:
        return None
    return date, void_at - date


def versions_to_delete(key_versions: Sequence[str], markers: Sequence[str], area: str
                       ) -> tuple[list[str], str | None]:
    """(version ids to delete, reason to keep instead) for one key of a versioned bucket
    (pure). A data key holding more than one version is kept (see the module docstring)."""
    if area == DATA and len(key_versions) > 1:
        return [], (f"{REWRITTEN}: the key holds {len(key_versions)} versions; an address is "
                    "written once, so which one was judged is unknown")
    return [*key_versions, *markers], None


# --- signing: the store refuses a late request ----------------------------------------------------

_QueryAuth: Any = S3SigV4QueryAuth  # (its stubs lack the hooks overridden here)


class ExpiringQueryAuth(_QueryAuth):  # type: ignore[misc]
    """SigV4 in the query string (``X-Amz-Date`` + ``X-Amz-Expires``) of a request whose body
    and headers go unchanged; ``timestamp``: its ``X-Amz-Date`` (default: now). The fault
    proxy signs a rewritten request again with it, keeping the original's date and expiry."""

    def __init__(self, credentials: Any, service_name: str, region_name: str, *,
                 expires: int, timestamp: str | None = None) -> None:
        super().__init__(credentials, service_name, region_name, expires=expires)
        self._timestamp = timestamp

    def add_auth(self, request: Any) -> None:
        if self._timestamp is None:
            super().add_auth(request)
            return
        request.context["timestamp"] = self._timestamp
        self._modify_request_before_signing(request)
        canonical = self.canonical_request(request)
        self._inject_signature_to_request(request, self.signature(
            self.string_to_sign(request, canonical), request))

    def _modify_request_before_signing(self, request: Any) -> None:
        # The presign signer moves a form body into the query; this request keeps its body.
        body = request.data
        request.data = b""
        try:
            super()._modify_request_before_signing(request)
        finally:
            request.data = body


_SIGNING = threading.local()  # (X-Amz-Date, X-Amz-Expires) of the request being sent
_SIGNED_OPS = ("DeleteObjects", "CopyObject")


def _choose_signer(**_: Any) -> Any:
    import botocore

    return botocore.UNSIGNED if getattr(_SIGNING, "bound", None) else None


def _sign(request: Any, request_signer: Any, **_: Any) -> None:
    bound = getattr(_SIGNING, "bound", None)
    if not bound:
        return
    date, expires = bound
    creds = request_signer._credentials.get_frozen_credentials()
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(date))
    ExpiringQueryAuth(creds, "s3", request_signer._region_name, expires=expires,
                      timestamp=stamp).add_auth(request)


def _install_signer(client: Any) -> None:
    events = getattr(getattr(client, "meta", None), "events", None)
    if events is None:
        return  # not a botocore client (a unit test's double)
    for op in _SIGNED_OPS:
        events.register(f"choose-signer.s3.{op}", _choose_signer,
                        unique_id=f"hardelete-deleter-choose-{op}")
        events.register(f"before-sign.s3.{op}", _sign, unique_id=f"hardelete-deleter-sign-{op}")


# --- the core -------------------------------------------------------------------------------------

@dataclass
class _Acc:
    deleted: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    kept: dict[str, str] = field(default_factory=dict)
    versions: dict[str, tuple[str, ...]] = field(default_factory=dict)
    requests: int = 0
    retries: int = 0

    def report(self) -> Report:
        return Report(deleted=tuple(self.deleted), failed=self.failed, kept=self.kept,
                      versions=self.versions, requests=self.requests, retries=self.retries)


class Deleter:
    """The synchronous core; thread-safe (one per process or task is enough)."""

    def __init__(self, client: Any, *, request_seconds: int = 10, skew_seconds: float = 1.0,
                 sleep: Callable[[float], None] = time.sleep, rng: random.Random | None = None,
                 wall: Callable[[], float] = time.time) -> None:
        if client_attempts(client) != 1:
            # A retry the client sent by itself would skip the recheck before every request.
            raise ValueError("the deleter needs an S3 client that does not retry by itself "
                             "(core.clients.s3_client(..., retries=False))")
        if int(request_seconds) != request_seconds or request_seconds < 1:
            raise ValueError(f"request_seconds must be a whole number >= 1 "
                             f"(got {request_seconds!r})")
        self.client = client
        self.request_seconds = int(request_seconds)
        self.skew_seconds = float(skew_seconds)
        self._sleep, self._wall = sleep, wall
        self._rng = rng or random.Random()
        self._versioning: dict[str, str] = {}
        self._lock = threading.Lock()
        _install_signer(client)

    @classmethod
    def for_settings(cls, settings: Any, client: Any = None, max_pool: int = 32) -> Deleter:
        from core.clients import s3_client

        return cls(client if client is not None else
                   s3_client(settings, max_pool=max_pool, retries=False),
                   request_seconds=settings.s3_request_seconds,
                   skew_seconds=settings.clock_skew_seconds)

    @property
    def settle_seconds(self) -> float:
        """How long after a recheck started a request it justified may still land (1)."""
        return self.request_seconds + self.skew_seconds

    # -- deletes --

    def batches(self, plan: Plan, addresses: Iterable[str]
                ) -> tuple[dict[str, str], list[tuple[str, dict[str, str]]]]:
        """(refused address -> why, [(bucket, {key: address})] of at most ``batch_keys``)."""
        refused: dict[str, str] = {}
        by_bucket: dict[str, dict[str, str]] = defaultdict(dict)
        for address in dict.fromkeys(addresses):
            problem = guard_problem(plan.namespace, address, plan.area)
            if problem is not None:
                refused[address] = problem
                continue
            bucket, key = split_s3_uri(address)
            by_bucket[bucket][key] = address
        out = []
        for bucket, keys in by_bucket.items():
            items = list(keys.items())
            for i in range(0, len(items), plan.batch_keys):
                out.append((bucket, dict(items[i:i + plan.batch_keys])))
        return refused, out

    def delete(self, plan: Plan, addresses: Iterable[str]) -> Report:
        refused, batches = self.batches(plan, addresses)
        report = Report(refused=refused)
        for bucket, keys in batches:
            report += self.delete_batch(plan, bucket, keys)
        return report

    def delete_batch(self, plan: Plan, bucket: str, keys: Mapping[str, str]) -> Report:
        """One batch (bucket key -> address, already guarded, at most 1,000)."""
        if len(keys) > S3_MAX_KEYS:
            raise ValueError(f"{len(keys)} keys in one delete request (at most {S3_MAX_KEYS})")
        acc = _Acc()
        pending = list(keys)
        last: dict[str, str] = {}  # key -> "Code: text" of its last failure
        attempt = 0
        while pending:
            anchor = self._wall()  # the requests of this attempt are void request_seconds on
            if plan.recheck is not None:
                try:
                    keep = plan.recheck([keys[k] for k in pending])
                except Exception as exc:  # the guards could not be read: nothing is sent
                    keep = {keys[k]: f"recheck failed: {type(exc).__name__}: {exc}"
                            for k in pending}
                acc.kept.update({keys[k]: keep[keys[k]] for k in pending if keys[k] in keep})
                pending = [k for k in pending if keys[k] not in keep]
                if not pending:
                    break
            versioned = self._status(bucket) != ""
            wanted: dict[str, list[str]] = {}
            partial: set[str] = set()
            if versioned:
                pending, wanted = self._listed_versions(plan, bucket, pending, keys, acc,
                                                        partial)
                if not pending:
                    break
            retry, give_up = self._send(bucket, pending, keys, wanted, partial, anchor, acc,
                                        last)
            attempt += 1
            pending = retry
            if not pending:
                break
            if give_up or attempt >= plan.retry.attempts:
                acc.failed.update({keys[k]: last[k] for k in pending})
                break
            acc.retries += 1
            self._sleep(plan.retry.backoff(attempt, self._rng))
        return acc.report()

    def _send(self, bucket: str, pending: list[str], keys: Mapping[str, str],
              wanted: Mapping[str, list[str]], partial: set[str], anchor: float,
              acc: _Acc, last: dict[str, str]) -> tuple[list[str], bool]:
        """Send the request(s) of one attempt; (keys to retry, whether to give up)."""
        # One key's versions stay in one request (its confirmation is judged per request).
        chunks: list[list[tuple[str, str | None]]] = [[]]
        for k in pending:
            entries = [(k, v) for v in wanted[k]] if k in wanted else [(k, None)]
            if chunks[-1] and len(chunks[-1]) + len(entries) > S3_MAX_KEYS:
                chunks.append([])
            chunks[-1].extend(entries)
        retry: set[str] = set()
        give_up = False
        for chunk in chunks:
            asked = {k for k, _ in chunk}
            window = signature_window(self.request_seconds, anchor, self._wall())
            if window is None:  # (the listing took the time): not sent, judged again
                last.update(dict.fromkeys(asked, f"{EXPIRED}: no time left to send it"))
                retry |= asked
                continue
            acc.requests += 1
            objects = [{"Key": k} if v is None else {"Key": k, "VersionId": v} for k, v in chunk]
            try:
                resp = self._call(window, self.client.delete_objects, Bucket=bucket,
                                  Delete={"Objects": objects, "Quiet": False})
            except Exception as exc:  # the whole request failed
                code, text = _request_error(exc)
                last.update(dict.fromkeys(asked, text))
                retry |= asked
                give_up = give_up or (code not in RETRIED and _is_client_error(exc))
                continue
            marker = self._judge_response(resp, chunk, wanted, partial, keys, acc, last,
                                          retry)
            if marker:
                with self._lock:
                    self._versioning.pop(bucket, None)  # read the status again
        return [k for k in pending if k in retry], give_up

    def _judge_response(self, resp: Mapping[str, Any], chunk: list[tuple[str, str | None]],
                        wanted: Mapping[str, list[str]], partial: set[str],
                        keys: Mapping[str, str], acc: _Acc, last: dict[str, str],
                        retry: set[str]) -> bool:
        """Confirm the keys of one answered request; whether a delete marker was written."""
        asked: dict[str, set[str | None]] = defaultdict(set)
        for k, v in chunk:
            asked[k].add(v)
        gone: dict[str, set[str | None]] = defaultdict(set)
        marker_written: set[str] = set()
        for d in resp.get("Deleted", ()) or ():
            k, v = d.get("Key"), d.get("VersionId")
            if k not in asked:
                continue
            if v is not None and v in asked[k]:
                gone[k].add(v)  # that version (or that marker) is gone for good
            elif d.get("DeleteMarker"):
                marker_written.add(k)  # a marker was written: the bytes are still there
            elif None in asked[k]:
                gone[k].add(None)
        errors: dict[str, tuple[str, str]] = {}
        for e in resp.get("Errors", ()) or ():
            k = e.get("Key", "")
            if k in asked:
                code, msg = str(e.get("Code", "Error")), str(e.get("Message", ""))
                errors[k] = (_normal_code(code, msg), msg)
        for k, vs in asked.items():
            if k in marker_written:
                last[k] = (f"{DELETE_MARKER}: the bucket keeps versions; the store wrote a "
                           "delete marker and kept the bytes")
                retry.add(k)
            elif k in errors:
                code, msg = errors[k]
                last[k] = f"{code}: {msg}"
                if code in RETRIED:
                    retry.add(k)
                else:
                    acc.failed[keys[k]] = last[k]
            elif gone[k] >= vs and k in partial:
                last[k] = f"{NO_ANSWER}: more versions than one request holds; the rest next"
                retry.add(k)
            elif gone[k] >= vs:
                acc.deleted.append(keys[k])
                if k in wanted:
                    acc.versions[keys[k]] = tuple(wanted[k])
            else:  # not mentioned, or not every version: not confirmed; ask again
                last[k] = f"{NO_ANSWER}: no answer from the store"
                retry.add(k)
        return bool(marker_written)

    def _listed_versions(self, plan: Plan, bucket: str, pending: list[str],
                         keys: Mapping[str, str], acc: _Acc, partial: set[str]
                         ) -> tuple[list[str], dict[str, list[str]]]:
        """Right before the request: each key's versions; keys kept or already gone leave.
        ``partial`` gets the keys with more versions than one request holds."""
        still: list[str] = []
        wanted: dict[str, list[str]] = {}
        for k in pending:
            data, markers = self._key_versions(bucket, k)
            ids, keep = versions_to_delete(data, markers, plan.area)
            if keep is not None:
                acc.kept[keys[k]] = keep
            elif not ids:
                acc.deleted.append(keys[k])  # nothing of it is there (the listing says so)
                acc.versions[keys[k]] = ()
            else:
                still.append(k)
                # More than one request holds: the rest goes at the next attempt (listed again).
                wanted[k] = ids[:S3_MAX_KEYS]
                if len(ids) > S3_MAX_KEYS:
                    partial.add(k)
        return still, wanted

    def _key_versions(self, bucket: str, key: str) -> tuple[list[str], list[str]]:
        """(data version ids, delete marker ids) of exactly ``key``."""
        data: list[str] = []
        markers: list[str] = []
        kwargs: dict[str, Any] = {"Bucket": bucket, "Prefix": key}
        while True:
            page = self.client.list_object_versions(**kwargs)
            beyond = False
            for name, out in (("Versions", data), ("DeleteMarkers", markers)):
                for v in page.get(name, ()) or ():
                    if v.get("Key") == key:
                        out.append(str(v.get("VersionId") or "null"))
                    else:
                        beyond = True  # (key sorts first among the keys it prefixes)
            if beyond or not page.get("IsTruncated"):
                return data, markers
            kwargs["KeyMarker"] = page.get("NextKeyMarker")
            if page.get("NextVersionIdMarker"):
                kwargs["VersionIdMarker"] = page["NextVersionIdMarker"]

    def _status(self, bucket: str) -> str:
        """The bucket's versioning status ('' : never enabled), cached."""
        with self._lock:
            if bucket in self._versioning:
                return self._versioning[bucket]
        reader = getattr(self.client, "get_bucket_versioning", None)
        if reader is None:
            status = ""  # a unit test's double of an unversioned store
        else:
            try:
                status = str(reader(Bucket=bucket).get("Status") or "")
            except Exception:  # unreadable: the versioned way is right on any bucket
                status = _VERSIONED_UNKNOWN
        with self._lock:
            self._versioning[bucket] = status
        return status

    def _call(self, bound: tuple[int, int], send: Callable[..., Any], **kwargs: Any) -> Any:
        _SIGNING.bound = bound
        try:
            return send(**kwargs)
        finally:
            _SIGNING.bound = None

    # -- copies --

    def copy(self, plan: Plan, orders: Iterable[Copy]) -> Report:
        report = Report()
        for order in orders:
            report += self.copy_one(plan, order)
        return report

    def copy_one(self, plan: Plan, order: Copy) -> Report:
        """One ``copy_object``: ``copied``, ``absent`` (no source), ``failed`` or ``refused``
        (keyed by the source). One attempt: a failed copy is reported, its caller deletes
        nothing of it."""
        problem = copy_problem(plan.namespace, order)
        if problem is not None:
            return Report(refused={order.source: problem})
        now = self._wall()
        window = signature_window(self.request_seconds, now, now)
        assert window is not None  # (request_seconds >= 1)
        bucket, key = split_s3_uri(order.source)
        tbucket, tkey = split_s3_uri(order.target)
        args: dict[str, Any] = {"Bucket": tbucket, "Key": tkey,
                                "CopySource": {"Bucket": bucket, "Key": key}}
        if order.metadata is None:
            args["MetadataDirective"] = "COPY"
        else:
            args.update(MetadataDirective="REPLACE", Metadata=dict(order.metadata))
        try:
            self._call(window, self.client.copy_object, **args)
        except Exception as exc:
            code, text = _request_error(exc)
            if code in _MISSING:
                return Report(absent=(order.source,), requests=1)
            return Report(failed={order.source: text}, requests=1)
        return Report(copied=(order.source,), requests=1)


class AsyncDeleter:
    """The core's batches in threads, at most ``concurrency`` requests in flight."""

    def __init__(self, deleter: Deleter, concurrency: int = 8) -> None:
        self.deleter = deleter
        self._sem = asyncio.Semaphore(concurrency)

    @property
    def settle_seconds(self) -> float:
        return self.deleter.settle_seconds

    async def delete(self, plan: Plan, addresses: Iterable[str]) -> Report:
        refused, batches = self.deleter.batches(plan, addresses)
        report = Report(refused=refused)
        for part in await asyncio.gather(*(self._batch(plan, b, k) for b, k in batches)):
            report += part
        return report

    async def _batch(self, plan: Plan, bucket: str, keys: dict[str, str]) -> Report:
        async with self._sem:
            return await asyncio.to_thread(self.deleter.delete_batch, plan, bucket, keys)

    async def copy(self, plan: Plan, orders: Iterable[Copy]) -> Report:
        async def one(order: Copy) -> Report:
            async with self._sem:
                return await asyncio.to_thread(self.deleter.copy_one, plan, order)

        report = Report()
        for part in await asyncio.gather(*(one(o) for o in orders)):
            report += part
        return report


# --- errors ---------------------------------------------------------------------------------------

def _normal_code(code: str, message: str) -> str:
    if code == "AccessDenied" and "expired" in message.lower():
        return EXPIRED  # our own signature's expiry: the store refused a late request
    return code


def _is_client_error(exc: BaseException) -> bool:
    from botocore.exceptions import ClientError

    return isinstance(exc, ClientError)


def _request_error(exc: BaseException) -> tuple[str, str]:
    from botocore.exceptions import ClientError

    if isinstance(exc, ClientError):
        err = exc.response.get("Error", {})
        code = _normal_code(str(err.get("Code", "ClientError")), str(err.get("Message", "")))
        return code, f"{code}: {exc}"
    return type(exc).__name__, f"{type(exc).__name__}: request: {exc}"


# --- no retries below us --------------------------------------------------------------------------

def client_attempts(s3: Any) -> int:
    """How many attempts botocore makes per request with this client (1: it never retries)."""
    config = getattr(getattr(s3, "meta", None), "config", None)
    if config is None:
        return 1  # not a botocore client: no botocore retries
    retries = getattr(config, "retries", None) or {}
    if "total_max_attempts" in retries:
        return int(retries["total_max_attempts"])
    if "max_attempts" in retries:
        return int(retries["max_attempts"]) + 1
    return 3  # botocore's legacy default: retries
