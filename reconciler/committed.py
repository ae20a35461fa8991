"""The committed live set: retention and expiration, then the retained commits' manifests.

1. :func:`plan_retention` (pure): from the tracker's commit graph, branches, tags and retention
   policy, the commits to retain (``reconciler.retention.retained_commits``: per-branch
   retention on first-parent ancestry, dangling commits by the repository default, optional
   snapshot expiration first) and the distinct manifests they use. A retained commit whose
   record or manifest is unknown is an error: its data cannot be protected, so the run fails.
2. :func:`manifest_keys_df`: the manifests are read in parallel inside Spark tasks (boto3 +
   pyarrow; column ``address``, full ``s3://`` URI or namespace-relative) into a DataFrame of
   namespace-relative keys in canonical form (``schemas.address.address_forms``: ``s3a://``,
   ``S3://``, percent escapes and relative rows are accepted; every form an ambiguous row may
   name is kept). A missing or unreadable manifest, or a row outside the namespace, fails the
   Spark job, and so the run.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from core.clients import split_s3_uri
from core.settings import Settings
from reconciler.errors import ReconcileError
from reconciler.evidence import manifest_key_batches, read_bytes
from reconciler.mark import KEYS_SCHEMA, is_plain_key
from reconciler.retention import (
    SECONDS_PER_DAY,
    ExpirationMode,
    ExpiredRef,
    expire_snapshots,
    refs_to_delete,
    retained_commits,
)
from reconciler.s3io import Namespace, cached_s3, read_parquet_rows
from reconciler.sparkio import distributed
from reconciler.state import CommittedState


@dataclass
class RetentionPlan:
    retained: frozenset[str]
    manifests: list[tuple[str, str]]  # (bucket, key), distinct
    commits: int
    expired_refs: list[tuple[str, str]] = field(default_factory=list)
    expired_commits: int = 0
    # --delete-expired-refs: the refs listed for the service to delete (None: not asked)
    refs_to_delete: list[ExpiredRef] | None = None

    def as_dict(self) -> dict[str, Any]:
        out = {"commits": self.commits, "retained": len(self.retained),
               "manifests": len(self.manifests), "expired_commits": self.expired_commits,
               "refs_pointing_to_expired": [f"{k}:{n}" for k, n in self.expired_refs]}
        if self.refs_to_delete is not None:
            out["refs_to_delete"] = [f"{r.kind}:{r.name}" for r in self.refs_to_delete]
        return out


def manifest_location(ns: Namespace, manifest: str) -> tuple[str, str]:
    """A manifest reference (``s3://`` URI or namespace-relative key) -> (bucket, key)."""
    if manifest.startswith("s3://"):
        return split_s3_uri(manifest)
    if "://" in manifest or manifest.startswith("/"):
        raise ReconcileError(f"manifest {manifest!r} is not an s3:// URI or a relative key")
    return ns.bucket, ns.key(manifest)


def plan_retention(state: CommittedState, now_s: float, *,
                   expire_older_than_days: float | None = None,
                   mode: ExpirationMode = "seed",
                   delete_expired_refs: bool = False) -> RetentionPlan:
    """Which commits are retained and which manifests to read (pure, no I/O).

    Every branch and tag of the mirror retains, expired or not (issue 33): with
    ``delete_expired_refs`` the refs that point at expired snapshots are only listed for the
    service to delete (``refs_to_delete``; never the default branch).
    """
    graph = state.commits
    days = (expire_older_than_days if expire_older_than_days is not None
            else state.expire_older_than_days)
    if days is not None and not days > 0:  # 0 (or NaN) counts every head as expired
        raise ReconcileError(f"expire_older_than_days must be > 0, got {days!r}: 0 would "
                             "count every branch and tag head as expired")
    expire_at = None if days is None else now_s - days * SECONDS_PER_DAY
    to_delete: list[ExpiredRef] | None = None
    try:
        retained = retained_commits(graph, state.branch_heads, state.tags, state.policy, now_s,
                                    expire_older_than=expire_at, mode=mode)
        expired_refs: list[tuple[str, str]] = []
        expired = 0
        if expire_at is not None:
            result = expire_snapshots(graph, state.branch_heads, state.tags, expire_at,
                                      mode=mode)
            expired_refs = [(k, n) for k, n in result.refs_pointing_to_expired]
            expired = len(result.expired)
            if delete_expired_refs:
                to_delete = list(refs_to_delete(state.branch_heads, state.tags, result,
                                                default_branch=state.default_branch))
    except ValueError as exc:  # a corrupt graph (first-parent cycle, ...)
        raise ReconcileError(f"commit graph: {exc}") from None
    manifests: dict[tuple[str, str], None] = {}
    for cid in sorted(retained):
        rec = state.commits.get(cid)
        if rec is None:
            raise ReconcileError(
                f"retained commit {cid!r} is unknown to the tracker: its data cannot be "
                "protected (missing commit event?)")
        if not rec.manifest:
            raise ReconcileError(f"retained commit {cid!r} has no manifest")
        manifests[manifest_location(state.namespace, rec.manifest)] = None
    return RetentionPlan(retained, list(manifests), len(state.commits), expired_refs, expired,
                         to_delete)


def manifest_keys_df(spark: Any, settings: Settings, ns: Namespace,
                     manifests: list[tuple[str, str]]) -> Any:
    """Namespace-relative keys of every address in the manifests (duplicates possible), and
    the keys of the manifests themselves that lie in the namespace (a retained commit needs
    its manifest). Each manifest is read by the one strict reader
    (``reconciler.evidence.manifest_key_batches``): a manifest that is missing, of another type,
    truncated, or holds a row outside the namespace fails the Spark job, and so the run."""

    def produce(item: dict[str, Any]) -> Iterator[tuple[str]]:
        where = f"manifest s3://{item['bucket']}/{item['key']}"
        data = read_bytes(cached_s3(settings), f"s3://{item['bucket']}/{item['key']}")
        for keys in manifest_key_batches(data, ns.uri, where):
            yield from zip(keys)

    # (under a reserved prefix, where services usually keep them, they are never candidates)
    own = [(rel,) for bucket, key in manifests
           if bucket == ns.bucket and (rel := ns.rel_of_key(key)) and is_plain_key(rel)]
    keys = distributed(spark, manifests, "bucket string, key string", produce, KEYS_SCHEMA)
    return keys.unionByName(spark.createDataFrame(own, KEYS_SCHEMA)) if own else keys


def export_df(spark: Any, settings: Settings, bucket: str, parts: list[str]) -> Any:
    """The tracker export (key, live, kind, reason, commit) from its Parquet chunks."""
    from reconciler.mark import EXPORT_SCHEMA
    from reconciler.state import EXPORT_COLUMNS

    def produce(item: dict[str, Any]) -> Iterator[tuple[Any, ...]]:
        # ``digest`` is optional: exports of format-1 runs (an optimized run's baseline) lack it
        yield from read_parquet_rows(cached_s3(settings), bucket, item["key"],
                                     EXPORT_COLUMNS[:-1], optional=EXPORT_COLUMNS[-1:])

    return distributed(spark, [(k,) for k in parts], "key string", produce, EXPORT_SCHEMA)
