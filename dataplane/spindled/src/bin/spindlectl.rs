//! spindlectl: the admin API of a spindled node from the command line.
//!
//!   spindlectl --node 127.0.0.1:7072 --token $TOKEN policy show
//!   spindlectl … policy set tenant 42 --body tenant.json --reason "raise the queue cap"
//!   spindlectl … policy delete lane BEST_EFFORT --reason "back to the configured lane"
//!   spindlectl … add provider vendor-2:acct-1:us:video-model-0 --concurrency 8 --rpm 600 \
//!       --reason "second account"   (the next id; other values copied from `--like`, or the first)
//!   spindlectl … add model video-model-2 --providers vendor-2:acct-1:us:video-model-0 \
//!       --like video-model-0 --reason "new model"
//!   spindlectl … lane close EXPENSIVE --reason "GPU pool degraded"   (the high-cost class)
//!   spindlectl … lane open EXPENSIVE --reason "GPUs back"
//!   spindlectl … audit --limit 20
//!   spindlectl … drain --reason "kernel upgrade"
//!   spindlectl … requeue 4097 4098 --reason "provider credentials fixed"   (FAILED tasks)
//!   spindlectl … rebuild-counters --reason "pool usage looked wrong"
//!
//! `--json` prints the node's JSON answer as it is; otherwise a short human form. Where the
//! node's `[tls]` is set its HTTP port speaks HTTPS: `--tls-ca` names the CA certificates its
//! certificate chains to (the public web's roots are trusted too).

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::{Parser, Subcommand};
use serde_json::{json, Value};

#[derive(Parser)]
#[command(
    name = "spindlectl",
    version,
    about = "Administer a spindled node over its HTTP port"
)]
struct Cli {
    /// The node's HTTP address (its /metrics port).
    #[arg(long, env = "SPINDLE_ADMIN_NODE", value_parser = spindle_node_base::config::address)]
    node: SocketAddr,
    /// An admin token from the node's configuration.
    #[arg(long, env = "SPINDLE_ADMIN_TOKEN", hide_env_values = true)]
    token: String,
    /// Print the node's JSON answer.
    #[arg(long)]
    json: bool,
    /// HTTPS: the CA certificates (PEM) the node's certificate chains to.
    #[arg(long, env = "SPINDLE_ADMIN_TLS_CA")]
    tls_ca: Option<PathBuf>,
    /// HTTPS: the name the node's certificate must carry (default: the IP of `--node`).
    #[arg(long, env = "SPINDLE_ADMIN_TLS_NAME", requires = "tls_ca")]
    tls_name: Option<String>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// The effective policy, or a change to it.
    Policy {
        #[command(subcommand)]
        action: PolicyAction,
    },
    /// Admission switch: close a lane to new work (queued and running work goes on), or open
    /// it again. Closing EXPENSIVE disables the high-cost resource class on the node.
    Lane {
        #[command(subcommand)]
        action: LaneAction,
    },
    /// Suspend a tenant (its submits are rejected and its queued tasks wait; running work goes
    /// on and it may still read and cancel its tasks), or resume it.
    Tenant {
        #[command(subcommand)]
        action: TenantAction,
    },
    /// A tenant's periodic quotas: what it consumed in each running period (`show`, asked of
    /// the node that serves it), its quotas replaced (`set`, a JSON array of quotas: see
    /// docs/operations.md "Quotas"), or its counts started again from zero (`reset`).
    Quota {
        #[command(subcommand)]
        action: QuotaAction,
    },
    /// Add a provider account or a model to the running nodes: it takes the next id, and the
    /// values not given are copied from an existing one (`--like`, else the first).
    Add {
        #[command(subcommand)]
        what: AddAction,
    },
    /// The latest audit entries (changes, drains, refusals).
    Audit {
        #[arg(long, default_value_t = 20)]
        limit: u32,
    },
    /// Stop admitting and dispatching on this node.
    Drain {
        #[arg(long)]
        reason: String,
    },
    /// Compare every pool's usage with what live attempts hold and every reserved budget with
    /// its open reservations, repairing nothing (what each node does every counter_check_s).
    CheckCounters,
    /// Recompute every pool's usage from what live attempts hold, repairing any drift. The pools
    /// are locked while the task table is walked: claims and reports wait for it.
    RebuildCounters {
        #[arg(long)]
        reason: String,
    },
    /// A task as stored, whatever its tenant: state, attempts, costs, why it failed, what it
    /// produced.
    Task { task: u64 },
    /// The dead-letter queue (FAILED tasks), a page at a time in task id order: at most `scan`
    /// tasks are looked at per page; the answer says where the next page starts.
    DeadLetters {
        #[arg(long, default_value_t = 0)]
        after: u64,
        #[arg(long, default_value_t = 10_000)]
        scan: usize,
    },
    /// Put FAILED tasks (the dead-letter queue) back in their queues, for another attempt.
    /// The node requeues those of the partitions it serves and names the node for the others.
    Requeue {
        /// Task ids.
        #[arg(required = true)]
        tasks: Vec<u64>,
        #[arg(long)]
        reason: String,
    },
    /// Cancel tasks whatever their tenant (at most 1,000), as their clients' cancels are: the
    /// node cancels those live on it and says of the others what they are (unknown, ended, or
    /// another node's, named).
    Cancel {
        /// Task ids.
        #[arg(required = true)]
        tasks: Vec<u64>,
        #[arg(long)]
        reason: String,
    },
}

