"""deploy/ as an operator meets it: every folder with a kustomization.yaml rendered by
`kubectl kustomize` and validated offline against the Kubernetes schemas (pinned
versions; DRA's resource.k8s.io/v1 and the S3 CSI volume included); every variant
identical to the baseline but for the speculative config; accelerators claimed through
the device plugins or DRA, never both; the artifacts cache mounted read-only from S3
where published there; the server and benchmark flags real `specserve` flags; probes,
scrape paths and every metric the Grafana dashboard queries checked against a live
`specserve serve`, and every metric the CloudWatch dashboard reads against what a real
`specserve bench --emf` run writes; the Jobs' scripts run with stand-ins for
`specserve` and `aws`; the Dockerfile's promises read from it.

The live server (smollm2-135m with n-gram speculation) starts once for the module.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import kubernetes_validate
import promql_parser
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from specserve import catalogue, cli
from specserve.bench.local_server import ServerProcess
from specserve.bench.options import options_from_args
from specserve.config import SpecConfig
from specserve.errors import ModelLoadError

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
# Each object validates against every pinned Kubernetes version that serves its API:
# 1.32 for the built-in kinds, 1.34 for those of DRA's resource.k8s.io/v1 (GA in 1.34).
KUBERNETES_VERSIONS = ("1.32.0", "1.34.0")
FIRST_VERSION = {"resource.k8s.io/v1": "1.34.0"}
KUSTOMIZATIONS = sorted(str(p.parent.relative_to(DEPLOY)) for p in DEPLOY.rglob("kustomization.yaml"))
# What an operator applies: the two services (base, overlays/*); the Job goes beside one.
STACKS = ["base", *sorted(str(p.relative_to(DEPLOY)) for p in (DEPLOY / "overlays").iterdir() if p.is_dir())]
VARIANTS = ("baseline", "speculative")
FOUR_WAY = (*VARIANTS, "eagle", "medusa")  # four variants: plain, draft model, EAGLE, Medusa
VARIANT_LABEL = "specserve/variant"
DASHBOARD = DEPLOY / "grafana" / "specserve.json"
CLOUDWATCH_DASHBOARD = DEPLOY / "cloudwatch" / "dashboard.json"
MODEL = "smollm2-135m"

needs_kubectl = pytest.mark.skipif(
    shutil.which("kubectl") is None, reason="kubectl is not installed: `kubectl kustomize` renders deploy/"
)

# The ServiceMonitor fields we use, as the Prometheus Operator's CRD defines them
# (its full schema is not in kubernetes-validate, which knows built-in kinds only).
SERVICE_MONITOR_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "ServiceMonitor"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {
            "type": "object",
            "required": ["selector", "endpoints"],
            "additionalProperties": False,
            "properties": {
                "selector": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {"matchLabels": {"type": "object", "additionalProperties": {"type": "string"}}},
                },
                "endpoints": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "required": ["port"],
                        "properties": {
                            "port": {"type": "string"},
                            "path": {"type": "string"},
                            "interval": {
                                "type": "string",
                                "pattern": r"^(0|(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$",
                            },
                        },
                    },
                },
            },
        },
    },
}


# ----- rendering -----


@functools.cache
def render(folder: str) -> tuple[dict[str, Any], ...]:
    result = subprocess.run(["kubectl", "kustomize", str(DEPLOY / folder)], capture_output=True, text=True)
    assert result.returncode == 0, f"kubectl kustomize deploy/{folder} failed:\n{result.stderr}"
    return tuple(doc for doc in yaml.safe_load_all(result.stdout) if doc)


def objects(folder: str, kind: str) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o for o in render(folder) if o["kind"] == kind}


def kustomization(folder: str) -> dict[str, Any]:
    return yaml.safe_load((DEPLOY / folder / "kustomization.yaml").read_text())


def container(deployment_or_job: dict[str, Any]) -> dict[str, Any]:
    (only,) = deployment_or_job["spec"]["template"]["spec"]["containers"]
    return only


def expand(args: list[str], env: dict[str, str]) -> list[str]:
    """Kubernetes' $(VAR) expansion of command and args: $$ is a $, unknown names stay."""

    def one(match: re.Match) -> str:
        return "$" if match.group(0) == "$$" else env.get(match.group(1), match.group(0))

    return [re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)", one, arg) for arg in args]


def server_env(stack: str, deployment: dict[str, Any]) -> dict[str, str]:
    """A server container's environment as Kubernetes builds it: envFrom, then env values."""
    spec = container(deployment)
    config_maps = objects(stack, "ConfigMap")
    env: dict[str, str] = {}
    for source in spec.get("envFrom", []):
        env |= config_maps[source["configMapRef"]["name"]]["data"]
    env |= {e["name"]: e["value"] for e in spec.get("env", []) if "value" in e}
    return env


def version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("."))


@needs_kubectl
@pytest.mark.parametrize("folder", KUSTOMIZATIONS)
def test_every_kustomization_renders_and_validates_against_the_kubernetes_schemas(folder):
    for obj in render(folder):
        if obj["apiVersion"].startswith("monitoring.coreos.com/"):
            jsonschema.validate(obj, SERVICE_MONITOR_SCHEMA)
            continue
        first = FIRST_VERSION.get(obj["apiVersion"], KUBERNETES_VERSIONS[0])
        versions = [v for v in KUBERNETES_VERSIONS if version(v) >= version(first)]
        assert versions, f"no pinned Kubernetes version serves {obj['apiVersion']}"
        for pinned in versions:
            kubernetes_validate.validate(obj, pinned, strict=True)
        name = obj["metadata"]["name"]
        assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", name) and len(name) <= 63, name


