//! `spindled`: see the crate docs and `spindled.example.toml`.

use clap::Parser;
use spindle_node_base::config::{Args, Config, LogFormat};

// The shards' tables are large vectors read at random: on huge pages (see `spindle-alloc`).
#[global_allocator]
static ALLOC: spindle_alloc::HugePages = spindle_alloc::HugePages;

/// The log on standard error: RUST_LOG filters (default: info); text is coloured only on a
/// terminal (never in journald or a container's log), JSON is one object a line with each
/// event's fields beside its message.
fn log_to_stderr(format: LogFormat) {
    use std::io::IsTerminal;
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Json => builder.json().flatten_event(true).init(),
        LogFormat::Text => builder.with_ansi(std::io::stderr().is_terminal()).init(),
    }
}

/// The exit status of a configuration that cannot run (sysexits' EX_CONFIG): the systemd unit
/// does not restart a node that exits with it (`RestartPreventExitStatus=78`).
const EXIT_CONFIG: u8 = 78;

fn main() -> std::process::ExitCode {
    match run() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            let config = e.downcast_ref::<spindled::ConfigError>().is_some();
            tracing::error!("{e:#}");
            std::process::ExitCode::from(if config { EXIT_CONFIG } else { 1 })
        }
    }
}

fn run() -> anyhow::Result<()> {
    let args = Args::parse();
    log_to_stderr(args.log_format);
    if args.hash_credential {
        let mut secret = String::new();
        std::io::stdin().read_line(&mut secret)?;
        let secret = secret.strip_suffix('\n').unwrap_or(&secret);
        let secret = secret.strip_suffix('\r').unwrap_or(secret);
        match spindle_node_base::credential::hashed_for_config(secret) {
            Ok(line) => {
                println!("{line}");
                return Ok(());
            }
            Err(e) => anyhow::bail!("{e}"),
        }
    }
    let config = Config::load(&args).map_err(|e| e.context(spindled::ConfigError))?;
    spindled::run(config)
}
