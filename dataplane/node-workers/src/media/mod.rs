//! The media stage in the node: worker threads (never a shard) that take a finished provider
//! job's video, probe it and transcode it to the configured rendition, each job holding the
//! media units the ledger placed it on (GPU engines where the inventory has them, CPU slots
//! otherwise). Results go back to the task's shard, carrying the attempt's fencing token.
//!
//! Long file: the pool, the workers' loop and one job's way from fetch through the ladder to
//! its upload, which share the job's state and its stage metrics; the bucket's puts and
//! listings are in `upload.rs`.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use spindle_core::{FencingToken, TaskId};
use spindle_gpu::{Inventory, MediaLedger, Source, TRANSCODE_DEMAND};
use spindle_transcode::{Accel, JobLimits, MediaError, Ran, Rendition};
use tokio::sync::mpsc;

pub use spindle_node_base::config::{DeclarationPolicy, MediaConfig, OUTPUT_URL_BYTES_MAX};

use spindle_node_base::messages::ShardMsg;

mod exposition;
mod upload;
use spindle_node_base::limits::DISCARDS_QUEUED_MAX;
pub use spindle_node_base::limits::MEDIA_QUEUE_MAX;
pub use spindle_node_base::messages::{MediaEvent, MediaOutcome, Uploaded};
use upload::{upload_all, Upload};
pub use upload::{
    UploadConfig, UPLOAD_ATTEMPTS_MAX, UPLOAD_PARTS_IN_FLIGHT_MAX, UPLOAD_PART_MB_MAX,
    UPLOAD_PREFIX_BYTES_MAX,
};

/// One job: the task's video at `input_url` (`http://` or `https://`, fetched into the output
/// directory under the job's quota, or `file://`).
#[derive(Debug)]
pub struct MediaJob {
    pub shard: usize,
    pub task: TaskId,
    pub token: FencingToken,
    /// The task's attempt this job belongs to (0: not known). Past the first, an earlier
    /// attempt may have left renditions in the bucket, which this one deletes.
    pub attempt_no: u32,
    pub input_url: String,
    /// What the task declared, when a video beyond it fails the task (`declaration =
    /// "reject"`): the job then fails once probed, before any rendition is made.
    pub reject_beyond: Option<spindle_core::TaskSpec>,
}

/// How media jobs end, as `/metrics` counts them.
pub const MEDIA_OUTCOMES: [&str; 3] = ["succeeded", "failed", "canceled"];
/// A job's stages, as `/metrics` times them: submitted to placed on units (the queue and the
/// wait for capacity), the provider's video fetched, probed and transcoded, the renditions
/// uploaded.
pub const MEDIA_STAGES: [&str; 4] = ["wait", "fetch", "transcode", "upload"];
const STAGE_WAIT: usize = 0;
const STAGE_FETCH: usize = 1;
const STAGE_TRANSCODE: usize = 2;
const STAGE_UPLOAD: usize = 3;
/// Media stage buckets (µs): 10 ms to 30 min.
const MEDIA_BUCKETS_US: &[u64] = &[
    10_000,
    50_000,
    100_000,
    250_000,
    500_000,
    1_000_000,
    2_500_000,
    5_000_000,
    10_000_000,
    30_000_000,
    60_000_000,
    120_000_000,
    300_000_000,
    600_000_000,
    1_800_000_000,
];

/// What the media stage has done and is doing, for `/metrics`.
pub struct MediaStats {
    /// Jobs submitted and not yet taken by a worker.
    pub queued: AtomicU64,
    /// Jobs a worker runs now.
    pub running: AtomicU64,
    /// Jobs ended, by [`MEDIA_OUTCOMES`].
    pub ended: [AtomicU64; 3],
    /// Seconds per stage, by [`MEDIA_STAGES`].
    pub stages: [spindle_node_base::metrics::Histogram; 4],
    /// Bytes of renditions put into the bucket (`[media.upload]`).
    pub uploaded_bytes: AtomicU64,
    /// Renditions made, by where they were decoded and encoded: `[decode][encode]`, 0 the CPU
    /// and 1 a GPU.
    pub renditions: [[AtomicU64; 2]; 2],
    /// Jobs placed on a GPU whose engine could not be used, then run on the CPU.
    pub gpu_fallbacks: AtomicU64,
    /// Multipart uploads left open (a node that died mid-upload) that a sweep aborted.
    pub uploads_aborted: AtomicU64,
    /// Objects the node deleted from the bucket, by [`OBJECTS_DELETED`].
    pub objects_deleted: [AtomicU64; 2],
}

