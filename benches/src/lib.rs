//! Benches live in `benches/`.
