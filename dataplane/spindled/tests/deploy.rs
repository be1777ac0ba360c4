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
/// problem; `--version` answers on both binaries.
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