/// Why the node deletes an uploaded object, as `/metrics` counts them: a task's earlier
/// attempt left it (superseded); its job's result was not taken — the task was canceled,
/// failed or had moved on when the job ended (unclaimed).
pub const OBJECTS_DELETED: [&str; 2] = ["superseded", "unclaimed"];
const DELETED_SUPERSEDED: usize = 0;
const DELETED_UNCLAIMED: usize = 1;

impl MediaStats {
    fn new() -> MediaStats {
        MediaStats {
            queued: AtomicU64::new(0),
            running: AtomicU64::new(0),
            ended: Default::default(),
            stages: std::array::from_fn(|_| {
                spindle_node_base::metrics::Histogram::new(MEDIA_BUCKETS_US)
            }),
            uploaded_bytes: AtomicU64::new(0),
            renditions: Default::default(),
            gpu_fallbacks: AtomicU64::new(0),
            uploads_aborted: AtomicU64::new(0),
            objects_deleted: Default::default(),
        }
    }

    fn time(&self, stage: usize, since: Instant) {
        self.stages[stage].record(since.elapsed().as_micros() as u64, 1);
    }
}

/// The pool every shard submits to.
#[derive(Clone)]
pub struct MediaPool {
    /// Jobs for the workers, with when each was submitted.
    jobs: std::sync::mpsc::SyncSender<(MediaJob, Instant)>,
    /// Cancel flags of queued and running jobs, by task.
    cancels: Arc<Mutex<std::collections::HashMap<TaskId, Arc<std::sync::atomic::AtomicBool>>>>,
    pub declaration: DeclarationPolicy,
    /// `media.output_url`, without a trailing `/`.
    pub output_url: Option<String>,
    pub ledger: Arc<MediaLedger>,
    /// The inventory the ledger was built from.
    pub inventory: Arc<Inventory>,
    /// The latest refresh (NVML only: utilization, and devices that went missing).
    pub latest: Arc<Mutex<Inventory>>,
    pub stats: Arc<MediaStats>,
    /// Uploaded renditions whose result nobody took, for the bucket's thread to delete (with
    /// `[media.upload]`).
    discards: Option<std::sync::mpsc::SyncSender<Discard>>,
}

/// Renditions in the bucket that no result names.
#[derive(Debug)]
enum Discard {
    /// These keys (a job's, whose result was not taken).
    Keys(Vec<String>),
    /// Whatever the task's attempt of this token put (its finish was refused: a newer attempt
    /// holds the task).
    Attempt(TaskId, FencingToken),
}

/// How often the bucket is swept for multipart uploads left open (at start, then this often).
pub const SWEEP_EVERY: Duration = Duration::from_secs(3600);
/// An upload is left open once older than a job may run plus this.
const SWEEP_MARGIN: Duration = Duration::from_secs(300);

/// How often an NVML inventory is read again.
pub const INVENTORY_REFRESH: Duration = Duration::from_secs(30);

