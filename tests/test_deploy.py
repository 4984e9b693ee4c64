"""The deployment files agree with the package: the Dockerfiles' extras with pyproject.toml and the README's
install table, their ports with the config (deploy/docker/stream.toml and the defaults)."""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path
from urllib.parse import urlparse

import pytest

from stream import config

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILES = {"gpu": ROOT / "Dockerfile", "cpu": ROOT / "Dockerfile.cpu"}


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile, continuation lines joined, comments dropped."""
    text = re.sub(
        r"\\\n", " ", "\n".join(ln for ln in path.read_text().splitlines() if not ln.lstrip().startswith("#"))
    )
    out = []
    for line in text.splitlines():
        if line.strip():
            word, _, rest = line.strip().partition(" ")
            out.append((word.upper(), " ".join(rest.split())))
    return out


def port_of(endpoint: str) -> int:
    port = urlparse(endpoint).port
    assert port is not None, endpoint
    return port


def extras() -> dict[str, list[str]]:
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return dict(data["project"]["optional-dependencies"])


def readme_install_table() -> dict[str, str]:
    """The README's install table: extra -> the machine it is for."""
    rows = re.findall(r"^\| (.+?) \| `pip install '\.\[(\w+)\]'` \|", (ROOT / "README.md").read_text(), re.M)
    assert rows, "the README's install table is gone"
    return {extra: machine for machine, extra in rows}


@pytest.mark.parametrize("flavour", DOCKERFILES)
def test_dockerfile_installs_the_readmes_extra(flavour: str) -> None:
    steps = instructions(DOCKERFILES[flavour])
    installed = [
        e for kind, args in steps if kind == "RUN" for e in re.findall(r"pip install [^&]*'\.\[([\w,]+)\]'", args)
    ]
    assert installed == [flavour], installed  # one ONNX Runtime flavour per image (README: exactly one extra)
    assert flavour in extras() and flavour in readme_install_table()
    froms = [args for kind, args in steps if kind == "FROM"]
    assert len(froms) >= 2, "multi-stage: a build stage and a runtime stage"
    if flavour == "gpu":  # the README: the gpu extra is CUDA 13
        assert "CUDA 13" in readme_install_table()["gpu"]
        assert all(re.match(r"nvidia/cuda:13\.\d+\.\d+-\S*runtime-ubuntu24\.04", f) for f in froms), froms
        assert any(dep.startswith("onnxruntime-gpu") for dep in extras()["gpu"])
    else:
        assert all(f.startswith("python:3.12-slim") for f in froms), froms
        assert readme_install_table()["cpu"] == "no GPU"


def test_the_readme_table_is_the_onnxruntime_extras() -> None:
    ort = {name for name, deps in extras().items() if any(d.startswith("onnxruntime") for d in deps)}
    assert ort == set(readme_install_table()) == {"cpu", "gpu", "cuda12"}


@pytest.mark.parametrize("flavour", DOCKERFILES)
def test_dockerfile_ports_health_user_and_command_agree_with_its_config(flavour: str) -> None:
    steps = instructions(DOCKERFILES[flavour])
    final = steps[max(i for i, (kind, _) in enumerate(steps) if kind == "FROM") :]
    args = {kind: a for kind, a in final}  # the runtime stage's last word on each
    copied = [a.split() for kind, a in final if kind == "COPY" and not a.startswith("--from")]
    src, dest = next((s, d) for s, d in copied if d.endswith(".toml"))
    cmd = json.loads(args["CMD"])
    assert json.loads(args["ENTRYPOINT"]) == ["stream"] and cmd == ["run", "--config", dest]
    cfg = config.load(ROOT / src)
    exposed = {int(p) for p in args["EXPOSE"].split()}
    assert exposed == {port_of(cfg.publish), port_of(cfg.control), cfg.metrics_port} == {5556, 5557, 8080}
    # the defaults a user knows from the docs: publish and `--control` alone
    assert port_of(config.Config().publish) == 5556 and port_of(config.CONTROL_ENDPOINT) == 5557
    assert urlparse(cfg.publish).hostname == "0.0.0.0" and cfg.metrics_host == "0.0.0.0"  # reachable from outside
    health = re.search(r"http://127\.0\.0\.1:(\d+)(/\w+)", args["HEALTHCHECK"])
    assert health and (int(health.group(1)), health.group(2)) == (cfg.metrics_port, "/healthz")
    assert args["USER"] not in ("root", "0") and "useradd" in " ".join(a for k, a in final if k == "RUN")


def test_dockerignore_keeps_what_the_build_copies() -> None:
    ignored = (ROOT / ".dockerignore").read_text().split()
    for needed in ("pyproject.toml", "README.md", "stream", "deploy"):
        assert needed not in ignored
    assert "!stream/models/*.onnx" in ignored  # the shipped model survives the **/*.onnx rule


# -- deploy/k8s: every object validates offline; the StatefulSet agrees with the ConfigMap's stream.toml ---------
K8S = ROOT / "deploy" / "k8s"


def manifests() -> dict[str, dict]:  # type: ignore[type-arg]
    yaml = pytest.importorskip("yaml")
    out = {}
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            out[doc["kind"]] = doc
    return out