#[derive(Subcommand)]
enum LaneAction {
    Open {
        /// ENTERPRISE_RESERVED, PAID_SHARED, STANDARD, BEST_EFFORT, EXPENSIVE or RECOVERY.
        lane: String,
        #[arg(long)]
        reason: String,
    },
    Close {
        lane: String,
        #[arg(long)]
        reason: String,
    },
}

#[derive(Subcommand)]
enum QuotaAction {
    Show {
        tenant: u32,
    },
    Set {
        tenant: u32,
        /// A file holding the tenant's quotas: a JSON array (an empty one removes them).
        #[arg(long)]
        body: std::path::PathBuf,
        #[arg(long)]
        reason: String,
    },
    Reset {
        tenant: u32,
        #[arg(long)]
        reason: String,
    },
}

#[derive(Subcommand)]
enum TenantAction {
    Suspend {
        tenant: u32,
        #[arg(long)]
        reason: String,
    },
    Resume {
        tenant: u32,
        #[arg(long)]
        reason: String,
    },
}

#[derive(Subcommand)]
enum AddAction {
    /// A provider account, named provider:account:region:model.
    Provider {
        name: String,
        #[arg(long)]
        like: Option<String>,
        #[arg(long)]
        concurrency: Option<u64>,
        /// Requests per minute.
        #[arg(long)]
        rpm: Option<u64>,
        /// The RPM bucket's burst.
        #[arg(long)]
        burst: Option<u64>,
        #[arg(long)]
        reason: String,
    },
    /// A model, served by the named provider accounts (in preference order).
    Model {
        name: String,
        #[arg(long, value_delimiter = ',', required = true)]
        providers: Vec<String>,
        #[arg(long)]
        like: Option<String>,
        #[arg(long)]
        reason: String,
    },
}

/// The provider accounts, or models (`field` of the effective policy, `object` in the store),
/// by id: those the node runs, with the store's rows over them — one added a moment ago may
/// not have reached the node's running policy yet, and the next id counts it.
fn known(policy: &Value, field: &str, object: &str) -> Vec<Value> {
    let mut all = policy["effective"][field]
        .as_array()
        .cloned()
        .unwrap_or_default();
    let mut stored: Vec<Value> = policy["objects"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|o| o["object"] == object)
        .map(|o| o["body"].clone())
        .collect();
    stored.sort_by_key(|b| b["id"].as_u64());
    for body in stored {
        match body["id"].as_u64().map(|id| id as usize) {
            Some(id) if id < all.len() => all[id] = body,
            Some(id) if id == all.len() => all.push(body),
            _ => {}
        }
    }
    all
}

/// The one of `all` named `like`, or the first.
fn template(all: &[Value], like: Option<&str>, what: &str) -> anyhow::Result<Value> {
    let found = match like {
        Some(name) => all.iter().find(|v| v["name"] == name),
        None => all.first(),
    };
    found
        .cloned()
        .with_context(|| format!("no {what} {} to copy", like.unwrap_or("at all")))
}

