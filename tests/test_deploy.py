"""deploy/ as an operator meets it: every folder with a kustomization.yaml rendered by
`kubectl kustomize` and validated offline against the Kubernetes schemas (one pinned
version); the baseline and speculative services identical but for the speculative
config; the server and benchmark flags real `specserve` flags; probes, scrape paths and
every metric the Grafana dashboard queries checked against a live `specserve serve`;
the benchmark Job's script run with stand-ins for `specserve`; the Dockerfile's
promises read from it.

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

from specserve import cli, models
from specserve.bench.local_server import ServerProcess
from specserve.bench.options import options_from_args
from specserve.config import SpecConfig

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
KUBERNETES_VERSION = "1.32.0"
KUSTOMIZATIONS = sorted(str(p.parent.relative_to(DEPLOY)) for p in DEPLOY.rglob("kustomization.yaml"))
# What an operator applies: the two services (base, overlays/*); the Job goes beside one.
STACKS = ["base", *sorted(str(p.relative_to(DEPLOY)) for p in (DEPLOY / "overlays").iterdir() if p.is_dir())]
VARIANTS = ("baseline", "speculative")
VARIANT_LABEL = "specserve/variant"
DASHBOARD = DEPLOY / "grafana" / "specserve.json"
MODEL = "smollm2-135m"

needs_kubectl = pytest.mark.skipif(shutil.which("kubectl") is None,
                                   reason="kubectl is not installed: `kubectl kustomize` renders deploy/")

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
                "selector": {"type": "object", "additionalProperties": False, "properties": {
                    "matchLabels": {"type": "object", "additionalProperties": {"type": "string"}}}},
                "endpoints": {"type": "array", "minItems": 1, "items": {
                    "type": "object", "additionalProperties": False, "required": ["port"],
                    "properties": {
                        "port": {"type": "string"},
                        "path": {"type": "string"},
                        "interval": {"type": "string", "pattern": r"^(0|(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"},
                    }}},
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


@needs_kubectl
@pytest.mark.parametrize("folder", KUSTOMIZATIONS)
def test_every_kustomization_renders_and_validates_against_the_kubernetes_schemas(folder):
    for obj in render(folder):
        if obj["apiVersion"].startswith("monitoring.coreos.com/"):
            jsonschema.validate(obj, SERVICE_MONITOR_SCHEMA)
        else:
            kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
        name = obj["metadata"]["name"]
        assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", name) and len(name) <= 63, name


@needs_kubectl
def test_the_folders_that_matter_are_there():
    assert {"base", "bench", "variants/baseline", "variants/speculative", "overlays/gpu", "overlays/neuron",
            "overlays/monitoring", "components/servicemonitor", "components/hpa"} <= set(KUSTOMIZATIONS)
    for component in (c for c in KUSTOMIZATIONS if c.startswith("components/")):
        assert kustomization(component)["kind"] == "Component"
        assert any(f"../{component}" in str(kustomization(s).get("components", [])) for s in [*STACKS, "bench"]), \
            f"{component} is used by no overlay, so nothing renders it"


@needs_kubectl
@pytest.mark.parametrize("stack", STACKS)
def test_each_stack_is_self_contained(stack):
    """Every name a stack refers to is an object of the stack (the API-key Secret is
    optional; the cache volume is the stack's own), and each Service selects exactly
    the pods of one Deployment."""
    rendered = render(stack)
    names = {(o["kind"], o["metadata"]["name"]) for o in rendered}
    deployments = objects(stack, "Deployment")
    assert set(deployments) == {f"specserve-{v}" for v in VARIANTS}
    for deployment in deployments.values():
        pod = deployment["spec"]["template"]["spec"]
        assert deployment["spec"]["selector"]["matchLabels"].items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
        for source in container(deployment)["envFrom"]:
            assert ("ConfigMap", source["configMapRef"]["name"]) in names
        for env in container(deployment)["env"]:
            if "secretKeyRef" in env.get("valueFrom", {}):
                assert env["valueFrom"]["secretKeyRef"]["optional"] is True
        for volume in pod["volumes"]:
            assert ("PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"]) in names
    for service in objects(stack, "Service").values():
        selected = [d for d in deployments.values()
                    if service["spec"]["selector"].items() <= d["spec"]["template"]["metadata"]["labels"].items()]
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
def test_baseline_and_speculative_differ_only_in_the_speculative_config(stack):
    deployments, services = objects(stack, "Deployment"), objects(stack, "Service")
    baseline, speculative = (without_variant(deployments[f"specserve-{v}"]) for v in VARIANTS)
    args = container(speculative)["args"]
    at = args.index("--speculative-config")
    assert "--speculative-config" not in container(baseline)["args"]
    del args[at:at + 2]
    assert speculative == baseline
    assert without_variant(services["specserve-baseline"]) == without_variant(services["specserve-speculative"])
    for variant in VARIANTS:  # the variant label tells the two apart everywhere
        assert deployments[f"specserve-{variant}"]["spec"]["template"]["metadata"]["labels"][VARIANT_LABEL] == variant
        assert services[f"specserve-{variant}"]["spec"]["selector"][VARIANT_LABEL] == variant


@needs_kubectl
@pytest.mark.parametrize("stack", STACKS)
def test_server_args_are_real_serve_flags_with_a_speculative_config_for_one(stack):
    parser = cli.build_parser()
    for variant, deployment in objects(stack, "Deployment").items():
        env = server_env(stack, deployment)
        args = expand(container(deployment)["args"], env)
        assert not any("$(" in arg for arg in args), f"unresolved variable in {args}"
        parsed = parser.parse_args(["serve", *args])
        assert parsed.model in models.CATALOGUE and parsed.host == "0.0.0.0" and parsed.port == 8000
        assert env["SPECSERVE_CACHE"] == "/cache"
        spec = SpecConfig.parse(parsed.speculative_config)
        assert (spec is not None) == variant.endswith("speculative")
        if spec is not None:
            assert spec.num_speculative_tokens >= 1


@needs_kubectl
@pytest.mark.parametrize("stack", STACKS)
def test_probes_allow_for_model_preparation_and_keep_the_api_key_optional(stack):
    for deployment in objects(stack, "Deployment").values():
        spec = container(deployment)
        ports = {p["name"]: p["containerPort"] for p in spec["ports"]}
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert spec[probe]["httpGet"]["port"] in ports
        startup = spec["startupProbe"]
        assert startup["periodSeconds"] * startup["failureThreshold"] >= 15 * 60
        api_key = next(e for e in spec["env"] if e["name"] == "SPECSERVE_API_KEY")
        assert api_key["valueFrom"]["secretKeyRef"] == {"name": "specserve-api-key", "key": "api-key", "optional": True}
        assert spec["resources"]["requests"] and spec["resources"]["limits"]
        pod = deployment["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert {"name": "cache", "mountPath": "/cache"} in spec["volumeMounts"]


def accelerators(stack: str) -> set[str]:
    found = set()
    for deployment in objects(stack, "Deployment").values():
        resources = container(deployment)["resources"]
        found |= {name for name in resources["limits"] if "/" in name}
        assert {k: v for k, v in resources["requests"].items() if "/" in k} == \
               {k: v for k, v in resources["limits"].items() if "/" in k}
    return found


@needs_kubectl
def test_accelerator_overlays_request_their_devices_for_both_services():
    assert accelerators("base") == set()
    assert accelerators("overlays/gpu") == {"nvidia.com/gpu"}
    assert accelerators("overlays/neuron") == {"aws.amazon.com/neuron"}
    for stack, resource in (("overlays/gpu", "nvidia.com/gpu"), ("overlays/neuron", "aws.amazon.com/neuron")):
        for deployment in objects(stack, "Deployment").values():
            assert container(deployment)["resources"]["limits"][resource] == "1"
            assert {"key": resource, "operator": "Exists", "effect": "NoSchedule"} in \
                   deployment["spec"]["template"]["spec"]["tolerations"]
    # A GPU pod computes on its GPU, or fails at start saying why; elsewhere the CPU.
    for stack, device in (("base", "auto"), ("overlays/gpu", "cuda"), ("overlays/autoscaled", "cuda"),
                          ("overlays/neuron", "auto")):
        for deployment in objects(stack, "Deployment").values():
            args = expand(container(deployment)["args"], server_env(stack, deployment))
            assert args[args.index("--device") + 1] == device


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


# ----- the benchmark Job -----

def job() -> dict[str, Any]:
    (only,) = objects("bench", "Job").values()
    return only


@needs_kubectl
def test_bench_job_volumes_and_image_are_the_services_own():
    claims = {v["persistentVolumeClaim"]["claimName"] for v in job()["spec"]["template"]["spec"]["volumes"]}
    assert claims == {"specserve-bench-results", "specserve-cache"}
    assert "specserve-bench-results" in objects("bench", "PersistentVolumeClaim")
    assert "specserve-cache" in objects("base", "PersistentVolumeClaim")
    assert container(job())["image"] == container(objects("base", "Deployment")["specserve-baseline"])["image"]


@needs_kubectl
def test_bench_job_script_benches_both_services_then_compares(tmp_path):
    """The Job's shell script, run here with `specserve` and `python` stand-ins that log
    their arguments, and /results moved under tmp_path; the logged `specserve bench`
    arguments then go through the real flag parser."""
    spec = container(job())
    env = {e["name"]: e["value"] for e in spec["env"] if "value" in e}
    shell, flag, script, name = expand(spec["command"], env)
    assert (shell, flag) == ("/bin/sh", "-c")
    results = tmp_path / "results"
    results.mkdir()
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "calls.jsonl"
    for tool in ("specserve", "python"):
        path = bin_dir / tool
        path.write_text(f"#!{sys.executable}\nimport json, sys\n"
                        f"open({str(log)!r}, 'a').write(json.dumps([{tool!r}, *sys.argv[1:]]) + '\\n')\n")
        path.chmod(path.stat().st_mode | stat.S_IEXEC)
    subprocess.run([shell, flag, script.replace("/results", str(results)), name, *expand(spec["args"], env)],
                   env={**env, "PATH": f"{bin_dir}:{os.environ['PATH']}"}, check=True, timeout=30)
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    health = [c[-1] for c in calls if c[0] == "python"]
    benches = [c[2:] for c in calls if c[:2] == ["specserve", "bench"]]
    compares = [c[2:] for c in calls if c[:2] == ["specserve", "compare"]]
    assert health == [f"http://specserve-{v}:8000/health" for v in VARIANTS]
    assert len(benches) == len(VARIANTS) and len(compares) == 1
    run = Path(os.readlink(results / "latest"))
    assert run.parent == results
    for variant, args in zip(VARIANTS, benches):
        options = options_from_args(cli.build_parser().parse_args(["bench", *args]))
        assert options.url == f"http://specserve-{variant}:8000"
        assert [w.name for w in options.workloads] == ["structured", "open-ended"]
        assert options.metadata == {"variant": variant} and options.results_dir == run / variant
        assert options.emf is not None and options.additional_sampling_params == {"temperature": 0}
    assert compares[0] == [str(run / v) for v in VARIANTS] + ["--output-dir", str(run / "comparison")]


# ----- the image -----

def test_dockerfile_runs_specserve_serve_as_a_non_root_user_with_the_cache_on_a_volume():
    text = (DEPLOY / "Dockerfile").read_text()
    instructions = [line for line in re.sub(r"\\\n", " ", text).splitlines() if line and not line.startswith("#")]
    def last(word: str) -> str:
        return [i for i in instructions if i.split()[0] == word][-1][len(word):].strip()
    assert last("USER").split(":")[0] not in ("", "0", "root")
    assert json.loads(last("ENTRYPOINT")) == ["specserve", "serve"]
    assert "SPECSERVE_CACHE=/cache" in last("ENV") and json.loads(last("VOLUME")) == ["/cache"]
    assert "/health" in last("HEALTHCHECK") and "--start-period" in last("HEALTHCHECK")
    assert re.search(r"ARG TORCH_INDEX_URL=\S+/cpu\b", text)  # a CPU torch unless told otherwise
    baked = re.search(r'ARG MODELS="([^"]+)"', text).group(1).split()
    assert set(baked) <= set(models.CATALOGUE)
    assert json.loads(last("CMD"))[0] in baked
    settings = dict(line.split("=", 1) for line in (DEPLOY / "base" / "settings.env").read_text().splitlines()
                    if line and not line.startswith("#"))
    spec = SpecConfig.parse(settings["SPECULATIVE_CONFIG"])
    assert {settings["MODEL"], spec.model} <= set(baked), "the deployed models must be baked into the image"


# ----- against a live server: routes and the dashboard's metrics -----

@pytest.fixture(scope="module")
def live_server(prepared_cache):
    server = ServerProcess(MODEL, "--speculative-config", json.dumps({"method": "ngram", "num_speculative_tokens": 3}),
                           "--max-model-len", "256", "--max-num-seqs", "2", "--log-stats-interval", "0")
    # One request that drafts, so the per-position counters have series.
    reply = httpx.post(server.url + "/v1/completions", timeout=120, json={
        "model": MODEL, "prompt": "1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3,", "max_tokens": 16, "temperature": 0,
        "ignore_eos": True})
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
    return [(where, re.sub(r"\$__rate_interval|\$namespace|\$service", lambda m: values[m.group(0)], expr))
            for where, expr in found]


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
    wanted = {f"specserve:{name}" for name in (
        "time_to_first_token_seconds_bucket", "inter_token_latency_seconds_bucket", "e2e_request_latency_seconds_bucket",
        "generation_tokens_total", "num_requests_running", "num_requests_waiting",
        "spec_decode_num_accepted_tokens_total", "spec_decode_num_draft_tokens_total", "spec_decode_num_drafts_total",
        "spec_decode_num_accepted_tokens_per_pos_total")}
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