@needs_kubectl
def test_the_folders_that_matter_are_there():
    assert {
        "base",
        "bench",
        "bench-four-way",
        "prepare",
        "prepare-s3",
        "variants/baseline",
        "variants/speculative",
        "variants/eagle",
        "variants/medusa",
        "overlays/gpu",
        "overlays/neuron",
        "overlays/gpu-dra",
        "overlays/neuron-dra",
        "overlays/s3",
        "overlays/four-way",
        "overlays/eks-gpu",
        "overlays/monitoring",
        "components/servicemonitor",
        "components/hpa",
        "components/dra-nvidia-gpu",
        "components/dra-aws-neuron",
        "components/s3-artifacts",
    } <= set(KUSTOMIZATIONS)
    for component in (c for c in KUSTOMIZATIONS if c.startswith("components/")):
        assert kustomization(component)["kind"] == "Component"
        assert any(f"../{component}" in str(kustomization(s).get("components", [])) for s in [*STACKS, "bench"]), (
            f"{component} is used by no overlay, so nothing renders it"
        )


def variants(stack: str) -> tuple[str, ...]:
    """The variants a stack serves: the baseline and draft model, or all four modes."""
    served = {d["spec"]["template"]["metadata"]["labels"][VARIANT_LABEL] for d in objects(stack, "Deployment").values()}
    assert served in (set(VARIANTS), set(FOUR_WAY)), f"{stack} serves {sorted(served)}"
    return tuple(v for v in FOUR_WAY if v in served)


@needs_kubectl
@pytest.mark.parametrize("stack", STACKS)
def test_each_stack_is_self_contained(stack):
    """Every name a stack refers to is an object of the stack (the API-key Secret is
    optional; the cache volume is the stack's own), and each Service selects exactly
    the pods of one Deployment."""
    rendered = render(stack)
    names = {(o["kind"], o["metadata"]["name"]) for o in rendered}
    deployments = objects(stack, "Deployment")
    assert set(deployments) == {f"specserve-{v}" for v in variants(stack)}
    for deployment in deployments.values():
        pod = deployment["spec"]["template"]["spec"]
        assert (
            deployment["spec"]["selector"]["matchLabels"].items()
            <= deployment["spec"]["template"]["metadata"]["labels"].items()
        )
        for source in container(deployment)["envFrom"]:
            assert ("ConfigMap", source["configMapRef"]["name"]) in names
        for env in container(deployment)["env"]:
            if "secretKeyRef" in env.get("valueFrom", {}):
                assert env["valueFrom"]["secretKeyRef"]["optional"] is True
        for volume in pod["volumes"]:
            assert ("PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"]) in names
        for claim in pod.get("resourceClaims", []):
            assert ("ResourceClaimTemplate", claim["resourceClaimTemplateName"]) in names
    for claim in objects(stack, "PersistentVolumeClaim").values():
        if "volumeName" in claim["spec"]:
            assert ("PersistentVolume", claim["spec"]["volumeName"]) in names
    for service in objects(stack, "Service").values():
        selected = [
            d
            for d in deployments.values()
            if service["spec"]["selector"].items() <= d["spec"]["template"]["metadata"]["labels"].items()
        ]
        assert len(selected) == 1, f"{service['metadata']['name']} selects {len(selected)} Deployments"
        ports = {p["name"] for p in container(selected[0])["ports"]}
        assert {p["targetPort"] for p in service["spec"]["ports"]} <= ports
    for hpa in objects(stack, "HorizontalPodAutoscaler").values():
        assert ("Deployment", hpa["spec"]["scaleTargetRef"]["name"]) in names


def without_variant(obj: dict[str, Any]) -> dict[str, Any]:
    """A Deployment or Service less its name and the variant label wherever labels go."""
    obj = copy.deepcopy(obj)
    del obj["metadata"]["name"]
    spec = obj["spec"]
    places = [obj["metadata"]["labels"]]
    if obj["kind"] == "Deployment":
        places += [spec["selector"]["matchLabels"], spec["template"]["metadata"]["labels"]]
    else:
        places.append(spec["selector"])
    for labels in places:
        labels.pop(VARIANT_LABEL)
    return obj


@needs_kubectl
@pytest.mark.parametrize("stack", STACKS)
def test_every_variant_differs_from_the_baseline_only_in_the_speculative_config(stack):
    deployments, services = objects(stack, "Deployment"), objects(stack, "Service")
    baseline = without_variant(deployments["specserve-baseline"])
    assert "--speculative-config" not in container(baseline)["args"]
    for variant in variants(stack)[1:]:
        speculative = without_variant(deployments[f"specserve-{variant}"])
        args = container(speculative)["args"]
        at = args.index("--speculative-config")
        del args[at : at + 2]
        assert speculative == baseline, f"specserve-{variant} differs from the baseline beyond speculation"
        assert without_variant(services[f"specserve-{variant}"]) == without_variant(services["specserve-baseline"])
    for variant in variants(stack):  # the variant label tells them apart everywhere
        assert deployments[f"specserve-{variant}"]["spec"]["template"]["metadata"]["labels"][VARIANT_LABEL] == variant
        assert services[f"specserve-{variant}"]["spec"]["selector"][VARIANT_LABEL] == variant


