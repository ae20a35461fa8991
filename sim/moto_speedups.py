"""The embedded S3 server: moto's standalone server with three of its costs removed.

moto spends its time, per request, on things that do not change what it answers:
- it finds the service for a request by listing its own package directory (~180 ``stat``
  calls, under a global lock) and then trying ~600 URL patterns;
- ``ListObjectsV2`` copies the bucket's whole key table, looks up every key and sorts the
  lot, for every page: a full listing of N keys costs O(N^2 / page). The soak's broker keeps
  its log in a bucket that every fetch lists, so the broker slowed as its log grew;
- its response serializer parses and re-formats every listed key's timestamp, for every
  page, though the broker lists the same batch objects at every fetch.

This module keeps moto's answers and removes those costs: the directory listing and the
host-to-service lookup are computed once; ``list_objects_v2`` walks a sorted index of the
bucket's key names from where the page starts, up to one key past the page; and each
object's ``<Contents>`` element, rendered by moto's serializer, is reused while the object's
fields are the same. Everything else (objects, versions, markers, tokens, errors) is moto's
own code. The equivalence with moto is a test
(``tests/integration/sim/test_moto_speedups.py``: the same pages and the same response bytes
as an unpatched server).

Run as ``python -m sim.moto_speedups -H 127.0.0.1 -p PORT`` (moto_server's arguments).
"""

from __future__ import annotations

import functools
import sys
import threading
from typing import Any

from sortedcontainers import SortedList  # type: ignore[import-untyped]

_INSTALLED = False


class _KeyIndex:
    """The sorted names of one key store, kept in step with it by the patched mutators."""

    def __init__(self, names: Any) -> None:
        self.lock = threading.Lock()
        self.names: SortedList = SortedList(names)


def _index_of(store: Any) -> _KeyIndex:
    index: _KeyIndex | None = store.__dict__.get("_hd_index")
    # A store changed through a path the patches do not see shows as a different size:
    # rebuild then (O(N log N) once), rather than list from a stale index.
    if index is None or len(index.names) != dict.__len__(store):
        index = _KeyIndex(dict.keys(store))
        store.__dict__["_hd_index"] = index
    return index


def _patch_key_store() -> None:
    from moto.s3.utils import _VersionedKeyStore as Store

    def added(store: Any, key: str) -> None:
        index = store.__dict__.get("_hd_index")
        if index is not None:
            with index.lock:
                if key not in index.names:
                    index.names.add(key)

    def removed(store: Any, key: str) -> None:
        index = store.__dict__.get("_hd_index")
        if index is not None:
            with index.lock:
                index.names.discard(key)

    def adding(method: Any) -> Any:
        def wrapped(self: Any, key: str, value: Any) -> Any:
            new = not dict.__contains__(self, key)
            out = method(self, key, value)
            if new:
                added(self, key)
            return out
        return wrapped

    def removing(method: Any) -> Any:
        def wrapped(self: Any, key: str) -> Any:
            out = method(self, key)
            removed(self, key)
            return out
        return wrapped

    def clear(self: Any) -> None:
        dict.clear(self)
        self.__dict__.pop("_hd_index", None)

    patches = {"__setitem__": adding(Store.__setitem__), "setlist": adding(Store.setlist),
               "pop": removing(Store.pop), "__delitem__": removing(dict.__delitem__),
               "clear": clear}
    for name, method in patches.items():
        setattr(Store, name, method)


def _patch_listing() -> None:
    from moto.s3.models import FakeDeleteMarker, S3Backend

    original = S3Backend.list_objects_v2

    def list_objects_v2(self: Any, bucket: Any, prefix: str | None, delimiter: str | None,
                        continuation_token: str | None, start_after: str | None,
                        max_keys: int) -> Any:
        limit: str | None = None
        if continuation_token:
            limit = self._pagination_tokens.get(continuation_token)
            if limit is None:
                # moto's own handling of an unknown token (an error): keep it.
                return original(self, bucket, prefix, delimiter, continuation_token,
                                start_after, max_keys)
        elif start_after:
            limit = start_after
        if type(bucket).__name__ == "FakeTableStorageBucket":
            return original(self, bucket, prefix, delimiter, continuation_token,
                            start_after, max_keys)
        prefix = prefix or ""
        store = bucket.keys
        index = _index_of(store)
        page: list[Any] = []
        last_folder: str | None = None
        start = limit if limit is not None and limit > prefix else prefix
        with index.lock:
            # All names that start with the prefix sort together, from the prefix on;
            # moto's results are sorted, so the page is the first max_keys + 1 of them
            # past the token (one more tells whether the listing is truncated).
            for name in index.names.irange(minimum=start):
                if not name.startswith(prefix):
                    break
                if limit is not None and name <= limit:
                    continue
                if delimiter:
                    rest = name[len(prefix):]
                    if delimiter in rest:
                        # As moto does: a folder is listed even if its keys are delete markers.
                        folder = prefix + rest.split(delimiter)[0] + delimiter
                        if folder == last_folder or (limit is not None and folder <= limit):
                            continue
                        last_folder = folder
                        page.append(folder)
                        if len(page) > max_keys:
                            break
                        continue
                versions = dict.get(store, name)
                if not versions or isinstance(versions[-1], FakeDeleteMarker):
                    continue
                page.append(versions[-1])
                if len(page) > max_keys:
                    break
        return self._truncate_result(page, max_keys)

    setattr(S3Backend, "list_objects_v2", list_objects_v2)  # noqa: B010 (mypy: a method)


