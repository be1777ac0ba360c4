//! The node's threads that run tokio: each a named thread with a one-thread runtime of its own
//! (timers and I/O enabled), so that none shares a runtime with another part's stalls.

use std::future::Future;

/// Spawns thread `name` running `work()` to its end on a one-thread tokio runtime of its own.
pub fn spawn_thread<F, Fut>(name: &str, work: F) -> std::io::Result<std::thread::JoinHandle<()>>
where
    F: FnOnce() -> Fut + Send + 'static,
    Fut: Future<Output = ()> + 'static,
{
    std::thread::Builder::new()
        .name(name.into())
        .spawn(move || block_on(work()).expect("a one-thread tokio runtime"))
}

/// Runs `work` to its end on a one-thread tokio runtime made for it (on this thread).
pub fn block_on<T>(work: impl Future<Output = T>) -> std::io::Result<T> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    Ok(rt.block_on(work))
}
