//! `spindled`: see the crate docs and `spindled.example.toml`.

use clap::Parser;
use spindle_node::config::{Args, Config};

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let config = Config::load(&args)?;
    spindle_node::run(config)
}
