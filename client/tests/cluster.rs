//! `Client::connect_cluster` follows a node's `WrongNode` answer to the address it names, and
//! gives up — with the path it took — when the nodes send it round in a loop. A
//! `ClusterClient` fails over within its window and not past it, and does not retry a
//! refusal no other node would answer otherwise, gives a subscribed task that ended during a
//! failover as its end, and keeps no more subscriptions than its bound. (Its failover from a killed node to the one that takes over,
//! requests and subscriptions, with real nodes: `dataplane/spindled/tests/takeover.rs`.)

use std::net::SocketAddr;

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use spindle_client::{Client, ClientError, ClusterClient};
use spindle_core::{TaskId, TaskState, TenantId};
use spindle_wire::{
    decode_request, Encoder, ErrorCode, Event, FrameReader, HelloOk, Request, Response,
    ResponseFrame, TaskStatus, WireError, PROTOCOL_VERSION,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// A fake node: answers every Hello on `listener` with HelloOk (`to` is `None`) or with
/// WrongNode redirecting to `to`.
async fn node(listener: TcpListener, name: &'static str, to: Option<SocketAddr>) {
    let answer = match to {
        None => Hello::Serve,
        Some(to) => Hello::Redirect(to),
    };
    fake(listener, name, answer).await
}

#[derive(Clone, Copy)]
enum Hello {
    Serve,
    Redirect(SocketAddr),
    Refuse(ErrorCode),
}

async fn fake(listener: TcpListener, name: &'static str, hello: Hello) {
    loop {
        let (mut socket, _) = listener.accept().await.unwrap();
        serve_frames(&mut socket, |request| {
            let Request::Hello(h) = request else {
                return (vec![], true);
            };
            let body = match hello {
                Hello::Serve => hello_ok(name),
                Hello::Refuse(code) => Response::Error(WireError::new(code, "no")),
                Hello::Redirect(to) => Response::Error(
                    WireError::new(
                        ErrorCode::WrongNode,
                        format!("tenant {} is served by node at {to}", h.tenant),
                    )
                    .redirecting_to(to.to_string()),
                ),
            };
            (vec![body], false)
        })
        .await;
    }
}

/// Reads `socket`'s request frames and writes what `answer` makes of each — its answers, on
/// the request's id, then whether to close — until the peer closes.
async fn serve_frames(
    socket: &mut TcpStream,
    mut answer: impl FnMut(Request) -> (Vec<Response>, bool),
) {
    let mut frames = FrameReader::new();
    let mut buf = vec![0u8; 4096];
    let mut encoder = Encoder::new();
    loop {
        let n = socket.read(&mut buf).await.unwrap_or(0);
        if n == 0 {
            return;
        }
        frames.extend(&buf[..n]);
        while let Some(f) = frames.next_frame().unwrap() {
            let frame = decode_request(f).unwrap();
            let (bodies, then_close) = answer(frame.body);
            let mut out = Vec::new();
            for body in bodies {
                let request_id = frame.request_id;
                encoder.response(&ResponseFrame { request_id, body }, &mut out);
            }
            if socket.write_all(&out).await.is_err() || then_close {
                return;
            }
        }
    }
}

/// A node's HelloOk, as node `name`.
fn hello_ok(name: &str) -> Response {
    Response::HelloOk(HelloOk {
        protocol_version: PROTOCOL_VERSION,
        node_id: name.into(),
        frame_bytes_max: 1 << 20,
        batch_max: 1024,
    })
}

async fn listener() -> (TcpListener, SocketAddr) {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    (l, addr)
}

#[tokio::test]
async fn a_cluster_client_follows_redirects_to_the_serving_node_and_stops_at_a_loop() {
    // c serves; b sends to c; a sends to b.
    let ((la, a), (lb, b), (lc, c)) = (listener().await, listener().await, listener().await);
    tokio::spawn(node(la, "a", Some(b)));
    tokio::spawn(node(lb, "b", Some(c)));
    tokio::spawn(node(lc, "c", None));
    let client = Client::connect_cluster(&a.to_string(), TenantId(3), "x")
        .await
        .unwrap();
    assert_eq!(client.hello().node_id, "c");
    // A plain connect is not redirected: the refusal names the node to ask, with its address.
    match Client::connect(a, TenantId(3), "x").await {
        Err(ClientError::Refused(e)) => {
            assert_eq!(
                (e.code, e.redirect),
                (ErrorCode::WrongNode, Some(b.to_string()))
            );
        }
        other => panic!("{:?}", other.map(|_| ())),
    }

    // d and e send to each other.
    let ((ld, d), (le, e)) = (listener().await, listener().await);
    tokio::spawn(node(ld, "d", Some(e)));
    tokio::spawn(node(le, "e", Some(d)));
    match Client::connect_cluster(&d.to_string(), TenantId(3), "x").await {
        Err(ClientError::Refused(err)) => {
            assert_eq!(err.code, ErrorCode::WrongNode);
            assert!(
                err.message
                    .contains(&format!("from {d} to {e} without reaching")),
                "{err}"
            );
        }
        other => panic!("a redirect loop connected: {:?}", other.map(|_| ())),
    }
}

#[tokio::test]
async fn a_cluster_client_stops_at_its_window_and_at_a_refusal_no_node_changes() {
    // Nothing listens at `gone`: every try fails to connect, until the window ends.
    let (l, gone) = listener().await;
    drop(l);
    let started = Instant::now();
    let window = Duration::from_millis(300);
    let r = ClusterClient::connect_within(&[gone.to_string()], TenantId(3), "x", window).await;
    assert!(matches!(r, Err(ClientError::Io(_))), "{:?}", r.map(|_| ()));
    let took = started.elapsed();
    assert!(
        took >= Duration::from_millis(100) && took < Duration::from_secs(3),
        "{took:?}"
    );

    // A wrong credential is answered at once, whatever the window, and the seed after the
    // refusing one is not asked.
    let ((lr, refusing), (ls, serving)) = (listener().await, listener().await);
    tokio::spawn(fake(lr, "r", Hello::Refuse(ErrorCode::AuthFailed)));
    tokio::spawn(fake(ls, "s", Hello::Serve));
    let started = Instant::now();
    let seeds = [refusing.to_string(), serving.to_string()];
    let r = ClusterClient::connect(&seeds, TenantId(3), "x").await;
    match r {
        Err(ClientError::Refused(e)) => assert_eq!(e.code, ErrorCode::AuthFailed),
        other => panic!("{:?}", other.map(|_| ())),
    }
    assert!(started.elapsed() < Duration::from_secs(5));

    // A seed that does not answer is passed over for the next.
    let (l, gone) = listener().await;
    drop(l);
    let seeds = [gone.to_string(), serving.to_string()];
    let cluster = ClusterClient::connect(&seeds, TenantId(3), "x")
        .await
        .unwrap();
    assert_eq!(cluster.client().await.unwrap().hello().node_id, "s");
    assert_eq!(cluster.failovers(), 0);
    assert!(ClusterClient::connect(&[], TenantId(3), "x").await.is_err());
}

/// A fake node for one connection: serves the Hello and answers a Subscribe, then closes and
/// takes no more connections; or, as the node that took over, refuses every Subscribe as not
/// live (counting them in `subscribes`) and reads the task as `stored`.
async fn one_shot(listener: TcpListener, name: &'static str, took_over: Option<Stored>) {
    let (mut socket, _) = listener.accept().await.unwrap();
    if took_over.is_none() {
        drop(listener);
    }
    serve_frames(&mut socket, |request| match request {
        Request::Hello(_) => (vec![hello_ok(name)], false),
        Request::Subscribe(task) => match &took_over {
            Some(stored) => {
                stored.subscribes.fetch_add(1, Ordering::Relaxed);
                let why = format!("task {task} is not live here");
                (
                    vec![Response::Error(WireError::new(ErrorCode::NotFound, why))],
                    false,
                )
            }
            None => (vec![Response::Subscribed(task)], true),
        },
        Request::Get(task) => (
            vec![Response::Status(TaskStatus {
                task,
                state: took_over.as_ref().expect("the node that took over").state,
                version: 4,
                attempt_no: 1,
                progress_pct: 100,
                cost_estimate_milli: 1_000,
                cost_actual_milli: 900,
                failure_reason: None,
                result: Some(r#"{"outputs":["/m/9.mp4"]}"#.into()),
                expected_start_ms: 0,
            })],
            false,
        ),
        other => panic!("unexpected request {other:?}"),
    })
    .await;
}

/// What the node that took over holds of the task: its stored state, and the Subscribes it
/// refused.
#[derive(Clone)]
struct Stored {
    state: TaskState,
    subscribes: Arc<AtomicU32>,
}

/// A cluster client subscribed to task 9 on node x, which goes away; node y, where the task
/// is stored as `state` but not live, serves next. Its next event, and y's refused Subscribes.
async fn failover_with_task_stored_as(state: TaskState) -> (Event, u32, ClusterClient) {
    let ((lx, x), (ly, y)) = (listener().await, listener().await);
    let subscribes = Arc::new(AtomicU32::new(0));
    let stored = Stored {
        state,
        subscribes: subscribes.clone(),
    };
    tokio::spawn(one_shot(lx, "x", None));
    tokio::spawn(one_shot(ly, "y", Some(stored)));
    let cluster = ClusterClient::connect(&[x.to_string(), y.to_string()], TenantId(3), "x")
        .await
        .unwrap();
    cluster.subscribe(TaskId(9)).await.unwrap();
    let event = tokio::time::timeout(Duration::from_secs(10), cluster.next_event())
        .await
        .expect("an event within the window")
        .unwrap();
    (event, subscribes.load(Ordering::Relaxed), cluster)
}

#[tokio::test]
async fn a_task_not_live_on_the_new_node_is_asked_for_again_then_given_as_its_state() {
    let (event, subscribes, cluster) = failover_with_task_stored_as(TaskState::Running).await;
    assert_eq!((event.task, event.state), (TaskId(9), TaskState::Running));
    assert!(subscribes > 1, "asked for again: {subscribes}");
    assert_eq!(cluster.failovers(), 1);
}

#[tokio::test]
async fn a_task_that_ended_during_a_failover_is_given_as_its_end() {
    let (end, subscribes, cluster) = failover_with_task_stored_as(TaskState::Succeeded).await;
    assert_eq!(subscribes, 1, "an ended task is not asked for again");
    assert_eq!(
        (end.task, end.state, end.progress_pct, end.result.as_deref()),
        (
            TaskId(9),
            TaskState::Succeeded,
            100,
            Some(r#"{"outputs":["/m/9.mp4"]}"#)
        )
    );
    assert_eq!(cluster.client().await.unwrap().hello().node_id, "y");
    assert_eq!(cluster.failovers(), 1);
}

/// A fake node that serves one connection's Hello and Subscribes, counting them in
/// `subscribes`; task 1 ends (SUCCEEDED) right after its Subscribed.
async fn subscribing(listener: TcpListener, subscribes: Arc<AtomicU32>) {
    let (mut socket, _) = listener.accept().await.unwrap();
    serve_frames(&mut socket, |request| match request {
        Request::Hello(_) => (vec![hello_ok("n")], false),
        Request::Subscribe(task) => {
            subscribes.fetch_add(1, Ordering::Relaxed);
            let mut answers = vec![Response::Subscribed(task)];
            if task == TaskId(1) {
                answers.push(Response::Event(Event {
                    task,
                    state: TaskState::Succeeded,
                    progress_pct: 100,
                    at_ms: 1,
                    result: None,
                }));
            }
            (answers, false)
        }
        other => panic!("unexpected request {other:?}"),
    })
    .await;
}

#[tokio::test]
async fn a_cluster_client_keeps_no_more_subscriptions_than_its_bound() {
    let (l, addr) = listener().await;
    let subscribes = Arc::new(AtomicU32::new(0));
    tokio::spawn(subscribing(l, subscribes.clone()));
    let cluster = ClusterClient::connect(&[addr.to_string()], TenantId(3), "x")
        .await
        .unwrap()
        .with_subscriptions_max(2);
    cluster.subscribe(TaskId(1)).await.unwrap();
    cluster.subscribe(TaskId(2)).await.unwrap();
    // A task held already is asked for again, not counted twice.
    cluster.subscribe(TaskId(2)).await.unwrap();
    match cluster.subscribe(TaskId(3)).await {
        Err(ClientError::Refused(e)) => {
            assert_eq!(e.code, ErrorCode::TooManySubscriptions, "{e}");
            assert!(e.message.contains("at most 2 subscriptions"), "{e}");
        }
        other => panic!("a third subscription was kept: {other:?}"),
    }
    assert_eq!(
        subscribes.load(Ordering::Relaxed),
        3,
        "the refused one never reached the node"
    );
    // Task 1's end frees its place.
    let end = tokio::time::timeout(Duration::from_secs(10), cluster.next_event())
        .await
        .expect("task 1's end")
        .unwrap();
    assert_eq!((end.task, end.state), (TaskId(1), TaskState::Succeeded));
    cluster.subscribe(TaskId(3)).await.unwrap();
    assert_eq!(subscribes.load(Ordering::Relaxed), 4);
}