/// The object `add` sends (`PUT /admin/v1/policy/{object}/{name}`), from `policy` (the node's
/// `GET /admin/v1/policy`).
fn addition(policy: &Value, add: &AddAction) -> anyhow::Result<(&'static str, String, Value)> {
    match add {
        AddAction::Provider {
            name,
            like,
            concurrency,
            rpm,
            burst,
            ..
        } => {
            let all = known(policy, "providers", "provider_account");
            let mut body = template(&all, like.as_deref(), "provider account")?;
            body["id"] = all.len().into();
            body["name"] = name.as_str().into();
            if let Some(c) = concurrency {
                body["concurrency"] = (*c).into();
            }
            if let Some(r) = rpm {
                body["rpm"]["per_minute"] = (*r).into();
            }
            if let Some(b) = burst {
                body["rpm"]["burst"] = (*b).into();
            }
            Ok(("provider_account", name.clone(), body))
        }
        AddAction::Model {
            name,
            providers,
            like,
            ..
        } => {
            let accounts = known(policy, "providers", "provider_account");
            let ids = providers
                .iter()
                .map(|p| {
                    accounts
                        .iter()
                        .find(|a| a["name"] == p.as_str())
                        .map(|a| a["id"].clone())
                        .with_context(|| format!("no provider account {p}"))
                })
                .collect::<anyhow::Result<Vec<_>>>()?;
            let all = known(policy, "models", "model_capability");
            let mut body = template(&all, like.as_deref(), "model")?;
            body["id"] = all.len().into();
            body["name"] = name.as_str().into();
            body["providers"] = ids.into();
            Ok(("model_capability", name.clone(), body))
        }
    }
}

/// Lane names in the order of the policy's `lanes` array.
const LANES: [&str; 6] = [
    "ENTERPRISE_RESERVED",
    "PAID_SHARED",
    "STANDARD",
    "BEST_EFFORT",
    "EXPENSIVE",
    "RECOVERY",
];

#[derive(Subcommand)]
enum PolicyAction {
    Show,
    /// Create or replace an object (tenant_policy, lane, provider_account, model_capability).
    Set {
        object: String,
        key: String,
        /// A JSON file with the object's body.
        #[arg(long)]
        body: PathBuf,
        #[arg(long)]
        reason: String,
    },
    Delete {
        object: String,
        key: String,
        #[arg(long)]
        reason: String,
    },
}

/// One request, `Connection: close`; the status code and the JSON body.
/// Sets one switch of a policy object as the node runs it now (`effective` picks it out of
/// the node's effective policy), everything else of it unchanged, and stores it at `path`.
fn switch(
    cli: &Cli,
    effective: impl Fn(&Value) -> Value,
    field: &str,
    value: Value,
    path: &str,
    reason: &str,
) -> anyhow::Result<(u16, Value)> {
    let (status, policy) = call(cli, "GET", "/admin/v1/policy", None)?;
    if !(200..300).contains(&status) {
        anyhow::bail!("reading the policy ({status}): {}", policy["error"]);
    }
    let mut body = effective(&policy["effective"]);
    if !body.is_object() {
        anyhow::bail!("not in the node's effective policy");
    }
    body[field] = value;
    call(
        cli,
        "PUT",
        path,
        Some(&json!({ "reason": reason, "body": body })),
    )
}

/// A connection to the node's HTTP port: HTTPS with `--tls-ca`.
trait Connection: Read + Write {}
impl<T: Read + Write> Connection for T {}

fn connect(cli: &Cli) -> anyhow::Result<Box<dyn Connection>> {
    let tcp = TcpStream::connect_timeout(&cli.node, Duration::from_secs(5))
        .with_context(|| format!("connecting to {}", cli.node))?;
    tcp.set_read_timeout(Some(Duration::from_secs(30)))?;
    let Some(ca) = &cli.tls_ca else {
        return Ok(Box::new(tcp));
    };
    let config = spindle_providers::tls::with_roots_file(ca)?;
    let name = match &cli.tls_name {
        Some(n) => rustls::pki_types::ServerName::try_from(n.clone())
            .with_context(|| format!("--tls-name {n:?}"))?,
        None => rustls::pki_types::ServerName::from(cli.node.ip()),
    };
    let tls = rustls::ClientConnection::new(config, name)?;
    Ok(Box::new(rustls::StreamOwned::new(tls, tcp)))
}

