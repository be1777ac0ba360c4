//! spindled's media stage against spindle-mock-provider's videos (in-process, real sockets):
//! the ladder transcoded in-process and checked against the task's declaration, a GPU that
//! cannot be used, a restart or a cancel during the step, the milestone event; renditions put
//! into an S3-compatible bucket (the fake, which checks every signature) and named by URL,
//! their keys from every source, what a dead node or a superseded attempt left cleaned up.

mod common;

use std::time::Duration;

use common::mock::*;
use common::{http_get, metric_sum, poll_until, start_with, task, Daemon};
use spindle_client::Client;
use spindle_control::testing::TestDb;
use spindle_core::{TaskId, TenantId};
use spindle_providers::api::Fault;
use spindle_providers::MockProvider;

/// spindled with the mock at `m` and a media stage writing to `out`.
async fn media_node(test: &TestDb, m: &MockProvider, out: &std::path::Path, media: &str) -> Daemon {
    start_with(test, &media_config(m, out, media)).await
}

/// The media tests' node configuration: the mock at `m`, renditions into `out`, `media` in
/// its `[media]` section; tenant 1's section last.
fn media_config(m: &MockProvider, out: &std::path::Path, media: &str) -> String {
    media_builder(m, out, media).toml()
}

/// [`media_config`] as a builder.
fn media_builder(m: &MockProvider, out: &std::path::Path, media: &str) -> common::NodeConfig {
    common::NodeConfig::new()
        .node_id("media-node")
        .tenants([1])
        .set("provider_concurrency", 4)
        .set("lane_capacity_units", 100_000)
        .section(&format!(
            "[provider]\nurl = \"{}\"\nsecret = \"{SECRET}\"\npoll_ms = [100, 200]",
            m.base_url()
        ))
        .section(&format!(
            "[media]\nworkers = 1\noutput_dir = \"{}\"\n{media}",
            out.display()
        ))
}

/// The rendition files each task's result names (`outputs`), as its client reads them.
async fn renditions_of(daemon: &Daemon, ids: &[TaskId]) -> Vec<Vec<std::path::PathBuf>> {
    results_of(daemon, ids, "outputs").await
}

/// The media stage: the provider's video (a clip made here) is probed and transcoded to the
/// ladder on a media worker before the task succeeds; a video that is not one fails the task
/// with the reason; a video larger than the task declared is charged as what it is (`correct`)
/// or fails the task (`reject`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_media_stage_transcodes_checks_declarations_and_fails_what_it_cannot_read() {
    let dir = tempfile::tempdir().unwrap();
    let make = |name: &str, w: u32, h: u32| {
        let path = dir.path().join(name);
        make_clip(&path, (w, h), 25, 1, 23);
        path
    };
    // The tasks declare 1280x720, 5 s.
    let small = make("small.mp4", 854, 480);
    let large = make("large.mp4", 1920, 1080);
    let garbage = dir.path().join("garbage.mp4");
    std::fs::write(&garbage, b"not a video").unwrap();
    let out = dir.path().join("out");

    enum Expect {
        Ladder,
        Failed(&'static str),
        ChargedMore,
    }
    for (case, (input, policy, expect)) in [
        (&small, "correct", Expect::Ladder),
        (
            &garbage,
            "correct",
            Expect::Failed("media: probe: unreadable input"),
        ),
        (
            &large,
            "reject",
            Expect::Failed("declared 1280x720 5000 ms, the video is 1920x1080"),
        ),
        (&large, "correct", Expect::ChargedMore),
    ]
    .into_iter()
    .enumerate()
    {
        let out = out.join(case.to_string());
        let test = TestDb::new().await;
        let (m, admin) = mock_with(20, Some(input.clone())).await;
        let media = format!("renditions = [240, 120]\ndeclaration = \"{policy}\"");
        let daemon = media_node(&test, &m, &out, &media).await;
        let (ids, states) = run(&daemon, &test, "media", 2).await;
        let sql = test.sql().await.unwrap();
        match expect {
            Expect::Ladder => {
                assert!(states.iter().all(|s| s == "SUCCEEDED"), "{states:?}");
                // The client learns where its renditions are from the task's result.
                for outputs in renditions_of(&daemon, &ids).await {
                    assert_eq!(outputs.len(), 2, "{outputs:?}");
                    for (file, (h, w)) in outputs.iter().zip([(240, 426), (120, 212)]) {
                        assert!(file.starts_with(&out), "{file:?}");
                        let (frames, fw, fh) = spindle_transcode::decode_all(file).unwrap();
                        assert_eq!((frames, fw, fh), (25, w, h), "{file:?}");
                    }
                }
                let (_, metrics) = http_get(daemon.http, "/metrics").await;
                assert!(
                    metrics.contains("spindle_media_inventory{source=\"declared\""),
                    "{metrics}"
                );
                assert!(
                    metrics.contains("spindle_media_engine_units{engine=\"cpu\",kind=\"used\"} 0"),
                    "{metrics}"
                );
            }
            Expect::Failed(why) => {
                assert!(states.iter().all(|s| s == "FAILED"), "{states:?}");
                let reasons: Vec<String> = sql
                    .query("SELECT failure_reason FROM dead_letter", &[])
                    .await
                    .unwrap()
                    .iter()
                    .map(|r| r.get(0))
                    .collect();
                assert_eq!(reasons.len(), 2);
                assert!(reasons.iter().all(|r| r.contains(why)), "{reasons:?}");
                // A video beyond its declaration is refused once probed: no rendition made.
                let (_, metrics) = http_get(daemon.http, "/metrics").await;
                assert_eq!(
                    metric_sum(&metrics, "spindle_media_renditions_total"),
                    0,
                    "{policy}"
                );
            }
            Expect::ChargedMore => {
                assert!(states.iter().all(|s| s == "SUCCEEDED"), "{states:?}");
                let rows = sql
                    .query(
                        "SELECT cost_estimate_milli, cost_actual_milli FROM task",
                        &[],
                    )
                    .await
                    .unwrap();
                for r in rows {
                    let (est, actual): (i64, Option<i64>) = (r.get(0), r.get(1));
                    assert!(
                        actual.unwrap_or(0) > est,
                        "1080p charged as declared 720p: {est} -> {actual:?}"
                    );
                }
            }
        }
        assert_clean(&test, &admin).await;
    }
    let left: Vec<_> = (0..4)
        .filter_map(|case| std::fs::read_dir(out.join(case.to_string())).ok())
        .flat_map(|d| d.map(|e| e.unwrap().file_name().to_string_lossy().into_owned()))
        .collect();
    // Two successful cases × 2 tasks × 2 renditions; nothing of the failed ones.
    assert_eq!(left.len(), 8, "{left:?}");
}

