//! The crate graph keeps its layers (ARCHITECTURE.md, "Architecture invariants"): every
//! dependency between the workspace's crates points to a lower layer, and the pure crates use
//! no runtime, network, database or media library. Read from `cargo metadata`, so a new crate
//! or a new dependency is checked the day it appears.

use std::collections::BTreeMap;

/// The layers, lowest first. A crate may depend only on crates of lower layers.
const LAYERS: &[&[&str]] = &[
    // Pure, and the bottom: scheduling, cross-thread counters, the allocator.
    &["spindle-core", "spindle-sync", "spindle-alloc"],
    // Pure, on the core: the protocol, the simulator.
    &["spindle-wire", "spindle-sim"],
    // Shell libraries, each owning one outside thing: PostgreSQL, providers' HTTP, GPUs, the
    // client's socket.
    &[
        "spindle-control",
        "spindle-providers",
        "spindle-gpu",
        "spindle-client",
    ],
    // FFmpeg, on the GPU ledger.
    &["spindle-transcode"],
    // The node's floor: its configuration as plain data, the policy derived from it,
    // credentials, routing, the messages between its parts and the state they share. Nothing
    // in it runs.
    &["spindle-node-base"],
    // The node's threads that serve the shards: provider and media workers; the control
    // plane's thread (PostgreSQL). Neither knows the other.
    &["spindle-node-workers", "spindle-node-control"],
    // The shards: they send to the control plane and the workers, never the reverse.
    &["spindle-node-shard"],
    // The HTTP port, above what it serves.
    &["spindle-node-http"],
    // The daemon: wiring only.
    &["spindled"],
    // Tools and checks on top: nothing depends on them.
    &["spindle-loadgen", "spindle-benches", "spindle-loom-tests"],
];

/// Crates that must stay pure (ARCHITECTURE.md): none of these libraries in their normal
/// dependencies.
const PURE: &[&str] = &[
    "spindle-core",
    "spindle-sync",
    "spindle-wire",
    "spindle-sim",
];
const IMPURE_LIBRARIES: &[&str] = &[
    "tokio",
    "glommio",
    "tokio-postgres",
    "hyper",
    "rustls",
    "ffmpeg-next",
    "nvml-wrapper",
    "libloading",
    "libc",
];

/// A workspace crate's dependencies that are not dev-dependencies: (name, is in the workspace).
type Graph = BTreeMap<String, Vec<String>>;

fn layer_of(name: &str) -> Option<usize> {
    LAYERS.iter().position(|l| l.contains(&name))
}

/// Every broken rule of `graph` (workspace crates → their normal and build dependencies), as
/// one line each.
fn violations(graph: &Graph) -> Vec<String> {
    let mut found = Vec::new();
    for (krate, deps) in graph {
        let Some(own) = layer_of(krate) else {
            found.push(format!(
                "{krate} is in no layer: place it in LAYERS (and ARCHITECTURE.md)"
            ));
            continue;
        };
        for dep in deps {
            if let Some(theirs) = layer_of(dep) {
                if theirs >= own {
                    found.push(format!(
                        "{krate} (layer {own}) depends on {dep} (layer {theirs}): dependencies \
                         point down only"
                    ));
                }
            } else if graph.contains_key(dep) {
                found.push(format!("{dep} is in no layer"));
            } else if PURE.contains(&krate.as_str()) && IMPURE_LIBRARIES.contains(&dep.as_str()) {
                found.push(format!("{krate} is pure and depends on {dep}"));
            }
        }
    }
    found
}

