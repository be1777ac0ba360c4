//! The Python SDK as a user has it: `clients/python` installed by pip into a virtualenv of its
//! own (made once per version of the package's files, under the target directory's `tmp/`),
//! and the check scripts of `clients/python/tests/` run by that virtualenv's python from a
//! directory outside the source tree, so that what they import is the installed package.

use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};
use std::process::Command;

fn sdk_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../clients/python")
}

/// The package's files as pip reads them: `pyproject.toml`, the README and every file of
/// `spindle_client/`, in order.
fn package_files() -> Vec<PathBuf> {
    let root = sdk_dir();
    let mut files = vec![root.join("pyproject.toml"), root.join("README.md")];
    let mut dirs = vec![root.join("spindle_client")];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                if !path.ends_with("__pycache__") {
                    dirs.push(path);
                }
            } else {
                files.push(path);
            }
        }
    }
    files.sort();
    files
}

/// A digest of the package's files (paths and contents).
fn digest() -> u64 {
    let root = sdk_dir();
    let mut h = DefaultHasher::new();
    for f in package_files() {
        f.strip_prefix(&root).unwrap().hash(&mut h);
        std::fs::read(&f).unwrap().hash(&mut h);
    }
    h.finish()
}

fn run(what: &str, command: &mut Command) {
    let out = command.output().unwrap_or_else(|e| panic!("{what}: {e}"));
    assert!(
        out.status.success(),
        "{what}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The python of a virtualenv where `pip install clients/python` ran (as the README's
/// quickstart does). Test processes that race to make it each make their own and keep the
/// first one renamed into place.
pub fn sdk_python() -> PathBuf {
    let tmp = Path::new(env!("CARGO_TARGET_TMPDIR"));
    let done = tmp.join(format!("python-sdk-{:016x}", digest()));
    let python = done.join("bin/python");
    if python.exists() {
        return python;
    }
    let building = tmp.join(format!(
        "python-sdk-{:016x}.{}",
        digest(),
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&building);
    run(
        "python3 -m venv",
        Command::new("python3").args(["-m", "venv"]).arg(&building),
    );
    // pip builds a local directory in place (its `build/`): each process installs from a
    // copy of its own, so that two never build in one directory.
    let source = building.join("source");
    for f in package_files() {
        let to = source.join(f.strip_prefix(sdk_dir()).unwrap());
        std::fs::create_dir_all(to.parent().unwrap()).unwrap();
        std::fs::copy(&f, &to).unwrap();
    }
    run(
        "pip install clients/python (needs the Python package index, as a user's does)",
        Command::new(building.join("bin/pip"))
            .args(["install", "--quiet"])
            .arg(&source),
    );
    // A virtualenv's scripts name its directory: the one renamed into place keeps working
    // through `bin/python` (a link to the interpreter), which is all the tests use.
    if std::fs::rename(&building, &done).is_err() {
        let _ = std::fs::remove_dir_all(&building);
    }
    assert!(python.exists(), "{} was not made", python.display());
    python
}

/// `clients/python/tests/SCRIPT` as a command of the installed SDK's python, run from the
/// target directory (not the source tree).
pub fn script(name: &str) -> Command {
    let mut command = Command::new(sdk_python());
    command
        .arg(sdk_dir().join("tests").join(name))
        .current_dir(env!("CARGO_TARGET_TMPDIR"));
    command
}
