// Offline validation of Kubernetes manifests, run by ../test.sh.
//
//   node validate.mjs [--extract-configs DIR] FILE...
//
// Every YAML document of every FILE must be a Kubernetes object that the
// API server would take. Two checks per object, both offline:
//
//   1. schema: the object against the OpenAPI schema of its apiVersion and
//      kind, from the npm packages kubernetes-models (the core and apps
//      APIs) and @kubernetes-models/prometheus-operator (ServiceMonitor),
//      through their compiled validators: types, required fields, formats
//      (quantities, ports), enums.
//   2. fields: no field the API does not know. The OpenAPI schemas allow
//      unknown fields, but the API server drops them with a warning, or with
//      kubectl's default --validate=strict refuses the object; a typo such
//      as `hostNetwrok: true` would otherwise pass check 1 and be silently
//      ignored. TypeScript's excess-property check against the same
//      packages' type declarations finds it, in rounds (tsc stops at an
//      object's first error).
//
//   3. consistency, across the objects of one run (see consistency()): the
//      ciuicd DaemonSet against its ConfigMap's ciuicd.yaml (socket on the
//      hostPath, probes on that socket, ports as listen and metrics_listen,
//      the token file in a mounted Secret), the ServiceMonitor and Service
//      against the daemon, the trainers' CIUIC_SOCKET against the daemon's.
//
// An object whose apiVersion/kind neither package models is an error, not a
// skip. Prints one line per object and per consistency check, "ok" or the
// error, and exits 1 if anything failed (2 on a usage error).
//
// --extract-configs DIR: writes the ciuicd.yaml of every ConfigMap to DIR
// (config-N.yaml as it is, config-N.local.yaml with what only exists in a
// pod replaced: cluster_token_file -> DIR/token, metrics_listen ->
// 127.0.0.1:0) and lists them in DIR/configs.tsv, so that test.sh can run
// the real daemon's parser on them. Lines are kept where they are, so the
// daemon's FILE:LINE messages point at the ConfigMap's text.
//
// It runs from the directory that holds node_modules (test.sh copies it
// there), so that Node and tsc resolve the packages next to it.

import fs from "node:fs";
import path from "node:path";
import { spawnSync } from "node:child_process";
import { fileURLToPath } from "node:url";
import YAML from "yaml";

const HERE = path.dirname(fileURLToPath(import.meta.url));

// Where the model of an apiVersion/kind may live, tried in order: a module
// `${package}/${apiVersion}/${kind}` exporting class `kind` and interface
// `I${kind}`.
const MODEL_PACKAGES = ["kubernetes-models", "@kubernetes-models/prometheus-operator"];

function usage(message) {
  process.stderr.write(`validate.mjs: ${message}\nusage: node validate.mjs [--extract-configs DIR] FILE...\n`);
  process.exit(2);
}

// The model class and its module for apiVersion/kind, or null if no package
// has one.
async function loadModel(apiVersion, kind) {
  // Only the shapes of real apiVersions and kinds ("v1", "apps/v1",
  // "monitoring.coreos.com/v1"; "DaemonSet") make a module path: nothing
  // from a manifest can point the import elsewhere ("..", "/").
  if (!/^([a-z0-9]([-a-z0-9.]*[a-z0-9])?\/)?v[0-9]+[a-z0-9]*$/.test(apiVersion) || !/^[A-Za-z][A-Za-z0-9]*$/.test(kind)) {
    return null;
  }
  for (const pkg of MODEL_PACKAGES) {
    const spec = `${pkg}/${apiVersion}/${kind}`;
    let mod;
    try {
      mod = await import(spec);
    } catch (e) {
      if (e.code === "ERR_PACKAGE_PATH_NOT_EXPORTED" || e.code === "ERR_MODULE_NOT_FOUND") continue;
      throw e;
    }
    const model = mod[kind];
    // A module of the same name may hold a part of an object (DaemonSetSpec):
    // only a top-level model carries its own apiVersion and kind.
    if (model && model.apiVersion === apiVersion && model.kind === kind) return { model, spec };
  }
  return null;
}

