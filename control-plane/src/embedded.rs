//! A private PostgreSQL server started from the system's binaries: the default for the main job,
//! the bench and the tests. It lives in a temporary directory, listens on 127.0.0.1 on a free
//! port, and is stopped and deleted on drop. As root it runs the server as the `postgres` user
//! (PostgreSQL refuses to run as root).

use std::io;
use std::net::TcpListener;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// Where the server's binaries are looked for when `SPINDLE_PG_BIN` is not set.
const BIN_GLOB_ROOT: &str = "/usr/lib/postgresql";
/// The superuser role created by initdb.
pub const SUPERUSER: &str = "spindle";

#[derive(Debug, thiserror::Error)]
pub enum EmbedError {
    #[error(
        "no PostgreSQL server binaries found (looked in $SPINDLE_PG_BIN and {BIN_GLOB_ROOT}/*/bin); \
         install them with `apt-get install -y postgresql`"
    )]
    NoBinaries,
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: io::Error,
    },
    #[error("`{command}` failed ({status}): {stderr}")]
    Command {
        command: String,
        status: String,
        stderr: String,
    },
}

/// Server settings for the private instance.
#[derive(Debug, Clone)]
pub struct EmbeddedOptions {
    pub max_connections: u32,
    pub shared_buffers_mb: u32,
    /// Extra `-c name=value` settings.
    pub settings: Vec<(String, String)>,
}

impl Default for EmbeddedOptions {
    fn default() -> Self {
        EmbeddedOptions {
            max_connections: 200,
            shared_buffers_mb: 128,
            // New WAL segments are created sparse instead of written full of zeroes first:
            // while the WAL grows (a fresh server, before checkpoints recycle segments) every
            // 16 MB segment's zero-fill and sync stalled every commit behind it. Measured
            // (docs/benchmarks/journal.md): submit ack p99 at 10k tasks/s 54–56 → 29 ms,
            // completions −4 % while the WAL grows; recycled segments make both the same
            // afterwards. Durability is unchanged: a commit's WAL is synced with fdatasync either
            // way.
            //
            // Backends start the write-back of the pages they write every 256 kB
            // (`sync_file_range`) instead of leaving them dirty in the kernel's cache, where
            // they piled up until the 30 s expiry (dirty_expire_centisecs) wrote them back at
            // once: ~280 MB in one second, every commit's flush queued behind it. Measured
            // (docs/benchmarks/journal.md, "Ninth round"): 45 s at 7,000 tasks/s, ack p99 over the
            // run 266–333 → 27–50 ms, the worst second's 577–680 → 252–360 ms, the same
            // completions and PostgreSQL CPU.
            settings: vec![
                ("wal_init_zero".into(), "off".into()),
                ("backend_flush_after".into(), "256kB".into()),
            ],
        }
    }
}

/// A running private server. Dropping it stops the server and deletes its files.
#[derive(Debug)]
pub struct EmbeddedPostgres {
    dir: tempfile::TempDir,
    bin: PathBuf,
    port: u16,
    as_postgres: bool,
    /// The superuser's password: random, made at initdb, in no file but [`Self::pgpass`] (the
    /// server takes no connection without it — no `trust` — and its socket's folder is the
    /// server's alone).
    password: String,
    options: EmbeddedOptions,
    running: bool,
}