impl MediaPool {
    /// Starts the workers; they fetch `https://` videos trusting `tls`'s roots (the
    /// provider's: [`crate::dispatch::ProviderConfig::tls`]).
    pub fn start(
        config: &MediaConfig,
        node: &str,
        shards: Vec<mpsc::Sender<ShardMsg>>,
        tls: Arc<spindle_providers::tls::ClientConfig>,
    ) -> anyhow::Result<MediaPool> {
        let declared = config.declared.clone().unwrap_or(spindle_gpu::Declared {
            cpu_units: 2 * config.workers as u64,
            temp_disk_mb: config.quota_mb * config.workers as u64,
            devices: Vec::new(),
        });
        let mut inventory = Inventory::discover(&declared);
        spindle_transcode::verify_encoders(&mut inventory);
        let inventory = Arc::new(inventory);
        match &inventory.source {
            Source::Nvml { driver } => tracing::info!(
                "media: NVML driver {driver}, {} GPU(s), {} CPU units",
                inventory.devices.len(),
                inventory.cpu_units
            ),
            Source::Declared { why } => tracing::warn!(
                "media: no NVML ({why}); {} declared GPU(s), {} CPU units",
                inventory.devices.len(),
                inventory.cpu_units
            ),
        }
        let ledger = Arc::new(MediaLedger::new(&inventory));
        let latest = Arc::new(Mutex::new((*inventory).clone()));
        let upload = match &config.upload {
            Some(u) => {
                tracing::info!("media: renditions are uploaded to {}", u.url);
                Some(Upload::resolve(u)?)
            }
            None => None,
        };
        if matches!(inventory.source, Source::Nvml { .. }) {
            watch_inventory(&declared, &inventory, &ledger, &latest)?;
        }
        let dir = config
            .output_dir
            .clone()
            .unwrap_or_else(|| std::env::temp_dir().join(format!("spindle-media-{node}")));
        std::fs::create_dir_all(&dir)?;
        let (tx, rx) = std::sync::mpsc::sync_channel::<(MediaJob, Instant)>(MEDIA_QUEUE_MAX);
        let stats = Arc::new(MediaStats::new());
        let rx = Arc::new(Mutex::new(rx));
        let cancels: Arc<
            Mutex<std::collections::HashMap<TaskId, Arc<std::sync::atomic::AtomicBool>>>,
        > = Arc::default();
        let discards = match upload.clone() {
            Some(upload) => {
                let (tx, rx) = std::sync::mpsc::sync_channel(DISCARDS_QUEUED_MAX);
                // A job's upload ends within the job's timeout; one open longer was left by a
                // node that died (the margin: the store's clock and this node's may differ).
                let sweep = config.upload.as_ref().is_some_and(|u| u.sweep_uploads);
                let sweep_older_than =
                    sweep.then(|| Duration::from_millis(config.timeout_ms) + SWEEP_MARGIN);
                let stats = stats.clone();
                std::thread::Builder::new()
                    .name("media-bucket".into())
                    .spawn(move || bucket_chores(&upload, &rx, sweep_older_than, &stats))?;
                Some(tx)
            }
            None => None,
        };
        let devices: Vec<u32> = inventory.devices.iter().map(|d| d.index).collect();
        for w in 0..config.workers {
            let rx = rx.clone();
            let shards = shards.clone();
            let ledger = ledger.clone();
            let devices = devices.clone();
            let dir = dir.clone();
            let config = config.clone();
            let cancels = cancels.clone();
            let tls = tls.clone();
            let upload = upload.clone();
            let stats = stats.clone();
            std::thread::Builder::new()
                .name(format!("media-{w}"))
                .spawn(move || {
                    // Downloads of provider outputs run on this worker's own small runtime.
                    let Some(rt) = small_runtime(&format!("media worker {w}")) else {
                        return;
                    };
                    let fetch = Fetch { rt, tls, upload };
                    work(
                        &rx, &shards, &ledger, &devices, &dir, &config, &cancels, &fetch, &stats,
                    );
                })?;
        }
        Ok(MediaPool {
            jobs: tx,
            cancels,
            declaration: config.declaration,
            output_url: config
                .output_url
                .as_deref()
                .map(|u| u.trim_end_matches('/').to_string()),
            ledger,
            inventory,
            latest,
            stats,
            discards,
        })
    }

    /// Has `task`'s uploaded renditions, whose result nobody took, deleted from the bucket (by
    /// the bucket's thread, in the background; past 256 jobs' keys waiting, they stay
    /// and are logged).
    pub fn discard(&self, task: TaskId, keys: Vec<String>) {
        self.send_discard(task, Discard::Keys(keys));
    }

    /// Has what `task`'s attempt of `token` put into the bucket deleted (its finish was
    /// refused as stale: the task is a newer attempt's), as [`MediaPool::discard`] does.
    pub fn discard_attempt(&self, task: TaskId, token: FencingToken) {
        self.send_discard(task, Discard::Attempt(task, token));
    }

    fn send_discard(&self, task: TaskId, discard: Discard) {
        let Some(tx) = &self.discards else { return };
        if tx.try_send(discard).is_err() {
            tracing::warn!(
                "media: {task}'s renditions stay in the bucket: too many deletes waiting"
            );
        }
    }

