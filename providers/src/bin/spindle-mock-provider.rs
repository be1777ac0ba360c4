//! spindle-mock-provider: serves the generic provider API with enforced, counted contracts and
//! per-account fault modes (see `spindle_providers::mock`).

use std::path::PathBuf;

use clap::Parser;
use spindle_providers::api::Fault;
use spindle_providers::{AccountSpec, MockConfig, MockProvider};

#[derive(Debug, Parser)]
#[command(
    version,
    name = "spindle-mock-provider",
    about = "A provider for tests, the loadgen and the demo"
)]
struct Args {
    /// Address to serve on (port 0: any free port).
    #[arg(long, default_value = "127.0.0.1:7480")]
    listen: std::net::SocketAddr,
    /// An account as `name:concurrency:rpm`; repeat for several.
    #[arg(long = "account", required = true)]
    accounts: Vec<AccountSpec>,
    /// `name:fault` sets an account's fault mode at start (also settable at run time with
    /// POST /v1/admin/faults).
    #[arg(long = "fault")]
    faults: Vec<String>,
    /// The secret callbacks are signed with.
    #[arg(long, default_value = "spindle-mock-secret")]
    secret: String,
    /// How long a job runs, in milliseconds.
    #[arg(long, default_value_t = 200)]
    job_ms: u64,
    /// What a succeeded job costs, in milli cost units.
    #[arg(long, default_value_t = 1_000)]
    cost_milli: u64,
    /// How long the timeout_after_accept fault holds its answer, in milliseconds.
    #[arg(long, default_value_t = 10_000)]
    hang_ms: u64,
    /// A video every succeeded job returns (as a file:// URL).
    #[arg(long)]
    clip: Option<PathBuf>,
    /// Also receive a node's event batches here (`[events] url = "http://ADDR/events"`,
    /// signed with `--secret`); `GET http://ADDR/stats` counts what arrived.
    #[arg(long)]
    events_listen: Option<std::net::SocketAddr>,
    /// Once serving, write the base URL to this file.
    #[arg(long)]
    ready_file: Option<PathBuf>,
    /// Serve HTTPS with this certificate chain (PEM, for `localhost`: the base URL is then
    /// `https://localhost:PORT`); a node trusts it through `provider.ca_file` (the chain's
    /// own file, for a self-signed certificate).
    #[arg(long, requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// The certificate's private key (PEM).
    #[arg(long, requires = "tls_cert")]
    tls_key: Option<PathBuf>,
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .init();
    let args = Args::parse();
    let mut faults = Vec::new();
    for f in &args.faults {
        let (account, fault) = f
            .split_once(':')
            .ok_or_else(|| anyhow::anyhow!("--fault {f:?}: expected name:fault"))?;
        let fault = <Fault as clap::ValueEnum>::from_str(fault, true)
            .map_err(|e| anyhow::anyhow!("--fault {f:?}: {e}"))?;
        faults.push((account.to_string(), fault));
    }
    let listener = tokio::net::TcpListener::bind(args.listen).await?;
    let config = MockConfig {
        accounts: args.accounts,
        secret: args.secret.clone(),
        job_ms: args.job_ms,
        cost_milli: args.cost_milli,
        hang_ms: args.hang_ms,
        clip: args.clip,
    };
    let (mock, admin) = match (&args.tls_cert, &args.tls_key) {
        (Some(cert), Some(key)) => {
            let cert = std::fs::read(cert).map_err(|e| anyhow::anyhow!("--tls-cert: {e}"))?;
            let key = std::fs::read(key).map_err(|e| anyhow::anyhow!("--tls-key: {e}"))?;
            let server = spindle_providers::tls::server_config(&cert, &key)?;
            let mock = MockProvider::serve_tls(listener, config, server);
            // Its own fault settings go over HTTPS too, trusting its chain.
            let roots = spindle_providers::tls::with_extra_roots(&cert, "--tls-cert")?;
            let admin = mock
                .client(std::time::Duration::from_secs(5))
                .with_tls(&roots);
            (mock, admin)
        }
        _ => {
            let mock = MockProvider::serve(listener, config);
            let admin = mock.client(std::time::Duration::from_secs(5));
            (mock, admin)
        }
    };
    let _receiver = match args.events_listen {
        Some(addr) => {
            let listener = tokio::net::TcpListener::bind(addr).await?;
            let r = spindle_providers::EventReceiver::serve(listener, args.secret.as_bytes());
            tracing::info!("receiving events on {}", r.url());
            Some(r)
        }
        None => None,
    };
    for (account, fault) in faults {
        admin.set_fault(&account, fault).await?;
    }
    tracing::info!("serving the provider API on {}", mock.base_url());
    if let Some(path) = &args.ready_file {
        let tmp = path.with_extension("partial");
        std::fs::write(&tmp, format!("{}\n", mock.base_url()))?;
        std::fs::rename(&tmp, path)?;
    }
    tokio::signal::ctrl_c().await?;
    Ok(())
}
