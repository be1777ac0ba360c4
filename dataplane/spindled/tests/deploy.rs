//! The deployment files, checked against what the node really is: the Kubernetes manifests parse
//! and are consistent (selectors, probes on real ports and paths, the PostgreSQL Secret, GPU
//! placement, a grace period that covers the drain), their configuration loads as spindled's own
//! configuration type, and the systemd unit is a notify unit whose stop timeout covers the drain.

use std::path::PathBuf;

use serde_yaml::Value;

fn repo(path: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .join(path)
}

fn str_at<'a>(v: &'a Value, path: &[&str]) -> &'a str {
    let mut cur = v;
    for p in path {
        cur = &cur[*p];
    }
    cur.as_str()
        .unwrap_or_else(|| panic!("{path:?} is not a string: {cur:?}"))
}

#[test]
fn the_kubernetes_manifests_are_consistent_with_the_node() {
    let text = std::fs::read_to_string(repo("deploy/kubernetes/spindled.yaml")).unwrap();
    let docs: Vec<Value> = serde_yaml::Deserializer::from_str(&text)
        .map(|d| serde::Deserialize::deserialize(d).unwrap())
        .collect();
    for d in &docs {
        assert!(!str_at(d, &["apiVersion"]).is_empty());
        assert!(!str_at(d, &["kind"]).is_empty());
        assert!(!str_at(d, &["metadata", "name"]).is_empty());
    }
    let find = |kind: &str| {
        docs.iter()
            .find(|d| d["kind"].as_str() == Some(kind))
            .unwrap_or_else(|| panic!("no {kind}"))
    };
    let (config_map, secret, ds) = (find("ConfigMap"), find("Secret"), find("DaemonSet"));

    // The configuration is spindled's own type.
    let toml_text = str_at(config_map, &["data", "spindled.toml"]);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("spindled.toml");
    std::fs::write(&path, toml_text).unwrap();
    let config =
        spindle_node_base::config::Config::load(&spindle_node_base::config::Args::file(path, None))
            .unwrap();

    let spec = &ds["spec"];
    let labels = &spec["template"]["metadata"]["labels"];
    for (k, v) in spec["selector"]["matchLabels"].as_mapping().unwrap() {
        assert_eq!(&labels[k.as_str().unwrap()], v, "selector label {k:?}");
    }
    let pod = &spec["template"]["spec"];
    assert_eq!(
        str_at(pod, &["nodeSelector", "nvidia.com/gpu.present"]),
        "true"
    );
    assert!(pod["tolerations"]
        .as_sequence()
        .unwrap()
        .iter()
        .any(|t| t["key"].as_str() == Some("nvidia.com/gpu")));
    let grace_s = pod["terminationGracePeriodSeconds"].as_u64().unwrap();
    assert!(
        grace_s * 1_000 > config.drain_ms,
        "a {grace_s} s grace period cuts a {} ms drain short",
        config.drain_ms
    );
    let c = &pod["containers"][0];
    let env = c["env"].as_sequence().unwrap();
    let var = |name: &str| env.iter().find(|e| e["name"].as_str() == Some(name));
    let caps = str_at(var("NVIDIA_DRIVER_CAPABILITIES").unwrap(), &["value"]);
    assert!(
        caps.split(',').any(|c| c == "video"),
        "NVDEC/NVENC need the video capability"
    );
    let pg = var("SPINDLE_POSTGRES").expect("PostgreSQL from a Secret");
    let key = &pg["valueFrom"]["secretKeyRef"];
    assert_eq!(
        str_at(key, &["name"]),
        str_at(secret, &["metadata", "name"])
    );
    // The database is another host: reached over TLS, its certificate checked against a CA
    // file the pod mounts from the same Secret.
    let conninfo = str_at(secret, &["stringData", str_at(key, &["key"])]);
    let tls = spindle_control::pg_tls::parse(
        conninfo
            .replace("/etc/spindle-postgres/ca.pem", "/x")
            .as_str(),
    );
    assert!(tls.is_err(), "sslrootcert is read: {conninfo}");
    assert!(conninfo.contains("sslmode=verify-full"), "{conninfo}");
    let root = conninfo
        .split_whitespace()
        .find_map(|w| w.strip_prefix("sslrootcert="))
        .expect("sslrootcert");
    let (folder, file) = root.rsplit_once('/').unwrap();
    let mount = c["volumeMounts"]
        .as_sequence()
        .unwrap()
        .iter()
        .find(|m| m["mountPath"].as_str() == Some(folder))
        .unwrap_or_else(|| panic!("{folder} is not mounted"));
    let volume = pod["volumes"]
        .as_sequence()
        .unwrap()
        .iter()
        .find(|v| v["name"] == mount["name"])
        .unwrap();
    assert_eq!(
        str_at(volume, &["secret", "secretName"]),
        str_at(secret, &["metadata", "name"])
    );
    let item = &volume["secret"]["items"][0];
    assert_eq!(str_at(item, &["path"]), file);
    assert!(str_at(secret, &["stringData", str_at(item, &["key"])]).contains("BEGIN CERTIFICATE"));
    // Probes hit the node's real endpoints on a declared port that is the configured one.
    let ports = c["ports"].as_sequence().unwrap();
    let port = |name: &str| {
        ports
            .iter()
            .find(|p| p["name"].as_str() == Some(name))
            .and_then(|p| p["containerPort"].as_u64())
            .unwrap_or_else(|| panic!("no port {name}"))
    };
    assert_eq!(port("http"), u64::from(config.http_listen.port()));
    assert_eq!(port("protocol"), u64::from(config.listen.port()));
    for (probe, path) in [("readinessProbe", "/readyz"), ("livenessProbe", "/livez")] {
        assert_eq!(str_at(c, &[probe, "httpGet", "path"]), path);
        assert_eq!(str_at(c, &[probe, "httpGet", "port"]), "http");
    }
    assert!(c["securityContext"]["capabilities"]["add"]
        .as_sequence()
        .unwrap()
        .iter()
        .any(|c| c.as_str() == Some("IPC_LOCK")));
    // Guaranteed QoS (requests equal limits, CPU and memory given), the GPU from the device
    // plugin only: no NVIDIA_VISIBLE_DEVICES overriding its grant.
    let resources = &c["resources"];
    for r in ["cpu", "memory", "nvidia.com/gpu"] {
        let (req, lim) = (&resources["requests"][r], &resources["limits"][r]);
        assert!(
            !req.is_null() && req == lim,
            "{r}: requests {req:?}, limits {lim:?}"
        );
    }
    assert!(var("NVIDIA_VISIBLE_DEVICES").is_none());
    // The headless Service, the disruption budget and the scrape all find the pods.
    let service = find("Service");
    assert_eq!(service["spec"]["clusterIP"].as_str(), Some("None"));
    for (k, v) in service["spec"]["selector"].as_mapping().unwrap() {
        assert_eq!(&labels[k.as_str().unwrap()], v, "service selector {k:?}");
    }
    for p in service["spec"]["ports"].as_sequence().unwrap() {
        let name = str_at(p, &["targetPort"]);
        assert_eq!(p["port"].as_u64(), Some(port(name)), "service port {name}");
    }
    let pdb = find("PodDisruptionBudget");
    assert_eq!(pdb["spec"]["maxUnavailable"].as_u64(), Some(1));
    assert_eq!(pdb["spec"]["selector"], spec["selector"]);
    let monitor = find("ServiceMonitor");
    for (k, v) in monitor["spec"]["selector"]["matchLabels"]
        .as_mapping()
        .unwrap()
    {
        assert_eq!(&service["metadata"]["labels"][k.as_str().unwrap()], v);
    }
    let endpoint = &monitor["spec"]["endpoints"][0];
    assert_eq!(str_at(endpoint, &["path"]), "/metrics");
    assert!(service["spec"]["ports"]
        .as_sequence()
        .unwrap()
        .iter()
        .any(|p| p["name"] == endpoint["port"]));
}