fn call(cli: &Cli, method: &str, path: &str, body: Option<&Value>) -> anyhow::Result<(u16, Value)> {
    let mut stream = connect(cli)?;
    let payload = body.map(|b| b.to_string()).unwrap_or_default();
    write!(
        stream,
        "{method} {path} HTTP/1.1\r\nhost: {}\r\nauthorization: Bearer {}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{payload}",
        cli.node,
        cli.token,
        payload.len()
    )?;
    stream.flush()?;
    let mut text = String::new();
    stream
        .read_to_string(&mut text)
        .with_context(|| format!("reading the answer of {}", cli.node))?;
    let (head, body) = text
        .split_once("\r\n\r\n")
        .context("the node's answer has no header end")?;
    let status: u16 = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .context("the node's answer has no status")?;
    let value = serde_json::from_str(body.trim()).unwrap_or(Value::String(body.trim().into()));
    Ok((status, value))
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let (status, value) = match &cli.command {
        Command::Policy { .. }
        | Command::Lane { .. }
        | Command::Tenant { .. }
        | Command::Quota { .. }
        | Command::Add { .. } => policy_command(&cli)?,
        _ => node_command(&cli)?,
    };
    let refused = !(200..300).contains(&status);
    if cli.json {
        println!("{}", serde_json::to_string_pretty(&value)?);
    } else if !refused {
        // A refusal is its error line alone, not a report of fields it does not have.
        print_human(&cli.command, &value);
    }
    if refused {
        anyhow::bail!("the node refused ({status}): {}", value["error"]);
    }
    Ok(())
}

/// The commands that read or change the policy store (policy objects, lanes, tenants, quotas).
fn policy_command(cli: &Cli) -> anyhow::Result<(u16, Value)> {
    Ok(match &cli.command {
        Command::Policy {
            action: PolicyAction::Show,
        } => call(cli, "GET", "/admin/v1/policy", None)?,
        Command::Policy {
            action:
                PolicyAction::Set {
                    object,
                    key,
                    body,
                    reason,
                },
        } => {
            let text = std::fs::read_to_string(body)
                .with_context(|| format!("reading {}", body.display()))?;
            let body: Value = serde_json::from_str(&text)
                .with_context(|| format!("{} is not JSON", body.display()))?;
            let path = format!("/admin/v1/policy/{object}/{key}");
            call(
                cli,
                "PUT",
                &path,
                Some(&json!({ "reason": reason, "body": body })),
            )?
        }
        Command::Policy {
            action:
                PolicyAction::Delete {
                    object,
                    key,
                    reason,
                },
        } => {
            let path = format!("/admin/v1/policy/{object}/{key}");
            call(cli, "DELETE", &path, Some(&json!({ "reason": reason })))?
        }
        Command::Lane { action } => {
            let (lane, open, reason) = match action {
                LaneAction::Open { lane, reason } => (lane, true, reason),
                LaneAction::Close { lane, reason } => (lane, false, reason),
            };
            let index = LANES
                .iter()
                .position(|l| l == lane)
                .with_context(|| format!("no lane {lane:?}; lanes are {}", LANES.join(", ")))?;
            let path = format!("/admin/v1/policy/lane/{lane}");
            let effective = |p: &Value| p["lanes"][index].clone();
            switch(cli, effective, "open", open.into(), &path, reason)
                .with_context(|| format!("lane {lane}"))?
        }
        Command::Tenant { action } => {
            let (tenant, suspended, reason) = match action {
                TenantAction::Suspend { tenant, reason } => (tenant, true, reason),
                TenantAction::Resume { tenant, reason } => (tenant, false, reason),
            };
            let path = format!("/admin/v1/policy/tenant_policy/{tenant}");
            let effective = |p: &Value| p["tenants"][tenant.to_string()].clone();
            switch(cli, effective, "suspended", suspended.into(), &path, reason)
                .with_context(|| format!("tenant {tenant}"))?
        }
        Command::Quota { action } => match action {
            QuotaAction::Show { tenant } => {
                call(cli, "GET", &format!("/admin/v1/quotas/{tenant}"), None)?
            }
            QuotaAction::Set {
                tenant,
                body,
                reason,
            } => {
                let text = std::fs::read_to_string(body)
                    .with_context(|| format!("reading {}", body.display()))?;
                let quotas: Value = serde_json::from_str(&text)
                    .with_context(|| format!("{}: not JSON", body.display()))?;
                anyhow::ensure!(
                    quotas.is_array(),
                    "{}: expected a JSON array",
                    body.display()
                );
                let path = format!("/admin/v1/policy/tenant_policy/{tenant}");
                let effective = |p: &Value| p["tenants"][tenant.to_string()].clone();
                switch(cli, effective, "quotas", quotas, &path, reason)
                    .with_context(|| format!("tenant {tenant}"))?
            }
            QuotaAction::Reset { tenant, reason } => call(
                cli,
                "POST",
                &format!("/admin/v1/quotas/{tenant}/reset"),
                Some(&json!({ "reason": reason })),
            )?,
        },
        Command::Add { what } => {
            let (status, policy) = call(cli, "GET", "/admin/v1/policy", None)?;
            if !(200..300).contains(&status) {
                anyhow::bail!("reading the policy ({status}): {}", policy["error"]);
            }
            let (object, key, body) = addition(&policy, what)?;
            let reason = match what {
                AddAction::Provider { reason, .. } | AddAction::Model { reason, .. } => reason,
            };
            call(
                cli,
                "PUT",
                &format!("/admin/v1/policy/{object}/{key}"),
                Some(&json!({ "reason": reason, "body": body })),
            )?
        }
        _ => anyhow::bail!("not a command of this kind"),
    })
}

