// SPDX-License-Identifier: GPL-2.0

//! Per-open-file table of buffer handles, with lock-free lookups.
//!
//! A handle is `generation << SLOT_BITS | slot`. Freeing a slot bumps its
//! generation, so a stale handle (kept by a buggy or malicious caller after
//! FREE) never reaches the buffer that later reuses the slot. The original
//! driver reused handles LIFO with no generation, and accepted any process's
//! handle; here each open file has its own table, so a handle from another
//! file simply does not exist.
//!
//! Every ioctl that names a buffer looks its handle up, several times per
//! SUBMIT, so lookups take no lock. The slots are a two-level array that
//! only grows: a directory of fixed-size chunks of entry pointers. Chunks
//! and outgrown directories are kept until the table is dropped, so a
//! reader may follow any pointer it loaded. (This is an XArray reduced to
//! what handles need: a dense index from 0, read with three dependent
//! loads instead of a tree walk.)
//!
//! Each slot points to an [`Entry`] holding one handle's item and a
//! reference count, of which the slot owns one. A lookup takes a reference
//! only while the count is not zero (inc-not-zero) and keeps it in a
//! [`Ref`]. Removal (FREE, close) clears the slot first and then drops the
//! slot's reference. Whoever drops the last reference drops the item at
//! once, in its own process context (so FREE still releases the memory
//! before it returns when nobody else uses the buffer), and puts the entry
//! on the table's free list for a later insert. Entries are freed only
//! with the table, so the pointer a lookup loaded always points to an
//! entry and needs no RCU: the lookup checks, after taking its reference,
//! that the entry still serves its handle (the handle's generation makes
//! that unambiguous), and lets go otherwise. A lookup racing FREE thus
//! finds the entry released (count zero, ENOENT), recycled (another
//! handle, ENOENT), or still holding the item, which orders it before the
//! FREE. The item cannot simply be an `Arc` read under RCU: `Arc` frees
//! its memory as soon as the count reaches zero, not after a grace period;
//! and freeing entries after a grace period instead would cost every ALLOC
//! and FREE an allocation and an RCU callback.
//!
//! Memory: a table keeps as many entries (32 bytes each) and slots as the
//! file ever had live handles at once, until the file is closed.
//!
//! Writers (insert and remove) are serialised by the owner's lock: they
//! take the [`Slots`] (generations, free slots, count) that the owner keeps
//! under that lock, beside its accounting. That also serialises the
//! growth of the slot array and the taking of free entries.

use core::{
    cell::UnsafeCell,
    mem::MaybeUninit,
    ops::Deref,
    ptr::{
        null_mut,
        NonNull, //
    }, //
};
use kernel::{
    prelude::*,
    sync::{
        atomic::{
            Acquire,
            Atomic,
            Full,
            Relaxed,
            Release, //
        }, //
    }, //
};

/// Slots per chunk of the slot array (a page of pointers with 4 KiB pages).
const CHUNK_SLOTS: usize = 512;

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

/// The writers' half of a table: which slots are free and the generation
/// of each slot's current (or next) occupant. Not synchronised: the owner
/// keeps it under the lock that serialises the table's writers.
pub(crate) struct Slots {
    /// Generation of each slot's current or next occupant; never 0.
    generations: KVec<u32>,
    /// Free slot indices. LIFO reuse is fine because the generation changes.
    free: KVec<u32>,
    live: usize,
}

impl Slots {
    pub(crate) const fn new() -> Self {
        Self {
            generations: KVec::new(),
            free: KVec::new(),
            live: 0,
        }
    }

    /// Number of live handles.
    pub(crate) fn len(&self) -> usize {
        self.live
    }

    /// Number of slots ever used: every handle's slot is below it.
    pub(crate) fn slot_count(&self) -> usize {
        self.generations.len()
    }

