//! A highly available PostgreSQL for tests and the failover bench: pg_auto_failover (Debian's
//! `postgresql-15-auto-failover`, its `pg_autoctl`) runs a monitor and two data nodes on
//! 127.0.0.1 — a primary and a standby it keeps synchronous (`synchronous_standby_names = 'ANY 1
//! (…)'`) — in a temporary directory, everything stopped and removed on drop.
//!
//! The monitor is tuned to fail over in seconds rather than its production defaults' tens of
//! seconds ([`MONITOR_SETTINGS`]): a dead primary is declared unhealthy after 3 s and demoted
//! 3 s after that. The order of events is the same as in production; only the timeouts are
//! shorter.
//!
//! Processes run as `postgres` when the caller is root (as [`crate::embedded`]'s server does).
//! Each `pg_autoctl` keeper runs in a process group of its own, so that [`AutoFailover::kill`]
//! can take a node down whole — keeper and postmaster — with SIGKILL, as a machine's loss does.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Settings of the monitor (`pgautofailover.*`, ms) that make a failover take seconds.
pub const MONITOR_SETTINGS: [(&str, u32); 6] = [
    ("health_check_period", 1_000),
    ("health_check_timeout", 1_000),
    ("health_check_max_retries", 1),
    ("health_check_retry_delay", 500),
    ("node_considered_unhealthy_timeout", 3_000),
    ("primary_demote_timeout", 3_000),
];

/// The database the data nodes are created with.
pub const DBNAME: &str = "spindle";

/// How long a step of the cluster's set-up may take.
const SETUP_STEP: Duration = Duration::from_secs(120);

#[derive(Debug, thiserror::Error)]
pub enum HaError {
    #[error(
        "pg_auto_failover is not installed (apt-get install postgresql-15-auto-failover): {0}"
    )]
    NotInstalled(String),
    #[error("{what}: {detail}")]
    Step { what: String, detail: String },
}

fn step(what: impl Into<String>, detail: impl std::fmt::Display) -> HaError {
    HaError::Step {
        what: what.into(),
        detail: detail.to_string(),
    }
}

struct Node {
    name: String,
    port: u16,
    pgdata: PathBuf,
    keeper: Option<Child>,
}

/// A monitor and two data nodes of one formation.
pub struct AutoFailover {
    dir: tempfile::TempDir,
    bin: PathBuf,
    as_postgres: bool,
    monitor: Node,
    nodes: [Node; 2],
}

impl AutoFailover {
    /// `pg_autoctl` and the monitor's extension, or why not.
    pub fn installed() -> Result<(), HaError> {
        let bin =
            crate::embedded::find_bin_dir().map_err(|e| HaError::NotInstalled(e.to_string()))?;
        let lib = bin.with_file_name("lib").join("pgautofailover.so");
        if !lib.exists() {
            return Err(HaError::NotInstalled(format!(
                "{} is missing",
                lib.display()
            )));
        }
        match Command::new("pg_autoctl").arg("version").output() {
            Ok(o) if o.status.success() => Ok(()),
            Ok(o) => Err(HaError::NotInstalled(
                String::from_utf8_lossy(&o.stderr).into(),
            )),
            Err(e) => Err(HaError::NotInstalled(format!("pg_autoctl: {e}"))),
        }
    }

