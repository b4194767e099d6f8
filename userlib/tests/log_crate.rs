//! Without a logger of its own, the library logs through the `log` crate
//! (target `tdrv`) and prints nothing itself. Its own process: the `log`
//! logger is global.

use std::sync::Mutex;
use std::thread;
use std::time::{Duration, Instant};

use tdrv::Tensor;
use tdrv::TensorOps;

static SEEN: Mutex<Vec<(log::Level, String, String)>> = Mutex::new(Vec::new());

struct Capture;

impl log::Log for Capture {
    fn enabled(&self, _: &log::Metadata<'_>) -> bool {
        true
    }
    fn log(&self, r: &log::Record<'_>) {
        SEEN.lock()
            .unwrap()
            .push((r.level(), r.target().to_owned(), r.args().to_string()));
    }
    fn flush(&self) {}
}

#[test]
fn warnings_reach_the_log_crate() {
    log::set_logger(&Capture).unwrap();
    log::set_max_level(log::LevelFilter::Debug);
    tdrv::set_heartbeat_interval(Duration::from_millis(20));
    let out = Tensor::allocate_host(8, Some("logged_output")).unwrap();
    let waiter = {
        let out = out.clone();
        thread::spawn(move || out.completion().wait(1, None))
    };
    // The heartbeat is the event: wait for it (the bound only turns a
    // missing heartbeat into a failure), then let the waiter through.
    let heartbeat = || {
        SEEN.lock().unwrap().iter().any(|(level, target, msg)| {
            *level == log::Level::Warn
                && target == "tdrv"
                && msg.contains("logged_output")
                && msg.contains("still waiting")
        })
    };
    let t0 = Instant::now();
    while !heartbeat() && t0.elapsed() < Duration::from_secs(60) {
        thread::sleep(Duration::from_millis(2));
    }
    out.completion().record().unwrap();
    waiter.join().unwrap().unwrap();
    let seen = SEEN.lock().unwrap();
    assert!(
        seen.iter()
            .any(|(level, target, msg)| *level == log::Level::Warn
                && target == "tdrv"
                && msg.contains("logged_output")
                && msg.contains("still waiting")),
        "{seen:?}"
    );
}