    /// Stops `task`'s job, queued or running (its output is removed; the job ends Canceled).
    pub fn cancel(&self, task: TaskId) {
        if let Ok(c) = self.cancels.lock() {
            if let Some(flag) = c.get(&task) {
                flag.store(true, std::sync::atomic::Ordering::Relaxed);
            }
        }
    }

    /// Queues `job`; `Err` (with the job) when the queue is full.
    pub fn submit(&self, job: MediaJob) -> Result<(), MediaJob> {
        if let Ok(mut c) = self.cancels.lock() {
            c.insert(job.task, Arc::default());
        }
        // Counted before it is sent: a worker may take it at once.
        self.stats.queued.fetch_add(1, Ordering::Relaxed);
        self.jobs.try_send((job, Instant::now())).map_err(|e| {
            self.stats.queued.fetch_sub(1, Ordering::Relaxed);
            match e {
                std::sync::mpsc::TrySendError::Full((j, _))
                | std::sync::mpsc::TrySendError::Disconnected((j, _)) => j,
            }
        })
    }
}

/// How a worker fetches the provider's videos: on its own small runtime, `https://` trusting
/// the provider's roots; and where it uploads renditions, trusting the store's.
struct Fetch {
    rt: tokio::runtime::Runtime,
    tls: Arc<spindle_providers::tls::ClientConfig>,
    upload: Option<Upload>,
}

/// The file a `file://` video names, if it lies under `root` (its path resolved: no `..` or
/// link leads out); why not otherwise.
fn local_input(path: &str, root: Option<&std::path::Path>) -> Result<PathBuf, String> {
    let Some(root) = root else {
        return Err(format!(
            "file://{path}: local videos are not fetched (media.fetch_root names where they may \
             be)"
        ));
    };
    let resolved = std::fs::canonicalize(path).map_err(|e| format!("file://{path}: {e}"))?;
    let root = std::fs::canonicalize(root)
        .map_err(|e| format!("media.fetch_root {}: {e}", root.display()))?;
    if !resolved.starts_with(&root) {
        return Err(format!(
            "file://{path}: outside media.fetch_root ({})",
            root.display()
        ));
    }
    Ok(resolved)
}

#[allow(clippy::too_many_arguments)]
fn run(
    job: &MediaJob,
    config: &MediaConfig,
    ledger: &Arc<MediaLedger>,
    devices: &[u32],
    dir: &std::path::Path,
    cancel: Arc<std::sync::atomic::AtomicBool>,
    fetch: &Fetch,
    progress: &dyn Fn(u8),
    stats: &MediaStats,
    submitted: Instant,
) -> MediaOutcome {
    let failed = |reason: String, retryable: bool| MediaOutcome::Failed { reason, retryable };
    if cancel.load(std::sync::atomic::Ordering::Relaxed) {
        return failed(MediaError::Canceled.to_string(), false);
    }
    // Hold the units for the whole job; wait (bounded by the job's timeout) while none fit.
    let deadline = Instant::now() + Duration::from_millis(config.timeout_ms);
    let mut placement = match place_by(ledger, devices, deadline, job.task) {
        Ok(p) => p,
        Err(e) => return failed(e, true),
    };
    stats.time(STAGE_WAIT, submitted);
    let quota = config.quota_mb << 20;
    let fetched = dir.join(format!("input-{}-{}", job.task.0, job.token.0));
    let input = match input_of(job, config, fetch, &fetched, deadline, quota, stats) {
        Ok(path) => path,
        Err((reason, retryable)) => return failed(reason, retryable),
    };
    let started = Instant::now();
    let ladder = |accel| {
        transcode_ladder(
            job,
            config,
            dir,
            &input,
            deadline,
            quota,
            cancel.clone(),
            progress,
            accel,
            stats,
        )
    };
    let outcome = match ladder(accel(&placement)) {
        Ok(outcome) => outcome,
        Err((device, reason)) => {
            // The GPU's units go back, and the job waits for CPU ones like any other.
            tracing::warn!(
                "media job for {}: gpu{device} could not be used ({reason}); running it on the CPU",
                job.task
            );
            stats.gpu_fallbacks.fetch_add(1, Ordering::Relaxed);
            drop(placement);
            placement = match place_by(ledger, &[], deadline, job.task) {
                Ok(p) => p,
                Err(e) => return failed(e, true),
            };
            // (A ladder on the CPU uses no GPU engine, so it cannot end in `Err`.)
            ladder(Accel::CPU)
                .unwrap_or_else(|(device, reason)| failed(format!("gpu{device}: {reason}"), true))
        }
    };
    stats.time(STAGE_TRANSCODE, started);
    // A fetched input is the job's own: it goes whatever happened.
    let _ = std::fs::remove_file(&fetched);
    drop(placement);
    match (outcome, &fetch.upload) {
        (
            MediaOutcome::Done {
                outputs, probed, ..
            },
            Some(upload),
        ) => put_renditions(
            job, upload, outputs, probed, fetch, deadline, &cancel, stats,
        ),
        (outcome, _) => outcome,
    }
}

