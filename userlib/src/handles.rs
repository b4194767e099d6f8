//! A table of live handles for a C ABI: opaque tokens that stand for
//! objects, checked on every use, never dereferenced.
//!
//! A C caller can pass any pointer: one it was given and has freed
//! already, one of another library, garbage. A table that maps tokens to
//! objects answers "is this a live handle?" without touching the memory the
//! pointer names, so a stale or foreign pointer is an error rather than a
//! read of freed memory. Tokens are never reused (a 64-bit counter), so a
//! stale token cannot name a newer object either. On 64-bit targets they
//! are addresses in the kernel half of the address space, which no user
//! pointer can equal.
//!
//! `libnrt.so.1` keeps its `nrt_tensor_t *` and `nrt_tensor_set_t *`
//! handles here. A lookup is a read lock and a hash probe; `make bench`
//! (host figure "registry") shows the cost.
//!
//! ```
//! use tdrv::handles::HandleTable;
//!
//! let table = HandleTable::new();
//! let h = table.insert(String::from("tensor"))?;
//! assert_eq!(table.get(h, |s| s.len()), Some(6));
//! assert_eq!(table.remove(h).as_deref(), Some("tensor"));
//! assert_eq!(table.get(h, |s| s.len()), None); // stale: refused
//! assert_eq!(table.remove(h), None); // double free: refused
//! assert_eq!(table.get(0x1234_5678, |s| s.len()), None); // foreign
//! # Ok::<(), tdrv::Error>(())
//! ```

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{RwLock, RwLockReadGuard, RwLockWriteGuard};

use crate::error::{Error, Result};

/// Tokens are `BASE + id * 16`: 16-byte steps (so they look aligned to C
/// code that checks), in the kernel half on 64-bit targets.
#[cfg(target_pointer_width = "64")]
const BASE: usize = 0xffff_a000_0000_0000;
#[cfg(not(target_pointer_width = "64"))]
const BASE: usize = 0;

/// See the module documentation.
#[derive(Debug)]
pub struct HandleTable<T> {
    next: AtomicU64,
    map: RwLock<HashMap<usize, T>>,
}

impl<T> Default for HandleTable<T> {
    fn default() -> Self {
        Self::new()
    }
}

/// The table locked for changes: several entries can be updated at once.
pub struct HandlesMut<'a, T> {
    table: &'a HandleTable<T>,
    map: RwLockWriteGuard<'a, HashMap<usize, T>>,
}

impl<T> HandleTable<T> {
    /// An empty table.
    pub fn new() -> Self {
        HandleTable {
            next: AtomicU64::new(1),
            map: RwLock::new(HashMap::new()),
        }
    }

    fn read(&self) -> RwLockReadGuard<'_, HashMap<usize, T>> {
        // No code panics while holding the lock; a poisoned map is whole.
        self.map.read().unwrap_or_else(|e| e.into_inner())
    }

    /// Locks the table for changes.
    pub fn lock(&self) -> HandlesMut<'_, T> {
        HandlesMut {
            table: self,
            map: self.map.write().unwrap_or_else(|e| e.into_inner()),
        }
    }

    /// Adds `value` under a fresh token. Fails with
    /// [`Error::OutOfMemory`] when the table cannot grow, or
    /// [`Error::InvalidArgument`] when the tokens ran out.
    pub fn insert(&self, value: T) -> Result<usize> {
        self.lock().insert(value)
    }

    /// Runs `f` on the object of `token`, under the read lock; `None` when
    /// `token` is not a live handle.
    pub fn get<R>(&self, token: usize, f: impl FnOnce(&T) -> R) -> Option<R> {
        self.read().get(&token).map(f)
    }

    /// The first `Some` that `f` returns for a live object (in no
    /// particular order), under the read lock.
    pub fn find_map<R>(&self, f: impl FnMut(&T) -> Option<R>) -> Option<R> {
        self.read().values().find_map(f)
    }

    /// Takes the object of `token` out; `None` when it is not live.
    pub fn remove(&self, token: usize) -> Option<T> {
        self.lock().remove(token)
    }

    /// Number of live handles.
    pub fn len(&self) -> usize {
        self.read().len()
    }

    /// Whether no handle is live.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl<T> HandlesMut<'_, T> {
    /// See [`HandleTable::insert`].
    pub fn insert(&mut self, value: T) -> Result<usize> {
        let id = self.table.next.fetch_add(1, Ordering::Relaxed);
        let token = usize::try_from(id)
            .ok()
            .and_then(|id| id.checked_mul(16))
            .filter(|&off| off <= usize::MAX - BASE)
            .map(|off| BASE + off)
            .ok_or_else(|| Error::invalid("handle tokens exhausted"))?;
        self.map
            .try_reserve(1)
            .map_err(|_| Error::OutOfMemory(std::mem::size_of::<(usize, T)>()))?;
        self.map.insert(token, value);
        Ok(token)
    }

    /// The object of `token`.
    pub fn get(&self, token: usize) -> Option<&T> {
        self.map.get(&token)
    }

    /// The object of `token`, for changing it.
    pub fn get_mut(&mut self, token: usize) -> Option<&mut T> {
        self.map.get_mut(&token)
    }

    /// Takes the object of `token` out.
    pub fn remove(&mut self, token: usize) -> Option<T> {
        self.map.remove(&token)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_never_reused_and_never_user_addresses() {
        let t = HandleTable::new();
        let a = t.insert(1).unwrap();
        assert_eq!(t.remove(a), Some(1));
        let b = t.insert(2).unwrap();
        assert_ne!(a, b);
        assert_eq!(t.get(a, |v| *v), None);
        assert_eq!(a % 16, 0);
        #[cfg(target_pointer_width = "64")]
        assert!(a >= 0xffff_8000_0000_0000);
        let local = 5u8;
        assert_eq!(t.get(&raw const local as usize, |v| *v), None);
    }

    #[test]
    fn concurrent_lookups_and_removals() {
        let t = std::sync::Arc::new(HandleTable::new());
        let hs: Vec<usize> = (0..64).map(|i| t.insert(i).unwrap()).collect();
        let workers: Vec<_> = (0..4)
            .map(|w| {
                let (t, hs) = (t.clone(), hs.clone());
                std::thread::spawn(move || {
                    let mut removed = 0;
                    for (i, &h) in hs.iter().enumerate() {
                        if i % 4 == w {
                            removed += usize::from(t.remove(h).is_some());
                        } else {
                            let _ = t.get(h, |v| *v);
                        }
                    }
                    removed
                })
            })
            .collect();
        let removed: usize = workers.into_iter().map(|w| w.join().unwrap()).sum();
        assert_eq!(removed, 64);
        assert!(t.is_empty());
    }
}