/// A job placed on a GPU whose engines cannot be used runs on the CPU. Here (no driver, as on
/// CI) the inventory is declared: one device with NVDEC and NVENC, so every job is placed on
/// it, the transcoder cannot make its CUDA context, and the node gives the GPU's units back,
/// takes CPU units and makes the ladder there; `/metrics` counts the fallbacks. On a machine
/// with NVML the declaration is not used and the renditions are counted where they ran.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_placed_on_a_gpu_that_cannot_be_used_runs_on_the_cpu() {
    let dir = tempfile::tempdir().unwrap();
    let clip = dir.path().join("clip.mp4");
    make_clip(&clip, (640, 360), 25, 1, 23);
    let out = dir.path().join("out");
    let test = TestDb::new().await;
    let (m, admin) = mock_with(20, Some(clip)).await;
    let media = r#"renditions = [240]
[media.declared]
cpu_units = 4
temp_disk_mb = 4096
[[media.declared.devices]]
index = 0
name = "declared L4"
memory_mb = 24000
compute_units = 100
nvenc_sessions = 8
nvdec_sessions = 8
mig = false
"#;
    let daemon = media_node(&test, &m, &out, media).await;
    let (ids, states) = run(&daemon, &test, "gpu", 2).await;
    assert!(states.iter().all(|s| s == "SUCCEEDED"), "{states:?}");
    for outputs in renditions_of(&daemon, &ids).await {
        let (frames, w, h) = spindle_transcode::decode_all(&outputs[0]).unwrap();
        assert_eq!((frames, w, h), (25, 426, 240));
    }
    let (_, metrics) = http_get(daemon.http, "/metrics").await;
    let count = |line: &str| -> u64 {
        metrics
            .lines()
            .find_map(|l| l.strip_prefix(line)?.trim().parse().ok())
            .unwrap_or_else(|| panic!("no {line} in\n{metrics}"))
    };
    if metrics.contains("spindle_media_inventory{source=\"declared\"") {
        assert_eq!(count("spindle_media_gpu_fallbacks_total "), 2);
        assert_eq!(
            count("spindle_media_renditions_total{decode=\"cpu\",encode=\"cpu\"} "),
            2
        );
    } else {
        let made: u64 = ["cpu", "gpu"]
            .iter()
            .flat_map(|d| ["cpu", "gpu"].map(|e| (d, e)))
            .map(|(d, e)| {
                count(&format!(
                    "spindle_media_renditions_total{{decode=\"{d}\",encode=\"{e}\"}} "
                ))
            })
            .sum();
        assert_eq!(made, 2);
    }
    // Every unit is back, the GPU's and the CPU's.
    let used: Vec<&str> = metrics
        .lines()
        .filter(|l| l.starts_with("spindle_media_engine_units{") && l.contains("kind=\"used\""))
        .collect();
    assert!(
        !used.is_empty() && used.iter().all(|l| l.ends_with(" 0")),
        "{used:?}"
    );
    assert_clean(&test, &admin).await;
}

/// kill -9 during the media step: the restarted node finds the job again at the provider
/// (not submitted again), takes its video and runs the media step once more, writing the whole
/// ladder under the attempt's own names.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_during_the_media_step_runs_it_again_from_the_providers_video() {
    let dir = tempfile::tempdir().unwrap();
    // What the tasks declare: 1280x720, 5 s.
    let clip = dir.path().join("clip.mp4");
    make_clip(&clip, (1280, 720), 25, 5, 30);
    let out = dir.path().join("out");
    let test = TestDb::new().await;
    let (m, admin) = mock_with(20, Some(clip)).await;
    let media = "renditions = [720, 480]\ndeclaration = \"correct\"";
    let mut daemon = media_node(&test, &m, &out, media).await;
    let ids = submit(&daemon, "media", 1).await;
    let sql = test.sql().await.unwrap();
    let key = ids[0].0 as i64;
    let state = poll_until(
        Duration::from_secs(15),
        async || state_of(&sql, key).await,
        |s| !["QUEUED", "DISPATCHING", "RUNNING"].contains(&s.as_str()),
    )
    .await;
    assert_eq!(
        state, "MEDIA_PROCESSING",
        "the media step was not caught running"
    );
    daemon.child.kill().unwrap();
    daemon.child.wait().unwrap();
    drop(daemon);

    let daemon = media_node(&test, &m, &out, media).await;
    let states = wait_final(&test, &ids).await;
    assert_eq!(states, ["SUCCEEDED"], "{}", daemon.log_tail(30));
    let total = assert_clean(&test, &admin).await;
    assert_eq!(
        total.accepted, 1,
        "the job was found again, not submitted again"
    );
    let token: i64 = sql
        .query_one(
            "SELECT fencing_token FROM task_attempt WHERE task_id = $1",
            &[&key],
        )
        .await
        .unwrap()
        .get(0);
    for (h, w) in [(720, 1280), (480, 852)] {
        let file = out.join(format!("task-{key}-{token}-{h}p.mp4"));
        let (frames, fw, fh) = spindle_transcode::decode_all(&file).unwrap();
        assert_eq!((frames, fw, fh), (125, w, h), "{file:?}");
    }
}

