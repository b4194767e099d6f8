//! The host-only programs of `examples/` run as tests (so `make test`, and
//! Miri, run them); device examples run in the guest.

#[path = "../examples/host_typed.rs"]
mod host_typed;

#[test]
fn host_typed_example_runs() {
    host_typed::main().unwrap();
}