# The method each variant's --speculative-config names (vLLM's keys).
METHODS = {"speculative": "draft_model", "eagle": "eagle3", "medusa": "medusa"}


@needs_kubectl
@pytest.mark.parametrize("stack", STACKS)
def test_server_args_are_real_serve_flags_with_a_speculative_config_for_all_but_the_baseline(stack):
    parser = cli.build_parser()
    for name, deployment in objects(stack, "Deployment").items():
        variant = deployment["spec"]["template"]["metadata"]["labels"][VARIANT_LABEL]
        env = server_env(stack, deployment)
        args = expand(container(deployment)["args"], env)
        assert not any("$(" in arg for arg in args), f"unresolved variable in {args}"
        parsed = parser.parse_args(["serve", *args])
        assert parsed.model in catalogue.CATALOGUE and parsed.host == "0.0.0.0" and parsed.port == 8000
        assert env["SPECSERVE_CACHE"] == "/cache"
        if variant == "baseline":
            assert SpecConfig.parse(parsed.speculative_config) is None
            continue
        method = json.loads(parsed.speculative_config).get("method", "draft_model")
        assert method == METHODS[variant], f"{name} speculates with {method}"
        spec = SpecConfig.parse(parsed.speculative_config)
        assert spec.method == method and (spec.num_speculative_tokens is None or spec.num_speculative_tokens >= 1)