/// A video larger than its task declared is charged as probed, and the tenant's quotas count
/// what it was charged, not the provider's bill alone: the month's cost `quota show` reports is
/// the task's stored actual cost. Without the probed difference charged to the quotas it is
/// the bill (10: the provider here bills less than the video is worth), and this fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_task_charged_as_probed_counts_that_in_its_quotas() {
    let dir = tempfile::tempdir().unwrap();
    let large = dir.path().join("large.mp4");
    make_clip(&large, (1920, 1080), 25, 1, 23);
    let test = TestDb::new().await;
    let mut cheap = mock_config(20, "4:6000", Some(large));
    cheap.cost_milli = 10;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let m = MockProvider::serve(listener, cheap);
    let admin = m.client(Duration::from_secs(5));
    let media = "renditions = [240]\ndeclaration = \"correct\"";
    let config = media_builder(&m, &dir.path().join("out"), media)
        .set("retention_finished_s", 3_000_000)
        .tenant_lines(
            1,
            "[[tenants.quotas]]\nscope = \"tenant\"\nperiod = \"month\"\ncost_milli = 100000000",
        )
        .section(&common::admin_tokens())
        .toml();
    let daemon = start_with(&test, &config).await;
    let (ids, states) = run(&daemon, &test, "probed", 1).await;
    assert_eq!(states, ["SUCCEEDED"]);
    let sql = test.sql().await.unwrap();
    let actual = common::read_i64(
        &sql,
        &format!(
            "SELECT cost_actual_milli FROM task WHERE task_id = {}",
            ids[0].0
        ),
    )
    .await;
    assert!(actual > 10, "charged as probed, above the bill: {actual}");
    let (ok, out) = common::ctl(daemon.http, common::VIEWER_TOKEN, &["quota", "show", "1"]);
    assert!(ok, "{out}");
    let shown: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(shown["quotas"][0]["used_cost_milli"], actual, "{shown}");
    assert_clean(&test, &admin).await;
}

/// A client's cancel stops the task's running media job: the task ends CANCELED, its partial
/// output is removed and its media units come back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_stops_a_running_media_job() {
    let dir = tempfile::tempdir().unwrap();
    let clip = dir.path().join("long.mp4");
    make_clip(&clip, (1920, 1080), 25, 20, 30);
    let out = dir.path().join("out");
    let test = TestDb::new().await;
    let (m, admin) = mock_with(20, Some(clip.clone())).await;
    let daemon = media_node(
        &test,
        &m,
        &out,
        "renditions = [1080, 720]\ndeclaration = \"correct\"",
    )
    .await;
    let client = Client::connect(daemon.addr, TenantId(1), "tenant-1-credential")
        .await
        .unwrap();
    let a = client.submit(task("long")).await.unwrap();
    common::wait_for(&client, a.task, spindle_core::TaskState::MediaProcessing).await;
    client.cancel(a.task).await.unwrap();
    // Stored CANCELED once the worker stopped and the shard settled the task.
    let sql = test.sql().await.unwrap();
    let key = a.task.0 as i64;
    let state = poll_until(
        Duration::from_secs(10),
        async || state_of(&sql, key).await,
        |s| s == "CANCELED",
    )
    .await;
    assert_eq!(state, "CANCELED");
    assert_clean(&test, &admin).await;
    // The worker notices between packets; give it its bounded moment to clean up.
    let left = poll_until(
        Duration::from_secs(10),
        async || -> Vec<std::ffi::OsString> {
            std::fs::read_dir(&out)
                .map(|d| d.map(|e| e.unwrap().file_name()).collect())
                .unwrap_or_default()
        },
        Vec::is_empty,
    )
    .await;
    assert!(left.is_empty(), "outputs of a canceled job: {left:?}");
    let (_, metrics) = http_get(daemon.http, "/metrics").await;
    assert!(
        metrics.contains("spindle_media_engine_units{engine=\"cpu\",kind=\"used\"} 0"),
        "{metrics}"
    );
    // Counted as canceled, not failed; nothing left running.
    for (series, want) in [
        ("spindle_media_jobs_ended_total{outcome=\"canceled\"}", 1),
        ("spindle_media_jobs_ended_total{outcome=\"failed\"}", 0),
        ("spindle_media_jobs{state=\"running\"}", 0),
    ] {
        assert_eq!(metric_sum(&metrics, series), want, "{series}");
    }
}

/// A subscriber follows a task through the media stage: it enters at 60 %, the ladder's 90 %
/// milestone arrives while it runs, and the end is 100 %.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn subscribers_hear_the_media_stage_milestone() {
    use spindle_core::TaskState;
    let dir = tempfile::tempdir().unwrap();
    let clip = dir.path().join("clip.mp4");
    make_clip(&clip, (854, 480), 25, 2, 23);
    let test = TestDb::new().await;
    // 300 ms at the provider: time to subscribe before the media stage.
    let (m, admin) = mock_with(300, Some(clip)).await;
    // The output directory served under a URL: the result names the renditions by it too.
    let media = "renditions = [240, 120]\ndeclaration = \"correct\"\n\
                 output_url = \"https://cdn.example.com/renditions/\"";
    let daemon = media_node(&test, &m, &dir.path().join("out"), media).await;
    let client = Client::connect(daemon.addr, TenantId(1), "tenant-1-credential")
        .await
        .unwrap();
    let a = client.submit(task("followed")).await.unwrap();
    client.subscribe(a.task).await.unwrap();
    let mut seen = Vec::new();
    let last = loop {
        let e = tokio::time::timeout(Duration::from_secs(30), client.next_event())
            .await
            .expect("an event within 30 s")
            .expect("the connection stays open");
        seen.push((e.state, e.progress_pct));
        if e.state.is_terminal() {
            break e;
        }
        assert_eq!(e.result, None, "only the end carries a result: {e:?}");
    };
    // The end carries what the task produced: its renditions, as GetTask gives them.
    let result = last.result.as_deref().expect("a result with SUCCEEDED");
    let result: serde_json::Value = serde_json::from_str(result).unwrap();
    let outputs: Vec<String> = serde_json::from_value(result["outputs"].clone()).unwrap();
    assert_eq!(outputs.len(), 2, "{result}");
    assert!(outputs[0].ends_with("-240p.mp4"), "{result}");
    let urls: Vec<String> = serde_json::from_value(result["urls"].clone()).unwrap();
    for (url, path) in urls.iter().zip(&outputs) {
        let name = std::path::Path::new(path).file_name().unwrap();
        assert_eq!(
            *url,
            format!(
                "https://cdn.example.com/renditions/{}",
                name.to_string_lossy()
            ),
            "{result}"
        );
    }
    assert_eq!(urls.len(), 2, "{result}");
    let at = |x: (TaskState, u8)| seen.iter().position(|&s| s == x);
    let entered = at((TaskState::MediaProcessing, 60)).expect("entered the media stage");
    let milestone = at((TaskState::MediaProcessing, 90)).expect("the media milestone");
    assert!(entered < milestone, "{seen:?}");
    assert_eq!(seen.last(), Some(&(TaskState::Succeeded, 100)), "{seen:?}");
    assert!(
        seen.windows(2).all(|w| w[0].1 <= w[1].1),
        "progress only grows: {seen:?}"
    );
    // Subscribers hear the end as the shard decides it; the store has it once reported.
    let sql = test.sql().await.unwrap();
    assert_eq!(
        common::wait_all_succeeded(&sql, &[a.task.0 as i64]).await,
        1
    );
    assert_clean(&test, &admin).await;
}

