//! `spindled`: see the crate docs and `spindled.example.toml`.

use clap::Parser;
use spindle_node::config::{Args, Config};

// The shards' tables are large vectors read at random: on huge pages (see `spindle-alloc`).
#[global_allocator]
static ALLOC: spindle_alloc::HugePages = spindle_alloc::HugePages;

fn main() -> anyhow::Result<()> {
    // RUST_LOG filters (default: info).
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    let args = Args::parse();
    let config = Config::load(&args)?;
    spindle_node::run(config)
}