/// The commands about the node's work: audit, drain, counters, tasks, dead letters.
fn node_command(cli: &Cli) -> anyhow::Result<(u16, Value)> {
    Ok(match &cli.command {
        Command::Audit { limit } => {
            call(cli, "GET", &format!("/admin/v1/audit?limit={limit}"), None)?
        }
        Command::Drain { reason } => call(
            cli,
            "POST",
            "/admin/v1/drain",
            Some(&json!({ "reason": reason })),
        )?,
        Command::CheckCounters => call(cli, "GET", "/admin/v1/counters", None)?,
        Command::Task { task } => call(cli, "GET", &format!("/admin/v1/tasks/{task}"), None)?,
        Command::DeadLetters { after, scan } => call(
            cli,
            "GET",
            &format!("/admin/v1/dead-letters?after={after}&scan={scan}"),
            None,
        )?,
        Command::RebuildCounters { reason } => call(
            cli,
            "POST",
            "/admin/v1/counters/rebuild",
            Some(&json!({ "reason": reason })),
        )?,
        Command::Requeue { tasks, reason } => call(
            cli,
            "POST",
            "/admin/v1/tasks/requeue",
            Some(&json!({ "tasks": tasks, "reason": reason })),
        )?,
        Command::Cancel { tasks, reason } => call(
            cli,
            "POST",
            "/admin/v1/tasks/cancel",
            Some(&json!({ "tasks": tasks, "reason": reason })),
        )?,
        _ => anyhow::bail!("not a command of this kind"),
    })
}

/// A text the node sent, as it is shown on a terminal: control characters (a terminal's escape
/// sequences among them) and the marks that reorder text written as escapes, so that what a
/// client named — an audit key, a reason — cannot rewrite the operator's screen.
fn escaped(text: &str) -> String {
    text.chars()
        .map(|c| {
            let reorders = matches!(c, '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}');
            if c.is_control() || reorders {
                c.escape_unicode().to_string()
            } else {
                c.to_string()
            }
        })
        .collect()
}

/// A JSON string field, [`escaped`] ("" when it is not a string).
fn shown(v: &Value) -> String {
    escaped(v.as_str().unwrap_or(""))
}