/// A checker the test command installs with pip (its path in `var` there, else `name` on
/// PATH), run on `file` with `args` first: whether it passed, and what it said.
fn check(var: &str, name: &str, args: &[&str], file: &std::path::Path) -> (bool, String) {
    let program = std::env::var(var).unwrap_or_else(|_| name.into());
    let out = std::process::Command::new(&program)
        .args(args)
        .arg(file)
        .output()
        .unwrap_or_else(|e| panic!("{program} ({name}, from the Python index): {e}"));
    let said =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (out.status.success(), said)
}

/// `file` passes `checker` (`check`'s arguments but the file), and a copy of it with `from`
/// replaced by `to` does not, the checker naming `named`.
fn passes_and_a_broken_copy_fails(
    checker: impl Fn(&std::path::Path) -> (bool, String),
    file: &std::path::Path,
    (from, to): (&str, &str),
    named: &str,
) {
    let (ok, said) = checker(file);
    assert!(ok, "{}: {said}", file.display());
    let text = std::fs::read_to_string(file).unwrap();
    assert!(text.contains(from), "{from:?} is not in {}", file.display());
    let dir = tempfile::tempdir().unwrap();
    let broken = dir.path().join(file.file_name().unwrap());
    std::fs::write(&broken, text.replacen(from, to, 1)).unwrap();
    let (ok, said) = checker(&broken);
    assert!(!ok, "the broken copy passed: {said}");
    assert!(said.contains(named), "{said}");
}