    /// Takes a free slot (growing the table if there is none) and returns
    /// it with its generation.
    fn take(&mut self) -> Result<(u32, u32)> {
        if self.live >= MAX_HANDLES {
            return Err(ENOSPC);
        }
        let slot = match self.free.pop() {
            Some(slot) => slot,
            None => {
                // Reserve the free-list space now, so that `put` never has
                // to allocate: room for every slot, this one included.
                let want = (self.generations.len() + 1).saturating_sub(self.free.len());
                self.free.reserve(want, GFP_KERNEL)?;
                self.generations.push(1, GFP_KERNEL)?;
                (self.generations.len() - 1) as u32
            }
        };
        self.live += 1;
        Ok((slot, self.generations[slot as usize]))
    }

    /// Gives back a slot taken by [`Slots::take`]; `retire` bumps its
    /// generation (the handle was published and is now dead).
    fn put(&mut self, slot: u32, retire: bool) {
        if retire {
            let g = &mut self.generations[slot as usize];
            // Skip 0 on wrap: generation 0 marks no handle at all.
            *g = (*g % GEN_MASK) + 1;
        }
        self.live -= 1;
        // Cannot fail: `take` reserved one free-list entry per slot.
        let _ = self.free.push(slot, GFP_KERNEL);
    }
}

/// What a slot points to: one handle's item and its reference count.
/// Entries are recycled within their table and freed only when it is
/// dropped, so a pointer loaded from a slot always points to an `Entry`,
/// though perhaps to a later handle's.
///
/// # Invariants
///
/// - `refs` counts the [`Ref`]s to the entry plus one while the entry is in
///   a slot; `item` is initialised while `refs` is not zero.
/// - `handle` names the handle the entry serves or last served; it and
///   `item` change only while `refs` is zero and the entry is in no slot
///   and on no free list (taken by the table's one writer).
/// - While `refs` is zero the entry is being released or is on its table's
///   free list, linked by `next`; it is a `KBox` allocation owned by the
///   table.
struct Entry<T> {
    refs: Atomic<u32>,
    handle: Atomic<u64>,
    next: Atomic<*mut Entry<T>>,
    item: UnsafeCell<MaybeUninit<T>>,
}

/// A counted reference to an item of a [`SharedHandleTable`]: the item stays
/// alive while it exists, whether or not its handle has been removed.
pub(crate) struct Ref<'a, T> {
    /// Invariant: holds one of the entry's `refs`.
    entry: NonNull<Entry<T>>,
    table: &'a SharedHandleTable<T>,
}

// SAFETY: A `Ref` gives `&T` on any thread and may drop the `T` on any
// thread, as an `Arc<T>` does; the table is `Sync` for such `T`.
unsafe impl<T: Send + Sync> Send for Ref<'_, T> {}
// SAFETY: As above.
unsafe impl<T: Send + Sync> Sync for Ref<'_, T> {}

impl<T> Ref<'_, T> {
    fn entry(&self) -> &Entry<T> {
        // SAFETY: Entries live as long as their table, which `self`
        // borrows.
        unsafe { self.entry.as_ref() }
    }
}

impl<T> Deref for Ref<'_, T> {
    type Target = T;

    fn deref(&self) -> &T {
        // SAFETY: This `Ref` holds a reference, so `item` is initialised and
        // does not change (type invariants); nobody gets `&mut` to it
        // before the last reference is dropped.
        unsafe { (*self.entry().item.get()).assume_init_ref() }
    }
}

impl<T> Drop for Ref<'_, T> {
    fn drop(&mut self) {
        let entry = self.entry();
        // Full ordering: every holder's use of the item happens before the
        // last holder drops it.
        if entry.refs.fetch_sub(1, Full) != 1 {
            return;
        }
        // SAFETY: The count reached zero, so (type invariants) the entry is
        // in no slot and no `Ref` is left: nothing else reads or writes
        // `item` until the entry is reused, which needs it on the free list.
        unsafe { (*entry.item.get()).assume_init_drop() };
        self.table.push_free(self.entry);
    }
}

/// A slot: null, or an entry holding one of its `refs` for the table.
type SlotPtr<T> = Atomic<*mut Entry<T>>;