impl EmbeddedPostgres {
    /// initdb into a fresh temporary directory and start the server.
    pub fn start(options: EmbeddedOptions) -> Result<EmbeddedPostgres, EmbedError> {
        let bin = find_bin_dir()?;
        let dir = tempfile::Builder::new()
            .prefix("spindle-pg-")
            .tempdir()
            .map_err(|source| EmbedError::Io {
                what: "creating the server's temporary directory".into(),
                source,
            })?;
        let as_postgres = running_as_root();
        let mut pg = EmbeddedPostgres {
            dir,
            bin,
            port: 0,
            as_postgres,
            password: random_password()?,
            options,
            running: false,
        };
        // initdb reads the password from a file of the server's user, removed right after.
        let pwfile = pg.dir.path().join("pwfile");
        write_private(&pwfile, &pg.password)?;
        if as_postgres {
            pg.run("chown", &["-R", "postgres:postgres", pg.dir_str()], false)?;
        }
        let data = pg.data_dir();
        // The "C" locale whatever the environment's: text compares and sorts by bytes, the
        // same on every machine, and without the collation functions' cost (the key column is `COLLATE "C"`).
        pg.run(
            "initdb",
            &[
                "-D",
                path_str(&data),
                "-U",
                SUPERUSER,
                "-A",
                "scram-sha-256",
                &format!("--pwfile={}", path_str(&pwfile)),
                "-E",
                "UTF8",
                "--locale=C",
                "--no-sync",
            ],
            true,
        )?;
        let _ = std::fs::remove_file(&pwfile);
        // For psql and other libpq tools of the node's user: PGPASSFILE=<pgpass>.
        write_private(
            &pg.pgpass(),
            &format!("127.0.0.1:*:*:{SUPERUSER}:{}\n", pg.password),
        )?;
        pg.start_server()?;
        Ok(pg)
    }

    /// A libpq password file (`PGPASSFILE`) with the superuser's password, readable by the
    /// node's user alone.
    pub fn pgpass(&self) -> PathBuf {
        self.dir.path().join("pgpass")
    }

    /// [`Self::conninfo`] without the password: what may be logged or printed.
    pub fn conninfo_public(&self, dbname: &str) -> String {
        format!(
            "host=127.0.0.1 port={} user={SUPERUSER} dbname={dbname}",
            self.port
        )
    }

    /// (Re)starts a stopped server: on its previous port when it had one (clients reconnect
    /// with the same conninfo), else on a fresh free port.
    pub fn start_server(&mut self) -> Result<(), EmbedError> {
        assert!(!self.running, "the server is already running");
        // A port found free can be taken before the server binds it: try a few.
        let mut last = None;
        for attempt in 0..5 {
            if !(attempt == 0 && self.port != 0) {
                self.port = free_port()?;
            }
            let mut server_opts = format!(
                "-p {} -k {} -c listen_addresses=127.0.0.1 -c max_connections={} -c shared_buffers={}MB",
                self.port,
                self.dir_str(),
                self.options.max_connections,
                self.options.shared_buffers_mb
            );
            for (k, v) in &self.options.settings {
                server_opts.push_str(&format!(" -c {k}={v}"));
            }
            let data = self.data_dir();
            let log = self.dir.path().join("server.log");
            match self.run(
                "pg_ctl",
                &[
                    "-D",
                    path_str(&data),
                    "-l",
                    path_str(&log),
                    "-o",
                    &server_opts,
                    "-w",
                    "-t",
                    "60",
                    "start",
                ],
                true,
            ) {
                Ok(_) => {
                    self.running = true;
                    return Ok(());
                }
                Err(e) => last = Some(e),
            }
        }
        Err(last.expect("at least one attempt"))
    }

    /// Stops the server (fast shutdown: open sessions are terminated); the files stay.
    pub fn stop_server(&mut self) -> Result<(), EmbedError> {
        if !self.running {
            return Ok(());
        }
        let data = self.data_dir();
        self.run(
            "pg_ctl",
            &["-D", path_str(&data), "-m", "fast", "-w", "stop"],
            true,
        )?;
        self.running = false;
        Ok(())
    }

