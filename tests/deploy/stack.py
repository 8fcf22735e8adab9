"""docker-compose.yml's services as native processes on loopback, with their own commands and
configuration files. Everything that has to differ outside containers is substituted here, and
only this:

1. addresses: ``SERVICE:PORT`` (``vllm-sim:8000``, ``alertmanager:9093``) and wildcard listen
   addresses (``0.0.0.0:10877``; ``--host 0.0.0.0`` with ``--port 8000``) become 127.0.0.1 and a
   free port, in the commands and inside the mounted configuration files;
2. paths: a container path in a command or a mounted file (``/etc/prometheus/prometheus.yml``)
   becomes the host path the compose file mounts there (for a mounted file, its copy with the
   addresses substituted); a named volume becomes an empty temporary folder;
3. binaries: ``build: .`` runs ``python -m kvdiag`` (the image's ENTRYPOINT), ``prom/prometheus``
   Debian's ``prometheus``, ``prom/alertmanager`` Debian's ``prometheus-alertmanager``; the
   listen address those images default to (``0.0.0.0:PORT``) is given on loopback with
   ``--web.listen-address``;
4. what a test asks for explicitly: ``mounts`` (a bind mount's host path, e.g. rules rendered
   with short ``for:``) and ``flags`` (an option's value, e.g. ``--speed``; the option must be in
   the command already).

Grafana has no Debian binary here: its provisioning is checked as files (test_compose.py).
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import yaml

from tests.mixin.conftest import ROOT, need
from tests.mixin.prom import Process, free_port

COMPOSE = ROOT / "docker-compose.yml"
LOOPBACK = "127.0.0.1"
WILDCARD = "0.0.0.0"
#: image repository -> (Debian binary, the health path it answers 200 on once ready)
IMAGES = {"prom/prometheus": ("prometheus", "/-/ready"), "prom/alertmanager": ("prometheus-alertmanager", "/-/ready")}
KVDIAG_READY = "/metrics"  # both `simulate` and `serve` answer it once listening


@dataclass(frozen=True)
class Service:
    """One compose service, as the native run needs it."""

    name: str
    image: str | None  # None: built from the Dockerfile (kvdiag)
    command: tuple[str, ...]
    port: int  # the published container port ("PORT:PORT")
    binds: Mapping[str, Path]  # container path -> host path
    volumes: tuple[str, ...]  # container paths of named volumes
    depends_on: tuple[str, ...]

    @property
    def repository(self) -> str | None:
        return self.image.rsplit(":", 1)[0] if self.image else None


def load() -> dict:
    """docker-compose.yml as data (PyYAML's safe loader resolves the ``<<`` merge keys)."""
    return yaml.safe_load(COMPOSE.read_text())


def services(doc: dict | None = None) -> dict[str, Service]:
    doc = load() if doc is None else doc
    named = set(doc.get("volumes") or {})
    out = {}
    for name, spec in doc["services"].items():
        binds: dict[str, Path] = {}
        volumes = []
        for entry in spec.get("volumes", []):
            source, target = entry.split(":")[:2]
            if source in named:
                volumes.append(target)
            else:
                binds[target] = (ROOT / source).resolve()
        (published,) = spec["ports"]
        host_port, container_port = published.split(":")
        assert host_port == container_port, f"{name}: publish each port as PORT:PORT ({published})"
        out[name] = Service(
            name=name,
            image=spec.get("image") if "build" not in spec else None,
            command=tuple(spec.get("command", ())),
            port=int(container_port),
            binds=binds,
            volumes=tuple(volumes),
            depends_on=tuple(spec.get("depends_on", ())),
        )
    return out


def start_order(chosen: Mapping[str, Service]) -> list[str]:
    """Dependencies first (``depends_on`` among the chosen services), then compose file order."""
    order: list[str] = []

    def visit(name: str) -> None:
        if name not in order:
            for dep in chosen[name].depends_on:
                if dep in chosen:
                    visit(dep)
            order.append(name)

    for name in chosen:
        visit(name)
    return order


class Loopback:
    """The substitutions (module docstring) for a set of services, with a free port each."""

    def __init__(self, chosen: Mapping[str, Service], workdir: Path, given: Mapping[str, int] | None = None) -> None:
        """``given``: services already listening (a real engine in place of a simulated one), by
        name, on their loopback port; the others get a free port each and are run by ``process``."""
        self.services = dict(chosen)
        self.workdir = workdir
        given = given or {}
        assert set(given) <= set(chosen), f"given services that are not chosen: {sorted(set(given) - set(chosen))}"
        self.ports = {s.port: given.get(name) or free_port() for name, s in chosen.items()}
        assert len(self.ports) == len(chosen), "two services publish the same port"
        hosts = "|".join(re.escape(h) for h in [WILDCARD, *chosen])
        self._address = re.compile(rf"(?<![\w.-])(?:{hosts}):(\d+)\b")

    def url(self, name: str) -> str:
        return f"http://{LOOPBACK}:{self.ports[self.services[name].port]}"

    def addresses(self, text: str) -> str:
        """``SERVICE:PORT`` and ``0.0.0.0:PORT`` to loopback; a port no service publishes fails."""

        def loopback(m: re.Match[str]) -> str:
            port = int(m.group(1))
            assert port in self.ports, f"{m.group(0)}: no service publishes port {port}"
            return f"{LOOPBACK}:{self.ports[port]}"

        return self._address.sub(loopback, text)

    def process(self, name: str, mounts: Mapping[str, Path] | None = None, flags: Mapping[str, str] | None = None) -> Process:
        """The service as a Process (not started); its files live under workdir/NAME."""
        svc = self.services[name]
        home = self.workdir / name
        home.mkdir(parents=True, exist_ok=True)
        paths = self._paths(svc, home, mounts or {})
        args = [self._path(self.addresses(a), paths) for a in self._flags(svc, flags or {})]
        args = self._listen(args, svc)
        if svc.repository is None:
            argv = [sys.executable, "-m", "kvdiag", *args]
            ready = KVDIAG_READY
        else:
            binary, ready = IMAGES[svc.repository]
            argv = [need(binary), *args, f"--web.listen-address={LOOPBACK}:{self.ports[svc.port]}"]
        return Process(argv, home / f"{name}.log", self.url(name) + ready)

    def _paths(self, svc: Service, home: Path, mounts: Mapping[str, Path]) -> dict[str, Path]:
        unknown = set(mounts) - set(svc.binds)
        assert not unknown, f"{svc.name} mounts nothing at {sorted(unknown)}"
        paths = {**svc.binds, **mounts}
        for target in svc.volumes:
            paths[target] = home / Path(target).name
            paths[target].mkdir(exist_ok=True)
        for target, source in list(paths.items()):
            if source.is_file():  # a configuration file: its copy with addresses and paths substituted
                copy = home / source.name
                copy.write_text(self._path(self.addresses(source.read_text()), paths))
                paths[target] = copy
        return paths

    @staticmethod
    def _path(text: str, paths: Mapping[str, Path]) -> str:
        """Container paths to host paths in one pass (a host path is never rewritten again); the
        deepest mount wins, and only whole path components match (``/prometheus`` is not in
        ``/etc/prometheus``)."""
        targets = "|".join(re.escape(t) for t in sorted(paths, key=len, reverse=True))
        pattern = re.compile(rf"(?<![\w.-])({targets})(?=/|[^\w.-]|$)")
        return pattern.sub(lambda m: str(paths[m.group(1)]), text)

    @staticmethod
    def _flags(svc: Service, flags: Mapping[str, str]) -> list[str]:
        args = list(svc.command)
        for flag, value in flags.items():
            assert flag in args, f"{svc.name}: {flag} is not in its command {args}"
            args[args.index(flag) + 1] = value
        return args

    def _listen(self, args: list[str], svc: Service) -> list[str]:
        """``--host 0.0.0.0`` and ``--port PORT`` (kvdiag simulate's form) on loopback."""
        out = list(args)
        for i, a in enumerate(out[:-1]):
            if a == "--host" and out[i + 1] == WILDCARD:
                out[i + 1] = LOOPBACK
            if a == "--port" and out[i + 1] == str(svc.port):
                out[i + 1] = str(self.ports[svc.port])
        return out
