//! Waiting for an event instead of sleeping for a while: every wait polls
//! the event itself, with a bound that only turns a hang into a failure
//! (it never measures speed: a slow guest passes, a stuck one fails).

use std::time::{Duration, Instant};

/// The bound of every event wait of the guest tests.
pub const HANG: Duration = Duration::from_secs(60);

/// Polls `cond` until it holds; fails naming `what` if it still does not
/// after [`HANG`], or as soon as `cond` fails.
pub fn until(what: &str, mut cond: impl FnMut() -> Result<bool, String>) -> Result<(), String> {
    let t0 = Instant::now();
    while !cond()? {
        if t0.elapsed() > HANG {
            return Err(format!("{what}: still not the case after {HANG:?}"));
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    Ok(())
}

/// Waits until thread `tid` of this process sleeps inside system call
/// `nr`, as `/proc/self/task/TID/syscall` and `stat` report it: a signal
/// sent now interrupts that call, not code before it.
pub fn until_asleep_in(tid: i32, nr: libc::c_long) -> Result<(), String> {
    let dir = format!("/proc/self/task/{tid}");
    until(&format!("thread {tid} asleep in syscall {nr}"), || {
        let syscall = std::fs::read_to_string(format!("{dir}/syscall"))
            .map_err(|e| format!("{dir}/syscall: {e}"))?;
        let stat = std::fs::read_to_string(format!("{dir}/stat"))
            .map_err(|e| format!("{dir}/stat: {e}"))?;
        // The state follows the parenthesised command name.
        let state = stat
            .rsplit_once(") ")
            .and_then(|(_, rest)| rest.chars().next());
        let in_call = syscall.split_whitespace().next() == Some(nr.to_string().as_str());
        Ok(in_call && state == Some('S'))
    })
}