    /// Creates and starts the monitor, then the first data node (the primary), then the
    /// second (its synchronous standby), and waits until the monitor reports them primary and
    /// secondary.
    pub fn start() -> Result<AutoFailover, HaError> {
        Self::installed()?;
        let bin =
            crate::embedded::find_bin_dir().map_err(|e| HaError::NotInstalled(e.to_string()))?;
        let dir = tempfile::Builder::new()
            .prefix("spindle-ha-")
            .tempdir()
            .map_err(|e| step("a temporary directory", e))?;
        let as_postgres = std::fs::metadata("/proc/self")
            .map(|m| std::os::unix::fs::MetadataExt::uid(&m) == 0)
            .unwrap_or(false);
        if as_postgres {
            let out = Command::new("chown")
                .args(["-R", "postgres:postgres"])
                .arg(dir.path())
                .output()
                .map_err(|e| step("chown", e))?;
            if !out.status.success() {
                return Err(step("chown", String::from_utf8_lossy(&out.stderr)));
            }
        }
        let node = |name: &str| -> Result<Node, HaError> {
            Ok(Node {
                name: name.into(),
                port: free_port()?,
                pgdata: dir.path().join(name),
                keeper: None,
            })
        };
        let mut ha = AutoFailover {
            bin,
            as_postgres,
            monitor: node("monitor")?,
            nodes: [node("node_1")?, node("node_2")?],
            dir,
        };
        let monitor = ha.monitor.pgdata.display().to_string();
        let port = ha.monitor.port.to_string();
        ha.autoctl(&[
            "create",
            "monitor",
            "--pgdata",
            &monitor,
            "--pgport",
            &port,
            "--hostname",
            "127.0.0.1",
            "--auth",
            "trust",
            "--no-ssl",
        ])?;
        ha.monitor.keeper = Some(ha.spawn(&["run", "--pgdata", &monitor], "monitor")?);
        ha.wait("the monitor to answer", SETUP_STEP, |ha| {
            ha.sql(ha.monitor.port, "pg_auto_failover", "SELECT 1")
                .is_ok()
        })?;
        for (name, ms) in MONITOR_SETTINGS {
            ha.sql(
                ha.monitor.port,
                "pg_auto_failover",
                &format!("ALTER SYSTEM SET pgautofailover.{name} = {ms}"),
            )?;
        }
        ha.sql(
            ha.monitor.port,
            "pg_auto_failover",
            "SELECT pg_reload_conf()",
        )?;
        for i in 0..2 {
            ha.create_node(i)?;
            if i == 0 {
                // Alone in its formation it is "single"; a primary once a standby joins.
                ha.wait("the first node to serve", SETUP_STEP, |ha| {
                    ha.states().is_ok_and(|s| {
                        s.iter().any(|(n, r, _)| {
                            n == "node_1" && (r == "single" || r.ends_with("primary"))
                        })
                    })
                })?;
            }
        }
        ha.wait_stable(SETUP_STEP)?;
        Ok(ha)
    }

    fn create_node(&mut self, i: usize) -> Result<(), HaError> {
        let monitor_uri = format!(
            "postgres://autoctl_node@127.0.0.1:{}/pg_auto_failover?sslmode=disable",
            self.monitor.port
        );
        let (pgdata, port, name) = {
            let n = &self.nodes[i];
            (
                n.pgdata.display().to_string(),
                n.port.to_string(),
                n.name.clone(),
            )
        };
        let child = self.spawn(
            &[
                "create",
                "postgres",
                "--pgdata",
                &pgdata,
                "--pgport",
                &port,
                "--hostname",
                "127.0.0.1",
                "--name",
                &name,
                "--auth",
                "trust",
                "--no-ssl",
                "--dbname",
                DBNAME,
                "--monitor",
                &monitor_uri,
                "--run",
            ],
            &name,
        )?;
        self.nodes[i].keeper = Some(child);
        Ok(())
    }

    /// A conninfo naming both data nodes, for whichever is primary.
    pub fn conninfo(&self) -> String {
        format!(
            "postgresql://postgres@127.0.0.1:{},127.0.0.1:{}/{DBNAME}?target_session_attrs=read-write",
            self.nodes[0].port, self.nodes[1].port
        )
    }

    /// Data node `i`'s port.
    pub fn node_port(&self, i: usize) -> u16 {
        self.nodes[i].port
    }

    /// A conninfo for data node `i` alone.
    pub fn node_conninfo(&self, i: usize) -> String {
        format!(
            "host=127.0.0.1 port={} user=postgres dbname={DBNAME}",
            self.nodes[i].port
        )
    }

