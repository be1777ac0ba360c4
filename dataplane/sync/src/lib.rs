//! Node-wide counters that several shard threads touch. Owns the `std`/`loom` switch; never blocks,
//! never allocates on the hot path.
//!
//! The pure scheduling core never sees these types: the node shell uses them for resources that
//! every shard draws on (a provider account's concurrency, GPU slots), and `loom-tests` model them.

mod primitive;
mod share;
mod slots;

pub use share::{even_part, Load, ShareBoard};
pub use slots::{SlotCounter, SlotsExhausted};