// "/spec/template/spec/containers/0/name" -> "spec.template.spec.containers[0].name"
function jsonPointerToPath(pointer) {
  if (!pointer) return "(object)";
  return pointer
    .split("/")
    .slice(1)
    .map((p) => p.replace(/~1/g, "/").replace(/~0/g, "~"))
    .reduce((out, p) => (/^\d+$/.test(p) ? `${out}[${p}]` : out ? `${out}.${p}` : p), "");
}

// Check 1: the compiled OpenAPI validator. Returns error lines, [] if none.
function schemaErrors(model, obj) {
  try {
    new model(obj).validate();
    return [];
  } catch (e) {
    if (!Array.isArray(e.errors)) return [String(e.message || e)];
    // oneOf alternatives (a quantity is a number or a string of a format)
    // report one error each: group them per field.
    const byPath = new Map();
    for (const err of e.errors) {
      const where = jsonPointerToPath(err.instancePath);
      if (!byPath.has(where)) byPath.set(where, new Set());
      byPath.get(where).add(err.message || err.keyword);
    }
    return [...byPath].map(([where, messages]) => `${where}: ${[...messages].join("; ")}`);
  }
}

// Writes `value` as JSON, one member per line, and records for each line the
// path (a list of keys and indices) of the member on it, so that a tsc
// error's line names the field.
function emitJson(value, pathHere, indent, prefix, suffix, lines, paths) {
  const pad = "  ".repeat(indent);
  const push = (text, p) => {
    lines.push(pad + text);
    paths.push(p);
  };
  if (Array.isArray(value)) {
    if (value.length === 0) return push(`${prefix}[]${suffix}`, pathHere);
    push(`${prefix}[`, pathHere);
    value.forEach((v, i) =>
      emitJson(v, [...pathHere, i], indent + 1, "", i + 1 < value.length ? "," : "", lines, paths));
    return push(`]${suffix}`, pathHere);
  }
  if (value !== null && typeof value === "object") {
    const keys = Object.keys(value);
    if (keys.length === 0) return push(`${prefix}{}${suffix}`, pathHere);
    push(`${prefix}{`, pathHere);
    keys.forEach((k, i) =>
      emitJson(value[k], [...pathHere, k], indent + 1, `${JSON.stringify(k)}: `,
        i + 1 < keys.length ? "," : "", lines, paths));
    return push(`}${suffix}`, pathHere);
  }
  return push(`${prefix}${JSON.stringify(value)}${suffix}`, pathHere);
}

// ["spec", "containers", 0, "name"] -> "spec.containers[0].name"
function formatPath(keys) {
  if (keys.length === 0) return "(object)";
  return keys.reduce((out, k) => (typeof k === "number" ? `${out}[${k}]` : out ? `${out}.${k}` : k), "");
}

// Removes the member at `keys` from `obj`; false if there is none (the root).
function removePath(obj, keys) {
  if (keys.length === 0) return false;
  let parent = obj;
  for (const k of keys.slice(0, -1)) parent = parent?.[k];
  const last = keys.at(-1);
  if (parent === null || typeof parent !== "object" || !(last in parent)) return false;
  if (Array.isArray(parent)) parent.splice(last, 1);
  else delete parent[last];
  return true;
}

