"""The namespace listing through obstore (Rust ``object_store``), with boto3's settings.

obstore lists about 4x faster than boto3 here (no Python per request, no GIL while it waits),
but ``object_store`` is not a byte-for-byte S3 client: its ``Path`` strips a key's trailing
``/`` (``dir/`` lists as ``dir``) and refuses keys with empty segments, ``.``/``..`` or
control characters. A listed key that is not the stored key would be judged with another
object's age and deleted by a name nobody listed, so the listing here is exact by
construction:

* one **delimited** listing per directory (``list_with_delimiter``): every object it returns
  lies directly under the directory, so its stored key has no ``/`` after the directory and
  nothing was stripped, except the directory's own marker (stored key == the directory),
  which comes back as the directory without its ``/`` and is given back its ``/``; a path
  of any other shape fails the listing;
* sub-directories (common prefixes) are listed the same way, one by one;
* a directory obstore cannot list exactly (a key ``object_store`` refuses, a prefix outside
  :data:`_PLAIN_PREFIX`, which it might encode) is listed by boto3 instead, delimited and
  paginated: slower, as exact;
* any other error raises: the task, and so the run, fails (never a smaller listing).

The store is built from the boto3 client's resolved endpoint and region (the settings'
endpoint, or boto3's own for AWS), with the settings' credentials, path-style addressing and
5 attempts per request, as :func:`core.clients.s3_client`.
"""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Iterator
from typing import Any

from core.settings import Settings

_STORES: dict[tuple[Settings, str], Any] = {}
# Prefixes handed to obstore as they are (object_store percent-encodes some characters of a
# prefix it is given; a prefix it rewrote would list another, probably empty, directory).
_PLAIN_PREFIX = re.compile(r"([A-Za-z0-9._=-]+/)*")

Row = tuple[str, int, int]  # (bucket key, size, last_modified ms)


class ListingError(RuntimeError):
    """obstore returned a path that is not a key directly under the directory listed."""


def store_for(settings: Settings, bucket: str, s3: Any) -> Any:
    """One ``S3Store`` per settings and bucket per process (Spark reuses its workers), on the
    endpoint and region the boto3 client ``s3`` resolved."""
    store = _STORES.get((settings, bucket))
    if store is None:
        from obstore.store import S3Store

        endpoint = str(s3.meta.endpoint_url)
        store = _STORES[(settings, bucket)] = S3Store(
            bucket, endpoint=endpoint, region=str(s3.meta.region_name or settings.s3_region),
            access_key_id=settings.s3_access_key, secret_access_key=settings.s3_secret_key,
            virtual_hosted_style_request=False,
            client_options={"allow_http": endpoint.startswith("http://")},
            # as boto3's listing client: 5 attempts (5xx, dropped connections), then fail
            retry_config={"max_retries": 4, "retry_timeout": dt.timedelta(seconds=60)})
    return store


def _ms(value: dt.datetime) -> int:
    return int(value.timestamp() * 1000)


def directory(store: Any, prefix: str) -> tuple[list[Row], list[str]]:
    """(objects directly under ``prefix``, its sub-directories), by obstore; keys exactly as
    stored (see the module docstring). ``prefix``: '' or ending with '/'. Raises
    ``obstore.exceptions.InvalidPathError`` for a key object_store refuses."""
    import obstore

    res = obstore.list_with_delimiter(store, prefix or None)
    rows: list[Row] = []
    for meta in res["objects"]:
        path = str(meta["path"])
        name = path[len(prefix):] if path.startswith(prefix) else None
        if prefix and path == prefix[:-1]:
            key = prefix  # the directory's own marker object
        elif name and "/" not in name:
            key = path
        else:
            raise ListingError(f"listing s3 prefix {prefix!r}: {path!r} is not a key under it")
        rows.append((key, int(meta["size"]), _ms(meta["last_modified"])))
    subs: list[str] = []
    for cp in res["common_prefixes"]:
        cp = str(cp)
        name = cp[len(prefix):] if cp.startswith(prefix) else None
        if not name or "/" in name:
            raise ListingError(f"listing s3 prefix {prefix!r}: {cp!r} is not a directory "
                               "under it")
        subs.append(cp + "/")
    return rows, subs


def directory_boto3(s3: Any, bucket: str, prefix: str) -> tuple[list[Row], list[str]]:
    """The same as :func:`directory` by boto3 (a delimited, paginated ``list_objects_v2``)."""
    rows: list[Row] = []
    subs: list[str] = []
    for page in s3.get_paginator("list_objects_v2").paginate(
            Bucket=bucket, Prefix=prefix, Delimiter="/", PaginationConfig={"PageSize": 1000}):
        for obj in page.get("Contents", ()):
            rows.append((obj["Key"], int(obj["Size"]), _ms(obj["LastModified"])))
        for cp in page.get("CommonPrefixes", ()):
            subs.append(cp["Prefix"])
    return rows, subs


def list_tree(settings: Settings, s3: Any, bucket: str, prefix: str, *,
              shallow: bool = False) -> Iterator[Row]:
    """Every object under ``prefix`` ('' or ending with '/'; ``shallow``: only those directly
    under it), directory by directory; each directory is listed whole before its rows are
    given, so a directory that fails gives none. Raises on any listing error."""
    from obstore.exceptions import InvalidPathError

    store = store_for(settings, bucket, s3)
    todo = [prefix]
    while todo:
        p = todo.pop()
        if _PLAIN_PREFIX.fullmatch(p):
            try:
                rows, subs = directory(store, p)
            except InvalidPathError:  # a key object_store cannot spell: boto3 can
                rows, subs = directory_boto3(s3, bucket, p)
        else:
            rows, subs = directory_boto3(s3, bucket, p)
        yield from rows
        if not shallow:
            todo.extend(reversed(subs))
