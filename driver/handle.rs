// SPDX-License-Identifier: GPL-2.0

//! Per-open-file table of buffer handles.
//!
//! A handle is `generation << SLOT_BITS | slot`. Freeing a slot bumps its
//! generation, so a stale handle (kept by a buggy or malicious caller after
//! FREE) never reaches the buffer that later reuses the slot. The original
//! driver reused handles LIFO with no generation, and accepted any process's
//! handle; here each open file has its own table, so a handle from another
//! file simply does not exist.

use kernel::prelude::*;

/// Bits of the slot index in a handle.
const SLOT_BITS: u32 = 24;
/// Bits of the generation: as many as keep `handle << PAGE_SHIFT` (the
/// mmap offset) a positive 64-bit `off_t` for this kernel's page size (27
/// with 4 KiB pages, 23 with 64 KiB pages).
const GEN_BITS: u32 = 63 - kernel::page::PAGE_SHIFT as u32 - SLOT_BITS;
const _: () = assert!(GEN_BITS >= 16);
/// Most live handles one file may hold.
pub(crate) const MAX_HANDLES: usize = 1 << SLOT_BITS;

const SLOT_MASK: u64 = (1 << SLOT_BITS) - 1;
const GEN_MASK: u32 = (1 << GEN_BITS) - 1;

struct Slot<T> {
    /// Generation of the current (or next) occupant; never 0.
    generation: u32,
    item: Option<T>,
}

/// Maps handles to items of type `T`. Not synchronised: the owner wraps it
/// in a lock.
pub(crate) struct HandleTable<T> {
    slots: KVec<Slot<T>>,
    /// Free slot indices. LIFO reuse is fine because the generation changes.
    free: KVec<u32>,
    live: usize,
}

impl<T> HandleTable<T> {
    pub(crate) const fn new() -> Self {
        Self {
            slots: KVec::new(),
            free: KVec::new(),
            live: 0,
        }
    }

    /// Number of live handles.
    pub(crate) fn len(&self) -> usize {
        self.live
    }

    fn encode(slot: u32, generation: u32) -> u64 {
        (u64::from(generation) << SLOT_BITS) | u64::from(slot)
    }

    fn decode(handle: u64) -> Option<(usize, u32)> {
        let generation = handle >> SLOT_BITS;
        if generation == 0 || generation > u64::from(GEN_MASK) {
            return None;
        }
        Some(((handle & SLOT_MASK) as usize, generation as u32))
    }

    /// Stores `item` and returns its new handle.
    pub(crate) fn insert(&mut self, item: T) -> Result<u64> {
        if self.live >= MAX_HANDLES {
            return Err(ENOSPC);
        }
        let slot = match self.free.pop() {
            Some(slot) => slot,
            None => {
                // Reserve the free-list space now, so that `remove` never
                // has to allocate: room for every slot, this one included.
                let want = (self.slots.len() + 1).saturating_sub(self.free.len());
                self.free.reserve(want, GFP_KERNEL)?;
                self.slots.push(
                    Slot {
                        generation: 1,
                        item: None,
                    },
                    GFP_KERNEL,
                )?;
                (self.slots.len() - 1) as u32
            }
        };
        let entry = &mut self.slots[slot as usize];
        entry.item = Some(item);
        self.live += 1;
        Ok(Self::encode(slot, entry.generation))
    }

    /// Returns the item behind `handle`, if the handle is current.
    pub(crate) fn get(&self, handle: u64) -> Option<&T> {
        let (slot, generation) = Self::decode(handle)?;
        let entry = self.slots.get(slot)?;
        if entry.generation != generation {
            return None;
        }
        entry.item.as_ref()
    }

    /// Returns the item behind `handle` for update, if the handle is current.
    pub(crate) fn get_mut(&mut self, handle: u64) -> Option<&mut T> {
        let (slot, generation) = Self::decode(handle)?;
        let entry = self.slots.get_mut(slot)?;
        if entry.generation != generation {
            return None;
        }
        entry.item.as_mut()
    }