    /// Crashes the server (immediate shutdown: no checkpoint, the next start recovers from
    /// the WAL, as after a power loss); the files stay.
    pub fn crash_server(&mut self) -> Result<(), EmbedError> {
        if !self.running {
            return Ok(());
        }
        let data = self.data_dir();
        self.run(
            "pg_ctl",
            &["-D", path_str(&data), "-m", "immediate", "-w", "stop"],
            true,
        )?;
        self.running = false;
        Ok(())
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// A libpq connection string for `dbname` on this server, its password included (never
    /// log it: [`Self::conninfo_public`]).
    pub fn conninfo(&self, dbname: &str) -> String {
        format!(
            "host=127.0.0.1 port={} user={SUPERUSER} password={} dbname={dbname}",
            self.port, self.password
        )
    }

    fn data_dir(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    fn dir_str(&self) -> &str {
        path_str(self.dir.path())
    }

    /// Runs a server binary (`pg_tool`) or, with `pg_tool` false, a system command.
    fn run(&self, program: &str, args: &[&str], pg_tool: bool) -> Result<Output, EmbedError> {
        let path = if pg_tool {
            self.bin.join(program)
        } else {
            PathBuf::from(program)
        };
        let mut cmd = if pg_tool && self.as_postgres {
            let mut c = Command::new("runuser");
            c.args(["-u", "postgres", "--"]).arg(&path);
            c
        } else {
            Command::new(&path)
        };
        cmd.args(args);
        let output = cmd.output().map_err(|source| EmbedError::Io {
            what: format!("running {}", path.display()),
            source,
        })?;
        if !output.status.success() {
            let mut stderr = String::from_utf8_lossy(&output.stderr).into_owned();
            if stderr.trim().is_empty() {
                stderr = String::from_utf8_lossy(&output.stdout).into_owned();
            }
            let log =
                std::fs::read_to_string(self.dir.path().join("server.log")).unwrap_or_default();
            if !log.is_empty() {
                stderr.push_str("\nserver log:\n");
                stderr.push_str(&log);
            }
            return Err(EmbedError::Command {
                command: format!("{} {}", path.display(), args.join(" ")),
                status: output.status.to_string(),
                stderr,
            });
        }
        Ok(output)
    }
}

/// 32 hex digits from the kernel's random source.
fn random_password() -> Result<String, EmbedError> {
    use std::io::Read;
    let mut bytes = [0u8; 16];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut bytes))
        .map_err(|source| EmbedError::Io {
            what: "reading /dev/urandom for the server's password".into(),
            source,
        })?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

/// Writes `text` to a new file `path` only its owner may read (0600).
pub fn write_private(path: &std::path::Path, text: &str) -> Result<(), EmbedError> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .and_then(|mut f| f.write_all(text.as_bytes()))
        .map_err(|source| EmbedError::Io {
            what: format!("writing {}", path.display()),
            source,
        })
}

impl Drop for EmbeddedPostgres {
    fn drop(&mut self) {
        if !self.running {
            return;
        }
        let data = self.data_dir();
        if let Err(e) = self.run(
            "pg_ctl",
            &["-D", path_str(&data), "-m", "immediate", "-w", "stop"],
            true,
        ) {
            eprintln!("spindle: stopping the private PostgreSQL failed: {e}");
        }
    }
}

fn path_str(p: &Path) -> &str {
    p.to_str().expect("temporary paths are UTF-8")
}

fn running_as_root() -> bool {
    std::fs::metadata("/proc/self").is_ok_and(|m| m.uid() == 0)
}

fn free_port() -> Result<u16, EmbedError> {
    let listener = TcpListener::bind("127.0.0.1:0").map_err(|source| EmbedError::Io {
        what: "finding a free port".into(),
        source,
    })?;
    let port = listener
        .local_addr()
        .map_err(|source| EmbedError::Io {
            what: "finding a free port".into(),
            source,
        })?
        .port();
    Ok(port)
}

/// `$SPINDLE_PG_BIN`, else the highest version under /usr/lib/postgresql.
pub fn find_bin_dir() -> Result<PathBuf, EmbedError> {
    if let Some(dir) = std::env::var_os("SPINDLE_PG_BIN") {
        let dir = PathBuf::from(dir);
        return if dir.join("initdb").exists() {
            Ok(dir)
        } else {
            Err(EmbedError::NoBinaries)
        };
    }
    let entries = std::fs::read_dir(BIN_GLOB_ROOT).map_err(|_| EmbedError::NoBinaries)?;
    let mut versions: Vec<(u32, PathBuf)> = entries
        .flatten()
        .filter_map(|e| {
            let version = e.file_name().to_str()?.parse::<u32>().ok()?;
            let bin = e.path().join("bin");
            bin.join("initdb").exists().then_some((version, bin))
        })
        .collect();
    versions.sort();
    versions
        .pop()
        .map(|(_, bin)| bin)
        .ok_or(EmbedError::NoBinaries)
}
