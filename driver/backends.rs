// SPDX-License-Identifier: GPL-2.0

//! The devices tdrv drives. Each backend creates its devices, hands the core
//! a [`crate::device::TdrvDevice`] with its [`crate::engine::Engine`], and
//! registers the `/dev/tdrv<N>` node; the core names none of them.
//!
//! - `soft.rs`: the software device, a faux device whose engine copies with
//!   the CPU in a work item, so tdrv works on any machine;
//! - `edu.rs` (+ `edu_regs.rs`): QEMU's edu PCI device, whose DMA engine
//!   moves one 4 KiB chunk per MSI completion interrupt;
//! - `sim/`: the tdrv sim device (QEMU ivshmem-doorbell served by the
//!   `tdrv-sim` process): device memory (HBM), several DMA queues fed by
//!   descriptor rings, doorbells and per-queue MSI-X interrupts.

pub(crate) mod edu;
mod edu_regs;
pub(crate) mod sim;
pub(crate) mod soft;
