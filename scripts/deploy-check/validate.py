"""Validates rendered Kubernetes manifests of deploy/kubernetes (run by scripts/check-deploy.sh).

usage: validate.py --repo DIR --npm DIR OVERLAY=RENDERED.yaml ...

Each object is checked against a schema that refuses unknown fields:
  - Kubernetes' own kinds: the OpenAPI schemas of Kubernetes 1.30 and 1.37 as strict JSON schemas
    (the kubernetes-validate package);
  - HTTPRoute (gateway.networking.k8s.io/v1): the Gateway API's generated TypeScript types,
    type-checked by tsc (an unknown field is an excess-property error), and its generated
    validator (patterns, enums, bounds, required fields) from @kubernetes-models/gateway-api;
  - InferencePool (inference.networking.k8s.io/v1): inferencepool-v1.schema.json beside this file.
A kind with none of these fails. Then the objects are checked against each other and against the
server (probe paths are routes of the server, the grace period covers the config's drain grace,
the pool selects the model server pods on their port, the picker reads metric names the pods'
engine label selects, the overlay's device is in the config and in the resource requests).
Exit status 1 and one line per problem when anything fails.
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

import importlib.resources

import jsonschema
import kubernetes_validate  # noqa: F401  (its schema files are read directly)
import referencing
import yaml

HERE = os.path.dirname(os.path.abspath(__file__))
K8S_VERSIONS = ("1.30", "1.37")
CORE_GROUPS = {"v1", "apps/v1", "policy/v1", "rbac.authorization.k8s.io/v1"}
DEVICE_RESOURCES = {"ascend": "huawei.com/Ascend910", "cuda": "nvidia.com/gpu"}

errors = []


def err(where, msg):
    errors.append(f"{where}: {msg}")


def kn(obj):
    return f"{obj.get('kind')}/{(obj.get('metadata') or {}).get('name')}"


def json_path(path):
    return ".".join(str(p) for p in path) or "(root)"


_validators = {}


def core_validator(version, obj):
    """The strict JSON schema of obj's kind in kubernetes-validate's files for this Kubernetes
    version (what kubernetes_validate.validate reads, with the definitions loaded once)."""
    api = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", obj["apiVersion"])
    key = (version, obj["kind"].lower(), api)
    if key not in _validators:
        base = importlib.resources.files("kubernetes_validate") / "kubernetes-json-schema"
        schema_dir = base / f"v{version}.0-local-strict"
        defs_key = ("defs", version)
        if defs_key not in _validators:
            _validators[defs_key] = referencing.Resource.from_contents(
                json.loads((schema_dir / "_definitions.json").read_text()))
        path = schema_dir / f"{key[1]}-{api}.json"
        if not path.is_file():
            _validators[key] = None
        else:
            schema = json.loads(path.read_text())
            registry = _validators[defs_key] @ (
                referencing.Resource.from_contents(schema) @ referencing.Registry())
            _validators[key] = jsonschema.Draft202012Validator(schema, registry=registry)
    return _validators[key]


def check_core(label, obj):
    for version in K8S_VERSIONS:
        v = core_validator(version, obj)
        if v is None:
            err(f"{label}: {kn(obj)}", f"no Kubernetes {version} schema for {obj['apiVersion']} {obj['kind']}")
            return
        found = sorted(v.iter_errors(obj), key=lambda e: list(e.absolute_path))
        for e in found:
            err(f"{label}: {kn(obj)}", f"{json_path(e.absolute_path)}: {e.message} (Kubernetes {version} schema)")
        if found:
            return


def check_inferencepool(overlay, obj, schema):
    v = jsonschema.Draft202012Validator(schema)
    for e in sorted(v.iter_errors(obj), key=lambda e: list(e.absolute_path)):
        err(f"{overlay}: {kn(obj)}", f"{json_path(e.absolute_path)}: {e.message} (InferencePool v1 schema)")
    spec = obj.get("spec") or {}
    ref = spec.get("endpointPickerRef")
    if isinstance(ref, dict) and ref.get("kind", "Service") == "Service" and "port" not in ref:
        err(f"{overlay}: {kn(obj)}", "spec.endpointPickerRef: port is required when kind is Service")
    numbers = [p.get("number") for p in spec.get("targetPorts") or [] if isinstance(p, dict)]
    if len(numbers) != len(set(numbers)):
        err(f"{overlay}: {kn(obj)}", "spec.targetPorts: port numbers must be unique")


def check_routes(routes, npm_dir):
    """tsc over the generated types, then the generated validator, for every HTTPRoute."""
    if not routes:
        return
    work = tempfile.mkdtemp(prefix="routes-", dir=npm_dir)
    try:
        lines = ['import type { IHTTPRoute } from '
                 '"@kubernetes-models/gateway-api/gateway.networking.k8s.io/v1/HTTPRoute";']
        names = []
        for i, (overlay, obj) in enumerate(routes):
            lines.append(f"// {overlay}: {kn(obj)}")
            lines.append(f"export const route{i}: IHTTPRoute = {json.dumps(obj, indent=1)};")
            names.append(f"{overlay}: {kn(obj)}")
        ts = os.path.join(work, "routes.ts")
        with open(ts, "w") as f:
            f.write("\n".join(lines) + "\n")
        tsc = os.path.join(npm_dir, "node_modules", ".bin", "tsc")
        r = subprocess.run([tsc, "--noEmit", "--strict", "--module", "nodenext", "--moduleResolution",
                            "nodenext", "--target", "es2022", "--skipLibCheck", ts],
                           capture_output=True, text=True)
        if r.returncode != 0:
            text = open(ts).read().splitlines()
            for line in (r.stdout + r.stderr).splitlines():
                m = re.match(r".*routes\.ts\((\d+),\d+\): error TS\d+: (.*)", line)
                if not m:
                    if line.strip():
                        err("HTTPRoute types", line.strip())
                    continue
                # Which object: the last "// overlay: kind/name" comment above the line.
                n = int(m.group(1))
                owner = next((t[3:] for t in reversed(text[:n]) if t.startswith("// ")), "HTTPRoute")
                err(owner, f"{m.group(2)} (Gateway API v1 types)")
        data = os.path.join(work, "routes.json")
        with open(data, "w") as f:
            json.dump([obj for _, obj in routes], f)
        js = os.path.join(work, "validate-routes.mjs")
        with open(js, "w") as f:
            f.write(
                'import { readFileSync } from "node:fs";\n'
                'import { HTTPRoute } from "@kubernetes-models/gateway-api/gateway.networking.k8s.io/v1/HTTPRoute";\n'
                'const routes = JSON.parse(readFileSync(process.argv[2], "utf8"));\n'
                'let bad = 0;\n'
                'routes.forEach((r, i) => { try { new HTTPRoute(r).validate(); } catch (e) {'
                ' bad++; console.log(i + "\\t" + String(e.message).split("\\n")[0]); } });\n'
                'process.exit(bad ? 1 : 0);\n')
        r = subprocess.run(["node", js, data], capture_output=True, text=True)
        if r.returncode != 0:
            for line in r.stdout.splitlines():
                i, _, msg = line.partition("\t")
                owner = names[int(i)] if i.isdigit() else "HTTPRoute"
                err(owner, f"{msg} (Gateway API v1 validator)")
            if r.stderr.strip():
                err("HTTPRoute validator", r.stderr.strip().splitlines()[-1])
    finally:
        subprocess.run(["rm", "-rf", work])


def server_routes(repo):
    """The paths the server's route table answers (server/src/api/mod.rs)."""
    text = open(os.path.join(repo, "server/src/api/mod.rs")).read()
    return set(re.findall(r'^\s*"(/[a-z_/]+)" => \(Route::', text, re.M))