@needs_kubectl
@pytest.mark.parametrize("stack", STACKS)
def test_probes_allow_for_model_preparation_and_keep_the_api_key_optional(stack):
    for deployment in objects(stack, "Deployment").values():
        spec = container(deployment)
        ports = {p["name"]: p["containerPort"] for p in spec["ports"]}
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert spec[probe]["httpGet"]["port"] in ports
        # Preparing in the pod (first start) needs the long budget; loading artifacts
        # prepared elsewhere, from a read-only mount, a shorter one that still allows
        # minutes of reading (deploy/README.md gives the measured figures).
        startup = spec["startupProbe"]
        budget = startup["periodSeconds"] * startup["failureThreshold"]
        cache = next(m for m in spec["volumeMounts"] if m["name"] == "cache")
        assert budget >= (5 * 60 if cache.get("readOnly") else 15 * 60)
        api_key = next(e for e in spec["env"] if e["name"] == "SPECSERVE_API_KEY")
        assert api_key["valueFrom"]["secretKeyRef"] == {"name": "specserve-api-key", "key": "api-key", "optional": True}
        assert spec["resources"]["requests"] and spec["resources"]["limits"]
        pod = deployment["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert any(m["name"] == "cache" and m["mountPath"] == "/cache" for m in spec["volumeMounts"])


def accelerators(stack: str) -> set[str]:
    found = set()
    for deployment in objects(stack, "Deployment").values():
        resources = container(deployment)["resources"]
        found |= {name for name in resources["limits"] if "/" in name}
        assert {k: v for k, v in resources["requests"].items() if "/" in k} == {
            k: v for k, v in resources["limits"].items() if "/" in k
        }
    return found


@needs_kubectl
def test_accelerator_overlays_request_their_devices_for_both_services():
    assert accelerators("base") == set()
    assert accelerators("overlays/gpu") == {"nvidia.com/gpu"}
    assert accelerators("overlays/neuron") == {"aws.amazon.com/neuron"}
    for stack, resource in (("overlays/gpu", "nvidia.com/gpu"), ("overlays/neuron", "aws.amazon.com/neuron")):
        for deployment in objects(stack, "Deployment").values():
            assert container(deployment)["resources"]["limits"][resource] == "1"
            assert {"key": resource, "operator": "Exists", "effect": "NoSchedule"} in deployment["spec"]["template"][
                "spec"
            ]["tolerations"]
    # A GPU pod computes on its GPU, or fails at start saying why; elsewhere the CPU.
    for stack, device in (
        ("base", "auto"),
        ("overlays/gpu", "cuda"),
        ("overlays/autoscaled", "cuda"),
        ("overlays/neuron", "auto"),
        ("overlays/gpu-dra", "cuda"),
        ("overlays/neuron-dra", "auto"),
        ("overlays/eks-gpu", "cuda"),
    ):
        for deployment in objects(stack, "Deployment").values():
            args = expand(container(deployment)["args"], server_env(stack, deployment))
            assert args[args.index("--device") + 1] == device


# What each DRA driver's DeviceClass gives, and the --device the servers then use.
DEVICE_CLASSES = {"gpu.nvidia.com": "nvidia.com/gpu", "neuron.aws.com": "aws.amazon.com/neuron"}


@needs_kubectl
def test_dra_overlays_claim_one_device_of_the_drivers_class_for_every_server():
    """Through DRA, each server pod claims one device from one ResourceClaimTemplate that
    all variants share (every pod gets its own claim from it), and asks for no device
    plugin resource: the two ways never mix."""
    claiming = {stack for stack in STACKS if objects(stack, "ResourceClaimTemplate")}
    assert claiming == {"overlays/gpu-dra", "overlays/neuron-dra", "overlays/eks-gpu"}
    for stack in STACKS:
        deployments = objects(stack, "Deployment").values()
        if stack not in claiming:
            assert not any("resourceClaims" in d["spec"]["template"]["spec"] for d in deployments)
            continue
        assert accelerators(stack) == set()
        (template,) = objects(stack, "ResourceClaimTemplate").values()
        (request,) = template["spec"]["spec"]["devices"]["requests"]
        exactly = request["exactly"]
        assert exactly["deviceClassName"] in DEVICE_CLASSES
        assert (exactly["allocationMode"], exactly["count"]) == ("ExactCount", 1)
        taint = DEVICE_CLASSES[exactly["deviceClassName"]]
        for deployment in deployments:
            pod = deployment["spec"]["template"]["spec"]
            (claim,) = pod["resourceClaims"]
            assert claim == {"name": claim["name"], "resourceClaimTemplateName": template["metadata"]["name"]}
            assert container(deployment)["resources"]["claims"] == [{"name": claim["name"]}]
            assert {"key": taint, "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]


@needs_kubectl
@pytest.mark.parametrize("stack", STACKS)
def test_service_monitor_only_when_enabled_and_then_selecting_both_services(stack):
    enabled = "../../components/servicemonitor" in kustomization(stack).get("components", [])
    monitors = objects(stack, "ServiceMonitor")
    assert bool(monitors) == enabled
    services = objects(stack, "Service")
    for monitor in monitors.values():
        selector = monitor["spec"]["selector"]["matchLabels"]
        selected = {name for name, s in services.items() if selector.items() <= s["metadata"]["labels"].items()}
        assert selected == {f"specserve-{v}" for v in VARIANTS}
        for endpoint in monitor["spec"]["endpoints"]:
            assert all(endpoint["port"] in {p["name"] for p in s["spec"]["ports"]} for s in services.values())
    for service in services.values():  # annotation-driven scraping in every stack
        assert service["metadata"]["annotations"]["prometheus.io/scrape"] == "true"


@needs_kubectl
def test_autoscaling_is_opt_in_and_identical_for_both_services():
    for stack in STACKS:
        enabled = "../../components/hpa" in kustomization(stack).get("components", [])
        hpas = objects(stack, "HorizontalPodAutoscaler")
        assert bool(hpas) == enabled
        for deployment in objects(stack, "Deployment").values():
            assert ("replicas" in deployment["spec"]) != enabled  # the autoscaler owns the count
        if enabled:
            assert {h["spec"]["scaleTargetRef"]["name"] for h in hpas.values()} == {f"specserve-{v}" for v in VARIANTS}
            stripped = [{**h["spec"], "scaleTargetRef": None} for h in hpas.values()]
            assert stripped[0] == stripped[1]


# ----- prepared artifacts: the prepare Job, and S3 -----


def job(folder: str) -> dict[str, Any]:
    (only,) = objects(folder, "Job").values()
    return only


def settings() -> dict[str, str]:
    text = (DEPLOY / "base" / "settings.env").read_text()
    return dict(line.split("=", 1) for line in text.splitlines() if line and not line.startswith("#"))


def stand_ins(tmp_path: Path, *tools: str) -> tuple[dict[str, str], Path]:
    """A PATH whose `tools` only log their arguments (one JSON list a line) to the returned file."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "calls.jsonl"
    for tool in tools:
        path = bin_dir / tool
        path.write_text(
            f"#!{sys.executable}\nimport json, sys\n"
            f"open({str(log)!r}, 'a').write(json.dumps([{tool!r}, *sys.argv[1:]]) + '\\n')\n"
        )
        path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}"}, log


def run_script(
    spec: dict[str, Any], tmp_path: Path, *tools: str, replace: dict[str, str] | None = None
) -> list[list[str]]:
    """A container's `/bin/sh -c` command run with its env values and stand-ins for `tools`:
    the stand-ins' calls, in order."""
    env = {e["name"]: e["value"] for e in spec.get("env", []) if "value" in e}
    shell, flag, script, *rest = expand(spec["command"], env)
    assert (shell, flag) == ("/bin/sh", "-c")
    for old, new in (replace or {}).items():
        script = script.replace(old, new)
    path, log = stand_ins(tmp_path, *tools)
    subprocess.run(
        [shell, flag, script, *rest, *expand(spec.get("args", []), env)], env={**env, **path}, check=True, timeout=30
    )
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def prepare_container(folder: str) -> dict[str, Any]:
    (only,) = job(folder)["spec"]["template"]["spec"]["initContainers"]
    return only


@needs_kubectl
def test_prepare_job_prepares_the_served_models_into_the_servers_cache(tmp_path):
    served = settings()
    calls = run_script(prepare_container("prepare"), tmp_path, "specserve")
    prepares = [c[1:] for c in calls if c[1:3] == ["models", "prepare"]]
    assert len(prepares) == 1
    parsed = cli.build_parser().parse_args(prepares[0])
    draft = json.loads(served["SPECULATIVE_CONFIG"])["model"]
    assert {served["MODEL"], draft} <= set(parsed.names) <= set(catalogue.CATALOGUE)
    pod = job("prepare")["spec"]["template"]["spec"]
    assert {v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"]} == {"specserve-cache"}
    assert {"name": "SPECSERVE_CACHE", "value": "/cache"} in prepare_container("prepare")["env"]
    assert (
        prepare_container("prepare")["image"] == container(objects("base", "Deployment")["specserve-baseline"])["image"]
    )


@needs_kubectl
def test_prepare_job_trains_the_heads_the_head_variants_serve(tmp_path):
    """`specserve train-head TARGET --method M` names its head TARGET-M: the name each
    head variant's config loads, and the calls parse."""
    served = settings()
    calls = run_script(prepare_container("prepare"), tmp_path, "specserve")
    trains = [c[2:] for c in calls if c[1] == "train-head"]
    assert trains, "HEADS is empty: the head variants would find no head"
    target = trains[0][0]
    assert target == served["MODEL"] and all(t[:2] == [target, "--method"] and len(t) == 3 for t in trains)
    configs = [json.loads(served[key]) for key in ("EAGLE_CONFIG", "MEDUSA_CONFIG")]
    assert {c["model"] for c in configs} == {f"{target}-{t[2]}" for t in trains}
    assert {c["method"] for c in configs} == {t[2] for t in trains}
    parser = cli.build_parser()
    for args in trains:
        parser.parse_args(["train-head", *args])


def s3_volume(stack: str) -> dict[str, Any]:
    (volume,) = objects(stack, "PersistentVolume").values()
    return volume


def artifacts_url(volume: dict[str, Any]) -> str:
    """s3://BUCKET/PREFIX/ that a Mountpoint S3 volume mounts."""
    options = dict(o.split(" ", 1) for o in volume["spec"]["mountOptions"] if " " in o)
    return f"s3://{volume['spec']['csi']['volumeAttributes']['bucketName']}/{options.get('prefix', '')}"


@needs_kubectl
def test_s3_stacks_mount_the_published_artifacts_read_only_for_every_server():
    s3 = {stack for stack in STACKS if objects(stack, "PersistentVolume")}
    assert s3 == {"overlays/s3", "overlays/eks-gpu"}
    for stack in s3:
        volume = s3_volume(stack)
        spec = volume["spec"]
        assert spec["csi"]["driver"] == "s3.csi.aws.com" and spec["csi"]["volumeHandle"]
        assert spec["accessModes"] == ["ReadOnlyMany"] and spec["storageClassName"] == ""
        options = spec["mountOptions"]
        assert "read-only" in options and "allow-other" in options
        assert artifacts_url(volume).endswith("/")
        claim = objects(stack, "PersistentVolumeClaim")["specserve-cache"]["spec"]
        assert claim["volumeName"] == volume["metadata"]["name"] and claim["storageClassName"] == ""
        assert claim["accessModes"] == ["ReadOnlyMany"]
        assert claim["resources"]["requests"]["storage"] == spec["capacity"]["storage"]
        for deployment in objects(stack, "Deployment").values():
            pod = deployment["spec"]["template"]["spec"]
            # Mountpoint presents the files as the pods' own user, or they cannot read them.
            user = pod["securityContext"]
            assert {f"uid={user['runAsUser']}", f"gid={user['runAsGroup']}"} <= set(options)
            (cache,) = [v for v in pod["volumes"] if v["name"] == "cache"]
            assert cache["persistentVolumeClaim"] == {"claimName": "specserve-cache", "readOnly": True}
            assert {"name": "cache", "mountPath": "/cache", "readOnly": True} in container(deployment)["volumeMounts"]


@needs_kubectl
def test_prepare_s3_publishes_to_the_mounted_bucket_with_the_markers_last(tmp_path):
    """The S3 Job prepares as deploy/prepare does, into a scratch volume, then syncs the
    prepared folders to the bucket and prefix the S3 volume mounts: everything but the
    files that mark a folder complete (specserve.json, a head's config.json), then those."""
    assert prepare_container("prepare-s3") == prepare_container("prepare")
    pod = job("prepare-s3")["spec"]["template"]["spec"]
    assert pod["volumes"] == [{"name": "cache", "emptyDir": pod["volumes"][0]["emptyDir"]}]
    assert ("ServiceAccount", pod["serviceAccountName"]) in {
        (o["kind"], o["metadata"]["name"]) for o in render("prepare-s3")
    }
    (publish,) = pod["containers"]
    calls = run_script(publish, tmp_path, "aws")
    destination = artifacts_url(s3_volume("overlays/s3"))
    assert destination == artifacts_url(s3_volume("overlays/eks-gpu"))
    assert len(calls) == 2 and all(c[:5] == ["aws", "s3", "sync", "/cache", destination] for c in calls), calls
    first, last = calls
    markers = ["--exclude", "*/specserve.json", "--exclude", "*/config.json"]
    assert first == last + markers
    assert {"models/*", "heads/*"} <= {last[i + 1] for i, arg in enumerate(last) if arg == "--include"}


# ----- the benchmark Job -----


@needs_kubectl
@pytest.mark.parametrize("folder", ["bench", "bench-four-way"])
def test_bench_job_volumes_and_image_are_the_services_own(folder):
    claims = {v["persistentVolumeClaim"]["claimName"] for v in job(folder)["spec"]["template"]["spec"]["volumes"]}
    assert claims == {"specserve-bench-results", "specserve-cache"}
    assert "specserve-bench-results" in objects(folder, "PersistentVolumeClaim")
    assert "specserve-cache" in objects("base", "PersistentVolumeClaim")
    assert {"name": "cache", "mountPath": "/cache", "readOnly": True} in container(job(folder))["volumeMounts"]
    assert container(job(folder))["image"] == container(objects("base", "Deployment")["specserve-baseline"])["image"]


@needs_kubectl
@pytest.mark.parametrize(
    ("folder", "stack", "benched"), [("bench", "base", VARIANTS), ("bench-four-way", "overlays/four-way", FOUR_WAY)]
)
def test_bench_job_script_benches_each_variant_then_compares(folder, stack, benched, tmp_path):
    """The Job's shell script, run here with `specserve` and `python` stand-ins that log
    their arguments, and /results moved under tmp_path; the logged `specserve bench`
    arguments then go through the real flag parser. It benches every variant its stack
    serves, the baseline first."""
    assert variants(stack) == benched
    results = tmp_path / "results"
    results.mkdir()
    calls = run_script(container(job(folder)), tmp_path, "specserve", "python", replace={"/results": str(results)})
    health = [c[-1] for c in calls if c[0] == "python"]
    benches = [c[2:] for c in calls if c[:2] == ["specserve", "bench"]]
    compares = [c[2:] for c in calls if c[:2] == ["specserve", "compare"]]
    assert health == [f"http://specserve-{v}:8000/health" for v in benched]
    assert len(benches) == len(benched) and len(compares) == 1
    run = Path(os.readlink(results / "latest"))
    assert run.parent == results
    for variant, args in zip(benched, benches):
        options = options_from_args(cli.build_parser().parse_args(["bench", *args]))
        assert options.url == f"http://specserve-{variant}:8000"
        assert [w.name for w in options.workloads] == ["structured", "open-ended"]
        assert options.metadata == {"variant": variant} and options.results_dir == run / variant
        assert options.emf is not None and options.additional_sampling_params == {"temperature": 0}
    assert compares[0] == [str(run / v) for v in benched] + ["--output-dir", str(run / "comparison")]


# ----- the image -----


def test_dockerfile_runs_specserve_serve_as_a_non_root_user_with_the_cache_on_a_volume():
    text = (DEPLOY / "Dockerfile").read_text()
    instructions = [line for line in re.sub(r"\\\n", " ", text).splitlines() if line and not line.startswith("#")]

    def last(word: str) -> str:
        return [i for i in instructions if i.split()[0] == word][-1][len(word) :].strip()

    assert last("USER").split(":")[0] not in ("", "0", "root")
    assert json.loads(last("ENTRYPOINT")) == ["specserve", "serve"]
    assert "SPECSERVE_CACHE=/cache" in last("ENV") and json.loads(last("VOLUME")) == ["/cache"]
    assert "/health" in last("HEALTHCHECK") and "--start-period" in last("HEALTHCHECK")
    assert re.search(r"ARG TORCH_INDEX_URL=\S+/cpu\b", text)  # a CPU torch unless told otherwise
    baked = re.search(r'ARG MODELS="([^"]+)"', text).group(1).split()
    assert set(baked) <= set(catalogue.CATALOGUE)
    assert json.loads(last("CMD"))[0] in baked
    served = settings()
    spec = SpecConfig.parse(served["SPECULATIVE_CONFIG"])
    assert {served["MODEL"], spec.model} <= set(baked), "the deployed models must be baked into the image"


# ----- against a live server: routes and the dashboard's metrics -----


@pytest.fixture(scope="module")
def live_server(prepared_cache):
    server = ServerProcess(
        MODEL,
        "--speculative-config",
        json.dumps({"method": "ngram", "num_speculative_tokens": 3}),
        "--max-model-len",
        "256",
        "--max-num-seqs",
        "2",
        "--log-stats-interval",
        "0",
    )
    # One request that drafts, so the per-position counters have series.
    reply = httpx.post(
        server.url + "/v1/completions",
        timeout=120,
        json={
            "model": MODEL,
            "prompt": "1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3,",
            "max_tokens": 16,
            "temperature": 0,
            "ignore_eos": True,
        },
    )
    assert reply.status_code == 200, reply.text
    yield server
    server.stop()


@pytest.fixture(scope="module")
def exported(live_server) -> set[str]:
    """The names of every sample the live server exports (histograms as _bucket,
    _sum and _count; counters as _total)."""
    text = httpx.get(live_server.url + "/metrics").text
    return {sample.name for family in text_string_to_metric_families(text) for sample in family.samples}


@needs_kubectl
def test_probe_and_scrape_paths_are_real_routes(live_server):
    paths = set()
    for stack in STACKS:
        for deployment in objects(stack, "Deployment").values():
            spec = container(deployment)
            paths |= {spec[p]["httpGet"]["path"] for p in ("startupProbe", "readinessProbe", "livenessProbe")}
        for service in objects(stack, "Service").values():
            paths.add(service["metadata"]["annotations"]["prometheus.io/path"])
        for monitor in objects(stack, "ServiceMonitor").values():
            paths |= {e["path"] for e in monitor["spec"]["endpoints"]}
    assert paths == {"/health", "/metrics"}
    for path in paths:
        assert httpx.get(live_server.url + path).status_code == 200


def dashboard_queries() -> list[tuple[str, str]]:
    """(where, PromQL) of every panel target and templating query, with Grafana's
    variables replaced by values a Prometheus would see."""
    dashboard = json.loads(DASHBOARD.read_text())
    found = [(f"panel {p['title']!r} {t['refId']}", t["expr"]) for p in dashboard["panels"] for t in p["targets"]]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            inner = re.fullmatch(r"label_values\((.*), *(\w+)\)", variable["query"]["query"])
            found.append((f"variable {variable['name']}", inner.group(1)))
    values = {"$__rate_interval": "1m", "$namespace": ".*", "$service": ".*"}
    return [
        (where, re.sub(r"\$__rate_interval|\$namespace|\$service", lambda m: values[m.group(0)], expr))
        for where, expr in found
    ]


def metric_names(expr: str) -> set[str]:
    names: set[str] = set()

    def visit(node) -> bool:
        if isinstance(node, promql_parser.VectorSelector):
            names.add(node.name)
        return True

    promql_parser.walk(promql_parser.parse(expr), visit)
    return names


def test_every_dashboard_query_parses_and_uses_only_metrics_the_server_exports(exported):
    used = set()
    for where, expr in dashboard_queries():
        names = metric_names(expr)
        assert names, f"{where} reads no metric"
        assert names <= exported, f"{where} reads {sorted(names - exported)}, which the server does not export"
        used |= names
    wanted = {
        f"specserve:{name}"
        for name in (
            "time_to_first_token_seconds_bucket",
            "inter_token_latency_seconds_bucket",
            "e2e_request_latency_seconds_bucket",
            "generation_tokens_total",
            "num_requests_running",
            "num_requests_waiting",
            "spec_decode_num_accepted_tokens_total",
            "spec_decode_num_draft_tokens_total",
            "spec_decode_num_drafts_total",
            "spec_decode_num_accepted_tokens_per_pos_total",
        )
    }
    assert wanted <= used, f"the dashboard lacks {sorted(wanted - used)}"


def test_every_dashboard_series_is_one_per_service():
    dashboard = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    cells = set()
    for panel in dashboard["panels"]:
        box = panel["gridPos"]
        area = {(x, y) for x in range(box["x"], box["x"] + box["w"]) for y in range(box["y"], box["y"] + box["h"])}
        assert box["x"] + box["w"] <= 24 and not area & cells, f"panel {panel['title']!r} overlaps another"
        cells |= area
        assert panel["datasource"]["uid"] == "${datasource}"
        for target in panel["targets"]:
            assert "{{service}}" in target["legendFormat"]
            tree = promql_parser.parse(re.sub(r"\$__rate_interval", "1m", target["expr"]))
            groupings: list[list[str]] = []

            def visit(node) -> bool:
                if isinstance(node, promql_parser.AggregateExpr):
                    by = node.modifier is not None and node.modifier.type == promql_parser.AggModifierType.By
                    groupings.append(list(node.modifier.labels) if by else [])
                return True

            promql_parser.walk(tree, visit)
            assert groupings and all("service" in labels for labels in groupings), target["expr"]
            assert 'service=~"$service"' in target["expr"]


# ----- the CloudWatch dashboard, against what `specserve bench --emf` writes -----


@pytest.fixture(scope="module")
def emf_written(live_server, tmp_path_factory) -> list[dict[str, Any]]:
    """The EMF lines of a real, short `specserve bench --emf` run against the live server,
    over the test cases the benchmark Job runs."""
    spec = container(job("bench"))
    env = {e["name"]: e["value"] for e in spec["env"] if "value" in e}
    out = tmp_path_factory.mktemp("emf")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "specserve.cli",
            "bench",
            "--url",
            live_server.url,
            "--test-case",
            env["TEST_CASES"],
            "--metadata",
            "variant=baseline",
            "--emf-file",
            str(out / "emf.jsonl"),
            "--max-num-completed-requests",
            "2",
            "--mean-output-tokens",
            "8",
            "--stddev-output-tokens",
            "0",
            "--results-dir",
            str(out / "results"),
        ],
        check=True,
        timeout=300,
        capture_output=True,
    )
    return [json.loads(line) for line in (out / "emf.jsonl").read_text().splitlines()]


# The fields of a dashboard body we use, as CloudWatch documents them ("Dashboard Body
# Structure and Syntax"): a metric row is [namespace, name, dimension, value, ..., {options}].
CLOUDWATCH_SCHEMA = {
    "type": "object",
    "required": ["widgets"],
    "additionalProperties": False,
    "properties": {
        "start": {"type": "string", "pattern": r"^-P(T?\d+[YMWDHS])+$"},
        "periodOverride": {"enum": ["auto", "inherit"]},
        "widgets": {
            "type": "array",
            "maxItems": 500,
            "items": {
                "type": "object",
                "additionalProperties": False,
                "required": ["type", "properties"],
                "properties": {
                    "type": {"enum": ["metric", "text"]},
                    "x": {"type": "integer", "minimum": 0, "maximum": 23},
                    "y": {"type": "integer", "minimum": 0},
                    "width": {"type": "integer", "minimum": 1, "maximum": 24},
                    "height": {"type": "integer", "minimum": 1, "maximum": 1000},
                    "properties": {"type": "object"},
                },
            },
        },
    },
}
METRIC_WIDGET_SCHEMA = {
    "type": "object",
    "required": ["metrics", "region"],
    "additionalProperties": False,
    "properties": {
        "title": {"type": "string"},
        "view": {"enum": ["timeSeries", "singleValue", "gauge", "bar", "pie", "table"]},
        "stacked": {"type": "boolean"},
        "setPeriodToTimeRange": {"type": "boolean"},
        "region": {"type": "string", "pattern": r"^[a-z]{2}(-[a-z]+)+-\d$"},
        "period": {"type": "integer", "minimum": 60, "multipleOf": 60},
        "stat": {"type": "string"},
        "metrics": {
            "type": "array",
            "minItems": 1,
            "maxItems": 500,
            "items": {
                "type": "array",
                "minItems": 3,
                "prefixItems": [{"type": "string"}, {"type": "string"}],
                "items": {
                    "anyOf": [
                        {"type": "string"},
                        {
                            "type": "object",
                            "additionalProperties": False,
                            "properties": {"stat": {"type": "string"}, "label": {"type": "string"}},
                        },
                    ]
                },
            },
        },
    },
}
STATISTIC = re.compile(r"^(SampleCount|Average|Sum|Minimum|Maximum|p\d{1,2}(\.\d+)?)$")


def cloudwatch_widgets() -> list[dict[str, Any]]:
    body = json.loads(CLOUDWATCH_DASHBOARD.read_text())
    jsonschema.validate(body, CLOUDWATCH_SCHEMA)
    return body["widgets"]


def cloudwatch_metrics() -> list[tuple[str, str, dict[str, str], str]]:
    """(namespace, metric name, dimensions, statistic) of every series the dashboard reads."""
    found = []
    for widget in cloudwatch_widgets():
        if widget["type"] != "metric":
            continue
        properties = widget["properties"]
        for row in properties["metrics"]:
            options = row[-1] if isinstance(row[-1], dict) else {}
            fields = row[:-1] if options else row
            namespace, name, *pairs = fields
            assert len(pairs) % 2 == 0, row
            found.append(
                (namespace, name, dict(zip(pairs[::2], pairs[1::2])), options.get("stat", properties.get("stat")))
            )
    return found


def test_cloudwatch_dashboard_is_a_put_dashboard_body_laid_out_without_overlaps():
    cells = set()
    for widget in cloudwatch_widgets():
        if widget["type"] == "metric":
            jsonschema.validate(widget["properties"], METRIC_WIDGET_SCHEMA)
        else:
            assert widget["properties"]["markdown"]
        x, y, w, h = (widget[k] for k in ("x", "y", "width", "height"))
        area = {(i, j) for i in range(x, x + w) for j in range(y, y + h)}
        assert x + w <= 24 and not area & cells, f"widget at {x},{y} overlaps another"
        cells |= area


def test_cloudwatch_dashboard_reads_only_metrics_and_dimensions_that_bench_emf_writes(emf_written):
    """Every namespace, metric name and dimension set the dashboard reads is one a real
    `specserve bench --emf` run wrote (CloudWatch finds a metric only by its exact
    dimension set); every dimension value is one the benchmark Jobs write: their variants
    and test cases, all of which the dashboard shows."""
    written = [d for line in emf_written for d in line["_aws"]["CloudWatchMetrics"]]
    namespaces = {d["Namespace"] for d in written}
    dimension_sets = {frozenset(s) for d in written for s in d["Dimensions"]}
    names = {m["Name"] for d in written for m in d["Metrics"]}
    test_cases = {line["TestCase"] for line in emf_written}
    jobs = [container(job(folder)) for folder in ("bench", "bench-four-way")]
    assert not any("--emf-namespace" in spec["args"] for spec in jobs), "the Jobs write the default namespace"
    benched = {v for spec in jobs for e in spec["env"] if e["name"] == "VARIANTS" for v in e["value"].split()}
    assert benched == set(FOUR_WAY)
    read = cloudwatch_metrics()
    for namespace, name, dimensions, statistic in read:
        where = f"{namespace}/{name} {dimensions}"
        assert namespace in namespaces, where
        assert name in names, f"{where}: `bench --emf` writes no {name}"
        assert frozenset(dimensions) in dimension_sets, f"{where}: `bench --emf` writes no such dimension set"
        assert dimensions["Variant"] in benched and dimensions["TestCase"] in test_cases, where
        assert statistic and STATISTIC.match(statistic), where
    assert {d["Variant"] for _, _, d, _ in read} == benched
    assert {d["Variant"] for _, name, d, _ in read if name == "AcceptanceRate"} == benched - {"baseline"}
    assert {d["TestCase"] for _, _, d, _ in read} == test_cases
    latencies = {"TimeToFirstToken", "InterTokenLatency", "EndToEndLatency"}
    assert latencies | {"OutputThroughput", "Errors", "AcceptanceRate", "MeanAcceptanceLength"} <= {
        name for _, name, _, _ in read
    }
    for latency in latencies:  # percentiles, as LLMPerf reports them
        assert {"p50", "p99"} <= {stat for _, name, _, stat in read if name == latency}


# ----- the artifacts cache, mounted read-only -----


def test_a_prepared_model_loads_from_a_cache_that_cannot_be_written(prepared_cache, tmp_path, monkeypatch):
    """A cache mounted read-only (prepared elsewhere, served from S3) resolves what it
    holds without taking a lock, and says what to do about what it lacks."""
    prepared = catalogue.prepare(MODEL)
    cache = tmp_path / "cache"
    (cache / "models").mkdir(parents=True)
    (cache / "models" / MODEL).symlink_to(prepared)
    (cache / "locks").write_text("")  # nothing can be made under it, as on a read-only mount
    monkeypatch.setenv("SPECSERVE_CACHE", str(cache))
    assert catalogue.resolve(MODEL) == cache / "models" / MODEL
    with pytest.raises(ModelLoadError, match="cannot be written"):
        catalogue.resolve(catalogue.DEFAULT_DRAFT)