    /// Removes and returns the item behind `handle`; the handle (and every
    /// copy of it) is dead afterwards.
    pub(crate) fn remove(&mut self, handle: u64) -> Option<T> {
        let (slot, generation) = Self::decode(handle)?;
        let entry = self.slots.get_mut(slot)?;
        if entry.generation != generation {
            return None;
        }
        let item = entry.item.take()?;
        // Skip 0 on wrap: generation 0 marks no handle at all.
        entry.generation = (entry.generation % GEN_MASK) + 1;
        self.live -= 1;
        // Cannot fail: `insert` reserved one free-list entry per slot.
        let _ = self.free.push(slot as u32, GFP_KERNEL);
        Some(item)
    }

    /// Calls `f` on every live item.
    pub(crate) fn for_each(&self, mut f: impl FnMut(&T)) {
        self.slots
            .iter()
            .filter_map(|s| s.item.as_ref())
            .for_each(&mut f);
    }
}

#[kunit_tests(tdrv_handle)]
mod tests {
    use super::*;

    #[test]
    fn insert_get_remove() -> Result {
        let mut t = HandleTable::new();
        let a = t.insert(10u32)?;
        let b = t.insert(20u32)?;
        assert_ne!(a, b);
        assert_eq!(t.get(a), Some(&10));
        assert_eq!(t.get(b), Some(&20));
        assert_eq!(t.len(), 2);
        assert_eq!(t.remove(a), Some(10));
        assert_eq!(t.get(a), None);
        assert_eq!(t.remove(a), None);
        assert_eq!(t.len(), 1);
        Ok(())
    }

    #[test]
    fn stale_handle_misses_reused_slot() -> Result {
        let mut t = HandleTable::new();
        let old = t.insert(1u32)?;
        t.remove(old);
        let new = t.insert(2u32)?;
        // Same slot, new generation.
        assert_eq!(old & SLOT_MASK, new & SLOT_MASK);
        assert_ne!(old, new);
        assert_eq!(t.get(old), None);
        assert_eq!(t.remove(old), None);
        assert_eq!(t.get(new), Some(&2));
        Ok(())
    }

    #[test]
    fn malformed_handles() -> Result {
        let mut t = HandleTable::new();
        let h = t.insert(1u32)?;
        assert_eq!(t.get(0), None);
        assert_eq!(t.get(h & SLOT_MASK), None);
        assert_eq!(t.get(h + 1), None);
        assert_eq!(t.get(u64::MAX), None);
        assert_eq!(t.get(h | (1 << 60)), None);
        // The mmap offset of any handle is a valid positive off_t.
        let largest = (u64::from(GEN_MASK) << SLOT_BITS) | SLOT_MASK;
        assert!((largest << kernel::page::PAGE_SHIFT) < (1 << 63));
        assert!(h <= largest);
        Ok(())
    }

    #[test]
    fn remove_never_needs_to_allocate() -> Result {
        let mut t = HandleTable::new();
        let mut hs = KVec::new();
        for i in 0..100u32 {
            hs.push(t.insert(i)?, GFP_KERNEL)?;
            assert!(t.free.capacity() >= t.slots.len());
        }
        for h in hs.iter() {
            assert!(t.remove(*h).is_some());
        }
        assert_eq!(t.free.len(), 100);
        Ok(())
    }

    #[test]
    fn generation_wraps_without_zero() -> Result {
        let mut t = HandleTable::new();
        let h = t.insert(1u32)?;
        t.remove(h);
        t.slots[0].generation = GEN_MASK;
        let h = t.insert(2u32)?;
        assert_eq!(h >> SLOT_BITS, u64::from(GEN_MASK));
        assert_eq!(t.remove(h), Some(2));
        assert_eq!(t.slots[0].generation, 1);
        Ok(())
    }
}