/// The bucket's thread: deletes the objects jobs' results left unclaimed as they come, and,
/// with `sweep_older_than`, sweeps the uploads left open at start and every [`SWEEP_EVERY`].
fn bucket_chores(
    upload: &Upload,
    discards: &std::sync::mpsc::Receiver<Discard>,
    sweep_older_than: Option<Duration>,
    stats: &MediaStats,
) {
    use std::sync::mpsc::RecvTimeoutError;
    let Some(rt) = small_runtime("media bucket") else {
        return;
    };
    // When the next sweep is due, and what it takes for left open.
    let mut next_sweep = sweep_older_than.map(|older_than| (Instant::now(), older_than));
    loop {
        let next = match next_sweep {
            Some((at, _)) => discards.recv_timeout(at.saturating_duration_since(Instant::now())),
            None => discards.recv().map_err(|_| RecvTimeoutError::Disconnected),
        };
        match next {
            Ok(discard) => {
                let deleted = match discard {
                    Discard::Keys(keys) => upload.delete(&rt, &keys),
                    Discard::Attempt(task, token) => upload.delete_attempt(&rt, task, token),
                };
                stats.objects_deleted[DELETED_UNCLAIMED].fetch_add(deleted, Ordering::Relaxed);
            }
            Err(RecvTimeoutError::Disconnected) => return,
            Err(RecvTimeoutError::Timeout) => {
                let Some((_, older_than)) = next_sweep else {
                    continue;
                };
                match upload.sweep(&rt, older_than) {
                    Ok(0) => {}
                    Ok(n) => {
                        tracing::info!("media: aborted {n} upload(s) left open");
                        stats.uploads_aborted.fetch_add(n, Ordering::Relaxed);
                    }
                    Err(e) => tracing::warn!("media: sweeping uploads left open: {e}"),
                }
                next_sweep = Some((Instant::now() + SWEEP_EVERY, older_than));
            }
        }
    }
}

/// The job's renditions put into the bucket: its result names them there (and keeps the local
/// files only where asked); a canceled or failed upload leaves nothing behind.
#[allow(clippy::too_many_arguments)]
fn put_renditions(
    job: &MediaJob,
    upload: &Upload,
    outputs: Vec<PathBuf>,
    probed: spindle_transcode::MediaInfo,
    fetch: &Fetch,
    deadline: Instant,
    cancel: &Arc<std::sync::atomic::AtomicBool>,
    stats: &MediaStats,
) -> MediaOutcome {
    let failed = |reason: String, retryable: bool| MediaOutcome::Failed { reason, retryable };
    match upload_all(&fetch.rt, upload, &outputs, deadline, cancel, stats) {
        Ok(Some(uploaded)) => {
            if job.attempt_no != 1 {
                let deleted = upload.delete_superseded(&fetch.rt, job.task, job.token);
                stats.objects_deleted[DELETED_SUPERSEDED].fetch_add(deleted, Ordering::Relaxed);
            }
            let outputs = if upload.keep_local() {
                outputs
            } else {
                for o in &outputs {
                    let _ = std::fs::remove_file(o);
                }
                Vec::new()
            };
            MediaOutcome::Done {
                outputs,
                probed,
                uploaded: Some(uploaded),
            }
        }
        Ok(None) => {
            for o in &outputs {
                let _ = std::fs::remove_file(o);
            }
            failed(MediaError::Canceled.to_string(), false)
        }
        Err(e) => {
            for o in &outputs {
                let _ = std::fs::remove_file(o);
            }
            failed(format!("upload: {e}"), e.is_retryable())
        }
    }
}