/// The manifests pass the Kubernetes schemas (`kubernetes-validate --strict`), and a copy with
/// a misspelt field does not.
#[test]
fn the_kubernetes_manifests_pass_the_kubernetes_schemas() {
    let validate = |f: &std::path::Path| {
        let args = ["--strict", "--quiet", "--no-warn"];
        check("KUBERNETES_VALIDATE", "kubernetes-validate", &args, f)
    };
    passes_and_a_broken_copy_fails(
        validate,
        &repo("deploy/kubernetes/spindled.yaml"),
        (
            "maxUnavailable: 1\n  selector",
            "maxUnavailable: 1\n  selectorr",
        ),
        "selectorr",
    );
}

#[test]
fn the_systemd_unit_is_a_notify_unit_that_outlasts_the_drain() {
    let unit = std::fs::read_to_string(repo("deploy/systemd/spindled.service")).unwrap();
    let get = |key: &str| {
        unit.lines()
            .find_map(|l| l.strip_prefix(&format!("{key}=")))
            .unwrap_or_else(|| panic!("no {key}="))
    };
    assert_eq!(get("Type"), "notify");
    assert!(get("WatchdogSec").ends_with('s'));
    let stop: u64 = get("TimeoutStopSec").trim_end_matches('s').parse().unwrap();
    let example =
        std::fs::read_to_string(repo("dataplane/spindled/spindled.example.toml")).unwrap();
    let drain_ms: u64 = example
        .lines()
        .find_map(|l| l.strip_prefix("drain_ms = "))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap();
    assert!(
        stop * 1_000 > drain_ms,
        "TimeoutStopSec {stop} s < drain {drain_ms} ms"
    );
    assert_eq!(get("LimitMEMLOCK"), "infinity");
    assert!(get("LimitNOFILE").parse::<u64>().unwrap() >= 65_536);
    assert_eq!(get("KillSignal"), "SIGTERM");
    // A configuration that cannot run is not restarted forever (see the test below).
    assert_eq!(get("RestartPreventExitStatus"), "78");
}