/// The chunk directory of an [`SharedHandleTable`].
///
/// # Invariants
///
/// Each of `chunks` is null or the buffer of a `KVec<SlotPtr<T>>` of
/// length and capacity `CHUNK_SLOTS`, owned by the table. `chunks` does not
/// change length after the directory is published. `prev` is null or the
/// directory this one replaced, whose non-null chunks this one also lists.
struct Dir<T> {
    chunks: KVec<Atomic<*mut SlotPtr<T>>>,
    prev: *mut Dir<T>,
}

/// Maps handles to items of type `T`. Lookups ([`SharedHandleTable::get`]) may
/// run concurrently with anything; writers pass the table's [`Slots`],
/// which the owner keeps under one lock.
///
/// # Invariants
///
/// `dir` is null or a `KBox<Dir<T>>` owned by the table; it and every
/// directory on its `prev` chain, and their chunks, live until the table
/// is dropped. Directories and chunks are published with release stores
/// after they are initialised. `free` heads a list (through `next`) of
/// entries whose count is zero, released and owned by the table. Every
/// entry of the table is in a slot, on `free`, or held by `Ref`s.
pub(crate) struct SharedHandleTable<T> {
    dir: Atomic<*mut Dir<T>>,
    free: Atomic<*mut Entry<T>>,
}

// SAFETY: The table may move to another thread with its items, and drops
// them there.
unsafe impl<T: Send + Sync> Send for SharedHandleTable<T> {}
// SAFETY: Shared access gives `&T` (through `Ref`s) on several threads and
// may drop items on any of them; slots are atomics, and writers are
// serialised by the owner.
unsafe impl<T: Send + Sync> Sync for SharedHandleTable<T> {}

impl<T> SharedHandleTable<T> {
    pub(crate) const fn new() -> Self {
        // INVARIANT: No directory and no entry yet.
        Self {
            dir: Atomic::new(null_mut()),
            free: Atomic::new(null_mut()),
        }
    }

    /// The slot of index `slot`, if its chunk exists.
    fn slot(&self, slot: usize) -> Option<&SlotPtr<T>> {
        let dir = self.dir.load(Acquire);
        if dir.is_null() {
            return None;
        }
        // SAFETY: Directories live as long as the table (type invariants),
        // which `self` borrows; the acquire load orders their contents.
        let dir = unsafe { &*dir };
        let chunk = dir.chunks.get(slot / CHUNK_SLOTS)?.load(Acquire);
        if chunk.is_null() {
            return None;
        }
        // SAFETY: A chunk has `CHUNK_SLOTS` slots and lives as long as the
        // table (type invariants of `Dir`).
        Some(unsafe { &*chunk.add(slot % CHUNK_SLOTS) })
    }

    /// The slot of index `slot`, growing the directory and adding its
    /// chunk as needed. Writers only.
    fn slot_or_grow(&self, slot: usize) -> Result<&SlotPtr<T>> {
        let index = slot / CHUNK_SLOTS;
        let mut dir = self.dir.load(Relaxed);
        let len = if dir.is_null() {
            0
        } else {
            // SAFETY: As in `slot`.
            unsafe { (*dir).chunks.len() }
        };
        if index >= len {
            let want = (index + 1).max(len * 2);
            let mut chunks = KVec::with_capacity(want, GFP_KERNEL)?;
            for i in 0..want {
                let chunk = if i < len {
                    // SAFETY: `i` is below the length of `dir`'s chunks.
                    unsafe { (&(*dir).chunks)[i].load(Relaxed) }
                } else {
                    null_mut()
                };
                chunks.push(Atomic::new(chunk), GFP_KERNEL)?;
            }
            let new = KBox::into_raw(KBox::new(Dir { chunks, prev: dir }, GFP_KERNEL)?);
            // INVARIANT: The new directory lists every chunk of the one it
            // replaces, which stays on its `prev` chain.
            self.dir.store(new, Release);
            dir = new;
        }
        // SAFETY: As in `slot`; `dir` is not null here.
        let entry = unsafe { &(&(*dir).chunks)[index] };
        let mut chunk = entry.load(Relaxed);
        if chunk.is_null() {
            let mut v = KVec::with_capacity(CHUNK_SLOTS, GFP_KERNEL)?;
            for _ in 0..CHUNK_SLOTS {
                v.push(Atomic::new(null_mut()), GFP_KERNEL)?;
            }
            chunk = v.into_raw_parts().0;
            // INVARIANT: A chunk of `CHUNK_SLOTS` slots, now the table's.
            entry.store(chunk, Release);
        }
        // SAFETY: As in `slot`.
        Ok(unsafe { &*chunk.add(slot % CHUNK_SLOTS) })
    }