_FRAGMENTS_MAX = 500_000  # ~250 MB at most: more than the soak's largest namespace lists


def _text(body: str | bytes) -> str:
    return body.decode() if isinstance(body, bytes) else body


def _patch_list_response() -> None:
    """Render each listed object's ``<Contents>`` element once, through moto's own serializer,
    and reuse it: the serializer parses and re-formats every key's timestamp on every page,
    and the broker lists the same batch objects at every fetch."""
    from collections import OrderedDict

    from moto import settings
    from moto.core.responses import ActionResult
    from moto.s3.responses import S3Response

    original = S3Response.serialized
    fragments: OrderedDict[str, str] = OrderedDict()
    lock = threading.Lock()

    def cache_key(item: dict[str, Any]) -> str:
        # The item's fields and values, lists and the owner included; moto builds every
        # item with its fields in the same order.
        return repr(item)

    def render(self: Any, items: list[dict[str, Any]]) -> str:
        keys = [cache_key(i) for i in items]
        with lock:
            found = [fragments.get(k) for k in keys]
            for k, f in zip(keys, found, strict=True):
                if f is not None:
                    fragments.move_to_end(k)
        missing = [n for n, f in enumerate(found) if f is None]
        if missing:
            # One serializer call for all the objects not seen before.
            _, _, body = original(self, ActionResult(
                {"IsTruncated": False, "Contents": [items[n] for n in missing]}))
            text = _text(body)
            start, end = text.index("<Contents>"), text.rindex("</Contents>")
            # A key's text is escaped, so "</Contents>" only ever closes an element.
            parts = [p + "</Contents>" for p in text[start:end].split("</Contents>")]
            if len(parts) != len(missing):
                raise RuntimeError("listing render: elements and objects differ in number")
            with lock:
                for n, part in zip(missing, parts, strict=True):
                    found[n] = fragments[keys[n]] = part
                while len(fragments) > _FRAGMENTS_MAX:
                    fragments.popitem(last=False)
        return "".join(f for f in found if f is not None)

    def serialized(self: Any, action_result: Any) -> Any:
        result = action_result.result
        if (settings.PRETTIFY_RESPONSES or self.data.get("Action") != "ListObjectsV2"
                or not isinstance(result, dict) or not result.get("Contents")):
            return original(self, action_result)
        # The page without its objects, then the objects where moto puts them: right after
        # IsTruncated (the order of the ListObjectsV2 output shape).
        status, headers, body = original(self, ActionResult({**result, "Contents": []}))
        text = _text(body)
        cut = text.index("</IsTruncated>") + len("</IsTruncated>")
        text = text[:cut] + render(self, result["Contents"]) + text[cut:]
        return status, headers, text.encode() if isinstance(body, bytes) else text

    setattr(S3Response, "serialized", serialized)  # noqa: B010


def _patch_response_costs() -> None:
    from moto.core.responses import BaseResponse
    from moto.s3 import models

    # Per key, the listing formats the object's datetime; the same objects are listed again
    # and again (a pure function of the datetime, so a cache answers the same).
    name = "iso_8601_datetime_without_milliseconds_s3"
    setattr(models, name, functools.lru_cache(maxsize=_FRAGMENTS_MAX)(getattr(models, name)))

    # Each response body is searched for a <RequestId> to fill in, by a regular expression
    # that costs O(body) even when there is none (a listing page is ~300 kB).
    enrich = BaseResponse._enrich_response

    def _enrich_response(headers: dict[str, str], body: Any) -> tuple[dict[str, str], Any]:
        if isinstance(body, str) and "<RequestId>" not in body:
            headers, _ = enrich(headers, "")  # the same headers; the body has nothing to fill
            return headers, body
        out: tuple[dict[str, str], Any] = enrich(headers, body)  # (Any without moto installed)
        return out

    setattr(BaseResponse, "_enrich_response", staticmethod(_enrich_response))  # noqa: B010


def _patch_dispatch() -> None:
    from moto import backends
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication

    modules = tuple(backends.list_of_moto_modules())
    backends.list_of_moto_modules = lambda: modules  # type: ignore[assignment]
    lookup = DomainDispatcherApplication.get_backend_for_host

    @functools.lru_cache(maxsize=1024)
    def cached(self: Any, host: str | None) -> Any:
        return lookup(self, host)

    setattr(DomainDispatcherApplication, "get_backend_for_host", cached)  # noqa: B010


def install() -> None:
    """Patch moto in this process (idempotent)."""
    global _INSTALLED
    if _INSTALLED:
        return
    _patch_key_store()
    _patch_listing()
    _patch_list_response()
    _patch_response_costs()
    _patch_dispatch()
    _INSTALLED = True


def main(argv: list[str] | None = None) -> None:
    install()
    from moto.server import main as moto_main

    moto_main(argv if argv is not None else sys.argv[1:])


if __name__ == "__main__":
    main()