def probe_path(container, probe):
    return ((container.get(probe) or {}).get("httpGet") or {}).get("path")


def check_overlay(label, overlay, objs, repo):
    by_kind = {}
    for o in objs:
        by_kind.setdefault(o["kind"], []).append(o)
    get = lambda kind, name: next((o for o in by_kind.get(kind, []) if o["metadata"]["name"] == name), None)
    where = label
    deployments = [d for d in by_kind.get("Deployment", [])
                   if d["metadata"].get("labels", {}).get("app.kubernetes.io/component") == "model-server"]
    if len(deployments) != 1:
        err(where, f"expected one model-server Deployment, found {len(deployments)}")
        return
    dep = deployments[0]
    where = f"{label}: {kn(dep)}"
    pod = dep["spec"]["template"]
    labels = pod["metadata"].get("labels", {})
    containers = {c["name"]: c for c in pod["spec"]["containers"]}
    server = containers.get("server")
    if server is None:
        err(where, "no container named server")
        return
    ports = {p.get("name"): p["containerPort"] for p in server.get("ports", [])}

    # Probes: the server's routes.
    routes = server_routes(repo)
    for probe, want in (("startupProbe", "/ready"), ("readinessProbe", "/ready"), ("livenessProbe", "/live")):
        path = probe_path(server, probe)
        if path != want:
            err(where, f"{probe}: path {path!r}, expected {want!r}")
        elif path not in routes:
            err(where, f"{probe}: {path} is not a route of the server (server/src/api/mod.rs)")

    # The config the pods mount, and the drain grace in it.
    volumes = {v["name"]: v for v in pod["spec"].get("volumes", [])}
    for v in volumes.values():
        if "configMap" in v and not get("ConfigMap", v["configMap"]["name"]):
            err(where, f"volume {v['name']}: ConfigMap {v['configMap']['name']} is not in the render")
    cm_name = (volumes.get("config") or {}).get("configMap", {}).get("name")
    cm = get("ConfigMap", cm_name) if cm_name else None
    if cm is None or "config.yaml" not in cm.get("data", {}):
        err(where, "no ConfigMap with config.yaml mounted as volume 'config'")
        return
    cfg = yaml.safe_load(cm["data"]["config.yaml"])
    grace_ms = (cfg.get("npu_serving") or {}).get("shutdown_grace_ms", 30000)
    pre_stop = ((server.get("lifecycle") or {}).get("preStop") or {}).get("sleep", {}).get("seconds", 0)
    tgps = pod["spec"].get("terminationGracePeriodSeconds", 30)
    need = pre_stop + grace_ms / 1000 + 5
    if tgps < need:
        err(where, f"terminationGracePeriodSeconds {tgps} < preStop {pre_stop} s + shutdown_grace_ms "
                   f"{grace_ms} ms + 5 s for the agents to exit ({need:g} s)")
    port = (cfg.get("serving_config") or {}).get("server_port")
    if ports.get("http") != port:
        err(where, f"container port http {ports.get('http')} is not the config's server_port {port}")

    # Device: config, resources.
    device = (cfg.get("npu_serving") or {}).get("device", "cpu")
    if device != overlay:
        err(where, f"the config says device {device!r} in overlay {overlay!r}")
    res = server.get("resources") or {}
    for dev, name in DEVICE_RESOURCES.items():
        lim = (res.get("limits") or {}).get(name)
        req = (res.get("requests") or {}).get(name)
        if dev == overlay and lim is None:
            err(where, f"no {name} in limits")
        if dev != overlay and (lim or req):
            err(where, f"{name} requested in overlay {overlay}")
        if req is not None and req != lim:
            err(where, f"{name}: requests {req} != limits {lim} (extended resources)")

    # Service, PDB, InferencePool select these pods.
    def selects(selector, what):
        missing = {k: v for k, v in (selector or {}).items() if labels.get(k) != v}
        if not selector or missing:
            err(f"{label}: {what}", f"selector {selector} does not select the pods of {kn(dep)}")
    for svc in by_kind.get("Service", []):
        if svc["metadata"]["name"] == dep["metadata"]["name"]:
            selects(svc["spec"].get("selector"), kn(svc))
    pdbs = by_kind.get("PodDisruptionBudget", [])
    if not pdbs:
        err(label, "no PodDisruptionBudget")
    for pdb in pdbs:
        selects(pdb["spec"]["selector"].get("matchLabels"), kn(pdb))
    pools = by_kind.get("InferencePool", [])
    if len(pools) != 1:
        err(label, f"expected one InferencePool, found {len(pools)}")
        return
    pool = pools[0]
    spec = pool["spec"]
    selects((spec.get("selector") or {}).get("matchLabels"), kn(pool))
    tp = [p.get("number") for p in spec.get("targetPorts", [])]
    if tp != [port]:
        err(f"{label}: {kn(pool)}", f"targetPorts {tp}, the server listens on {port}")
    ref = spec.get("endpointPickerRef") or {}
    epp_svc = get("Service", ref.get("name"))
    if epp_svc is None:
        err(f"{label}: {kn(pool)}", f"endpointPickerRef: no Service {ref.get('name')}")
    elif (ref.get("port") or {}).get("number") not in [p["port"] for p in epp_svc["spec"]["ports"]]:
        err(f"{label}: {kn(pool)}", f"endpointPickerRef: port not on Service {ref.get('name')}")
    for route in by_kind.get("HTTPRoute", []):
        for rule in route["spec"].get("rules", []):
            for b in rule.get("backendRefs", []):
                if b.get("kind") == "InferencePool" and b.get("name") != pool["metadata"]["name"]:
                    err(f"{label}: {kn(route)}", f"backendRef to unknown InferencePool {b.get('name')}")
    if not any(b.get("kind") == "InferencePool" and b.get("group") == "inference.networking.k8s.io"
               for r in by_kind.get("HTTPRoute", []) for rule in r["spec"].get("rules", [])
               for b in rule.get("backendRefs", [])):
        err(label, "no HTTPRoute to the InferencePool")

    # The endpoint picker: its pool, its config, the engine label of the pods.
    epps = [d for d in by_kind.get("Deployment", []) if d is not dep]
    if len(epps) != 1:
        err(label, "expected one endpoint picker Deployment")
        return
    epp = epps[0]
    args = epp["spec"]["template"]["spec"]["containers"][0].get("args", [])
    arg = lambda flag: args[args.index(flag) + 1] if flag in args and args.index(flag) + 1 < len(args) else None
    if arg("--pool-name") != pool["metadata"]["name"]:
        err(f"{label}: {kn(epp)}", f"--pool-name {arg('--pool-name')} is not the InferencePool")
    epp_vols = {v["name"]: v for v in epp["spec"]["template"]["spec"].get("volumes", [])}
    epp_cm = get("ConfigMap", (epp_vols.get("config") or {}).get("configMap", {}).get("name"))
    cfg_file = os.path.basename(arg("--config-file") or "")
    if epp_cm is None or cfg_file not in epp_cm.get("data", {}):
        err(f"{label}: {kn(epp)}", f"--config-file {cfg_file} is not in its mounted ConfigMap")
        return
    epp_cfg = yaml.safe_load(epp_cm["data"][cfg_file])
    extractor = next((p for p in epp_cfg.get("plugins", []) if p.get("type") == "core-metrics-extractor"), None)
    if extractor is None:
        err(f"{label}: {kn(epp)}", "no core-metrics-extractor plugin in the picker's config")
        return
    params = extractor.get("parameters") or {}
    key = params.get("engineLabelKey", "llm-d.ai/engine-type")
    engines = {e["name"]: e for e in params.get("engineConfigs", [])}
    engine = labels.get(key)
    if engine not in engines:
        err(where, f"pod label {key}={engine} names no engineConfigs entry of the picker ({sorted(engines)})")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repo", required=True)
    ap.add_argument("--npm", required=True)
    ap.add_argument("renders", nargs="+",
                    help="OVERLAY=FILE or LABEL:OVERLAY=FILE (problems are reported under LABEL)")
    a = ap.parse_args()
    pool_schema = json.load(open(os.path.join(HERE, "inferencepool-v1.schema.json")))
    routes = []
    total = 0
    for item in a.renders:
        name, _, path = item.partition("=")
        label, _, overlay = name.rpartition(":")
        label = label or overlay
        objs = [o for o in yaml.safe_load_all(open(path)) if o]
        total += len(objs)
        before = len(errors)
        for obj in objs:
            api = obj.get("apiVersion")
            if api in CORE_GROUPS:
                check_core(label, obj)
            elif api == "inference.networking.k8s.io/v1" and obj.get("kind") == "InferencePool":
                check_inferencepool(label, obj, pool_schema)
            elif api == "gateway.networking.k8s.io/v1" and obj.get("kind") == "HTTPRoute":
                routes.append((label, obj))
            else:
                err(f"{label}: {kn(obj)}", f"no schema for {api} {obj.get('kind')}")
        if len(errors) == before:  # the cross-checks assume well-formed objects
            check_overlay(label, overlay, objs, a.repo)
    check_routes(routes, a.npm)
    for e in errors:
        print(f"check-deploy: FAIL {e}")
    if errors:
        return 1
    print(f"check-deploy: {total} objects in {len(a.renders)} overlays valid "
          f"(Kubernetes {' and '.join(K8S_VERSIONS)} strict schemas, Gateway API v1 types and validator, "
          f"InferencePool v1 schema) and consistent")
    return 0


if __name__ == "__main__":
    sys.exit(main())