    /// Returns the item behind `handle`, if the handle is current. Takes no
    /// lock.
    pub(crate) fn get(&self, handle: u64) -> Option<Ref<'_, T>> {
        let (slot, _) = decode(handle)?;
        let entry = NonNull::new(self.slot(slot)?.load(Acquire))?;
        // SAFETY: Entries live as long as the table (type invariants).
        let e = unsafe { entry.as_ref() };
        if e.handle.load(Relaxed) != handle {
            return None;
        }
        // Acquire: the entry's `item` and `handle` as its last insert wrote
        // them (the count's release sequence starts there).
        let mut cur = e.refs.load(Relaxed);
        loop {
            // Zero: the last reference is gone and the item with it.
            let next = cur.checked_add(1).filter(|_| cur != 0)?;
            match e.refs.cmpxchg(cur, next, Acquire) {
                Ok(_) => break,
                Err(seen) => cur = seen,
            }
        }
        // INVARIANT: The reference just taken.
        let r = Ref { entry, table: self };
        // The entry may have been recycled for another handle between the
        // check above and the increment: then it is not ours (and dropping
        // `r` may release that handle's item, if it was the last).
        if e.handle.load(Relaxed) != handle {
            return None;
        }
        Some(r)
    }

    /// Puts an entry whose count reached zero on the free list (any thread).
    fn push_free(&self, entry: NonNull<Entry<T>>) {
        // SAFETY: Entries live as long as the table.
        let e = unsafe { entry.as_ref() };
        let mut head = self.free.load(Relaxed);
        loop {
            e.next.store(head, Relaxed);
            match self.free.cmpxchg(head, entry.as_ptr(), Release) {
                Ok(_) => return,
                Err(seen) => head = seen,
            }
        }
    }

    /// Takes an entry off the free list. Writers only: with one taker, an
    /// entry on the list stays there (its `next` unchanged) until taken, so
    /// the compare-exchange cannot succeed on a stale `next` (no ABA).
    fn pop_free(&self) -> Option<NonNull<Entry<T>>> {
        let mut head = self.free.load(Acquire);
        loop {
            let entry = NonNull::new(head)?;
            // SAFETY: Entries live as long as the table.
            let next = unsafe { entry.as_ref() }.next.load(Relaxed);
            match self.free.cmpxchg(head, next, Acquire) {
                Ok(_) => return Some(entry),
                Err(seen) => head = seen,
            }
        }
    }

    /// Stores `item` and returns its new handle.
    pub(crate) fn insert(&self, slots: &mut Slots, item: T) -> Result<u64> {
        let (slot, generation) = slots.take()?;
        let place = match self.slot_or_grow(slot as usize) {
            Ok(place) => place,
            Err(e) => {
                slots.put(slot, false);
                return Err(e);
            }
        };
        let entry = match self.pop_free() {
            Some(entry) => entry,
            None => {
                let new = KBox::new(
                    Entry {
                        refs: Atomic::new(0),
                        handle: Atomic::new(0),
                        next: Atomic::new(null_mut()),
                        item: UnsafeCell::new(MaybeUninit::uninit()),
                    },
                    GFP_KERNEL,
                );
                match new {
                    // INVARIANT: A released entry, now the table's.
                    // SAFETY: `into_raw` returns a non-null pointer.
                    Ok(new) => unsafe { NonNull::new_unchecked(KBox::into_raw(new)) },
                    Err(e) => {
                        slots.put(slot, false);
                        return Err(e.into());
                    }
                }
            }
        };
        let handle = encode(slot, generation);
        // SAFETY: Entries live as long as the table.
        let e = unsafe { entry.as_ref() };
        // SAFETY: The entry's count is zero and it is in no slot and on no
        // list: only this writer touches `item` (lookups that still hold
        // the pointer read `item` only after a successful increment).
        unsafe { (*e.item.get()).write(item) };
        e.handle.store(handle, Relaxed);
        // INVARIANT: The slot's reference; the release store publishes
        // `item` and `handle` to whoever increments the count.
        e.refs.store(1, Release);
        let old = place.xchg(entry.as_ptr(), Release);
        if let Some(old) = NonNull::new(old) {
            // Only a `Slots` of another table gets here: the slot was taken
            // as free. The table's reference to the replaced entry is ours.
            drop(Ref {
                entry: old,
                table: self,
            });
        }
        Ok(handle)
    }

    /// Removes `handle` and returns the table's reference to its item; the
    /// handle (and every copy of it) is dead afterwards. The caller drops
    /// the reference where dropping the item is allowed.
    pub(crate) fn remove(&self, slots: &mut Slots, handle: u64) -> Option<Ref<'_, T>> {
        let (slot, generation) = decode(handle)?;
        if *slots.generations.get(slot)? != generation {
            return None;
        }
        let entry = NonNull::new(self.slot(slot)?.xchg(null_mut(), Relaxed))?;
        slots.put(slot as u32, true);
        // INVARIANT: The cleared slot's reference, now the caller's.
        Some(Ref { entry, table: self })
    }

    /// Removes the handle in slot `slot`, if any, and returns its
    /// reference (emptying the table slot by slot, below
    /// [`Slots::slot_count`]).
    pub(crate) fn remove_slot(&self, slots: &mut Slots, slot: usize) -> Option<Ref<'_, T>> {
        let generation = *slots.generations.get(slot)?;
        self.remove(slots, encode(slot as u32, generation))
    }
}

