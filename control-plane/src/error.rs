//! The control plane's typed errors. `Unavailable` is what callers branch on: PostgreSQL cannot be
//! reached, nothing was committed, stop claiming and try again later.

use spindle_core::TaskId;

#[derive(Debug, Clone, thiserror::Error)]
pub enum StoreError {
    /// The server is down, the connection was lost or the backend was terminated. Nothing of
    /// the failed call is committed.
    #[error("PostgreSQL is unavailable: {0}")]
    Unavailable(String),
    /// A call that changes rows went out on a live connection and its answer never came back
    /// (the connection broke, the server went away): PostgreSQL may or may not have committed
    /// it. Look at the rows before doing it again ([`crate::Db::task_heads`]).
    #[error("PostgreSQL connection lost before the answer, the call may have committed: {0}")]
    InDoubt(String),
    /// The batch was refused before it reached PostgreSQL.
    #[error("invalid input: {0}")]
    Invalid(#[from] InputError),
    /// PostgreSQL refused the statement (nothing committed). `retryable` for deadlocks,
    /// serialization failures and timeouts.
    #[error("PostgreSQL refused the call ({code}): {message}")]
    Refused {
        code: String,
        message: String,
        retryable: bool,
    },
    /// The client library refused the call before sending it (a parameter of the wrong type):
    /// a bug in this crate, never retryable.
    #[error("PostgreSQL client error: {0}")]
    Client(String),
    /// A migration already applied differs from the one this binary carries.
    #[error("migration {version} ({name}) was applied with a different checksum")]
    MigrationChanged { version: i32, name: &'static str },
    /// The database holds a value this binary cannot read (a newer schema, a manual edit).
    #[error("unexpected value in the database: {0}")]
    Corrupt(String),
}

/// SQLSTATE `read_only_sql_transaction`.
const READ_ONLY: &str = "25006";

impl StoreError {
    /// A write refused by a read-only server (SQLSTATE 25006): the connection is to a standby.
    pub fn is_read_only(&self) -> bool {
        matches!(self, StoreError::Unavailable(text) if text.starts_with(READ_ONLY))
    }

    /// PostgreSQL could not be reached, before the call or under it.
    pub fn is_unavailable(&self) -> bool {
        matches!(self, StoreError::Unavailable(_) | StoreError::InDoubt(_))
    }

    pub fn is_in_doubt(&self) -> bool {
        matches!(self, StoreError::InDoubt(_))
    }

    /// Worth sending again. A call in doubt is only when repeating it is harmless (reports: a
    /// repeat that finds its step taken is refused by token and state).
    pub fn is_retryable(&self) -> bool {
        match self {
            StoreError::Unavailable(_) | StoreError::InDoubt(_) => true,
            StoreError::Refused { retryable, .. } => *retryable,
            _ => false,
        }
    }
}

impl From<tokio_postgres::Error> for StoreError {
    fn from(e: tokio_postgres::Error) -> Self {
        let Some(db) = e.as_db_error() else {
            // No server answer: an I/O error, a closed connection, a failed connect — or a
            // client-side fault (a parameter that does not serialize), which is a bug here.
            let io = std::error::Error::source(&e).is_some_and(|s| s.is::<std::io::Error>());
            let text = e.to_string();
            if e.is_closed() || io || text.contains("connect") || text.contains("timeout") {
                return StoreError::Unavailable(text);
            }
            return StoreError::Client(text);
        };
        let code = db.code().code();
        // 08: connection exception; 57P0x: admin shutdown, crash shutdown, cannot connect now;
        // 53300: too many connections.
        if code.starts_with("08") || code.starts_with("57P") || code == "53300" {
            return StoreError::Unavailable(format!("{code}: {}", db.message()));
        }
        // 25006: a write on a server that is read-only — a standby, or an old primary a
        // failover demoted. Nothing was committed; the primary is elsewhere.
        if code == READ_ONLY {
            return StoreError::Unavailable(format!("{READ_ONLY}: {}", db.message()));
        }
        // 40001 serialization failure, 40P01 deadlock, 57014 statement timeout / canceled,
        // 55P03 lock not available.
        let retryable = matches!(code, "40001" | "40P01" | "57014" | "55P03");
        StoreError::Refused {
            code: code.to_string(),
            message: db.message().to_string(),
            retryable,
        }
    }
}

/// The error of a call that changes rows, sent while its connection was `was_open`: a
/// connection that broke without the server answering the call leaves it in doubt. (An error
/// the server sent is an answer: the call's transaction was rolled back.)
pub(crate) fn sent_call_error(e: tokio_postgres::Error, was_open: bool) -> StoreError {
    let answered = e.as_db_error().is_some();
    match StoreError::from(e) {
        StoreError::Unavailable(text) if was_open && !answered => StoreError::InDoubt(text),
        other => other,
    }
}

/// Input the control plane refuses before any round trip, naming the offending row and field.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InputError {
    #[error("batch of {len} rows exceeds the maximum of {max}")]
    BatchTooLarge { len: usize, max: usize },
    #[error("task {0} appears twice in one batch")]
    DuplicateTask(TaskId),
    #[error("row {row}: field `{field}` is {len} bytes, more than {max}")]
    TooLong {
        row: usize,
        field: &'static str,
        len: usize,
        max: usize,
    },
    #[error("row {row}: field `{field}` is empty")]
    Empty { row: usize, field: &'static str },
    #[error("row {row}: field `{field}` is out of range ({value})")]
    OutOfRange {
        row: usize,
        field: &'static str,
        value: String,
    },
    #[error("row {row}: {count} demands, more than {max}")]
    TooManyDemands {
        row: usize,
        count: usize,
        max: usize,
    },
    #[error("row {row}: pool shard {pool}/{shard} demanded twice")]
    DuplicateDemand {
        row: usize,
        pool: String,
        shard: u16,
    },
    #[error("row {row}: {reason}")]
    Illegal { row: usize, reason: String },
}

/// Checks a text field against its maximum; `row` names it in the error.
pub(crate) fn check_text(
    row: usize,
    field: &'static str,
    value: &str,
    max: usize,
) -> Result<(), InputError> {
    if value.is_empty() {
        return Err(InputError::Empty { row, field });
    }
    if value.len() > max {
        return Err(InputError::TooLong {
            row,
            field,
            len: value.len(),
            max,
        });
    }
    Ok(())
}

pub(crate) fn check_batch_len(len: usize) -> Result<(), InputError> {
    if len > crate::limits::BATCH_MAX {
        return Err(InputError::BatchTooLarge {
            len,
            max: crate::limits::BATCH_MAX,
        });
    }
    Ok(())
}

/// A bounded walk of the task or outbox table reads 1..=`SCAN_MAX` rows.
pub(crate) fn check_scan(scan: usize) -> Result<(), InputError> {
    if scan == 0 || scan > crate::limits::SCAN_MAX {
        return Err(InputError::OutOfRange {
            row: 0,
            field: "scan",
            value: scan.to_string(),
        });
    }
    Ok(())
}

/// The task ids of one batch, row by row: each may appear once and must fit a PostgreSQL
/// `bigint`.
#[derive(Default)]
pub(crate) struct BatchTasks(std::collections::HashSet<TaskId>);

impl BatchTasks {
    pub(crate) fn check(&mut self, row: usize, task: TaskId) -> Result<(), InputError> {
        if !self.0.insert(task) {
            return Err(InputError::DuplicateTask(task));
        }
        to_i64(row, "task", task.0).map(|_| ())
    }
}

/// Converts a count or amount for a PostgreSQL `bigint`, naming the field when it does not fit.
pub(crate) fn to_i64(row: usize, field: &'static str, value: u64) -> Result<i64, InputError> {
    i64::try_from(value).map_err(|_| InputError::OutOfRange {
        row,
        field,
        value: value.to_string(),
    })
}

/// A batch function answers one row per input row; anything else is a schema this binary does
/// not understand.
pub(crate) fn check_answered(
    what: &str,
    rows: &[tokio_postgres::Row],
    sent: usize,
) -> Result<(), StoreError> {
    if rows.len() != sent {
        return Err(StoreError::Corrupt(format!(
            "{what} answered {} rows for {sent}",
            rows.len()
        )));
    }
    Ok(())
}