// One tsc run: each object in `work` (index -> object) assigned, as a
// literal, to its model's interface. Returns index -> the first diagnostic
// of that object, {keys, code, message}: tsc reports one per assignment.
function tscRound(items, work, dir) {
  const lines = [];
  const paths = [];
  const owner = []; // line -> index into items
  for (const i of work.keys()) {
    lines.push(`import type { I${items[i].obj.kind} as T${i} } from ${JSON.stringify(items[i].spec)};`);
    paths.push([]);
    owner.push(-1);
  }
  for (const [i, obj] of work) {
    const start = lines.length;
    emitJson(obj, [], 0, `export const o${i}: T${i} = `, ";", lines, paths);
    for (let l = start; l < lines.length; ++l) owner[l] = i;
  }
  fs.writeFileSync(path.join(dir, "objects.mts"), lines.join("\n") + "\n");
  const tsc = path.join(HERE, "node_modules", "typescript", "bin", "tsc");
  const run = spawnSync(process.execPath, [tsc, "-p", path.join(dir, "tsconfig.json"), "--pretty", "false"], {
    encoding: "utf8",
  });
  if (run.error) throw run.error;
  // "objects.mts(LINE,COL): error TSNNNN: message", its continuation lines
  // indented below it.
  const found = new Map();
  let last = null;
  for (const text of (run.stdout + run.stderr).split("\n")) {
    const m = /objects\.mts\((\d+),(\d+)\): error (TS\d+): (.*)$/.exec(text);
    if (m) {
      const line = Number(m[1]) - 1;
      const i = owner[line] ?? -1;
      if (i < 0) throw new Error(`tsc: ${text}`); // an import line: a model without its interface
      last = { keys: paths[line], code: m[3], message: m[4] };
      if (!found.has(i)) found.set(i, last);
    } else if (last && /^\s+\S/.test(text)) {
      last.message += ` ${text.trim()}`;
    }
  }
  if (run.status !== 0 && found.size === 0) {
    throw new Error(`tsc failed without a diagnostic naming a field:\n${run.stdout}${run.stderr}`);
  }
  return found;
}