/// A 160x120 clip of one second at `dir/clip.mp4`: the mock's video where its frames do not
/// matter.
fn small_clip(dir: &tempfile::TempDir) -> std::path::PathBuf {
    let clip = dir.path().join("clip.mp4");
    make_clip(&clip, (160, 120), 10, 1, 30);
    clip
}

/// Where an upload test starts: a temporary directory, the fake bucket, a fresh database, and
/// the mock (with its admin client) serving a [`small_clip`].
async fn upload_stage() -> (
    tempfile::TempDir,
    spindle_providers::fake_s3::FakeS3,
    TestDb,
    MockProvider,
    spindle_providers::HttpProvider,
) {
    let dir = tempfile::tempdir().unwrap();
    let bucket = fake_bucket().await;
    let test = TestDb::new().await;
    let (m, admin) = mock_with(20, Some(small_clip(&dir))).await;
    (dir, bucket, test, m, admin)
}

/// A fake bucket, `videos` in `us-test-1`, taking requests signed with key `AKID`.
async fn fake_bucket() -> spindle_providers::fake_s3::FakeS3 {
    spindle_providers::fake_s3::FakeS3::start("videos", "us-test-1", "AKID", "s")
        .await
        .unwrap()
}

/// `[media.upload]` for `bucket` (path-style), objects under `renditions/`; no sweep of open
/// uploads at start (its listing would land among the requests the tests count).
fn upload_config(bucket: &spindle_providers::fake_s3::FakeS3) -> String {
    let b = bucket.bucket();
    format!(
        "\n[media.upload]\nurl = \"{}\"\nregion = \"{}\"\naccess_key_id = \"{}\"\n\
         secret_access_key = \"{}\"\nprefix = \"renditions/\"\nsweep_uploads = false\n",
        b.url, b.region, b.access_key_id, b.secret_access_key
    )
}

/// Multipart uploads a node that died mid-upload left open: a node with `[media.upload]`
/// aborts, at its start (and hourly), those under its prefix named as renditions are and older
/// than a job may run; a fresh one, another application's, and one outside the prefix stay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn uploads_a_dead_node_left_open_are_aborted_and_the_rest_kept() {
    use spindle_providers::object_store::create_multipart_upload;
    let dir = tempfile::tempdir().unwrap();
    let bucket = fake_bucket().await;
    let tls = spindle_providers::tls::public_roots();
    let open = async |key: &str| {
        create_multipart_upload(
            &bucket.bucket(),
            key,
            "video/mp4",
            Duration::from_secs(10),
            &tls,
        )
        .await
        .unwrap()
    };
    for key in [
        "renditions/task-7-3-96p.mp4",
        "renditions/backup.tar",
        "elsewhere/task-8-1-96p.mp4",
    ] {
        open(key).await;
    }
    bucket.backdate_uploads(Duration::from_secs(2 * 3600));
    open("renditions/task-9-1-96p.mp4").await;
    let test = TestDb::new().await;
    let (m, admin) = mock_with(20, None).await;
    let media = format!("renditions = [96]\n{}", upload_config(&bucket))
        .replace("sweep_uploads = false", "sweep_uploads = true");
    let daemon = media_node(&test, &m, &dir.path().join("out"), &media).await;
    let aborted = poll_until(
        Duration::from_secs(30),
        async || {
            let (_, metrics) = http_get(daemon.http, "/metrics").await;
            metric_sum(&metrics, "spindle_media_uploads_aborted_total")
        },
        |&n| n >= 1,
    )
    .await;
    assert_eq!(aborted, 1);
    assert_eq!(
        bucket.open_upload_keys(),
        [
            "elsewhere/task-8-1-96p.mp4",
            "renditions/backup.tar",
            "renditions/task-9-1-96p.mp4"
        ]
    );
    assert!(
        bucket
            .log()
            .contains(&"DELETE upload renditions/task-7-3-96p.mp4".to_string()),
        "{:?}",
        bucket.log()
    );
    assert_clean(&test, &admin).await;
}

