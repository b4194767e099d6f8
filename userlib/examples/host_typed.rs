//! Host tensors with typed data, slices and f16: runs anywhere
//! (`cargo run --example host_typed`).

use tdrv::half::f16;
use tdrv::Tensor;

pub fn main() -> Result<(), tdrv::Error> {
    // A TypedTensor<f16> of 16 elements: indices and lengths in elements.
    let t = Tensor::from_vec((0..16).map(|i| f16::from_f32(i as f32)).collect())?;
    let tail = t.slice(8..)?; // the last 8 elements
    tail.write(0, &[f16::from_f32(-1.0); 8])?;
    let all: Vec<f16> = t.to_vec()?;
    assert_eq!(all[7], f16::from_f32(7.0));
    assert_eq!(all[8], f16::from_f32(-1.0));
    // The untyped view counts bytes: 16 elements of 2 bytes.
    assert_eq!(t.tensor().size(), 32);
    // Caller mistakes are errors, not panics.
    let err = t.tensor().read_into(30, &mut [0u32; 1]).unwrap_err();
    println!("{err} (errno {:?})", err.raw_os_error());
    Ok(())
}