@pytest.mark.parametrize("kind", ["ConfigMap", "StatefulSet", "Service", "PodMonitor"])
def test_every_object_validates(kind: str) -> None:
    kv = pytest.importorskip("kubernetes_validate")
    obj = manifests()[kind]
    if kind == "PodMonitor":  # a CRD: kubernetes-validate has no schema for it, so its required fields by hand
        with pytest.raises(kv.SchemaNotFoundError):
            kv.validate(obj, kv.latest_version(), strict=True)
        assert obj["apiVersion"] == "monitoring.coreos.com/v1" and obj["metadata"]["name"]
        spec = obj["spec"]
        assert set(spec) <= {"selector", "podMetricsEndpoints", "namespaceSelector", "jobLabel", "podTargetLabels"}
        assert spec["selector"]["matchLabels"] and spec["podMetricsEndpoints"]
        for ep in spec["podMetricsEndpoints"]:
            assert set(ep) <= {"port", "path", "interval", "scrapeTimeout", "scheme"} and ep["path"].startswith("/")
        return
    kv.validate(obj, kv.latest_version(), strict=True)  # raises ValidationError naming the field
    broken = json.loads(json.dumps(obj))
    broken["spec" if "spec" in broken else "data"]["notAField"] = 1
    with pytest.raises(kv.ValidationError):  # the validator does look (strict: unknown fields are errors)
        kv.validate(broken, kv.latest_version(), strict=True)


def stream_toml(tmp_path: Path) -> config.Config:
    path = tmp_path / "stream.toml"
    path.write_text(manifests()["ConfigMap"]["data"]["stream.toml"])
    return config.load(path)


def test_statefulset_agrees_with_the_configmap(tmp_path: Path) -> None:
    from stream.core.shard import SHARDS_ENV

    objs = manifests()
    cfg = stream_toml(tmp_path)
    sts, svc, cm = objs["StatefulSet"], objs["Service"], objs["ConfigMap"]
    pod = sts["spec"]["template"]["spec"]
    (box,) = pod["containers"]
    ports = {p["name"]: p["containerPort"] for p in box["ports"]}
    assert ports == {"publish": port_of(cfg.publish), "control": port_of(cfg.control), "http": cfg.metrics_port}
    assert urlparse(cfg.publish).hostname == "0.0.0.0" and cfg.metrics_host == "0.0.0.0"
    for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
        get = box[probe]["httpGet"]
        assert get["path"] == "/healthz" and ports[get["port"]] == cfg.metrics_port, probe
    # SIGTERM drains what is in flight, then queued messages may leave for linger_s (there is no shutdown-timeout
    # key): the grace period leaves that and 20 s for the drain
    assert pod["terminationGracePeriodSeconds"] >= cfg.linger_s + 20
    # the config file the container reads is the ConfigMap's
    args = box["args"]
    cfg_path = Path(args[args.index("--config") + 1])
    mounts = {m["name"]: m["mountPath"] for m in box["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    (cm_volume,) = [n for n, v in volumes.items() if v.get("configMap", {}).get("name") == cm["metadata"]["name"]]
    assert Path(mounts[cm_volume]) / cfg_path.name == cfg_path and cfg_path.name in cm["data"]
    # CURVE keys from Secrets, where the config looks for them
    secret_dirs = [Path(mounts[n]) for n, v in volumes.items() if "secret" in v]
    assert Path(cfg.curve_secret).parent in secret_dirs and Path(cfg.curve_clients) in secret_dirs
    # one GPU per pod; the shard from the pod's name, N = replicas
    assert box["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert args[args.index("--shard") + 1] == "auto" and cfg.shard == ""
    env = {e["name"]: e["value"] for e in box["env"]}
    assert int(env[SHARDS_ENV]) == sts["spec"]["replicas"]
    # the headless Service: publish and HTTP, the StatefulSet's governing service, the pods' labels
    assert svc["spec"]["clusterIP"] == "None" and sts["spec"]["serviceName"] == svc["metadata"]["name"]
    assert {p["name"]: p["port"] for p in svc["spec"]["ports"]} == {"publish": ports["publish"], "http": ports["http"]}
    assert all(p["targetPort"] in ports for p in svc["spec"]["ports"])
    labels = sts["spec"]["template"]["metadata"]["labels"]
    for selector in (
        svc["spec"]["selector"],
        sts["spec"]["selector"]["matchLabels"],
        objs["PodMonitor"]["spec"]["selector"]["matchLabels"],
    ):
        assert selector.items() <= labels.items()
    assert [ep["port"] for ep in objs["PodMonitor"]["spec"]["podMetricsEndpoints"]] == ["http"]


def test_the_images_and_the_cluster_use_the_same_ports(tmp_path: Path) -> None:
    cluster = stream_toml(tmp_path)
    image = config.load(ROOT / "deploy" / "docker" / "stream.toml")
    for key in ("publish", "control"):
        assert port_of(getattr(cluster, key)) == port_of(getattr(image, key)), key
    assert cluster.metrics_port == image.metrics_port