/// Where the job's input is read from: a local file under `fetch_root`, or the provider's video
/// downloaded to `fetched`; `Err` is why the job fails, and whether a retry may do better.
fn input_of(
    job: &MediaJob,
    config: &MediaConfig,
    fetch: &Fetch,
    fetched: &std::path::Path,
    deadline: Instant,
    quota: u64,
    stats: &MediaStats,
) -> Result<PathBuf, (String, bool)> {
    if let Some(path) = job.input_url.strip_prefix("file://") {
        local_input(path, config.fetch_root.as_deref()).map_err(|why| (why, false))
    } else if spindle_providers::tls::is_http_url(&job.input_url) {
        let timeout = deadline.saturating_duration_since(Instant::now());
        let started = Instant::now();
        let sources = spindle_providers::sources::Sources::only(&config.fetch_hosts);
        let got = fetch.rt.block_on(spindle_providers::download_from(
            &job.input_url,
            fetched,
            quota,
            timeout,
            &fetch.tls,
            &sources,
        ));
        stats.time(STAGE_FETCH, started);
        match got {
            Ok(_) => Ok(fetched.to_path_buf()),
            Err(e) => Err((format!("fetch: {e}"), e.is_retryable())),
        }
    } else {
        Err((
            format!(
                "unsupported media URL {:?} (http://, https:// or file://)",
                job.input_url
            ),
            false,
        ))
    }
}

/// Reads the GPU inventory again every [`INVENTORY_REFRESH`] on a thread of its own: a GPU that
/// went missing takes no new media work, one that is back takes work again.
fn watch_inventory(
    declared: &spindle_gpu::Declared,
    inventory: &Arc<Inventory>,
    ledger: &Arc<MediaLedger>,
    latest: &Arc<Mutex<Inventory>>,
) -> std::io::Result<()> {
    let (latest, ledger, start) = (latest.clone(), ledger.clone(), inventory.clone());
    let declared = declared.clone();
    std::thread::Builder::new()
        .name("gpu-inventory".into())
        .spawn(move || loop {
            std::thread::sleep(INVENTORY_REFRESH);
            let mut now = Inventory::discover(&declared);
            // The encoders asked at start stand (a session per device per refresh
            // would cost more than it tells).
            for d in &mut now.devices {
                if let Some(first) = start.devices.iter().find(|f| f.index == d.index) {
                    d.nvenc_sessions = first.nvenc_sessions;
                }
            }
            // A GPU that went missing takes no new media work (what runs on it ends
            // as it will); one that is back takes work again.
            for (device, online) in ledger.apply_refresh(&now) {
                if online {
                    tracing::warn!("GPU {device} is back: media work is placed on it");
                } else {
                    tracing::error!("GPU {device} is missing: no new media work goes to it");
                }
            }
            if let Ok(mut l) = latest.lock() {
                *l = now;
            }
        })?;
    Ok(())
}

