//! The operator dashboard in Debian's headless Chromium against a running node under load: the
//! page renders the node's numbers, they change as work runs, a policy change made through
//! spindlectl shows up in its audit list once signed in (the token kept in an HttpOnly cookie,
//! never in the URL), what a client names is shown as text — a script in an audit reason does
//! not run — and a screenshot is kept in target/test-artifacts/dashboard.png.

mod common;

use std::path::PathBuf;

use common::{admin_tokens, start_with, task, NodeConfig, OPERATOR_TOKEN, VIEWER_TOKEN};
use spindle_client::Client;
use spindle_control::testing::TestDb;
use spindle_core::TenantId;

/// The node with the admin API's three roles.
fn config() -> String {
    NodeConfig::new()
        .node_id("dash-node")
        .time_scale(0.01)
        .tenants([1])
        .section(&admin_tokens())
        .toml()
}

/// The page's DOM after its scripts ran (Chromium's virtual time lets its timers fire).
fn dump_dom(url: &str) -> String {
    let out = std::process::Command::new("chromium")
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--virtual-time-budget=3000",
            "--dump-dom",
        ])
        .arg(url)
        .output()
        .expect("Debian's chromium (scripts/setup-system installs it)");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The page after signing in with `token`: a local page whose form posts the token to the
/// node's sign-in, which answers with the session cookie and sends the browser on to the
/// dashboard — the token in no URL.
fn dump_signed_in(http: std::net::SocketAddr, token: &str, dir: &std::path::Path) -> String {
    let page = dir.join("sign-in.html");
    std::fs::write(
        &page,
        format!(
            "<form method=\"post\" action=\"http://{http}/dashboard/login\">\
             <input name=\"token\" value=\"{token}\"></form>\
             <script>document.forms[0].submit()</script>"
        ),
    )
    .unwrap();
    dump_dom(&format!("file://{}", page.display()))
}

/// The "completed N" the page shows.
fn completed(dom: &str) -> u64 {
    dom.split("completed ")
        .nth(1)
        .and_then(|s| s.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no completed count on the page:\n{dom}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboard_renders_live_numbers_and_the_audit_list_in_chromium() {
    let test = TestDb::new().await;
    let daemon = start_with(&test, &config()).await;
    let url = format!("http://{}/dashboard", daemon.http);
    let before = dump_dom(&url);
    // Not signed in: the sign-in form, no audit list.
    assert!(before.contains("sign in with a viewer token"), "{before}");
    assert!(
        before.contains("<th>lane</th>") && before.contains("STANDARD"),
        "{before}"
    );

    // Load: the numbers move.
    let client = Client::connect(daemon.addr, TenantId(1), "tenant-1-credential")
        .await
        .unwrap();
    let batch: Vec<_> = (0..40).map(|i| task(&format!("d{i}"))).collect();
    let last = client.submit_batch(batch).await.unwrap().pop().unwrap();
    common::wait_for(&client, last.task, spindle_core::TaskState::Succeeded).await;
    let during = dump_dom(&url);
    assert!(
        completed(&during) > completed(&before),
        "the page did not follow the load"
    );
    assert!(during.contains("<td>ACCEPTED</td>"), "{during}");
    // The one client connection open, none refused.
    let status = during
        .split_once("id=\"status\">")
        .and_then(|(_, rest)| rest.split_once("</div>"))
        .map_or("", |(status, _)| status);
    assert!(
        status.contains("connections 1 ·") && !status.contains("refused"),
        "{status}"
    );
    assert!(during.contains("<th>entitlement</th>"), "{during}");
    assert!(
        during.contains("<th>admits</th><th>weight</th>"),
        "{during}"
    );

    // A policy change through spindlectl appears in the page's audit list.
    let dir = tempfile::tempdir().unwrap();
    let body = dir.path().join("t.json");
    std::fs::write(
        &body,
        serde_json::to_string(&spindle_core::presets::tenant(
            spindle_core::Lane::Standard,
            2,
        ))
        .unwrap(),
    )
    .unwrap();
    let status = std::process::Command::new(env!("CARGO_BIN_EXE_spindlectl"))
        .arg("--node")
        .arg(daemon.http.to_string())
        .args([
            "--token",
            OPERATOR_TOKEN,
            "policy",
            "set",
            "tenant_policy",
            "1",
        ])
        .arg("--body")
        .arg(&body)
        .args(["--reason", "dashboard-check"])
        .status()
        .unwrap();
    assert!(status.success());
    let after = dump_signed_in(daemon.http, VIEWER_TOKEN, dir.path());
    assert!(
        after.contains("dashboard-check") && after.contains("<td>otto</td>"),
        "{after}"
    );
    // A wrong token signs nobody in.
    let stranger = dump_signed_in(daemon.http, "not-a-token-of-this-node", dir.path());
    assert!(!stranger.contains("dashboard-check"), "{stranger}");

    // What a client names is text: a reason carrying markup and a script is shown as such, and
    // nothing of it runs (it would retitle the page).
    let payload = "<img src=x onerror=\"document.title='pwned'\">";
    let status = std::process::Command::new(env!("CARGO_BIN_EXE_spindlectl"))
        .arg("--node")
        .arg(daemon.http.to_string())
        .args([
            "--token",
            OPERATOR_TOKEN,
            "policy",
            "set",
            "tenant_policy",
            "1",
        ])
        .arg("--body")
        .arg(&body)
        .args(["--reason", payload])
        .status()
        .unwrap();
    assert!(status.success());
    let shown = dump_signed_in(daemon.http, VIEWER_TOKEN, dir.path());
    assert!(
        shown.contains("&lt;img src=x onerror=\"document.title='pwned'\"&gt;"),
        "{shown}"
    );
    assert!(!shown.contains("<img"), "{shown}");
    assert!(shown.contains("<title>spindle node</title>"), "{shown}");
    // The page's headers: no framing, no sniffing, only its own script.
    let (head, _) = raw_get(daemon.http, "/dashboard").await;
    for h in [
        "x-frame-options: DENY",
        "x-content-type-options: nosniff",
        "content-security-policy: default-src 'none'; script-src 'self'",
    ] {
        assert!(head.contains(h), "{h}: {head}");
    }

    // The screenshot, kept as the test's artifact.
    let artifacts = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target/test-artifacts");
    std::fs::create_dir_all(&artifacts).unwrap();
    let shot = artifacts.join("dashboard.png");
    let _ = std::fs::remove_file(&shot);
    let out = std::process::Command::new("chromium")
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
            "--window-size=1280,900",
            "--virtual-time-budget=3000",
        ])
        .arg(format!("--screenshot={}", shot.display()))
        .arg(&url)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let png = std::fs::read(&shot).unwrap();
    assert!(
        png.starts_with(b"\x89PNG") && png.len() > 10_000,
        "{} bytes",
        png.len()
    );
}

/// A GET's response head and body, read to the end.
async fn raw_get(addr: std::net::SocketAddr, path: &str) -> (String, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(format!("GET {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut text = String::new();
    s.read_to_string(&mut text).await.unwrap();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    (
        head.to_ascii_lowercase()
            .replace("x-frame-options: deny", "x-frame-options: DENY"),
        body.to_string(),
    )
}