/// A configuration that cannot run — a value of the wrong type in the file, a misspelt
/// variable, an unreadable TLS key — stops spindled with 78 (EX_CONFIG) and a line naming the
/// problem, in text without colour codes off a terminal or as a JSON object
/// (`--log-format json`); `--version` answers on both binaries.
#[test]
fn a_configuration_that_cannot_run_exits_78_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let run = |text: &str, vars: &[(&str, &str)]| {
        let path = dir.path().join("c.toml");
        std::fs::write(&path, text).unwrap();
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_spindled"))
            .arg("--config")
            .arg(&path)
            .envs(vars.iter().copied())
            .env("RUST_LOG", "error")
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (code, said) = run("lease_ms = \"soon\"\n", &[]);
    assert_eq!(code, Some(78), "{said}");
    assert!(said.contains("lease_ms"), "{said}");
    let (code, said) = run("", &[("SPINDLE_BREAKER__COOLDOWN", "5")]);
    assert_eq!(code, Some(78), "{said}");
    assert!(said.contains("SPINDLE_BREAKER__COOLDOWN"), "{said}");
    let (code, said) = run(
        "[tls]\ncert_file = \"/nonexistent/node.pem\"\nkey_file = \"/nonexistent/node.key\"\n",
        &[],
    );
    assert_eq!(code, Some(78), "{said}");
    assert!(said.contains("/nonexistent/node"), "{said}");
    // Not a terminal: no colour codes in the text log (journald, a container's log).
    assert!(!said.contains('\u{1b}'), "{said:?}");
    // The JSON log: one object a line, with its level and message.
    let (code, said) = run("lease_ms = \"soon\"\n", &[("SPINDLE_LOG_FORMAT", "json")]);
    assert_eq!(code, Some(78), "{said}");
    let line: serde_json::Value = serde_json::from_str(said.lines().last().unwrap())
        .unwrap_or_else(|e| panic!("{e}: {said}"));
    assert_eq!(line["level"], "ERROR", "{line}");
    assert!(
        line["message"].as_str().unwrap().contains("lease_ms"),
        "{line}"
    );
    for bin in [
        env!("CARGO_BIN_EXE_spindled"),
        env!("CARGO_BIN_EXE_spindlectl"),
    ] {
        let out = std::process::Command::new(bin)
            .arg("--version")
            .output()
            .unwrap();
        let said = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && said.contains(env!("CARGO_PKG_VERSION")),
            "{said}"
        );
    }
}

/// The dependencies pass `cargo deny` (`scripts/deny`: advisories from the RustSec snapshot in
/// deny/advisories/, licences, duplicate majors, sources; every exception in deny.toml with its
/// reason); without the exception for bitmaps' advisory it fails, naming the advisory.
#[test]
fn the_dependencies_pass_cargo_deny() {
    let script = repo("scripts/deny").display().to_string();
    let deny = |f: &std::path::Path| check("SPINDLE_DENY", &script, &[], f);
    passes_and_a_broken_copy_fails(
        deny,
        &repo("deny.toml"),
        (
            "{ id = \"RUSTSEC-2026-0247\"",
            "# { id = \"RUSTSEC-2026-0247\"",
        ),
        "RUSTSEC-2026-0247",
    );
}

/// The Dockerfile passes hadolint (`.hadolint.yaml`: the one rule off, with its reason) and
/// runs unprivileged; one built on a `latest` image does not pass.
#[test]
fn the_dockerfile_passes_hadolint() {
    let config = repo(".hadolint.yaml").display().to_string();
    let lint = |f: &std::path::Path| check("HADOLINT", "hadolint", &["--config", &config], f);
    let dockerfile = repo("Dockerfile");
    passes_and_a_broken_copy_fails(
        lint,
        &dockerfile,
        ("debian:bookworm-slim", "debian:latest"),
        "DL3007",
    );
    let text = std::fs::read_to_string(&dockerfile).unwrap();
    assert!(
        text.contains("\nUSER 10001\n"),
        "the image runs unprivileged"
    );
}