impl<T> Drop for SharedHandleTable<T> {
    fn drop(&mut self) {
        // No `Ref` is left (they borrow the table): every entry is in a slot
        // with only the table's reference, or on the free list.
        let dir = self.dir.load(Relaxed);
        if !dir.is_null() {
            // SAFETY: The table owns its directories (type invariants) and
            // nobody else uses them any more.
            let dir = unsafe { KBox::from_raw(dir) };
            for chunk in dir.chunks.iter() {
                let chunk = chunk.load(Relaxed);
                if chunk.is_null() {
                    continue;
                }
                // SAFETY: A chunk is a `KVec` buffer of `CHUNK_SLOTS` slots
                // owned by the table (type invariants of `Dir`), listed once
                // in the newest directory.
                let chunk = unsafe { KVec::from_raw_parts(chunk, CHUNK_SLOTS, CHUNK_SLOTS) };
                for slot in chunk.iter() {
                    if let Some(entry) = NonNull::new(slot.load(Relaxed)) {
                        // INVARIANT: The slot's reference, the entry's last:
                        // dropping it puts the entry on the free list.
                        drop(Ref {
                            entry,
                            table: &*self,
                        });
                    }
                }
            }
            // Older directories list a subset of the chunks freed above.
            let mut prev = dir.prev;
            drop(dir);
            while !prev.is_null() {
                // SAFETY: As above.
                let dir = unsafe { KBox::from_raw(prev) };
                prev = dir.prev;
            }
        }
        while let Some(entry) = self.pop_free() {
            // SAFETY: A released entry is a `KBox` owned by the table (type
            // invariants); its `item` was dropped and `MaybeUninit` does not
            // drop it again.
            drop(unsafe { KBox::from_raw(entry.as_ptr()) });
        }
    }
}

#[kunit_tests(tdrv_handle)]
mod tests {
    use super::*;