    /// The nodes as the monitor sees them: name, reported state, goal state.
    pub fn states(&self) -> Result<Vec<(String, String, String)>, HaError> {
        let out = self.sql(
            self.monitor.port,
            "pg_auto_failover",
            "SELECT nodename, reportedstate, goalstate FROM pgautofailover.node ORDER BY nodeid",
        )?;
        Ok(out
            .lines()
            .filter_map(|l| {
                let mut f = l.split('|');
                Some((f.next()?.into(), f.next()?.into(), f.next()?.into()))
            })
            .collect())
    }

    /// Waits until one node is primary and the other secondary (each reported and assigned),
    /// hurrying the standby's base backup along with checkpoints; the primary's index.
    pub fn wait_stable(&self, within: Duration) -> Result<usize, HaError> {
        let mut primary = None;
        self.wait("a primary and a synchronous secondary", within, |ha| {
            let Ok(states) = ha.states() else {
                return false;
            };
            let settled =
                |state: &str| states.iter().position(|(_, r, g)| r == state && g == state);
            match (settled("primary"), settled("secondary")) {
                (Some(p), Some(_)) => {
                    primary = Some(p);
                    true
                }
                _ => {
                    // A standby's pg_basebackup waits for the primary's next checkpoint.
                    for n in 0..2 {
                        let _ = ha.sql(ha.nodes[n].port, DBNAME, "CHECKPOINT");
                    }
                    false
                }
            }
        })?;
        primary.ok_or_else(|| step("waiting for a primary", "none"))
    }

    /// Which data node answers as a primary now.
    pub fn primary(&self) -> Option<usize> {
        (0..2).find(|&i| {
            self.sql(self.nodes[i].port, DBNAME, "SELECT pg_is_in_recovery()")
                .is_ok_and(|o| o.trim() == "f")
        })
    }

    /// A planned failover (`pg_autoctl perform failover`), waited for.
    pub fn perform_failover(&self) -> Result<(), HaError> {
        let monitor = self.monitor.pgdata.display().to_string();
        self.autoctl(&["perform", "failover", "--pgdata", &monitor, "--wait", "60"])
            .map(|_| ())
    }

    /// Kills data node `i` whole with SIGKILL — its keeper's process group, then its
    /// postmaster — as the loss of its machine would.
    pub fn kill(&mut self, i: usize) -> Result<(), HaError> {
        if let Some(mut keeper) = self.nodes[i].keeper.take() {
            // The group was made with process_group(0): its id is the child's pid.
            let _ = Command::new("kill")
                .args(["-KILL", "--", &format!("-{}", keeper.id())])
                .stderr(Stdio::null())
                .status();
            let _ = keeper.wait();
        }
        if let Some(pid) = postmaster_pid(&self.nodes[i].pgdata) {
            let _ = Command::new("kill")
                .args(["-KILL", &pid.to_string()])
                .stderr(Stdio::null())
                .status();
        }
        Ok(())
    }

    /// Starts data node `i`'s keeper again: it rejoins as a standby (pg_rewind).
    pub fn restart(&mut self, i: usize) -> Result<(), HaError> {
        let pgdata = self.nodes[i].pgdata.display().to_string();
        let name = self.nodes[i].name.clone();
        self.nodes[i].keeper = Some(self.spawn(&["run", "--pgdata", &pgdata], &name)?);
        Ok(())
    }

