"""deploy/: every overlay renders with `kubectl kustomize`, validates strictly, and hangs together.

Built-in kinds are checked against the Kubernetes schemas (kubernetes-validate, offline, strict:
unknown fields fail); CRD kinds against the openAPIV3Schema of the CRD vendored under
deploy/crds/, made strict the same way. Then the wiring: selectors match the pods, flags are
ones the commands accept, the vLLM kind carries the same profile as the gpu overlay.
"""

from __future__ import annotations

import copy
import shutil
import subprocess
from functools import cache
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import typer
import yaml

from chatfleet.cli.main import app
from chatfleet.engine.config import parse_memory_size
from chatfleet.gateway.config import GatewayConfig, Profile
from chatfleet.gateway.discovery import parse_source

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
OVERLAYS = sorted(p.name for p in (DEPLOY / "overlays").iterdir() if (p / "kustomization.yaml").is_file())
# The oldest Kubernetes release the manifests promise to run on, and the newest schemas shipped.
K8S_VERSIONS = ("1.30.0", kubernetes_validate.latest_version())
KUBECTL = shutil.which("kubectl")

needs_kubectl = pytest.mark.skipif(KUBECTL is None, reason="kubectl is not installed: cannot render the overlays")


@cache
def _render(overlay: str) -> tuple[dict, ...]:
    out = subprocess.run([KUBECTL, "kustomize", str(DEPLOY / "overlays" / overlay)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, f"kubectl kustomize {overlay} failed:\n{out.stderr}"
    return tuple(doc for doc in yaml.safe_load_all(out.stdout) if doc)


def render(overlay: str) -> list[dict]:
    return copy.deepcopy(list(_render(overlay)))


def strict(schema: dict) -> dict:
    """The schema with unknown fields rejected wherever the API server would prune them."""
    schema = copy.deepcopy(schema)

    def walk(node: object) -> None:
        if isinstance(node, dict):
            if ("properties" in node and "additionalProperties" not in node
                    and not node.get("x-kubernetes-preserve-unknown-fields")):
                node["additionalProperties"] = False
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(schema)
    return schema


@cache
def crd_schemas() -> dict[tuple[str, str], dict]:
    """(apiVersion, kind) -> strict openAPIV3Schema, for every served version of every vendored CRD."""
    schemas = {}
    for path in sorted((DEPLOY / "crds").glob("*.yaml")):
        for crd in yaml.safe_load_all(path.read_text()):
            if not crd or crd.get("kind") != "CustomResourceDefinition":
                continue
            group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
            for version in crd["spec"]["versions"]:
                if version.get("served"):
                    schemas[(f"{group}/{version['name']}", kind)] = strict(version["schema"]["openAPIV3Schema"])
    return schemas


# API groups Kubernetes itself serves; anything else needs a CRD.
BUILTIN_GROUPS = {"", "apps", "batch", "policy", "autoscaling", "networking.k8s.io", "rbac.authorization.k8s.io",
                  "storage.k8s.io", "scheduling.k8s.io", "discovery.k8s.io", "coordination.k8s.io"}


def is_custom(obj: dict) -> bool:
    return obj["apiVersion"].rpartition("/")[0] not in BUILTIN_GROUPS


def validate_custom(obj: dict) -> None:
    key = (obj["apiVersion"], obj["kind"])
    assert key in crd_schemas(), f"{key} has no CRD vendored under deploy/crds/"
    jsonschema.validate(obj, crd_schemas()[key], cls=jsonschema.Draft7Validator)


def find(objects: list[dict], kind: str, name: str | None = None) -> dict:
    found = [o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def container(deployment: dict, name: str) -> dict:
    return next(c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == name)


def subcommand(name: str):
    group = typer.main.get_command(app)
    command = group.get_command(group.make_context("chatfleet", [name], resilient_parsing=True), name)
    assert command is not None, f"no `chatfleet {name}` command"
    return command


def accepts(command: str, args: list[str]) -> None:
    """Parse ``args`` as `chatfleet COMMAND` would (types and names checked), without running it."""
    cmd = subcommand(command)
    cmd.make_context(command, list(args))


def test_the_overlays_are_there():
    assert {"cpu-tiny", "gpu", "vllm"} <= set(OVERLAYS)


@needs_kubectl
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_builtin_objects_validate_strictly(overlay):
    objects = [o for o in render(overlay) if not is_custom(o)]
    assert objects
    for obj in objects:
        for version in K8S_VERSIONS:
            kubernetes_validate.validate(obj, version, strict=True)


@needs_kubectl
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_custom_objects_validate_against_their_crds(overlay):
    for obj in render(overlay):
        if is_custom(obj):
            validate_custom(obj)


@needs_kubectl
def test_the_validators_reject_what_the_api_server_would():
    objects = render("gpu")
    deployment = find(objects, "Deployment", "chatfleet-engine")
    container(deployment, "engine")["livenessProbes"] = []  # a typo'd field
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSIONS[0], strict=True)
    scaled = find(objects, "ScaledObject")
    scaled["spec"]["maxReplicas"] = 16  # KEDA's field is maxReplicaCount
    with pytest.raises(jsonschema.ValidationError):
        validate_custom(scaled)
    pool = find(objects, "InferencePool")
    pool["spec"]["targetPorts"] = [{"number": 70000}]
    with pytest.raises(jsonschema.ValidationError):
        validate_custom(pool)


@needs_kubectl
def test_cpu_tiny_needs_no_operator():
    kinds = {(o["apiVersion"], o["kind"]) for o in render("cpu-tiny") if is_custom(o)}
    assert not kinds, f"cpu-tiny must run on a bare cluster, but needs CRDs for {kinds}"


@needs_kubectl
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_selectors_match_the_pods(overlay):
    objects = render(overlay)
    engine = find(objects, "Deployment", "chatfleet-engine")
    gateway = find(objects, "Deployment", "chatfleet-gateway")
    engine_labels = engine["spec"]["template"]["metadata"]["labels"]
    gateway_labels = gateway["spec"]["template"]["metadata"]["labels"]

    def selects(selector: dict, labels: dict) -> bool:
        return selector.items() <= labels.items()

    for deployment, labels in ((engine, engine_labels), (gateway, gateway_labels)):
        assert selects(deployment["spec"]["selector"]["matchLabels"], labels)
    engine_service = find(objects, "Service", "chatfleet-engine")
    assert engine_service["spec"]["clusterIP"] == "None"  # headless: one A record per ready pod
    assert selects(engine_service["spec"]["selector"], engine_labels)
    assert not selects(engine_service["spec"]["selector"], gateway_labels)
    assert selects(find(objects, "Service", "chatfleet-gateway")["spec"]["selector"], gateway_labels)
    for pdb in (o for o in objects if o["kind"] == "PodDisruptionBudget"):
        target = engine_labels if pdb["metadata"]["name"] == "chatfleet-engine" else gateway_labels
        assert selects(pdb["spec"]["selector"]["matchLabels"], target)
    for obj in objects:
        if obj["kind"] == "InferencePool":
            assert selects(obj["spec"]["selector"]["matchLabels"], engine_labels)
            ports = {p["containerPort"] for p in container(engine, "engine")["ports"]}
            assert {p["number"] for p in obj["spec"]["targetPorts"]} <= ports
        if obj["kind"] == "PodMonitor":
            target = engine_labels if obj["metadata"]["name"] == "chatfleet-engine" else gateway_labels
            assert selects(obj["spec"]["selector"]["matchLabels"], target)
        if obj["kind"] == "ScaledObject":
            ref = obj["spec"]["scaleTargetRef"]
            assert (ref["kind"], ref["name"]) == ("Deployment", "chatfleet-engine")
            queries = [t["metadata"]["query"] for t in obj["spec"]["triggers"]]
            assert all("vllm:num_requests_waiting" in q for q in queries)


@needs_kubectl
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_probes_and_ports_line_up(overlay):
    objects = render(overlay)
    for name, main in (("chatfleet-engine", "engine"), ("chatfleet-gateway", "gateway")):
        deployment = find(objects, "Deployment", name)
        c = container(deployment, main)
        port_names = {p["name"] for p in c["ports"]}
        for probe in ("readinessProbe", "livenessProbe"):
            check = c[probe].get("httpGet") or c[probe].get("tcpSocket")
            assert check["port"] in port_names
        pod = deployment["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
    engine = container(find(objects, "Deployment", "chatfleet-engine"), "engine")
    assert {"startupProbe", "readinessProbe", "livenessProbe"} <= engine.keys()
    assert engine["readinessProbe"]["httpGet"]["path"] == "/health"
    gateway = find(objects, "Deployment", "chatfleet-gateway")
    assert gateway["spec"]["replicas"] >= 2


@needs_kubectl
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_gateway_profile_and_flags_are_valid(overlay, tmp_path):
    objects = render(overlay)
    gateway = find(objects, "Deployment", "chatfleet-gateway")
    c = container(gateway, "gateway")
    assert c["command"] == ["chatfleet", "gateway"]
    sources = [a.partition("=")[2] for a in c["args"] if a.startswith("--replicas-from=")]
    assert len(sources) == 1, "the gateway finds the engines through discovery"
    parse_source(sources[0])
    accepts("gateway", c["args"])
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in gateway["spec"]["template"]["spec"]["volumes"]}
    config_map = find(objects, "ConfigMap", volumes["profile"]["configMap"]["name"])
    (key, text), = config_map["data"].items()
    assert f"--profile={mounts['profile']}/{key}" in c["args"]
    profile = Profile(**yaml.safe_load(text))
    config = GatewayConfig.from_dict(profile.gateway)
    assert config.max_in_flight is not None, "the per-replica cap comes from the measured knee"
    assert config.gateways == gateway["spec"]["replicas"], "each gateway enforces cap / (the gateways there are)"
    http = next(p for p in c["ports"] if p["name"] == "http")
    assert config.port == http["containerPort"] and config.host == "0.0.0.0"


@needs_kubectl
@pytest.mark.parametrize("overlay", [o for o in OVERLAYS if o != "vllm"])
def test_engine_flags_are_ones_the_engine_accepts(overlay):
    engine = container(find(render(overlay), "Deployment", "chatfleet-engine"), "engine")
    assert engine["command"] == ["chatfleet", "engine"]
    accepts("engine", engine["args"])
    assert "--port=8000" in engine["args"] and "--host=0.0.0.0" in engine["args"]


def _flags(args: list[str]) -> dict[str, str]:
    return dict(a.removeprefix("--").partition("=")[::2] for a in args if a.startswith("--"))


@needs_kubectl
def test_gpu_engines_get_a_gpu_and_the_model_volume():
    objects = render("gpu")
    engine = find(objects, "Deployment", "chatfleet-engine")
    c = container(engine, "engine")
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "1"
    claim = next(v for v in engine["spec"]["template"]["spec"]["volumes"] if "persistentVolumeClaim" in v)
    find(objects, "PersistentVolumeClaim", claim["persistentVolumeClaim"]["claimName"])
    mount = next(m for m in c["volumeMounts"] if m["name"] == claim["name"])
    assert _flags(c["args"])["model"].startswith(mount["mountPath"] + "/")
    host_tier = parse_memory_size(_flags(c["args"])["host-cache-memory"])
    assert parse_memory_size(c["resources"]["limits"]["memory"].replace("Gi", "GiB")) > host_tier


@needs_kubectl
def test_the_vllm_kind_carries_the_gpu_profile():
    ours = _flags(container(find(render("gpu"), "Deployment", "chatfleet-engine"), "engine")["args"])
    engine = find(render("vllm"), "Deployment", "chatfleet-engine")
    c = container(engine, "engine")
    assert c["command"] == ["vllm", "serve"]
    theirs = _flags(c["args"])
    assert c["args"][0] == ours["model"]  # vllm serve MODEL
    assert {"enable-prefix-caching", "enable-chunked-prefill"} <= theirs.keys()
    same = {"max-num-seqs": "max-running", "max-num-batched-tokens": "max-batched-tokens",
            "kv-cache-dtype": "kv-cache-dtype", "dtype": "dtype", "port": "port",
            "served-model-name": "served-model-name"}
    for vllm_flag, our_flag in same.items():
        assert theirs[vllm_flag] == ours[our_flag], vllm_flag
    assert float(theirs["kv-offloading-size"]) * 2**30 == parse_memory_size(ours["host-cache-memory"])
    assert "no-prefix-cache" not in ours


def test_every_vendored_crd_says_where_it_came_from():
    readme = (DEPLOY / "crds" / "README.md").read_text()
    files = sorted(p.name for p in (DEPLOY / "crds").glob("*.yaml"))
    assert files
    for name in files:
        assert name in readme, f"deploy/crds/README.md does not say where {name} came from"


# -- Dockerfile ------------------------------------------------------------------------------

INSTRUCTIONS = {"FROM", "ARG", "ENV", "RUN", "COPY", "ADD", "WORKDIR", "USER", "EXPOSE", "ENTRYPOINT",
                "CMD", "LABEL", "HEALTHCHECK", "SHELL", "STOPSIGNAL", "VOLUME", "ONBUILD"}


def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) per instruction: comments dropped, continuation lines joined."""
    out, pending = [], ""
    for line in text.splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        whole, pending = pending + line, ""
        word, _, rest = whole.strip().partition(" ")
        out.append((word.upper(), rest.strip()))
    assert not pending, "the Dockerfile ends inside a continued line"
    return out


def test_dockerfile_parses_and_runs_unprivileged():
    steps = dockerfile_instructions((ROOT / "Dockerfile").read_text())
    assert {word for word, _ in steps} <= INSTRUCTIONS, {word for word, _ in steps} - INSTRUCTIONS
    first = next(word for word, _ in steps if word != "ARG")
    assert first == "FROM"
    stages, final_user = [], None
    for word, rest in steps:
        if word == "FROM":
            parts = rest.split()
            stages.append(parts[2] if len(parts) >= 3 and parts[1].upper() == "AS" else None)
            final_user = None
        if word == "COPY" and rest.startswith("--from="):
            assert rest.split()[0].removeprefix("--from=") in stages[:-1]
        if word == "COPY" and not rest.startswith("--from="):
            for source in rest.split()[:-1]:
                assert (ROOT / source).exists(), f"COPY {source}: no such file in the repo"
        if word == "USER":
            final_user = rest
        if word in ("ENTRYPOINT", "CMD"):
            assert rest.startswith("["), f"{word} in exec form (signals reach the process)"
            yaml.safe_load(rest)
    assert final_user is not None and final_user.split(":")[0] not in ("0", "root")


def test_dockerfile_torch_pin_matches_ci():
    pin = next(rest for word, rest in dockerfile_instructions((ROOT / "Dockerfile").read_text())
               if word == "ARG" and rest.startswith("TORCH_VERSION="))
    ci = (ROOT / ".ci" / "run").read_text()
    assert f"torch=={pin.partition('=')[2]}" in ci


def test_dockerignore_keeps_what_the_image_copies():
    ignore = (ROOT / ".dockerignore").read_text().split()
    assert "*" in ignore
    for needed in ("pyproject.toml", "README.md", "src/"):
        assert f"!{needed}" in ignore
