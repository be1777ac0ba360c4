//! The systemd notify protocol, for `Type=notify` units: `READY=1` once the node serves,
//! `WATCHDOG=1` while the control plane answers, `STOPPING=1` when a drain starts. Without
//! `NOTIFY_SOCKET` (not under systemd) every call does nothing.

use std::os::unix::net::UnixDatagram;

/// Sends `state` to the service manager; false when there is none or it cannot be reached.
pub fn notify(state: &str) -> bool {
    let Some(path) = std::env::var_os("NOTIFY_SOCKET") else {
        return false;
    };
    let Ok(socket) = UnixDatagram::unbound() else {
        return false;
    };
    let path = std::path::PathBuf::from(path);
    // An abstract socket ("@name") is not reachable through std's path API; systemd passes a
    // path for system services, which is what this supports.
    if path.as_os_str().to_string_lossy().starts_with('@') {
        tracing::warn!("NOTIFY_SOCKET is abstract; systemd notifications are not sent");
        return false;
    }
    socket.send_to(state.as_bytes(), &path).is_ok()
}

/// Half the watchdog interval systemd asked for (`WATCHDOG_USEC`), if it asked.
pub fn watchdog_interval() -> Option<std::time::Duration> {
    let usec: u64 = std::env::var("WATCHDOG_USEC").ok()?.parse().ok()?;
    (usec > 0).then(|| std::time::Duration::from_micros(usec / 2))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ready_reaches_the_notify_socket() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("notify.sock");
        let receiver = UnixDatagram::bind(&path).unwrap();
        // The variable is this process's only user of NOTIFY_SOCKET (set for this test only).
        std::env::set_var("NOTIFY_SOCKET", &path);
        assert!(notify("READY=1"));
        std::env::remove_var("NOTIFY_SOCKET");
        let mut buf = [0u8; 64];
        let n = receiver.recv(&mut buf).unwrap();
        assert_eq!(&buf[..n], b"READY=1");
        assert!(!notify("READY=1"), "without NOTIFY_SOCKET nothing is sent");
    }
}