/// compose.yaml's node is configured by variables alone: they load as spindled's
/// configuration, its ports are the ones it publishes, and it gets what io_uring needs.
#[test]
fn the_compose_file_configures_a_node() {
    let text = std::fs::read_to_string(repo("compose.yaml")).unwrap();
    let compose: Value = serde_yaml::from_str(&text).unwrap();
    let node = &compose["services"]["spindled"];
    let vars: Vec<(String, String)> = node["environment"]
        .as_mapping()
        .unwrap()
        .iter()
        .map(|(k, v)| {
            (
                k.as_str().unwrap().to_string(),
                v.as_str().unwrap().to_string(),
            )
        })
        .collect();
    let dir = tempfile::tempdir().unwrap();
    let empty = dir.path().join("empty.toml");
    std::fs::write(&empty, "").unwrap();
    let config = spindle_node_base::config::Config::load_with(
        &spindle_node_base::config::Args::file(empty, None),
        vars,
    )
    .unwrap();
    assert_eq!(config.tenants.len(), 1);
    assert!(config.provider.is_some());
    let published: Vec<&str> = node["ports"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|p| p.as_str().unwrap())
        .collect();
    for port in [config.listen.port(), config.http_listen.port()] {
        assert!(
            published.contains(&format!("{port}:{port}").as_str()),
            "{published:?}"
        );
    }
    let security = format!("{:?}", node["security_opt"]);
    assert!(security.contains("seccomp-io-uring.json"), "{security}");
    assert_eq!(node["cap_add"][0].as_str(), Some("IPC_LOCK"));
    let provider_url = config.provider.unwrap().url;
    let mock = &compose["services"]["mock-provider"]["command"];
    let listen = format!("{:?}", mock);
    let port = provider_url.rsplit(':').next().unwrap();
    assert!(listen.contains(&format!("0.0.0.0:{port}")), "{listen}");
}

/// The profile maker adds the io_uring calls to the default it is given, once.
#[test]
fn the_seccomp_profile_allows_io_uring() {
    let dir = tempfile::tempdir().unwrap();
    let default = dir.path().join("default.json");
    std::fs::write(
        &default,
        r#"{"defaultAction": "SCMP_ACT_ERRNO", "syscalls": [{"names": ["read"], "action": "SCMP_ACT_ALLOW"}]}"#,
    )
    .unwrap();
    let run = |input: &std::path::Path| {
        let out = std::process::Command::new("python3")
            .arg(repo("deploy/container/seccomp-io-uring.py"))
            .arg(input)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    };
    let once = run(&default);
    let profile: serde_json::Value = serde_json::from_str(&once).unwrap();
    assert_eq!(profile["defaultAction"], "SCMP_ACT_ERRNO");
    let rules = profile["syscalls"].as_array().unwrap();
    assert_eq!(rules.len(), 2, "{once}");
    assert_eq!(
        rules[1]["names"],
        serde_json::json!(["io_uring_setup", "io_uring_enter", "io_uring_register"])
    );
    let again = dir.path().join("again.json");
    std::fs::write(&again, &once).unwrap();
    assert_eq!(run(&again), once, "applied twice, the rule is there once");
}

/// docs/admin-openapi.yaml is a valid OpenAPI description (openapi-spec-validator, from the
/// Python index; a broken copy is refused) of exactly the admin routes the node serves
/// (`admin::ROUTES`, which the node's router matches against): every route described, and
/// nothing described that the node does not serve.
#[test]
fn the_admin_api_description_is_valid_and_is_the_nodes_routes() {
    let path = repo("docs/admin-openapi.yaml");
    let validate =
        |f: &std::path::Path| check("OPENAPI_SPEC_VALIDATOR", "openapi-spec-validator", &[], f);
    // The broken copy: a path parameter said to come in a body (Swagger 2's place, not
    // OpenAPI 3's).
    passes_and_a_broken_copy_fails(
        validate,
        &path,
        ("      in: path", "      in: body"),
        "'in': 'body'",
    );
    let text = std::fs::read_to_string(&path).unwrap();

    let doc: Value = serde_yaml::from_str(&text).unwrap();
    let mut described: Vec<(String, String)> = Vec::new();
    for (route, item) in doc["paths"].as_mapping().unwrap() {
        for (method, _) in item.as_mapping().unwrap() {
            let method = method.as_str().unwrap();
            if method != "parameters" {
                described.push((
                    method.to_ascii_uppercase(),
                    route.as_str().unwrap().to_string(),
                ));
            }
        }
    }
    described.sort();
    let mut served: Vec<(String, String)> = spindle_node_http::admin::ROUTES
        .iter()
        .map(|(m, p, _)| (m.to_string(), p.to_string()))
        .collect();
    served.sort();
    assert_eq!(described, served);
}