fn print_human(command: &Command, v: &Value) {
    match command {
        Command::Policy {
            action: PolicyAction::Show,
        } => {
            println!(
                "policy version {} (this node runs {})",
                v["version"], v["effective"]["version"]
            );
            for (name, l) in LANES
                .iter()
                .zip(v["effective"]["lanes"].as_array().into_iter().flatten())
            {
                println!(
                    "  lane {name:<20} {:<6} weight {:<5} capacity {} units",
                    if l["open"] == true { "open" } else { "CLOSED" },
                    l["weight"].to_string(),
                    l["capacity"].as_u64().map_or(0, |m| m / 1000)
                );
            }
            for p in v["effective"]["providers"].as_array().into_iter().flatten() {
                println!(
                    "  provider {:<3} {:<40} concurrency {:<6} rpm {} (burst {})",
                    p["id"].to_string(),
                    shown(&p["name"]),
                    p["concurrency"].to_string(),
                    p["rpm"]["per_minute"],
                    p["rpm"]["burst"]
                );
            }
            for m in v["effective"]["models"].as_array().into_iter().flatten() {
                println!(
                    "  model    {:<3} {:<40} providers {}",
                    m["id"].to_string(),
                    shown(&m["name"]),
                    m["providers"]
                );
            }
            for o in v["objects"].as_array().into_iter().flatten() {
                println!(
                    "  {:<18} {:<40} v{}",
                    shown(&o["object"]),
                    shown(&o["key"]),
                    o["version"]
                );
            }
        }
        Command::Audit { .. } => {
            for e in v.as_array().into_iter().flatten() {
                println!(
                    "v{:<5} {:<12} {:<18} {:<30} {}",
                    e["version"],
                    shown(&e["actor"]),
                    shown(&e["object"]),
                    shown(&e["key"]),
                    shown(&e["reason"])
                );
            }
        }
        Command::CheckCounters => print_drift(&v["drifted"], &v["budgets_drifted"]),
        Command::Task { .. } => {
            let actual = match &v["cost_actual_milli"] {
                Value::Null => "none".to_string(),
                c => c.to_string(),
            };
            println!(
                "task {} of tenant {}: {} (version {}, attempt {}), cost {} milli-units \
                 estimated, {actual} actual",
                v["task"],
                v["tenant"],
                shown(&v["state"]),
                v["version"],
                v["attempt_no"],
                v["cost_estimate_milli"]
            );
            if let Some(why) = v["failure_reason"].as_str() {
                println!("  failed: {}", escaped(why));
            }
            if !v["result"].is_null() {
                println!("  result: {}", v["result"]);
            }
        }
        Command::DeadLetters { .. } => {
            for t in v["tasks"].as_array().into_iter().flatten() {
                println!(
                    "task {:<10} tenant {:<6} attempt {:<3} {}",
                    t["task"],
                    t["tenant"],
                    t["attempt_no"],
                    shown(&t["failure_reason"])
                );
            }
            if let Some(next) = v["next_after"].as_u64() {
                println!("more: spindlectl dead-letters --after {next}");
            }
        }
        Command::RebuildCounters { .. } => print_drift(&v["repaired"], &v["budgets_repaired"]),
        Command::Requeue { .. } | Command::Cancel { .. } => {
            for t in v["tasks"].as_array().into_iter().flatten() {
                let detail = match &t["detail"] {
                    Value::Null => String::new(),
                    Value::String(s) => format!(" ({})", escaped(s)),
                    other => format!(" ({other})"),
                };
                println!("task {:<10} {}{detail}", t["task"], shown(&t["outcome"]));
            }
        }
        _ => println!("{v}"),
    }
}

/// Pool shards and budgets whose stored counter differs from what they derive from.
fn print_drift(pools: &Value, budgets: &Value) {
    let pools = pools.as_array().cloned().unwrap_or_default();
    let budgets = budgets.as_array().cloned().unwrap_or_default();
    if pools.is_empty() && budgets.is_empty() {
        println!(
            "no drift: every pool's usage matches what live attempts hold, every reserved \
             budget what open reservations hold"
        );
    }
    for d in pools {
        println!(
            "{}/{}: stored {} → derived {}",
            d["pool"].as_str().unwrap_or(""),
            d["shard"],
            d["stored"],
            d["derived"]
        );
    }
    for d in budgets {
        println!(
            "tenant {} reserved budget: stored {} → derived {}",
            d["tenant"], d["stored"], d["derived"]
        );
    }
}

#[cfg(test)]
mod shown_tests {
    use super::*;

    /// What a client put in an audit key or a reason reaches the terminal as text: a
    /// terminal's escape sequence and a mark that reverses the line are written as escapes.
    #[test]
    fn a_terminals_escapes_and_reordering_marks_are_shown_escaped() {
        assert_eq!(
            escaped("key\u{1b}[2J\u{202e}gnp.exe\n"),
            "key\\u{1b}[2J\\u{202e}gnp.exe\\u{a}"
        );
        assert_eq!(escaped("plain <text> é"), "plain <text> é");
        assert_eq!(shown(&serde_json::json!(7)), "");
    }
}