// Check 2. tsc stops at an object's first error, so this runs rounds: each
// reported member is taken out of a copy of its object and the object is
// checked again, until it is clean (or MAX_ROUNDS). Returns index -> error
// lines. Type errors that check 1 already reported are not repeated.
const MAX_ROUNDS = 20;
function fieldErrors(items) {
  const errors = new Map();
  const work = new Map();
  items.forEach((item, i) => {
    if (item.spec) work.set(i, structuredClone(item.obj));
  });
  if (work.size === 0) return errors;

  // Inside HERE, so that tsc resolves the packages from its node_modules.
  const dir = fs.mkdtempSync(path.join(HERE, ".fields-"));
  try {
    fs.writeFileSync(
      path.join(dir, "tsconfig.json"),
      JSON.stringify({
        compilerOptions: {
          strict: true,
          noEmit: true,
          module: "nodenext",
          moduleResolution: "nodenext",
          skipLibCheck: true,
          types: [],
        },
        files: ["objects.mts"],
      }),
    );
    for (let round = 1; work.size > 0; ++round) {
      const found = tscRound(items, work, dir);
      for (const i of [...work.keys()]) {
        const diagnostic = found.get(i);
        if (!diagnostic) {
          work.delete(i); // clean
          continue;
        }
        const unknown = /known properties, and '"?([^'"]+)"?' does not exist in type '([^']+)'/.exec(
          diagnostic.message);
        if (unknown || items[i].errors.length === 0) {
          if (!errors.has(i)) errors.set(i, []);
          errors.get(i).push(`${formatPath(diagnostic.keys)}: ` +
            (unknown ? `unknown field (not in ${unknown[2]})` : `${diagnostic.message} [${diagnostic.code}]`));
        }
        if (!removePath(work.get(i), diagnostic.keys) || round === MAX_ROUNDS) {
          if (round === MAX_ROUNDS) errors.get(i)?.push(`(stopped after ${MAX_ROUNDS} rounds; there may be more)`);
          work.delete(i);
        }
      }
    }
  } finally {
    fs.rmSync(dir, { recursive: true, force: true });
  }
  return errors;
}

// The parts of a ciuicd.yaml that only exist inside a daemon pod, made local
// (see the header). Replaces whole lines of top-level keys only.
function localConfig(text, dir) {
  let config;
  try {
    config = YAML.parse(text); // yaml-cpp, like this, reads YAML 1.2
  } catch {
    return text; // the daemon will name the syntax error itself
  }
  if (config === null || typeof config !== "object") return text;
  const replace = (key, value) => {
    if (!config[key]) return; // unset or "": nothing to make local
    text = text.replace(new RegExp(`^${key}[ \\t]*:.*$`, "m"), `${key}: ${JSON.stringify(value)}`);
  };
  replace("cluster_token_file", path.join(dir, "token"));
  replace("metrics_listen", "127.0.0.1:0");
  return text;
}

// Check 3, across the objects of one run: what must agree between the
// ciuicd DaemonSet, its config, the metrics Service, the ServiceMonitor and
// the trainers, none of which a schema sees. Each DaemonSet whose container
// runs ciuicd with --config is checked against the ciuicd.yaml of the
// ConfigMap mounted there (when that ConfigMap is among the objects).
// Returns [what, error or null] pairs.
function consistency(objects) {
  const results = [];
  const check = (what, error) => results.push([what, error || null]);
  const byKind = (kind) => objects.filter((o) => o?.kind === kind);
  const podSpecOf = (o) => (o.kind === "Pod" ? o.spec : o.spec?.template?.spec);
  const labelsOf = (o) => (o.kind === "Pod" ? o.metadata?.labels : o.spec?.template?.metadata?.labels) || {};
  const subset = (small, big) => Object.entries(small || {}).every(([k, v]) => big?.[k] === v);
  const portOf = (hostPort) => Number(/:(\d+)$/.exec(String(hostPort ?? ""))?.[1] ?? NaN);
  const dirOf = (p) => path.posix.dirname(String(p));
  // The volume mounted at the directory of `file` (or above it) in `container`.
  const volumeFor = (spec, container, file) => {
    const mount = (container.volumeMounts || [])
      .filter((m) => file === m.mountPath || String(file).startsWith(`${m.mountPath.replace(/\/$/, "")}/`))
      .sort((a, b) => b.mountPath.length - a.mountPath.length)[0];
    return mount && (spec.volumes || []).find((v) => v.name === mount.name);
  };

  const daemons = [];
  for (const ds of byKind("DaemonSet")) {
    const spec = podSpecOf(ds);
    for (const c of spec?.containers || []) {
      const argv = [...(c.command || []), ...(c.args || [])];
      const at = argv.indexOf("--config");
      if (!/ciuicd$/.test(argv[0] || "") || at < 0) continue;
      const configVolume = volumeFor(spec, c, argv[at + 1]);
      const cm = byKind("ConfigMap").find((m) => m.metadata?.name === configVolume?.configMap?.name);
      const name = `DaemonSet/${ds.metadata?.name}`;
      check(`${name}: --config ${argv[at + 1]} is a mounted ConfigMap of these objects`, cm ? null :
        `no ConfigMap among the objects is mounted at ${dirOf(argv[at + 1])}`);
      if (!cm) continue;
      let config;
      try {
        config = YAML.parse(cm.data?.["ciuicd.yaml"] ?? "") ?? {};
      } catch (e) {
        check(`${name}: ConfigMap/${cm.metadata.name} holds ciuicd.yaml`, `not YAML: ${e.message}`);
        continue;
      }
      const socket = config.socket ?? "/run/ciuic/ciuicd.sock";
      const socketVolume = volumeFor(spec, c, socket);
      check(`${name}: the socket ${socket} is on a hostPath`, socketVolume?.hostPath ? null :
        `no hostPath volume is mounted at ${dirOf(socket)} (the trainers could not reach the socket)`);
      for (const probe of ["livenessProbe", "readinessProbe"]) {
        const cmd = c[probe]?.exec?.command || [];
        const i = cmd.indexOf("--socket");
        check(`${name}: ${probe} asks ciuicctl at ${socket}`,
          cmd.length && /ciuicctl$/.test(cmd[0]) && i > 0 && cmd[i + 1] === socket ? null :
            `${probe} is ${JSON.stringify(cmd)}, not ciuicctl --socket ${socket} ...`);
      }
      const ports = Object.fromEntries((c.ports || []).map((p) => [p.name, p.containerPort]));
      if (config.metrics_listen) {
        check(`${name}: container port "metrics" is metrics_listen's`, ports.metrics === portOf(config.metrics_listen)
          ? null : `metrics_listen ${config.metrics_listen}, container port "metrics" ${JSON.stringify(ports.metrics)}`);
      }
      const listen = String(config.listen ?? "auto");
      if (listen !== "off") {
        const peer = listen === "auto" ? 7361 : portOf(listen);
        check(`${name}: container port "peer" is listen's`, ports.peer === peer ? null :
          `listen ${listen} (port ${peer}), container port "peer" ${JSON.stringify(ports.peer)}`);
      }
      if (config.cluster_token_file) {
        const v = volumeFor(spec, c, config.cluster_token_file);
        check(`${name}: cluster_token_file is in a mounted Secret`, v?.secret ? null :
          `no Secret volume is mounted above ${config.cluster_token_file}`);
      }
      daemons.push({ ds, socket, hostDir: socketVolume?.hostPath?.path, mountDir: dirOf(socket) });
    }
  }

  // The metrics path: ServiceMonitor -> Service -> the daemon pods' port.
  for (const sm of byKind("ServiceMonitor")) {
    const name = `ServiceMonitor/${sm.metadata?.name}`;
    const namespaces = sm.spec?.namespaceSelector?.matchNames;
    const services = byKind("Service").filter((s) => subset(sm.spec?.selector?.matchLabels, s.metadata?.labels) &&
      (!namespaces || namespaces.includes(s.metadata?.namespace)));
    check(`${name} selects a Service of these objects`, services.length ? null : "it selects none");
    for (const ep of sm.spec?.endpoints || []) {
      check(`${name}: endpoint port "${ep.port}" is a port of the Service`,
        services.some((s) => (s.spec?.ports || []).some((p) => p.name === ep.port)) ? null :
          `no selected Service has a port named ${ep.port}`);
    }
  }
  for (const svc of byKind("Service")) {
    const targets = daemons.filter(({ ds }) => subset(svc.spec?.selector, labelsOf(ds)) && svc.spec?.selector);
    if (targets.length === 0) continue; // not a Service of the daemon
    for (const p of svc.spec?.ports || []) {
      const named = typeof p.targetPort === "string";
      check(`Service/${svc.metadata?.name}: port ${p.name} reaches the daemon`, targets.every(({ ds }) =>
        podSpecOf(ds).containers.some((c) => (c.ports || []).some((cp) =>
          named ? cp.name === p.targetPort : cp.containerPort === (p.targetPort ?? p.port)))) ? null :
        `targetPort ${p.targetPort ?? p.port} is no port of the daemon container`);
    }
  }

  // Trainers: a container that sets CIUIC_SOCKET must see the daemon's socket
  // directory, from the same host path.
  for (const o of objects) {
    const spec = o && ["Pod", "Job", "Deployment", "StatefulSet"].includes(o.kind) ? podSpecOf(o) : null;
    for (const c of spec?.containers || []) {
      const socket = (c.env || []).find((e) => e.name === "CIUIC_SOCKET")?.value;
      if (!socket || daemons.length === 0) continue;
      const v = volumeFor(spec, c, socket);
      const name = `${o.kind}/${o.metadata?.name}`;
      check(`${name}: CIUIC_SOCKET ${socket} is a daemon's socket, through its hostPath`,
        daemons.some((d) => d.socket === socket && v?.hostPath?.path === d.hostDir) ? null :
          `the daemons serve ${daemons.map((d) => `${d.socket} (hostPath ${d.hostDir})`).join(", ")}; ` +
            `this container has ${socket} on ${v?.hostPath ? `hostPath ${v.hostPath.path}` : "no hostPath"}`);
    }
  }
  return results;
}

async function main() {
  const args = process.argv.slice(2);
  let extractDir = null;
  const files = [];
  for (let i = 0; i < args.length; ++i) {
    if (args[i] === "--extract-configs") {
      if (i + 1 >= args.length) usage("--extract-configs needs a directory");
      extractDir = args[++i];
    } else if (args[i].startsWith("-")) {
      usage(`unknown option ${args[i]}`);
    } else {
      files.push(args[i]);
    }
  }
  if (files.length === 0) usage("no files");

  // Every document of every file, with where it came from.
  const items = [];
  let unreadable = 0; // documents that are not YAML
  for (const file of files) {
    const text = fs.readFileSync(file, "utf8");
    // YAML 1.1, as kubectl and Helm read manifests (go-yaml): 0440 is octal,
    // `on`/`yes` are booleans. Duplicate keys are errors.
    const docs = YAML.parseAllDocuments(text, { version: "1.1", uniqueKeys: true, prettyErrors: true });
    docs.forEach((doc, n) => {
      // Helm puts "# Source: chart/templates/x.yaml" above each document.
      const source = /Source: (\S+)/.exec(`${doc.commentBefore ?? ""} ${doc.contents?.commentBefore ?? ""}`);
      const where = `${file}#${n + 1}${source ? ` (${source[1]})` : ""}`;
      if (doc.errors.length > 0) {
        console.log(`FAIL ${where}: YAML: ${doc.errors.map((e) => e.message).join("; ")}`);
        ++unreadable;
        return;
      }
      const obj = doc.toJS({ maxAliasCount: 100 });
      if (obj === null) return; // an empty document (a template that rendered nothing)
      items.push({ where, obj });
    });
  }

  // Check 1 for each object; its module for check 2.
  for (const item of items) {
    const { obj } = item;
    if (obj === null || typeof obj !== "object" || Array.isArray(obj)) {
      item.errors = ["not a mapping: not a Kubernetes object"];
      continue;
    }
    item.name = `${obj.kind}/${obj.metadata?.namespace ? `${obj.metadata.namespace}/` : ""}${obj.metadata?.name}`;
    if (typeof obj.apiVersion !== "string" || typeof obj.kind !== "string") {
      item.errors = ["apiVersion and kind must be strings"];
      continue;
    }
    if (typeof obj.metadata?.name !== "string" || obj.metadata.name === "") {
      item.errors = ["metadata.name is required"];
      continue;
    }
    const found = await loadModel(obj.apiVersion, obj.kind);
    if (!found) {
      item.errors = [`unknown kind: no model of ${obj.apiVersion} ${obj.kind} in ${MODEL_PACKAGES.join(" or ")}`];
      continue;
    }
    item.spec = found.spec;
    item.errors = schemaErrors(found.model, obj);
  }

  // Check 2: tsc over all objects at once, in rounds.
  const unknownFields = fieldErrors(items);
  items.forEach((item, i) => item.errors.push(...(unknownFields.get(i) || [])));

  let failed = 0;
  for (const item of items) {
    if (item.errors.length === 0) {
      console.log(`ok   ${item.where}: ${item.name}`);
    } else {
      ++failed;
      console.log(`FAIL ${item.where}: ${item.name ?? "?"}`);
      for (const e of item.errors) console.log(`       ${e}`);
    }
  }

  // Check 3 over all objects of this run.
  let inconsistent = 0;
  for (const [what, error] of consistency(items.map((item) => item.obj))) {
    if (error) ++inconsistent;
    console.log(error ? `FAIL consistency: ${what}\n       ${error}` : `ok   consistency: ${what}`);
  }

  if (extractDir) {
    fs.mkdirSync(extractDir, { recursive: true });
    const list = [];
    items.forEach((item) => {
      const text = item.obj?.kind === "ConfigMap" ? item.obj.data?.["ciuicd.yaml"] : undefined;
      if (typeof text !== "string") return;
      const base = `config-${list.length + 1}`;
      fs.writeFileSync(path.join(extractDir, `${base}.yaml`), text);
      fs.writeFileSync(path.join(extractDir, `${base}.local.yaml`), localConfig(text, extractDir));
      list.push(`${base}\t${item.where} ${item.name}`);
    });
    fs.writeFileSync(path.join(extractDir, "configs.tsv"), list.map((l) => l + "\n").join(""));
  }

  console.log(
    `${items.length} objects: ${items.length - failed} ok, ${failed} failed` +
      (unreadable ? `; ${unreadable} documents not YAML` : "") +
      (inconsistent ? `; ${inconsistent} consistency checks failed` : ""),
  );
  process.exit(failed + unreadable + inconsistent > 0 ? 1 : 0);
}

main().catch((e) => {
  console.error(`validate.mjs: ${e.stack || e}`);
  process.exit(1);
});
