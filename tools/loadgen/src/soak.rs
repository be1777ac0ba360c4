//! `soak`: a private PostgreSQL, spindle-mock-provider and three spindled nodes (in this
//! process, each with its own partitions) under steady load for minutes. Every ten seconds the
//! mock's counters are printed; at the end every node must have completed its work and the
//! mock must report zero concurrency or RPM violations and zero duplicate request keys.

use std::path::Path;
use std::time::{Duration, Instant};

use spindle_client::Client;
use spindle_core::TenantId;

const CONCURRENCY: u64 = 20;
const RPM: u64 = 1_200;
const NODES: u32 = 3;
const TENANTS: u32 = 6;

pub struct Options {
    pub seconds: u64,
    /// Tasks a second offered across all tenants.
    pub rate: u64,
}

pub fn run(opts: Options) -> anyhow::Result<()> {
    crate::harness::with_private_postgres("soak", |conninfo, dir| async move {
        soak(&opts, &conninfo, &dir).await
    })
}

async fn soak(opts: &Options, conninfo: &str, dir: &Path) -> anyhow::Result<bool> {
    let mock = crate::harness::mock(CONCURRENCY, RPM, 400, "soak").await?;
    let admin = mock.client(Duration::from_secs(5));
    let mut addrs = Vec::new();
    for n in 0..NODES {
        let ready = dir.join(format!("ready-{n}"));
        let mut text = format!(
            r#"node_id = "soak-{n}"
listen = "127.0.0.1:0"
http_listen = "127.0.0.1:0"
postgres = "{conninfo}"
partitions = {TENANTS}
owned_partitions = [{}, {}]
idle_spin_us = 0
provider_concurrency = {CONCURRENCY}
provider_rpm = {RPM}
lane_capacity_units = 100000

[provider]
url = "{}"
secret = "soak"
poll_ms = [500, 1000]
"#,
            2 * n,
            2 * n + 1,
            mock.base_url()
        );
        for t in 1..=TENANTS {
            text.push_str(&format!(
                "\n[[tenants]]\nid = {t}\ncredential = \"soak-credential-{t}\"\n"
            ));
        }
        let config = crate::toml_config_at(&text, &ready, &format!("spindled-{n}.toml"))?;
        addrs.push(crate::start_node(&format!("spindled-{n}"), config, &ready)?.client);
    }
    // Let every node count the others (their RPM shares depend on it): a third of a lease.
    tokio::time::sleep(Duration::from_secs(11)).await;
    println!(
        "soak: {NODES} nodes, 2 accounts ({CONCURRENCY} concurrent, {RPM}/min each), {} tasks/s \
         for {} s",
        opts.rate, opts.seconds
    );
    let mut senders = Vec::new();
    let per_tenant = (opts.rate as f64 / f64::from(TENANTS)).max(0.1);
    for t in 1..=TENANTS {
        // Every tenant asks the first node, which sends those of the others' partitions on
        // (tenant t's partition t % TENANTS is owned by node (t % TENANTS) / 2).
        let seed = addrs[0].to_string();
        let client =
            Client::connect_cluster(&seed, TenantId(t), &format!("soak-credential-{t}")).await?;
        let expected = format!("soak-{}", (t % TENANTS) / 2);
        anyhow::ensure!(
            client.hello().node_id == expected,
            "tenant {t} was served by {}, not {expected}",
            client.hello().node_id
        );
        let seconds = opts.seconds;
        senders.push(tokio::spawn(async move {
            let gap = Duration::from_secs_f64(1.0 / per_tenant);
            let start = tokio::time::Instant::now();
            let mut ids = Vec::new();
            let mut n = 0u32;
            while start.elapsed() < Duration::from_secs(seconds) {
                tokio::time::sleep_until(start + gap * n).await;
                n += 1;
                if let Ok(a) = client
                    .submit(crate::harness::video_task(format!("soak-{t}-{n}")))
                    .await
                {
                    if a.decision.is_accepted() {
                        ids.push(a.task.0 as i64);
                    }
                }
            }
            ids
        }));
    }
    let start = Instant::now();
    println!("  time  accepted  completed  in flight  violations  duplicates");
    let report = |stats: &spindle_providers::Stats| {
        let (mut a, mut c, mut f, mut v, mut d) = (0, 0, 0, 0, 0);
        for s in stats.accounts.values() {
            a += s.accepted;
            c += s.completed;
            f += s.in_flight;
            v += s.concurrency_violations + s.rpm_violations;
            d += s.duplicate_keys;
        }
        println!(
            "{:>5}s  {a:>8}  {c:>9}  {f:>9}  {v:>10}  {d:>10}",
            start.elapsed().as_secs()
        );
        (v, d)
    };
    while start.elapsed() < Duration::from_secs(opts.seconds) {
        tokio::time::sleep(Duration::from_secs(10)).await;
        report(&admin.mock_stats().await?);
    }
    let mut ids = Vec::new();
    for s in senders {
        ids.extend(s.await?);
    }
    // Drain: bounded by what the provider takes per second.
    let db = spindle_control::Db::open(&spindle_control::DbConfig::new(conninfo)).await?;
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut done = 0i64;
    while Instant::now() < deadline {
        done = db
            .client()
            .query_one(
                "SELECT count(*) FROM task WHERE task_id = ANY ($1) AND state = 'SUCCEEDED'",
                &[&ids],
            )
            .await?
            .get(0);
        if done == ids.len() as i64 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let (violations, duplicates) = report(&admin.mock_stats().await?);
    let states = crate::final_states(conninfo).await?;
    println!(
        "{} tasks accepted, {done} succeeded; states {states:?}; violations {violations}, \
         duplicate keys {duplicates}",
        ids.len()
    );
    Ok(violations == 0 && duplicates == 0 && done == ids.len() as i64)
}
