// SPDX-License-Identifier: GPL-2.0

//! Registers of QEMU's educational PCI device (`-device edu`, 1234:11e8),
//! in BAR0 (1 MiB of MMIO).
//!
//! Registers below 0x80 take 32-bit accesses only; the DMA registers take
//! 32- or 64-bit accesses and ignore writes while a transfer runs.

use kernel::io::register;

/// Size of BAR0.
pub(crate) const BAR0_SIZE: usize = 0x10_0000;

/// Device address of the edu's internal DMA buffer.
pub(crate) const DMA_BUFFER_ADDR: u64 = 0x4_0000;
/// Size of that buffer.
pub(crate) const DMA_BUFFER_SIZE: usize = 4096;
/// Bytes tdrv moves per DMA transfer. Not the full buffer: QEMU releases up
/// to at least 7.2 check the buffer range with an exclusive end
/// (`end < buffer end`), so a transfer filling the whole 4 KiB buffer is
/// rejected as out of bounds and stops the VM. 4032 keeps chunks 64-byte
/// aligned and works on every version.
pub(crate) const DMA_CHUNK: usize = DMA_BUFFER_SIZE - 64;

/// `IRQ_STATUS` bit raised when a DMA transfer with `raise_irq` finishes.
pub(crate) const IRQ_DMA: u32 = 0x100;

/// The identification value of the device.
pub(crate) const IDENT_EDU: u32 = 0x0100_00ed;

register! {
    /// Identification register.
    pub(crate) IDENT(u32) @ 0x00 {
        /// Major version (1).
        31:24 major;
        /// Minor version (0).
        23:16 minor;
        /// Constant 0xed.
        7:0 magic;
    }

    /// Liveness check: reads back the bitwise inverse of the last write.
    pub(crate) LIVENESS(u32) @ 0x04 {
        /// The value (inverted on read-back).
        31:0 value;
    }

    /// Pending interrupt sources (`IRQ_DMA`, 0x1 for the factorial unit, or any
    /// value written to `IRQ_RAISE`).
    pub(crate) IRQ_STATUS(u32) @ 0x24 {
        /// Bitmask of raised sources.
        31:0 value;
    }

    /// Raises the given interrupt sources (sends an MSI).
    pub(crate) IRQ_RAISE(u32) @ 0x60 {
        /// Bitmask of sources to raise.
        31:0 value;
    }

    /// Acknowledges (clears) the given interrupt sources.
    pub(crate) IRQ_ACK(u32) @ 0x64 {
        /// Bitmask of sources to clear.
        31:0 value;
    }

    /// DMA source address: a bus address in RAM, or an address in the
    /// device buffer (`DMA_BUFFER_ADDR..+DMA_BUFFER_SIZE`).
    pub(crate) DMA_SRC(u64) @ 0x80 {
        /// Source address.
        63:0 addr;
    }

    /// DMA destination address (RAM or device buffer, see `DMA_SRC`).
    pub(crate) DMA_DST(u64) @ 0x88 {
        /// Destination address.
        63:0 addr;
    }

    /// DMA transfer length in bytes, at most `DMA_BUFFER_SIZE`.
    pub(crate) DMA_COUNT(u64) @ 0x90 {
        /// Length in bytes.
        63:0 bytes;
    }

    /// DMA command. The transfer completes about 100 ms (virtual time)
    /// after `run` is set; `run` reads as 1 until then.
    pub(crate) DMA_CMD(u64) @ 0x98 {
        /// Raise `IRQ_DMA` when the transfer finishes.
        2:2 raise_irq;
        /// Direction: 1 copies the device buffer to RAM, 0 RAM to the buffer.
        1:1 to_ram;
        /// Start (write 1); busy (reads 1) while the transfer runs.
        0:0 run;
    }
}
