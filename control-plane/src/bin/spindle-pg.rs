//! Runs a private PostgreSQL for scripts: `spindle-pg serve --ready-file F` starts one from the
//! system binaries, writes its conninfo to F once it accepts connections, and stops it (deleting
//! its files) on SIGTERM or SIGINT. The test command uses it to give every test one server.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use spindle_control::{EmbeddedOptions, EmbeddedPostgres};
use tokio::signal::unix::{signal, SignalKind};

#[derive(Parser)]
#[command(
    version,
    about = "A private PostgreSQL for spindle's tests and benches"
)]
struct Args {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Start a server and keep it until SIGTERM/SIGINT.
    Serve {
        /// Where to write the conninfo once the server is ready.
        #[arg(long)]
        ready_file: PathBuf,
    },
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<()> {
    let Command::Serve { ready_file } = Args::parse().command;
    let mut term = signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
    let mut int = signal(SignalKind::interrupt()).context("installing the SIGINT handler")?;
    let pg = EmbeddedPostgres::start(EmbeddedOptions::default())
        .context("starting the private PostgreSQL")?;
    let conninfo = pg.conninfo("postgres");
    // Write then rename: a reader never sees half a line.
    let tmp = ready_file.with_extension("partial");
    // It holds the server's password: readable by this user alone.
    let _ = std::fs::remove_file(&tmp);
    spindle_control::embedded::write_private(&tmp, &format!("{conninfo}\n"))
        .context("writing the ready file")?;
    std::fs::rename(&tmp, &ready_file).context("publishing the ready file")?;
    eprintln!(
        "spindle-pg: serving {} (password in {} and PGPASSFILE={})",
        pg.conninfo_public("postgres"),
        ready_file.display(),
        pg.pgpass().display()
    );
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
    drop(pg);
    eprintln!("spindle-pg: stopped");
    Ok(())
}