/// A media worker's loop: takes the next job, runs it, and reports its end to its shard, until
/// the pool's queue closes.
#[allow(clippy::too_many_arguments)]
fn work(
    rx: &Mutex<std::sync::mpsc::Receiver<(MediaJob, Instant)>>,
    shards: &[mpsc::Sender<ShardMsg>],
    ledger: &Arc<MediaLedger>,
    devices: &[u32],
    dir: &std::path::Path,
    config: &MediaConfig,
    cancels: &Mutex<std::collections::HashMap<TaskId, Arc<std::sync::atomic::AtomicBool>>>,
    fetch: &Fetch,
    stats: &MediaStats,
) {
    loop {
        let (job, submitted) = match rx.lock() {
            Ok(r) => match r.recv() {
                Ok(j) => j,
                Err(_) => return,
            },
            Err(_) => return,
        };
        stats.queued.fetch_sub(1, Ordering::Relaxed);
        stats.running.fetch_add(1, Ordering::Relaxed);
        let cancel = cancels
            .lock()
            .ok()
            .and_then(|c| c.get(&job.task).cloned())
            .unwrap_or_default();
        // Progress is best effort: a full shard inbox drops it (the end
        // still comes, on the blocking send below).
        let inbox = shards.get(job.shard).cloned();
        let progress = |pct: u8| {
            if let Some(inbox) = &inbox {
                let _ = inbox.try_send(ShardMsg::MediaProgress {
                    task: job.task,
                    token: job.token,
                    pct,
                });
            }
        };
        let canceled = cancel.clone();
        let outcome = run(
            &job, config, ledger, devices, dir, cancel, fetch, &progress, stats, submitted,
        );
        stats.running.fetch_sub(1, Ordering::Relaxed);
        // A job canceled once it could no longer stop (its upload running)
        // ends done, but its task canceled: counted as canceled.
        let ended = match &outcome {
            _ if canceled.load(Ordering::Relaxed) => 2,
            MediaOutcome::Done { .. } => 0,
            MediaOutcome::Failed { .. } => 1,
        };
        stats.ended[ended].fetch_add(1, Ordering::Relaxed);
        if let Ok(mut c) = cancels.lock() {
            c.remove(&job.task);
        }
        let event = MediaEvent {
            task: job.task,
            token: job.token,
            outcome,
        };
        if let Some(inbox) = shards.get(job.shard) {
            let _ = inbox.blocking_send(ShardMsg::Media(event));
        }
    }
}

/// A one-thread tokio runtime for a media thread's network calls (`None`, logged, if the
/// system refuses one).
fn small_runtime(thread: &str) -> Option<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| tracing::error!("{thread}: no runtime: {e}"))
        .ok()
}

/// Places the job on media units, waiting while none fit until `deadline`.
fn place_by(
    ledger: &Arc<MediaLedger>,
    devices: &[u32],
    deadline: Instant,
    task: TaskId,
) -> Result<spindle_gpu::Placement, String> {
    loop {
        match spindle_gpu::place(ledger, devices, TRANSCODE_DEMAND, None) {
            Ok(p) => return Ok(p),
            Err(e) if Instant::now() < deadline => {
                tracing::debug!(task = %task, "media job for {task} waits: {e}");
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) => return Err(format!("no media capacity: {e}")),
        }
    }
}

/// Why `probed` is not the video `declared` says: longer (by more than a tenth) or with more
/// pixels; `None` when it is.
pub fn over_declared(
    declared: &spindle_core::TaskSpec,
    probed: &spindle_transcode::MediaInfo,
) -> Option<String> {
    let longer = probed.duration_ms * 10 > u64::from(declared.duration_ms) * 11;
    let larger = u64::from(probed.width) * u64::from(probed.height)
        > u64::from(declared.width) * u64::from(declared.height);
    (longer || larger).then(|| {
        format!(
            "declared {}x{} {} ms, the video is {}x{} {} ms",
            declared.width,
            declared.height,
            declared.duration_ms,
            probed.width,
            probed.height,
            probed.duration_ms
        )
    })
}

/// The engines a placement gives the transcoder.
fn accel(p: &spindle_gpu::Placement) -> Accel {
    Accel {
        nvdec: p.device.filter(|_| p.decode_on_gpu),
        nvenc: p.device.filter(|_| p.encode_on_gpu),
    }
}

/// The share of the whole ladder at which the media stage reports its milestone (design.md §5's
/// 90 %: the task's last milestone before it ends).
pub const MEDIA_MILESTONE_PCT: u8 = 90;

