// SPDX-License-Identifier: MIT OR Apache-2.0
//! Gives the C library the SONAME third-party programs load it by.

fn main() {
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libnrt.so.1");
    println!("cargo:rerun-if-changed=build.rs");
}