/// What an earlier attempt left in the bucket (a node that died after its upload, before its
/// report): the attempt that ends the task deletes its renditions — those named with the task
/// and an older fencing token — once its own are in, and nothing else: another task's whose id
/// begins the same, a key not named as a rendition, one with a newer token. A first attempt
/// does not look (the upload test counts every request).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_attempt_after_the_first_deletes_what_earlier_attempts_left_in_the_bucket() {
    let (dir, bucket, test, m, admin) = upload_stage().await;
    set_fault(&admin, Fault::Auth).await;
    let media = format!(
        "renditions = [96]\n{}{}",
        upload_config(&bucket),
        common::admin_tokens()
    );
    let daemon = media_node(&test, &m, &dir.path().join("out"), &media).await;
    let (ids, states) = run(&daemon, &test, "again", 1).await;
    assert_eq!(states, ["FAILED"]);
    let task = ids[0].0;
    let sql = test.sql().await.unwrap();
    let first: i64 = sql
        .query_one(
            "SELECT final_fencing FROM task WHERE task_id = $1",
            &[&(task as i64)],
        )
        .await
        .unwrap()
        .get(0);
    let tls = spindle_providers::tls::public_roots();
    let left = [
        format!("renditions/task-{task}-{first}-96p.mp4"),
        format!("renditions/task-{task}-{first}-720p.mp4"),
    ];
    let kept = [
        format!("renditions/task-{task}1-{first}-96p.mp4"),
        format!("renditions/task-{task}-{first}-notes.txt"),
        format!("renditions/task-{task}-999999999-96p.mp4"),
        format!("elsewhere/task-{task}-{first}-96p.mp4"),
    ];
    for key in left.iter().chain(&kept) {
        spindle_providers::object_store::put_object(
            &bucket.bucket(),
            key,
            b"an earlier attempt's".to_vec().into(),
            "video/mp4",
            Duration::from_secs(10),
            &tls,
        )
        .await
        .unwrap();
    }
    set_fault(&admin, Fault::None).await;
    let id = task.to_string();
    let requeue = ["requeue", id.as_str(), "--reason", "provider fixed"];
    let (ok, out) = common::ctl(daemon.http, common::OPERATOR_TOKEN, &requeue);
    assert!(ok, "{out}");
    assert_eq!(wait_final(&test, &ids).await, ["SUCCEEDED"]);
    let second: i64 = sql
        .query_one(
            "SELECT final_fencing FROM task WHERE task_id = $1 AND attempt_no = 2",
            &[&(task as i64)],
        )
        .await
        .unwrap()
        .get(0);
    assert!(second > first, "tokens grow: {first} then {second}");
    let mut want: Vec<String> = kept.to_vec();
    want.push(format!("renditions/task-{task}-{second}-96p.mp4"));
    want.sort();
    assert_eq!(bucket.keys(), want);
    assert_eq!(
        common::metric(
            &daemon,
            "spindle_media_objects_deleted_total{why=\"superseded\"}"
        )
        .await,
        2
    );
    let lists = bucket.log().iter().filter(|l| *l == "GET objects").count();
    assert_eq!(lists, 1, "one listing, by the second attempt");
    assert_clean(&test, &admin).await;
}

/// A media node making the ladder `renditions` (`[96]`) and uploading it to `bucket`, and a
/// task `name` of tenant 1 caught in the upload: its first object in the bucket, the answer to
/// its `PUT` held (`hold_puts`; the caller lets it go). The node, the task's client and the
/// task.
async fn caught_mid_upload(
    test: &TestDb,
    m: &MockProvider,
    bucket: &spindle_providers::fake_s3::FakeS3,
    dir: &tempfile::TempDir,
    renditions: &str,
    name: &str,
) -> (Daemon, Client, TaskId) {
    let media = format!("renditions = {renditions}\n{}", upload_config(bucket));
    let daemon = media_node(test, m, &dir.path().join("out"), &media).await;
    bucket.hold_puts(true);
    let client = Client::connect(daemon.addr, TenantId(1), "tenant-1-credential")
        .await
        .unwrap();
    let a = client.submit(task(name)).await.unwrap();
    let keys = poll_until(
        Duration::from_secs(30),
        async || bucket.keys(),
        |k| !k.is_empty(),
    )
    .await;
    assert_eq!(keys.len(), 1, "{keys:?}");
    assert!(keys[0].starts_with(&format!("renditions/task-{}-", a.task.0)));
    (daemon, client, a.task)
}

/// The node's bucket thread deleted one unclaimed object (within 10 s) and the bucket is empty.
async fn assert_unclaimed_deleted(daemon: &Daemon, bucket: &spindle_providers::fake_s3::FakeS3) {
    let series = "spindle_media_objects_deleted_total{why=\"unclaimed\"}";
    let deleted = poll_until(
        Duration::from_secs(10),
        async || common::metric(daemon, series).await,
        |&n| n >= 1,
    )
    .await;
    assert_eq!(deleted, 1);
    assert_eq!(bucket.keys(), Vec::<String>::new(), "{:?}", bucket.log());
}

/// A task canceled while its renditions are being put into the bucket: the upload ends, but
/// the result is nobody's — the task ends CANCELED and the objects are deleted again, by the
/// node's bucket thread.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn renditions_of_a_task_canceled_during_their_upload_are_deleted_again() {
    let (dir, bucket, test, m, admin) = upload_stage().await;
    let (daemon, client, a) = caught_mid_upload(&test, &m, &bucket, &dir, "[96]", "canceled").await;
    client.cancel(a).await.unwrap();
    bucket.hold_puts(false);
    let sql = test.sql().await.unwrap();
    let state = poll_until(
        Duration::from_secs(10),
        async || state_of(&sql, a.0 as i64).await,
        |s| s == "CANCELED",
    )
    .await;
    assert_eq!(state, "CANCELED");
    assert_unclaimed_deleted(&daemon, &bucket).await;
    let (_, metrics) = http_get(daemon.http, "/metrics").await;
    for (series, want) in [
        ("spindle_media_jobs_ended_total{outcome=\"canceled\"}", 1),
        ("spindle_media_jobs_ended_total{outcome=\"succeeded\"}", 0),
    ] {
        assert_eq!(metric_sum(&metrics, series), want, "{series}");
    }
    assert!(client.get(a).await.unwrap().result.is_none());
    assert_clean(&test, &admin).await;
}

/// A cancel between two renditions' uploads stops the job there: the rendition already put is
/// deleted again by the worker, the next is never sent, and the task ends CANCELED.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_between_two_renditions_uploads_sends_no_more_and_deletes_what_went() {
    let (dir, bucket, test, m, admin) = upload_stage().await;
    let (daemon, client, a) =
        caught_mid_upload(&test, &m, &bucket, &dir, "[120, 96]", "canceled").await;
    client.cancel(a).await.unwrap();
    bucket.hold_puts(false);
    let sql = test.sql().await.unwrap();
    let state = poll_until(
        Duration::from_secs(10),
        async || state_of(&sql, a.0 as i64).await,
        |s| s == "CANCELED",
    )
    .await;
    assert_eq!(state, "CANCELED");
    assert_eq!(bucket.keys(), Vec::<String>::new(), "{:?}", bucket.log());
    let log = bucket.log();
    let sent: Vec<&String> = log.iter().filter(|l| l.starts_with("PUT object")).collect();
    assert_eq!(sent.len(), 1, "the second rendition was sent: {log:?}");
    assert!(sent[0].ends_with("-120p.mp4"), "{log:?}");
    let (_, metrics) = http_get(daemon.http, "/metrics").await;
    for (series, want) in [
        ("spindle_media_jobs_ended_total{outcome=\"canceled\"}", 1),
        ("spindle_media_objects_deleted_total{why=\"unclaimed\"}", 0),
    ] {
        assert_eq!(metric_sum(&metrics, series), want, "{series}");
    }
    assert_clean(&test, &admin).await;
}

