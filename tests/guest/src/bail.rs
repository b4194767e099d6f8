//! Preconditions of a test program: steps that set up what the checks
//! test (opening the device, configuring fault injection, unbinding a
//! device). They are not checks themselves, so they print no `ok` line:
//! if one fails, the program stops with a TAP `Bail out!` line naming the
//! step and exits 1, which the runner counts as a failed program.

use std::fmt::Display;

/// Prints `Bail out! <reason>` and exits 1 (kselftest's failure code).
pub fn bail_out(reason: impl Display) -> ! {
    println!("Bail out! {reason}");
    std::process::exit(1)
}

/// The value of a precondition that must hold; bails out naming `step`
/// with the error otherwise.
pub fn require<T, E: Display>(step: &str, r: Result<T, E>) -> T {
    r.unwrap_or_else(|e| bail_out(format!("{step}: {e}")))
}