    fn table<T>() -> Result<KBox<SharedHandleTable<T>>> {
        Ok(KBox::new(SharedHandleTable::new(), GFP_KERNEL)?)
    }

    /// Counts drops of its items.
    struct Tracked<'a>(&'a Atomic<u32>);

    impl Drop for Tracked<'_> {
        fn drop(&mut self) {
            self.0.add(1, Relaxed);
        }
    }

    #[test]
    fn insert_get_remove() -> Result {
        let t = table()?;
        let mut s = Slots::new();
        let a = t.insert(&mut s, 10u32)?;
        let b = t.insert(&mut s, 20u32)?;
        assert_ne!(a, b);
        assert_eq!(t.get(a).map(|r| *r), Some(10));
        assert_eq!(t.get(b).map(|r| *r), Some(20));
        assert_eq!(s.len(), 2);
        assert_eq!(t.remove(&mut s, a).map(|r| *r), Some(10));
        assert!(t.get(a).is_none());
        assert!(t.remove(&mut s, a).is_none());
        assert_eq!(s.len(), 1);
        Ok(())
    }

    #[test]
    fn stale_handle_misses_reused_slot() -> Result {
        let t = table()?;
        let mut s = Slots::new();
        let old = t.insert(&mut s, 1u32)?;
        drop(t.remove(&mut s, old));
        let new = t.insert(&mut s, 2u32)?;
        // Same slot, new generation.
        assert_eq!(old & SLOT_MASK, new & SLOT_MASK);
        assert_ne!(old, new);
        assert!(t.get(old).is_none());
        assert!(t.remove(&mut s, old).is_none());
        assert_eq!(t.get(new).map(|r| *r), Some(2));
        Ok(())
    }

    #[test]
    fn malformed_handles() -> Result {
        let t = table()?;
        let mut s = Slots::new();
        let h = t.insert(&mut s, 1u32)?;
        assert!(t.get(0).is_none());
        assert!(t.get(h & SLOT_MASK).is_none());
        assert!(t.get(h + 1).is_none());
        assert!(t.get(u64::MAX).is_none());
        assert!(t.get(h | (1 << 60)).is_none());
        // A free slot's next generation names no handle yet.
        assert!(t.get(h + (1 << SLOT_BITS)).is_none());
        assert!(t.remove(&mut s, h + (1 << SLOT_BITS)).is_none());
        // The mmap offset of any handle is a valid positive off_t.
        let largest = (u64::from(GEN_MASK) << SLOT_BITS) | SLOT_MASK;
        assert!((largest << kernel::page::PAGE_SHIFT) < (1 << 63));
        assert!(h <= largest);
        Ok(())
    }

    #[test]
    fn remove_never_needs_to_allocate() -> Result {
        let t = table()?;
        let mut s = Slots::new();
        let mut hs = KVec::new();
        for i in 0..100u32 {
            hs.push(t.insert(&mut s, i)?, GFP_KERNEL)?;
            assert!(s.free.capacity() >= s.generations.len());
        }
        for h in hs.iter() {
            assert!(t.remove(&mut s, *h).is_some());
        }
        assert_eq!(s.free.len(), 100);
        assert_eq!(s.len(), 0);
        Ok(())
    }

    #[test]
    fn generation_wraps_without_zero() -> Result {
        let t = table()?;
        let mut s = Slots::new();
        let h = t.insert(&mut s, 1u32)?;
        drop(t.remove(&mut s, h));
        s.generations[0] = GEN_MASK;
        let h = t.insert(&mut s, 2u32)?;
        assert_eq!(h >> SLOT_BITS, u64::from(GEN_MASK));
        assert_eq!(t.remove(&mut s, h).map(|r| *r), Some(2));
        assert_eq!(s.generations[0], 1);
        Ok(())
    }

    /// A lookup's reference keeps the item alive past its removal, and the
    /// last reference drops it exactly once.
    #[test]
    fn reference_outlives_removal() -> Result {
        let drops = Atomic::new(0u32);
        let t = table()?;
        let mut s = Slots::new();
        let h = t.insert(&mut s, Tracked(&drops))?;
        let looked_up = t.get(h).ok_or(ENOENT)?;
        let table_ref = t.remove(&mut s, h).ok_or(ENOENT)?;
        assert!(t.get(h).is_none());
        drop(table_ref);
        assert_eq!(drops.load(Relaxed), 0);
        assert!(core::ptr::eq(looked_up.0, &drops));
        drop(looked_up);
        assert_eq!(drops.load(Relaxed), 1);
        Ok(())
    }

    /// Removing without a lookup drops the item before `remove`'s
    /// reference is gone: FREE releases memory synchronously.
    #[test]
    fn last_reference_drops_item_at_once() -> Result {
        let drops = Atomic::new(0u32);
        let t = table()?;
        let mut s = Slots::new();
        let h = t.insert(&mut s, Tracked(&drops))?;
        drop(t.get(h));
        assert_eq!(drops.load(Relaxed), 0);
        drop(t.remove(&mut s, h));
        assert_eq!(drops.load(Relaxed), 1);
        Ok(())
    }

    /// `remove_slot` empties the table, and dropping the table drops what
    /// is left.
    #[test]
    fn remove_slot_and_drop_release_everything() -> Result {
        let drops = Atomic::new(0u32);
        {
            let t = table()?;
            let mut s = Slots::new();
            for _ in 0..5 {
                t.insert(&mut s, Tracked(&drops))?;
            }
            drop(t.remove_slot(&mut s, 0));
            drop(t.remove_slot(&mut s, 3));
            drop(t.remove_slot(&mut s, 3));
            drop(t.remove_slot(&mut s, 99));
            assert_eq!(drops.load(Relaxed), 2);
            assert_eq!(s.len(), 3);
        }
        assert_eq!(drops.load(Relaxed), 5);
        let t = table()?;
        let mut s = Slots::new();
        t.insert(&mut s, Tracked(&drops))?;
        for slot in 0..s.slot_count() {
            drop(t.remove_slot(&mut s, slot));
        }
        assert_eq!(drops.load(Relaxed), 6);
        assert_eq!(s.len(), 0);
        Ok(())
    }

    /// A released entry is reused by the next insert, and the old handle
    /// does not reach it; items are dropped once, when the last reference
    /// goes, also when the table drops its free entries.
    #[test]
    fn entries_are_recycled() -> Result {
        let drops = Atomic::new(0u32);
        let t = table()?;
        let mut s = Slots::new();
        let old = t.insert(&mut s, Tracked(&drops))?;
        let first = t.slot(0).ok_or(ENOENT)?.load(Relaxed);
        drop(t.remove(&mut s, old));
        assert_eq!(drops.load(Relaxed), 1);
        let new = t.insert(&mut s, Tracked(&drops))?;
        assert!(core::ptr::eq(t.slot(0).ok_or(ENOENT)?.load(Relaxed), first));
        assert!(t.get(old).is_none());
        let r = t.get(new).ok_or(ENOENT)?;
        assert!(core::ptr::eq(r.0, &drops));
        drop(t.remove(&mut s, new));
        assert_eq!(drops.load(Relaxed), 1);
        drop(r);
        assert_eq!(drops.load(Relaxed), 2);
        Ok(())
    }

    /// The slot array grows over several chunks and directories without
    /// losing a handle.
    #[test]
    fn growth_keeps_every_handle() -> Result {
        let t = table()?;
        let mut s = Slots::new();
        let mut hs = KVec::new();
        let n = 5 * CHUNK_SLOTS as u32 + 7;
        for i in 0..n {
            hs.push(t.insert(&mut s, i)?, GFP_KERNEL)?;
        }
        for (i, h) in hs.iter().enumerate() {
            assert_eq!(t.get(*h).map(|r| *r), Some(i as u32));
        }
        assert!(t.get(encode(n, 1)).is_none());
        assert!(t.get(encode(MAX_HANDLES as u32 - 1, 1)).is_none());
        Ok(())
    }
}
