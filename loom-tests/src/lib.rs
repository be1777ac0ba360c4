//! Loom models live in `tests/`; they compile only under `--cfg loom`.
