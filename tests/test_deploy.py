"""The Dockerfile and the Kubernetes example point at real files, flags and probes (no engine here:
building and running them is a manual check, see README 'Containers')."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from sloserve.cli.main import cli
from sloserve.grpc.server import SERVICE_NAME

yaml = pytest.importorskip("yaml")
ROOT = Path(__file__).resolve().parents[1]


def serve_flags() -> set[str]:
    return {opt for p in cli.commands["serve"].params for opt in (*p.opts, *p.secondary_opts)}


def flags_in(args: list[str]) -> list[str]:
    return [a for a in args if a.startswith("--")]


def dockerfile() -> list[tuple[str, str]]:
    """(instruction, arguments) of each Dockerfile line, continuation lines joined."""
    text = re.sub(r"\\\n\s*", " ", (ROOT / "Dockerfile").read_text())
    return [
        tuple(line.split(None, 1))
        for line in text.splitlines()
        if line.strip() and not line.startswith("#")
    ]


def test_the_dockerfile_copies_real_paths_and_runs_real_flags():
    steps = dockerfile()
    for instruction, args in steps:
        if instruction == "COPY" and not args.startswith("--from"):
            for source in args.split()[:-1]:
                assert (ROOT / source).exists(), source
    entrypoint = json.loads(next(a for i, a in steps if i == "ENTRYPOINT"))
    cmd = json.loads(next(a for i, a in steps if i == "CMD"))
    assert (
        entrypoint == ["sloserve"]
        and "sloserve = sloserve.cli.main:cli" in (ROOT / "setup.cfg").read_text()
    )
    assert cmd[0] == "serve" and set(flags_in(cmd)) <= serve_flags()
    torch_pin = re.search(r"torch==([\d.]+)", (ROOT / "Makefile").read_text()).group(1)
    # the version CI tests
    assert f"ARG TORCH_VERSION={torch_pin}" in (ROOT / "Dockerfile").read_text()
    ports = {int(p) for i, a in steps if i == "EXPOSE" for p in a.split()}
    assert {
        int(cmd[cmd.index(f) + 1]) for f in ("--port", "--http-port", "--metrics-port")
    } == ports


def test_the_kubernetes_example_probes_grpc_health_on_the_served_port():
    deployment, service = yaml.safe_load_all((ROOT / "deploy/kubernetes/sloserve.yaml").read_text())
    assert deployment["kind"] == "Deployment" and service["kind"] == "Service"
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    args = container["args"]
    assert args[0] == "serve" and set(flags_in(args)) <= serve_flags()
    grpc_port = int(args[args.index("--port") + 1])
    assert {p["name"]: p["containerPort"] for p in container["ports"]}["grpc"] == grpc_port
    assert container["readinessProbe"]["grpc"] == {"port": grpc_port, "service": SERVICE_NAME}
    for probe in (
        "livenessProbe",
        "startupProbe",
    ):  # "" (the default service): the process can make progress
        assert container[probe]["grpc"] == {"port": grpc_port}
    assert pod["terminationGracePeriodSeconds"] > float(args[args.index("--grace") + 1])
    env = {e["name"] for e in container["env"]}
    option = next(p for p in cli.commands["serve"].params if p.name == "auth_token")
    assert option.envvar in env
    targets = {p["targetPort"] for p in service["spec"]["ports"]}
    assert targets == {p["name"] for p in container["ports"]}


def test_the_readme_shows_how_to_check_them_by_hand():
    readme = (ROOT / "README.md").read_text()
    for command in (
        "docker build -t sloserve:cpu .",
        "kubectl apply -f deploy/kubernetes/sloserve.yaml",
    ):
        assert command in readme, command