fn workspace_graph() -> Graph {
    let out = std::process::Command::new(env!("CARGO"))
        .args([
            "metadata",
            "--format-version",
            "1",
            "--no-deps",
            "--offline",
        ])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("running cargo metadata");
    assert!(
        out.status.success(),
        "cargo metadata: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let metadata: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let mut graph = Graph::new();
    for package in metadata["packages"].as_array().unwrap() {
        let deps = package["dependencies"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|d| d["kind"].as_str() != Some("dev"))
            .map(|d| d["name"].as_str().unwrap().to_string())
            .collect();
        graph.insert(package["name"].as_str().unwrap().to_string(), deps);
    }
    graph
}

#[test]
fn every_dependency_points_to_a_lower_layer() {
    let graph = workspace_graph();
    assert!(
        graph.contains_key("spindled") && graph.len() >= 10,
        "{graph:?}"
    );
    let found = violations(&graph);
    assert!(found.is_empty(), "{}", found.join("\n"));
}

/// The check itself: an upward edge, a crate outside every layer and a pure crate on a runtime
/// are each reported.
#[test]
fn the_layer_check_reports_what_breaks_it() {
    let mut graph = workspace_graph();
    assert!(violations(&graph).is_empty());
    graph
        .get_mut("spindle-core")
        .unwrap()
        .push("spindled".into());
    graph.insert("spindle-new".into(), vec!["spindle-core".into()]);
    graph.get_mut("spindle-sim").unwrap().push("tokio".into());
    let found = violations(&graph);
    assert_eq!(found.len(), 3, "{found:#?}");
    assert!(found[0].contains("spindle-core (layer 0) depends on spindled"));
    assert!(found[1].contains("spindle-new is in no layer"));
    assert!(found[2].contains("spindle-sim is pure and depends on tokio"));
}

/// The node's source files, from the workspace root.
fn node_sources() -> Vec<std::path::PathBuf> {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let mut files = Vec::new();
    // Every `dataplane/node*` crate, and the daemon.
    let mut dirs: Vec<std::path::PathBuf> = std::fs::read_dir(root.join("dataplane"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|name| name.starts_with("node") || name == "spindled")
        .map(|name| root.join("dataplane").join(name).join("src"))
        .collect();
    assert!(dirs.len() >= 6, "{dirs:?}");
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                files.push(path);
            }
        }
    }
    files.sort();
    assert!(files.len() > 30, "{files:?}");
    files
}

/// A node file's code (its lines before its tests) runs to at most 800 lines, or its module
/// documentation says why it is longer ("Long file: …").
#[test]
fn long_node_files_say_why() {
    let mut unexplained = Vec::new();
    for path in node_sources() {
        let text = std::fs::read_to_string(&path).unwrap();
        let code = text.split("\n#[cfg(test)]").next().unwrap_or("");
        let lines = code.lines().count();
        if lines > 800 && !text.contains("//! Long file: ") {
            unexplained.push(format!("{}: {lines} lines", path.display()));
        }
    }
    assert!(unexplained.is_empty(), "{unexplained:#?}");
}

/// Functions of the node longer than 120 lines, each still to be split (the list only
/// shrinks: a new long function fails here, and so does one on the list that got short).
const LONG_FUNCTIONS: &[(&str, &str)] = &[];

/// Every function of more than 120 lines in the node's sources, as (its file under
/// `dataplane/`, the function).
fn long_functions() -> Vec<(String, String)> {
    let mut long = Vec::new();
    for path in node_sources() {
        let text = std::fs::read_to_string(&path).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        let file = path.to_string_lossy();
        let file = file[file.rfind("/dataplane/").expect("under dataplane/") + 11..].to_string();
        let mut i = 0;
        while i < lines.len() {
            let line = lines[i];
            let indent = line.len() - line.trim_start().len();
            let rest = line.trim_start();
            let rest = rest
                .strip_prefix("pub(crate) ")
                .or_else(|| rest.strip_prefix("pub(super) "))
                .or_else(|| rest.strip_prefix("pub "))
                .unwrap_or(rest);
            let rest = rest.strip_prefix("async ").unwrap_or(rest);
            let Some(name) = rest
                .strip_prefix("fn ")
                .map(|r| r.split(['(', '<']).next().unwrap_or(r).to_string())
            else {
                i += 1;
                continue;
            };
            let close = format!("{}}}", " ".repeat(indent));
            let Some(end) = (i + 1..lines.len()).find(|&k| lines[k] == close) else {
                i += 1;
                continue;
            };
            if end - i + 1 > 120 {
                long.push((file.clone(), name));
            }
            i = end + 1;
        }
    }
    long
}

#[test]
fn no_new_function_runs_past_120_lines() {
    let long = long_functions();
    let listed = |f: &(String, String)| LONG_FUNCTIONS.iter().any(|(a, b)| f.0 == *a && f.1 == *b);
    let new: Vec<_> = long.iter().filter(|f| !listed(f)).collect();
    assert!(new.is_empty(), "functions past 120 lines: {new:?}");
    let shortened: Vec<_> = LONG_FUNCTIONS
        .iter()
        .filter(|(a, b)| !long.iter().any(|f| f.0 == *a && f.1 == *b))
        .collect();
    assert!(
        shortened.is_empty(),
        "now within 120 lines, take them off LONG_FUNCTIONS: {shortened:?}"
    );
}
