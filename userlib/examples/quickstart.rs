//! Allocate on a device, fill, copy with a job, wait, read back:
//! `cargo run --example quickstart [/dev/tdrvN]` (in the guest, or on a
//! machine with tdrv.ko loaded).

use tdrv::{Device, Job, Tensor};

fn main() -> Result<(), tdrv::Error> {
    let path = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "/dev/tdrv0".into());
    let dev = Device::open(&path)?;
    let src = Tensor::builder()
        .on(&dev)
        .name("input")
        .from_slice(&[1.5f32; 1024])?;
    let dst = Tensor::builder()
        .on(&dev)
        .name("output")
        .zeroed(src.tensor().size())?;
    Job::new().copy_all(src.tensor(), &dst)?.submit()?.wait()?;
    let out: Vec<f32> = dst.to_vec_of()?;
    assert!(out.iter().all(|x| *x == 1.5));
    println!("{path}: copied {} f32 values", out.len());
    Ok(())
}