/// An attempt superseded while its upload ran (its partition moved and another node's claim
/// took the task — here the newer token is written into the task's row, as that claim would):
/// the node's finish is refused as stale, and what the attempt put into the bucket is deleted
/// again; the row stays the newer attempt's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn renditions_of_an_attempt_whose_finish_is_refused_as_stale_are_deleted_again() {
    let (dir, bucket, test, m, _admin) = upload_stage().await;
    let (daemon, _client, a) =
        caught_mid_upload(&test, &m, &bucket, &dir, "[96]", "superseded").await;
    let sql = test.sql().await.unwrap();
    let newer: i64 = sql
        .query_one(
            "UPDATE task SET current_fencing = current_fencing + 1000000 WHERE task_id = $1
             RETURNING current_fencing",
            &[&(a.0 as i64)],
        )
        .await
        .unwrap()
        .get(0);
    bucket.hold_puts(false);
    assert_unclaimed_deleted(&daemon, &bucket).await;
    let row = sql
        .query_one(
            "SELECT state, current_fencing, result FROM task WHERE task_id = $1",
            &[&(a.0 as i64)],
        )
        .await
        .unwrap();
    let (state, token, result): (String, i64, Option<String>) =
        (row.get(0), row.get(1), row.get(2));
    assert_eq!(
        (state.as_str(), token, result),
        ("MEDIA_PROCESSING", newer, None)
    );
}

/// `presign_s`: each task's result names its renditions by presigned URLs, which read the
/// private bucket's objects without keys (every frame decodes); the objects' plain URLs do not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn presigned_urls_read_a_private_buckets_renditions_without_keys() {
    let (dir, bucket, test, m, admin) = upload_stage().await;
    let media = format!(
        "renditions = [96]\n{}presign_s = 3600\n",
        upload_config(&bucket)
    );
    let daemon = media_node(&test, &m, &dir.path().join("out"), &media).await;
    let (ids, states) = run(&daemon, &test, "signed", 1).await;
    assert_eq!(states, ["SUCCEEDED"]);
    let urls: Vec<Vec<String>> = results_of(&daemon, &ids, "urls").await;
    let url = &urls[0][0];
    assert!(
        url.contains("X-Amz-Expires=3600&") && url.contains("&X-Amz-Signature="),
        "{url}"
    );
    let tls = spindle_providers::tls::public_roots();
    let got = dir.path().join("got.mp4");
    spindle_providers::download(url, &got, 1 << 30, Duration::from_secs(10), &tls)
        .await
        .unwrap();
    let (frames, _, h) = spindle_transcode::decode_all(&got).unwrap();
    assert_eq!((frames, h), (10, 96));
    let plain = url.split('?').next().unwrap();
    let e = spindle_providers::download(plain, &got, 1 << 30, Duration::from_secs(10), &tls)
        .await
        .unwrap_err();
    assert!(e.to_string().contains("403"), "{e}");
    assert_clean(&test, &admin).await;
}

