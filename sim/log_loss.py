"""The broker's log lost (its disk gone, the broker formatted anew on the same port), and the
few events of one repository the tests of a lost log publish around it."""

from __future__ import annotations

from schemas import events as ev
from sim.stack import KafkaServer


def repo_events(ns: str, repo: str = "repo0") -> list[ev.Event]:
    return [ev.RepositoryCreated(repository=repo, storage_namespace=ns, default_branch="main",
                                 default_retention_days=1.0),
            ev.BranchCreated(repository=repo, branch="main", staging_token="t1", ref_version=1)]


def write(repo: str, address: str, ref: str, token: str = "t1") -> ev.ObjectWritten:
    return ev.ObjectWritten(repository=repo, branch="main", staging_token=token, path=ref,
                            address=address, size=1, ref_id=ref)


def delete(repo: str, address: str, ref: str, token: str = "t1") -> ev.ObjectDeleted:
    return ev.ObjectDeleted(repository=repo, branch="main", staging_token=token, path=ref,
                            address=address, ref_id=ref)


def _lose_log(server: KafkaServer) -> None:
    """The broker's disk is lost: killed, its data gone, formatted anew, same port."""
    server.kill()
    server.lose_log()
    server.start(move_on_clash=False)
