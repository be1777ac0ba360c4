//! Send times kept to the microsecond. tokio's timer rounds every deadline up to its next
//! whole millisecond, so a frame meant for 10.2 ms left at 11 ms or later — measured at 12,000
//! tasks/s: 1.1 ms late at the median, 2.4 ms at p99, all of it counted in the acknowledgement
//! latency (which runs from the intended send time). A pacer sleeps on a Linux timerfd, the
//! OS's high-resolution timer, registered with the runtime's own event loop: the runtime's
//! thread wakes at the deadline itself. (A pacing thread that woke the runtime through a
//! channel, as before, cost two more thread switches per frame: docs/benchmarks/journal.md,
//! "Sixteenth round".)

use std::os::fd::{AsFd, AsRawFd, RawFd};
use std::time::Instant;

use nix::errno::Errno;
use nix::sys::time::TimeSpec;
use nix::sys::timerfd::{ClockId, Expiration, TimerFd, TimerFlags, TimerSetTimeFlags};
use tokio::io::unix::AsyncFd;
use tokio::io::Interest;

/// One sender's timer: one deadline at a time.
pub struct Pacer {
    timer: AsyncFd<Timer>,
}

/// The timerfd, as `AsyncFd` takes it.
struct Timer(TimerFd);

impl AsRawFd for Timer {
    fn as_raw_fd(&self) -> RawFd {
        self.0.as_fd().as_raw_fd()
    }
}

impl Pacer {
    /// A timer on the monotonic clock (the one `Instant` reads), registered with the current
    /// runtime.
    pub fn new() -> std::io::Result<Pacer> {
        let fd = TimerFd::new(
            ClockId::CLOCK_MONOTONIC,
            TimerFlags::TFD_NONBLOCK | TimerFlags::TFD_CLOEXEC,
        )?;
        #[allow(unsafe_code)]
        // SAFETY: `Timer` owns its timerfd for as long as the `AsyncFd` holds it and always
        // answers that one descriptor.
        let timer = unsafe { AsyncFd::register_with_interest(Timer(fd), Interest::READABLE) }?;
        Ok(Pacer { timer })
    }

    /// Resolves at `at` (never before it).
    pub async fn wait_until(&mut self, at: Instant) -> std::io::Result<()> {
        let left = at.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Ok(());
        }
        self.timer.get_ref().0.set(
            Expiration::OneShot(TimeSpec::from_duration(left)),
            TimerSetTimeFlags::empty(),
        )?;
        loop {
            let mut ready = self.timer.readable().await?;
            // Non-blocking: the expiration count once it fired, EAGAIN before.
            match ready.get_inner().0.wait() {
                Ok(()) => return Ok(()),
                Err(Errno::EAGAIN) => ready.clear_ready(),
                Err(e) => return Err(e.into()),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// Every waiter resumes at or after its deadline, whatever order they asked in.
    #[tokio::test]
    async fn waiters_never_resume_early() {
        let base = Instant::now() + Duration::from_millis(20);
        let mut tasks = Vec::new();
        // Deadlines 0.5 ms apart, asked for in reverse.
        for i in (0..32u64).rev() {
            let mut pacer = Pacer::new().expect("timerfd");
            let at = base + Duration::from_micros(500 * i);
            tasks.push(tokio::spawn(async move {
                pacer.wait_until(at).await.expect("timer");
                Instant::now() >= at
            }));
        }
        for t in tasks {
            assert!(
                t.await.expect("waiter"),
                "a waiter resumed before its deadline"
            );
        }
    }

    /// One pacer waits for deadline after deadline, each at or after its time.
    #[tokio::test]
    async fn a_pacer_is_reused_for_every_deadline() {
        let mut pacer = Pacer::new().expect("timerfd");
        let base = Instant::now();
        for i in 1..=20u64 {
            let at = base + Duration::from_micros(700 * i);
            pacer.wait_until(at).await.expect("timer");
            assert!(Instant::now() >= at, "deadline {i} resumed early");
        }
    }

    /// A near deadline on one pacer is not held behind a far one on another.
    #[tokio::test]
    async fn a_near_deadline_does_not_wait_for_a_far_one() {
        let mut far = Pacer::new().expect("timerfd");
        let _far = tokio::spawn(async move {
            far.wait_until(Instant::now() + Duration::from_secs(600))
                .await
                .expect("timer");
        });
        tokio::task::yield_now().await;
        let mut pacer = Pacer::new().expect("timerfd");
        let near = Instant::now() + Duration::from_millis(5);
        tokio::time::timeout(Duration::from_secs(30), pacer.wait_until(near))
            .await
            .expect("the near deadline was held behind the far one")
            .expect("timer");
        assert!(Instant::now() >= near);
    }

    #[tokio::test]
    async fn a_deadline_already_past_resolves_at_once() {
        let mut pacer = Pacer::new().expect("timerfd");
        let before = Instant::now();
        pacer
            .wait_until(before - Duration::from_millis(5))
            .await
            .expect("past");
        pacer.wait_until(before).await.expect("now");
    }
}