/// `[media.upload]`: each rendition is put into the bucket (a stand-in that checks every
/// request's SigV4 signature and payload hash, as S3 does); the result names the objects by URL
/// and nothing stays in `output_dir`; a store that is briefly unavailable is tried again; one
/// that refuses fails the task with its answer, leaving no file behind — and no object: the
/// renditions already put are deleted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn renditions_are_uploaded_to_an_s3_bucket_and_named_by_url() {
    let dir = tempfile::tempdir().unwrap();
    let clip = dir.path().join("clip.mp4");
    make_clip(&clip, (320, 240), 25, 1, 23);
    let bucket = spindle_providers::fake_s3::FakeS3::start(
        "videos",
        "us-test-1",
        "AKIDSPINDLETEST",
        "bucket-secret-for-tests",
    )
    .await
    .unwrap();
    // Two 503s first: the first rendition's upload is tried three times.
    bucket.unavailable_for(2);
    let test = TestDb::new().await;
    let (m, admin) = mock_with(20, Some(clip.clone())).await;
    let out = dir.path().join("out");
    let media = format!("renditions = [120, 96]\n{}", upload_config(&bucket));
    let daemon = media_node(&test, &m, &out, &media).await;
    let (ids, states) = run(&daemon, &test, "upload", 2).await;
    assert!(states.iter().all(|s| s == "SUCCEEDED"), "{states:?}");
    let client = Client::connect(daemon.addr, TenantId(1), "tenant-1-credential")
        .await
        .unwrap();
    assert_eq!(bucket.keys().len(), 4, "two tasks × two renditions");
    for t in &ids {
        let status = client.get(*t).await.unwrap();
        let result: serde_json::Value =
            serde_json::from_str(status.result.as_deref().expect("a result")).unwrap();
        let urls: Vec<String> = serde_json::from_value(result["urls"].clone()).unwrap();
        assert_eq!(urls.len(), 2, "{result}");
        assert!(
            result.get("outputs").is_none(),
            "files named that are gone: {result}"
        );
        for (url, height) in urls.iter().zip([120, 96]) {
            let key = url
                .strip_prefix(&format!("{}/", bucket.url()))
                .unwrap_or_else(|| panic!("{url} is not the bucket's"));
            assert!(
                key.starts_with(&format!("renditions/task-{}-", t.0))
                    && key.ends_with(&format!("-{height}p.mp4")),
                "{key}"
            );
            // The object is the rendition: every frame decodes, at its height.
            let body = bucket
                .object(key)
                .unwrap_or_else(|| panic!("{key} not in the bucket"));
            let copy = dir.path().join("object.mp4");
            std::fs::write(&copy, body).unwrap();
            let (frames, _, h) = spindle_transcode::decode_all(&copy).unwrap();
            assert_eq!((frames, h), (25, height), "{key}");
        }
    }
    assert_eq!(bucket.bad_signatures(), 0, "a signature did not check out");
    let log = bucket.log();
    assert_eq!(log.len(), 6, "4 objects + 2 unavailable: {log:?}");
    // `/metrics` tells what the media stage did: two jobs through every stage (the mock
    // serves its video over HTTP), every byte in the bucket counted.
    let stored: u64 = bucket
        .keys()
        .iter()
        .map(|k| bucket.object(k).map_or(0, |o| o.len() as u64))
        .sum();
    for (series, want) in [
        ("spindle_media_jobs_ended_total{outcome=\"succeeded\"}", 2),
        ("spindle_media_jobs_ended_total{outcome=\"failed\"}", 0),
        ("spindle_media_jobs{state=\"queued\"}", 0),
        ("spindle_media_jobs{state=\"running\"}", 0),
        ("spindle_media_stage_seconds_count{stage=\"wait\"}", 2),
        ("spindle_media_stage_seconds_count{stage=\"fetch\"}", 2),
        ("spindle_media_stage_seconds_count{stage=\"transcode\"}", 2),
        ("spindle_media_stage_seconds_count{stage=\"upload\"}", 2),
        ("spindle_media_uploaded_bytes_total", stored),
    ] {
        assert_eq!(common::metric(&daemon, series).await, want, "{series}");
    }
    assert_eq!(log.iter().filter(|l| *l == "refused 503").count(), 2);
    let left = std::fs::read_dir(&out).unwrap().count();
    assert_eq!(left, 0, "files left in output_dir after their upload");
    assert_clean(&test, &admin).await;
    drop(daemon);

    // Read through a CDN: the result names the object by `public_url`, the key the same. (Each
    // part of this test has its own prefix: a fresh database numbers its tasks from 1 again.)
    let test = TestDb::new().await;
    let (m, admin) = mock_with(20, Some(clip.clone())).await;
    let cdn = format!(
        "{}public_url = \"https://cdn.example.com/v/\"\n",
        media.replace("renditions/", "cdn/")
    );
    let daemon = media_node(&test, &m, &out, &cdn).await;
    let (ids, states) = run(&daemon, &test, "cdn", 1).await;
    assert_eq!(states, ["SUCCEEDED"]);
    let status = Client::connect(daemon.addr, TenantId(1), "tenant-1-credential")
        .await
        .unwrap()
        .get(ids[0])
        .await
        .unwrap();
    let result: serde_json::Value =
        serde_json::from_str(status.result.as_deref().unwrap()).unwrap();
    let urls: Vec<String> = serde_json::from_value(result["urls"].clone()).unwrap();
    let key = format!("cdn/task-{}-", ids[0].0);
    assert!(
        urls.iter()
            .all(|u| u.starts_with(&format!("https://cdn.example.com/v/{key}"))),
        "{urls:?}"
    );
    assert_eq!(bucket.keys().len(), 6, "two more objects in the bucket");
    assert_clean(&test, &admin).await;
    drop(daemon);

    // The second rendition refused: the task fails with the store's answer, and the first,
    // already put, is deleted again.
    bucket.refuse_keys_with(Some("-96p"));
    let test = TestDb::new().await;
    let (m, admin) = mock_with(20, Some(clip.clone())).await;
    let half = media.replace("renditions/", "half/");
    let daemon = media_node(&test, &m, &out, &half).await;
    let (ids, states) = run(&daemon, &test, "half", 1).await;
    assert_eq!(states, ["FAILED"]);
    let reason = failure_reason(&test).await;
    assert!(
        reason.contains("media: upload: http://") && reason.contains("HTTP 403"),
        "{reason}"
    );
    let log = bucket.log();
    let tail: Vec<&str> = log[log.len() - 3..].iter().map(String::as_str).collect();
    let first = format!("half/task-{}-", ids[0].0);
    assert!(
        tail[0].starts_with(&format!("PUT object {first}"))
            && tail[0].ends_with("-120p.mp4")
            && tail[1].starts_with("refused 403 ")
            && tail[2].starts_with(&format!("DELETE object {first}"))
            && tail[2].ends_with("-120p.mp4"),
        "{tail:?}"
    );
    let keys = bucket.keys();
    assert!(
        keys.len() == 6 && !keys.iter().any(|k| k.starts_with("half/")),
        "an object of the failed attempt stayed: {keys:?}"
    );
    assert_eq!(std::fs::read_dir(&out).unwrap().count(), 0, "files left");
    assert_clean(&test, &admin).await;
    drop(daemon);

    // A bucket that refuses everything (wrong credentials, say): the task fails with its
    // answer.
    bucket.refuse_keys_with(None);
    bucket.refuse_with(403);
    let test = TestDb::new().await;
    let (m, admin) = mock_with(20, Some(clip)).await;
    let daemon = media_node(&test, &m, &out, &media).await;
    let (_, states) = run(&daemon, &test, "refused", 1).await;
    assert_eq!(states, ["FAILED"]);
    let reason = failure_reason(&test).await;
    assert!(
        reason.contains("media: upload: http://") && reason.contains("HTTP 403"),
        "{reason}"
    );
    assert_eq!(std::fs::read_dir(&out).unwrap().count(), 0, "files left");
    assert_clean(&test, &admin).await;
}

/// Temporary keys named `id`: their secret and session token follow from it.
fn temporary_keys(id: &str) -> spindle_providers::object_store::Credentials {
    spindle_providers::object_store::Credentials {
        access_key_id: id.into(),
        secret_access_key: format!("secret-of-{id}"),
        session_token: Some(format!("token-of-{id}")),
    }
}