    /// Runs `sql` on the server at `port` (psql, as `postgres` over TCP; the cluster trusts
    /// 127.0.0.1), its rows as `|`-separated lines.
    pub fn sql(&self, port: u16, db: &str, sql: &str) -> Result<String, HaError> {
        let out = Command::new(self.bin.join("psql"))
            .args(["-X", "-A", "-t", "-v", "ON_ERROR_STOP=1"])
            .arg(format!(
                "host=127.0.0.1 port={port} user=postgres dbname={db} connect_timeout=2"
            ))
            .args(["-c", sql])
            .output()
            .map_err(|e| step("psql", e))?;
        if !out.status.success() {
            return Err(step(
                format!("psql on port {port}: {sql}"),
                String::from_utf8_lossy(&out.stderr),
            ));
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    fn command(&self, args: &[&str]) -> Command {
        let path = format!(
            "{}:{}",
            self.bin.display(),
            std::env::var("PATH").unwrap_or_default()
        );
        let xdg = self.dir.path();
        let mut c = if self.as_postgres {
            let mut c = Command::new("runuser");
            c.args(["-u", "postgres", "--", "env"]);
            c
        } else {
            Command::new("env")
        };
        c.arg(format!("PATH={path}"))
            .arg(format!("XDG_CONFIG_HOME={}", xdg.join("config").display()))
            .arg(format!("XDG_DATA_HOME={}", xdg.join("data").display()))
            .arg("PG_AUTOCTL_DEBUG=0")
            .arg("pg_autoctl")
            .args(args);
        c
    }

    /// Runs `pg_autoctl args` to its end.
    fn autoctl(&self, args: &[&str]) -> Result<String, HaError> {
        let out = self
            .command(args)
            .output()
            .map_err(|e| step(format!("pg_autoctl {}", args.join(" ")), e))?;
        if !out.status.success() {
            return Err(step(
                format!("pg_autoctl {}", args.join(" ")),
                String::from_utf8_lossy(&out.stderr),
            ));
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// Starts `pg_autoctl args` in a process group of its own, logging to `<log>.log`.
    fn spawn(&self, args: &[&str], log: &str) -> Result<Child, HaError> {
        let file = |what| {
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(self.dir.path().join(format!("{log}.log")))
                .map_err(|e| step(format!("{what} of {log}"), e))
        };
        self.command(args)
            .stdin(Stdio::null())
            .stdout(file("stdout")?)
            .stderr(file("stderr")?)
            .process_group(0)
            .spawn()
            .map_err(|e| step(format!("pg_autoctl {}", args.join(" ")), e))
    }

    /// The log of `what` (`monitor`, `node_1`, `node_2`), for failure messages.
    pub fn log(&self, what: &str) -> String {
        std::fs::read_to_string(self.dir.path().join(format!("{what}.log"))).unwrap_or_default()
    }

    /// Polls `ready` (every 200 ms) until it holds, or fails after `within`.
    fn wait(
        &self,
        what: &str,
        within: Duration,
        mut ready: impl FnMut(&Self) -> bool,
    ) -> Result<(), HaError> {
        let began = Instant::now();
        while began.elapsed() < within {
            if ready(self) {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        Err(step(
            format!("waiting for {what}"),
            format!(
                "not within {within:?}; states {:?}\nmonitor log:\n{}",
                self.states().ok(),
                tail(&self.log("monitor"), 20)
            ),
        ))
    }
}

impl Drop for AutoFailover {
    fn drop(&mut self) {
        for i in 0..2 {
            let _ = self.kill(i);
        }
        if let Some(mut keeper) = self.monitor.keeper.take() {
            let _ = Command::new("kill")
                .args(["-KILL", "--", &format!("-{}", keeper.id())])
                .stderr(Stdio::null())
                .status();
            let _ = keeper.wait();
        }
        if let Some(pid) = postmaster_pid(&self.monitor.pgdata) {
            let _ = Command::new("kill")
                .args(["-KILL", &pid.to_string()])
                .stderr(Stdio::null())
                .status();
        }
    }
}

fn postmaster_pid(pgdata: &Path) -> Option<u32> {
    std::fs::read_to_string(pgdata.join("postmaster.pid"))
        .ok()?
        .lines()
        .next()?
        .trim()
        .parse()
        .ok()
}

fn free_port() -> Result<u16, HaError> {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|e| step("a free port", e))
}

fn tail(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}
