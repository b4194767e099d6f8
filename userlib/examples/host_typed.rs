//! Host tensors with typed data, slices and f16: runs anywhere
//! (`cargo run --example host_typed`).

use tdrv::half::f16;
use tdrv::Tensor;

pub fn main() -> Result<(), tdrv::Error> {
    let t = Tensor::from_vec((0..16).map(|i| f16::from_f32(i as f32)).collect())?;
    let tail = t.slice_range(16..)?; // the last 8 elements (2 bytes each)
    tail.write_from(0, &[f16::from_f32(-1.0); 8])?;
    let all: Vec<f16> = t.to_vec_of()?;
    assert_eq!(all[7], f16::from_f32(7.0));
    assert_eq!(all[8], f16::from_f32(-1.0));
    // Caller mistakes are errors, not panics.
    let err = t.read_into(30, &mut [0u32; 1]).unwrap_err();
    println!("{err} (errno {:?})", err.raw_os_error());
    Ok(())
}