/// `media.upload.credentials_file`: the keys (temporary ones, with their session token) are read
/// again for every job, so a rotation by an agent that rewrites the file is used without a
/// restart; a key the store no longer takes fails the job with the store's answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rotated_credentials_are_read_again_for_every_job() {
    use spindle_providers::object_store::Credentials;
    let dir = tempfile::tempdir().unwrap();
    let clip = small_clip(&dir);
    let file = dir.path().join("credentials");
    let write = |k: &Credentials| {
        let text = format!(
            "[default]\naws_access_key_id = unused\naws_secret_access_key = unused\n\n\
             [renditions]\naws_access_key_id = {}\naws_secret_access_key = {}\n\
             aws_session_token = {}\n",
            k.access_key_id,
            k.secret_access_key,
            k.session_token.as_deref().unwrap()
        );
        // Written aside and renamed into place, as an agent does.
        let aside = dir.path().join("credentials.new");
        std::fs::write(&aside, text).unwrap();
        std::fs::rename(&aside, &file).unwrap();
    };
    let bucket = spindle_providers::fake_s3::FakeS3::start("videos", "us-test-1", "x", "y")
        .await
        .unwrap();
    bucket.rotate_key(temporary_keys("ASIAFIRST"));
    write(&temporary_keys("ASIAFIRST"));
    let test = TestDb::new().await;
    let (m, admin) = mock_with(20, Some(clip)).await;
    let out = dir.path().join("out");
    let media = format!(
        "renditions = [96]\n\n[media.upload]\nurl = \"{}\"\nregion = \"us-test-1\"\n\
         credentials_file = {:?}\nprofile = \"renditions\"\nsweep_uploads = false\n",
        bucket.url(),
        file.display().to_string()
    );
    let daemon = media_node(&test, &m, &out, &media).await;
    let (_, states) = run(&daemon, &test, "first", 1).await;
    assert_eq!(states, ["SUCCEEDED"]);

    // The agent rotates the key: the next job uses the new one.
    bucket.rotate_key(temporary_keys("ASIASECOND"));
    write(&temporary_keys("ASIASECOND"));
    let (_, states) = run(&daemon, &test, "second", 1).await;
    assert_eq!(states, ["SUCCEEDED"]);
    assert_eq!(bucket.keys().len(), 2);
    assert_eq!(bucket.bad_signatures(), 0);

    // The store moves on and the file does not: the job fails with the store's answer.
    bucket.rotate_key(temporary_keys("ASIATHIRD"));
    let (_, states) = run(&daemon, &test, "third", 1).await;
    assert_eq!(states, ["FAILED"]);
    let reason = failure_reason(&test).await;
    assert!(
        reason.contains("HTTP 403") && reason.contains("SignatureDoesNotMatch"),
        "{reason}"
    );
    assert_clean(&test, &admin).await;
}

/// What every source of temporary keys owes the bucket, run through the node: keys with 2
/// minutes left (under the refresh margin) fetched for the first job; once the source issues
/// keys for hours, which the bucket then alone takes, fetched again for the next job and kept
/// for the two after. `source` is the `[media.upload]` lines naming where keys come from (it
/// starts out issuing `temporary_keys("ASIAFIRST")` for 2 minutes); `issue` has it issue others;
/// `fetched` counts its fetches.
async fn temporary_keys_are_renewed_near_expiry(
    source: &str,
    issue: impl Fn(spindle_providers::object_store::Credentials, Duration),
    fetched: impl Fn() -> u32,
) {
    let dir = tempfile::tempdir().unwrap();
    let clip = small_clip(&dir);
    let bucket = spindle_providers::fake_s3::FakeS3::start("videos", "us-test-1", "x", "y")
        .await
        .unwrap();
    bucket.rotate_key(temporary_keys("ASIAFIRST"));
    let test = TestDb::new().await;
    let (m, admin) = mock_with(20, Some(clip)).await;
    let media = format!(
        "renditions = [96]\n\n[media.upload]\nurl = \"{}\"\nregion = \"us-test-1\"\n\
         sweep_uploads = false\n{source}",
        bucket.url(),
    );
    let daemon = media_node(&test, &m, &dir.path().join("out"), &media).await;
    let (_, states) = run(&daemon, &test, "first", 1).await;
    assert_eq!(states, ["SUCCEEDED"]);
    assert_eq!(fetched(), 1);
    issue(temporary_keys("ASIASECOND"), Duration::from_secs(6 * 3600));
    bucket.rotate_key(temporary_keys("ASIASECOND"));
    let (_, states) = run(&daemon, &test, "second", 1).await;
    assert_eq!(states, ["SUCCEEDED"]);
    assert_eq!(fetched(), 2, "keys near expiry fetched again");
    let (_, states) = run(&daemon, &test, "third", 2).await;
    assert_eq!(states, ["SUCCEEDED", "SUCCEEDED"]);
    assert_eq!(fetched(), 2, "keys with hours left kept");
    assert_eq!((bucket.keys().len(), bucket.bad_signatures()), (4, 0));
    assert_clean(&test, &admin).await;
}

/// A Kubernetes service account's keys (`role_arn`, `web_identity_token_file`): traded at STS
/// for the first job, again once they near expiry, kept while they have time left — each job
/// signing with the keys and session token STS issued, which the bucket requires.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_service_accounts_web_identity_is_traded_for_keys_at_sts() {
    let dir = tempfile::tempdir().unwrap();
    let role = "arn:aws:iam::111122223333:role/renditions";
    let token = dir.path().join("token");
    std::fs::write(&token, "projected-jwt").unwrap();
    let sts = spindle_providers::fake_sts::FakeSts::start(
        role,
        "projected-jwt",
        temporary_keys("ASIAFIRST"),
        Duration::from_secs(120),
    )
    .await
    .unwrap();
    let source = format!(
        "role_arn = \"{role}\"\nweb_identity_token_file = {:?}\nsts_url = \"{}\"\n",
        token.display().to_string(),
        sts.url()
    );
    temporary_keys_are_renewed_near_expiry(&source, |k, d| sts.issue(k, d), || sts.trades()).await;
    assert_eq!(sts.refused(), 0);
}

/// An EC2 instance's role (`instance_profile`): its keys read from the instance metadata
/// service the IMDSv2 way for the first job, again once they near expiry, kept while they
/// have hours left — each job signing with the keys and session token the instance was given,
/// which the bucket requires.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_profiles_keys_are_read_from_the_metadata_service() {
    let imds = spindle_providers::fake_imds::FakeImds::start(
        Some("gpu-node"),
        temporary_keys("ASIAFIRST"),
        Duration::from_secs(120),
    )
    .await
    .unwrap();
    let source = format!("instance_profile = true\nimds_url = \"{}\"\n", imds.url());
    temporary_keys_are_renewed_near_expiry(&source, |k, d| imds.issue(k, d), || imds.key_reads())
        .await;
    assert_eq!(imds.refused(), 0, "every read carried a session token");
}
