"""Seeded event workloads that follow the publisher contract (for tests and the benchmark).

:class:`ServiceSim` plays a lakeFS-like service: repositories, branches with one open staging
token each, issued uploads that get linked, overwrites in the same token (``replaces_ref_id``),
deletes, shallow copies, commits, resets, branch deletes and tags. It emits the events in the
order a (single) service would publish them. The mix is roughly: writes 45%, issues 15%,
deletes 15%, copies 8%, commits 2%, resets 1%, the rest branch and tag events.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from schemas import events as ev


@dataclass
class _Branch:
    token: str
    head: str | None
    staged: dict[str, tuple[str, str]] = field(default_factory=dict)  # path -> (ref, address)
    files: dict[str, str] = field(default_factory=dict)  # committed path -> address


class ServiceSim:
    def __init__(self, rng: random.Random, repo: str, bucket: str = "bucket",
                 ttl_seconds: float = 3600.0) -> None:
        self.rng = rng
        self.repo = repo
        self.namespace = f"s3://{bucket}/{repo}/"
        self.ttl = ttl_seconds
        self.n = 0
        self.branches: dict[str, _Branch] = {}
        self.pending: list[str] = []  # issued, not yet linked
        self.commits: list[str] = []
        self.tags: set[str] = set()
        self.versions: dict[str, int] = {}  # the KV's per-ref version ('b:x', 't:x')

    def _v(self, ref: str) -> int:
        v = self.versions[ref] = self.versions.get(ref, 0) + 1
        return v

    def _id(self, kind: str) -> str:
        self.n += 1
        return f"{kind}{self.n}"

    def _address(self) -> str:
        return f"{self.namespace}data/s{self.n // 1000:04d}/{self._id('o')}"

    def start(self) -> list[ev.Event]:
        out: list[ev.Event] = [ev.RepositoryCreated(
            repository=self.repo, storage_namespace=self.namespace, default_branch="main",
            default_retention_days=7.0, branch_retention_days={"main": 30.0},
            event_id=self._id("e"))]
        out += self._create_branch("main", None)
        return out

    def _create_branch(self, name: str, source: str | None) -> list[ev.Event]:
        tok = self._id("tok")
        self.branches[name] = _Branch(tok, source)
        return [ev.BranchCreated(repository=self.repo, branch=name, staging_token=tok,
                                 source_commit=source, event_id=self._id("e"),
                                 ref_version=self._v("b:" + name))]

    def _write(self, b: str, address: str, copy: bool = False) -> list[ev.Event]:
        br = self.branches[b]
        rng = self.rng
        if br.staged and rng.random() < 0.3:
            path = rng.choice(list(br.staged))
        else:
            path = f"p/{self._id('f')}"
        old = br.staged.get(path)
        ref = self._id("r")
        br.staged[path] = (ref, address)
        common = dict(repository=self.repo, branch=b, staging_token=br.token, path=path,
                      address=address, size=rng.randint(1, 1 << 20), ref_id=ref,
                      replaces_ref_id=old[0] if old else None,
                      replaces_address=old[1] if old else None, event_id=self._id("e"))
        if copy:
            return [ev.ObjectCopied(**common, source_read_at=1.0)]  # type: ignore[arg-type]
        return [ev.ObjectWritten(**common)]  # type: ignore[arg-type]

    def step(self) -> list[ev.Event]:
        """One service operation: its events, in publish order."""
        rng = self.rng
        b = rng.choice(list(self.branches))
        br = self.branches[b]
        x = rng.random()
        if x < 0.15:
            address = self._address()
            self.pending.append(address)
            return [ev.AddressIssued(repository=self.repo, address=address,
                                     ttl_seconds=self.ttl, event_id=self._id("e"))]
        if x < 0.60:
            if self.pending and rng.random() < 0.7:
                address = self.pending.pop(rng.randrange(len(self.pending)))
            else:
                address = self._address()
            return self._write(b, address)
        if x < 0.75:
            if not br.staged:
                return self._write(b, self._address())
            path = rng.choice(list(br.staged))
            ref, address = br.staged.pop(path)
            return [ev.ObjectDeleted(repository=self.repo, branch=b, staging_token=br.token,
                                     path=path, address=address, ref_id=ref,
                                     event_id=self._id("e"))]
        if x < 0.83:
            sources = [a for brx in self.branches.values()
                       for a in list(brx.files.values())[-20:]]
            sources += [a for _, a in list(br.staged.values())[-20:]]
            if not sources:
                return self._write(b, self._address())
            return self._write(b, rng.choice(sources), copy=True)
        if x < 0.85:
            return self._commit(b)
        if x < 0.86:
            old = br.token
            br.token = self._id("tok")
            br.staged.clear()
            return [ev.BranchReset(repository=self.repo, branch=b, dropped_tokens=[old],
                                   staging_token=br.token, head=br.head, event_id=self._id("e"),
                                   ref_version=self._v("b:" + b))]
        if x < 0.88 and len(self.branches) < 6:
            return self._create_branch(self._id("br"), br.head)
        if x < 0.89 and b != "main":
            del self.branches[b]
            return [ev.BranchDeleted(repository=self.repo, branch=b, dropped_tokens=[br.token],
                                     last_head=br.head, event_id=self._id("e"),
                                     ref_version=self._v("b:" + b))]
        if x < 0.90 and self.commits:
            tag = self._id("v")
            self.tags.add(tag)
            return [ev.TagCreated(repository=self.repo, tag=tag,
                                  commit_id=rng.choice(self.commits), event_id=self._id("e"),
                                  ref_version=self._v("t:" + tag))]
        if x < 0.91 and self.tags:
            tag = rng.choice(sorted(self.tags))
            self.tags.discard(tag)
            return [ev.TagDeleted(repository=self.repo, tag=tag, event_id=self._id("e"),
                                  ref_version=self._v("t:" + tag))]
        return self._write(b, self._address())

    def _commit(self, b: str) -> list[ev.Event]:
        br = self.branches[b]
        cid = self._id("c")
        sealed = br.token
        br.token = self._id("tok")
        for path, (_, address) in br.staged.items():
            br.files[path] = address
        br.staged.clear()
        parents = [br.head] if br.head else []
        br.head = cid
        self.commits.append(cid)
        return [ev.CommitCreated(repository=self.repo, branch=b, commit_id=cid, parents=parents,
                                 sealed_tokens=[sealed], staging_token=br.token,
                                 committed_at=float(self.n),
                                 manifest=f"{self.namespace}_hardelete/manifests/{cid}.parquet",
                                 event_id=self._id("e"), ref_version=self._v("b:" + b))]


def workload(seed: int, n_events: int, repos: int = 4, ttl_seconds: float = 3600.0
             ) -> list[ev.Event]:
    """About ``n_events`` events over ``repos`` repositories, interleaved as services would."""
    rng = random.Random(seed)
    sims = [ServiceSim(rng, f"repo{i}", ttl_seconds=ttl_seconds) for i in range(repos)]
    out: list[ev.Event] = []
    for s in sims:
        out += s.start()
    while len(out) < n_events:
        out += rng.choice(sims).step()
    return out