/// Probes `input` and makes every rung of the ladder from it on `accel`'s engines. `progress`
/// hears [`MEDIA_MILESTONE_PCT`] once, when the ladder as a whole is that far. `Err` (device,
/// why) when a GPU engine could not be used: nothing of the ladder is left, and the same
/// ladder can run on the CPU.
#[allow(clippy::too_many_arguments)]
fn transcode_ladder(
    job: &MediaJob,
    config: &MediaConfig,
    dir: &std::path::Path,
    input: &std::path::Path,
    deadline: Instant,
    quota: u64,
    cancel: Arc<std::sync::atomic::AtomicBool>,
    progress: &dyn Fn(u8),
    accel: Accel,
    stats: &MediaStats,
) -> Result<MediaOutcome, (u32, String)> {
    let failed = |reason: String, retryable: bool| MediaOutcome::Failed { reason, retryable };
    let probed = match spindle_transcode::probe(input) {
        Ok(i) => i,
        Err(e) => return Ok(failed(format!("probe: {e}"), e.is_retryable())),
    };
    if let Some(why) = job
        .reject_beyond
        .as_ref()
        .and_then(|declared| over_declared(declared, &probed))
    {
        return Ok(failed(why, false));
    }
    let mut outputs = Vec::new();
    let mut used = 0u64;
    let rungs = config.renditions.len().max(1) as u64;
    let mut reported = false;
    for (rung, &height) in config.renditions.iter().enumerate() {
        let output = dir.join(format!("task-{}-{}-{height}p.mp4", job.task.0, job.token.0));
        let rendition = Rendition {
            name: format!("{height}p"),
            height,
            crf: 28,
            preset: "veryfast".into(),
        };
        let limits = JobLimits {
            threads: 1,
            timeout: deadline.saturating_duration_since(Instant::now()),
            quota_bytes: quota.saturating_sub(used),
            cancel: cancel.clone(),
            accel,
        };
        let result = spindle_transcode::transcode(
            &spindle_transcode::Source::File(input.to_path_buf()),
            &output,
            &rendition,
            &limits,
            &mut |pct| {
                let whole = (rung as u64 * 100 + u64::from(pct)) / rungs;
                if !reported && whole >= u64::from(MEDIA_MILESTONE_PCT) {
                    reported = true;
                    progress(MEDIA_MILESTONE_PCT);
                }
            },
        );
        match result {
            Ok(t) => {
                used += t.bytes;
                outputs.push(output);
                let on_gpu = |r: Ran| usize::from(r != Ran::Cpu);
                stats.renditions[on_gpu(t.decoded_on)][on_gpu(t.encoded_on)]
                    .fetch_add(1, Ordering::Relaxed);
            }
            Err(e) => {
                // The job's earlier renditions go too: nothing of a failed job stays on disk.
                for o in &outputs {
                    let _ = std::fs::remove_file(o);
                }
                if let MediaError::Hardware { device, reason } = e {
                    return Err((device, reason));
                }
                let retryable = e.is_retryable();
                return Ok(failed(e.to_string(), retryable));
            }
        }
    }
    Ok(MediaOutcome::Done {
        outputs,
        probed,
        uploaded: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A `file://` video is read only from under `media.fetch_root`, its path resolved: none
    /// set refuses it, and a `..` or a link out of the root is refused too.
    #[test]
    fn local_videos_are_read_only_from_under_the_fetch_root() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("videos");
        std::fs::create_dir(&root).unwrap();
        std::fs::write(root.join("a.mp4"), b"x").unwrap();
        std::fs::write(dir.path().join("secret"), b"x").unwrap();
        let inside = root.join("a.mp4").display().to_string();
        let e = local_input(&inside, None).unwrap_err();
        assert!(e.contains("are not fetched"), "{e}");
        assert!(local_input(&inside, Some(&root)).is_ok());
        let escaping = format!("{}/../secret", root.display());
        let e = local_input(&escaping, Some(&root)).unwrap_err();
        assert!(e.contains("outside media.fetch_root"), "{e}");
        std::os::unix::fs::symlink(dir.path().join("secret"), root.join("link")).unwrap();
        let linked = root.join("link").display().to_string();
        assert!(local_input(&linked, Some(&root)).is_err());
        assert!(local_input("/etc/passwd", Some(&root)).is_err());
    }

    fn checked(text: &str) -> anyhow::Result<()> {
        toml::from_str::<MediaConfig>(text)?.check()
    }

    #[test]
    fn the_output_url_is_an_http_url_within_its_bound() {
        checked("output_url = \"https://cdn.example.com/renditions/\"").unwrap();
        checked("").unwrap();
        let long = format!(
            "output_url = \"https://{}\"",
            "a".repeat(OUTPUT_URL_BYTES_MAX)
        );
        for bad in [
            "output_url = \"ftp://cdn.example.com/\"",
            "output_url = \"https://cdn.example.com/a b\"",
            long.as_str(),
        ] {
            let e = checked(bad).unwrap_err().to_string();
            assert!(e.starts_with("media.output_url must be"), "{bad}: {e}");
        }
    }
}
