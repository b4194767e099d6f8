// SPDX-License-Identifier: GPL-2.0

//! The software device: a faux bus device with DMA-coherent memory and the
//! CPU copy engine, so that tdrv works on any machine.

use kernel::{bindings, device, error::to_result, faux, prelude::*, str::CString, sync::Arc};

use crate::{
    device::{
        raw_device,
        DeviceIndex,
        TdrvDevice, //
    },
    engine::{
        Engine,
        SoftBackend,
        SoftEngine, //
    },
    node::DeviceNode,
    stats::DeviceDebugfs,
    uapi::DEVICE_SOFT,
    Params, //
};

/// Sets the coherent DMA mask of a faux device, which 7.2 cannot do safely
/// (`dma::Device` is implemented for PCI and platform devices only).
fn set_coherent_mask_all(dev: &device::Device) -> Result {
    // SAFETY: `dev` is a valid, registered device, and no DMA allocation
    // exists for it yet. A faux device has no `dma_mask` (so
    // `dma_set_mask` would fail), but the coherent mask is all that
    // `dma_alloc_coherent` and `dma_mmap_attrs` consult.
    to_result(unsafe { bindings::dma_set_coherent_mask(raw_device(dev), u64::MAX) })
}

/// One software device and its `/dev/tdrv<N>` node.
#[pin_data(PinnedDrop)]
pub(crate) struct SoftDevice {
    #[pin]
    node: DeviceNode,
    _debugfs: DeviceDebugfs,
    // Dropped last: the faux device backs every buffer's DMA memory.
    _faux: faux::Registration,
}

impl SoftDevice {
    pub(crate) fn new(params: &Params) -> impl PinInit<Self, Error> + '_ {
        pin_init::pin_init_scope(move || {
            let index = DeviceIndex::take()?;
            let name = CString::try_from_fmt(fmt!("tdrv-soft{}", index.get()))?;
            let faux = faux::Registration::new(&name, None)?;
            set_coherent_mask_all(faux.as_ref())?;
            let engine: KBox<dyn Engine> = KBox::new(SoftBackend(SoftEngine::new()?), GFP_KERNEL)?;
            let device: Arc<TdrvDevice> =
                TdrvDevice::new(faux.as_ref(), DEVICE_SOFT, index, params, engine)?;
            let debugfs = DeviceDebugfs::new(&device)?;
            Ok(try_pin_init!(SoftDevice {
                node <- DeviceNode::new(device),
                _debugfs: debugfs,
                _faux: faux,
            }))
        })
    }
}

#[pinned_drop]
impl PinnedDrop for SoftDevice {
    fn drop(self: Pin<&mut Self>) {
        // No file is open (the module is going away, and files pin it), and
        // closed files' jobs were cancelled; stop the engine and free every
        // buffer's memory before the faux device goes away.
        self.node.device.unbind(|| {});
    }
}
