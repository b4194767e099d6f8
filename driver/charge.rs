// SPDX-License-Identifier: GPL-2.0

//! What an open file is charged for its buffers (`file_max_mib`, fdinfo,
//! debugfs), and charges that outlive the file's handle.
//!
//! A buffer's bytes (page-rounded) are charged to the file that holds a
//! handle to it from ALLOC or IMPORT on. FREE gives them back, except for
//! a handle that was exported: its dma-bufs keep the memory, so they keep
//! the charge too, until the handle is freed *and* every dma-buf exported
//! from it is released. Without that, ALLOC, EXPORT and FREE in a loop
//! would hold any amount of memory through dma-buf fds at no cost to the
//! file's limit.
//!
//! The counters are atomics: a file charges under its handle lock (so its
//! limit check and the charge are one step), while a dma-buf's release may
//! give a charge back at any time, even after the file closed.

use kernel::{
    prelude::*,
    sync::{
        atomic::{
            Atomic,
            Relaxed, //
        },
        Arc,
        UniqueArc, //
    }, //
};

/// The bytes charged to one open file, in all and per channel.
pub(crate) struct Account {
    bytes: Atomic<u64>,
    per_channel: KVec<Atomic<u64>>,
}

impl Account {
    /// An empty account for a device with `channels` channels.
    pub(crate) fn new(channels: u32) -> Result<Arc<Self>> {
        let mut per_channel = KVec::with_capacity(channels as usize, GFP_KERNEL_ACCOUNT)?;
        for _ in 0..channels {
            per_channel.push(Atomic::new(0), GFP_KERNEL_ACCOUNT)?;
        }
        Ok(Arc::new(
            Self {
                bytes: Atomic::new(0),
                per_channel,
            },
            GFP_KERNEL_ACCOUNT,
        )?)
    }

    /// Bytes charged in all.
    pub(crate) fn bytes(&self) -> u64 {
        self.bytes.load(Relaxed)
    }

    /// Bytes charged on each channel, in channel order.
    pub(crate) fn channel_bytes(&self) -> impl Iterator<Item = u64> + '_ {
        self.per_channel.iter().map(|c| c.load(Relaxed))
    }

    /// Charges `bytes` on `channel`.
    pub(crate) fn charge(&self, channel: u32, bytes: u64) {
        self.bytes.add(bytes, Relaxed);
        if let Some(c) = self.per_channel.get(channel as usize) {
            c.add(bytes, Relaxed);
        }
    }

    /// Gives back a charge of `bytes` on `channel` made earlier.
    pub(crate) fn uncharge(&self, channel: u32, bytes: u64) {
        // Every uncharge pairs with an earlier charge of the same amount:
        // the counters cannot go below zero.
        self.bytes.fetch_sub(bytes, Relaxed);
        if let Some(c) = self.per_channel.get(channel as usize) {
            c.fetch_sub(bytes, Relaxed);
        }
    }
}

/// The charge of one exported handle, shared by the handle and the
/// dma-bufs exported from it; given back when the last of them goes.
pub(crate) struct Charge {
    account: Arc<Account>,
    channel: u32,
    bytes: u64,
}

impl Charge {
    /// Takes over a charge of `bytes` on `channel` already made to
    /// `account`, in memory allocated beforehand: nothing can fail (and so
    /// give the charge back early) once it is taken over.
    pub(crate) fn adopt(
        slot: UniqueArc<core::mem::MaybeUninit<Self>>,
        account: Arc<Account>,
        channel: u32,
        bytes: u64,
    ) -> Arc<Self> {
        slot.write(Self {
            account,
            channel,
            bytes,
        })
        .into()
    }
}

impl Drop for Charge {
    fn drop(&mut self) {
        self.account.uncharge(self.channel, self.bytes);
    }
}
