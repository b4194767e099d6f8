//! The accessor coherency enforcer (seed 003): per-tensor bookkeeping of the
//! accessors open on a tensor's memory, and the policy deciding what happens
//! when a new accessor would be incoherent with those already open.
//!
//! Three kinds of accessor touch a tensor's memory:
//! - a *buffered reader* ([`TensorReadStreamAccessor`]) caches data in a
//!   local staging buffer, refilled at times the user does not see;
//! - a *buffered writer* ([`TensorWriteStreamAccessor`]) caches writes and
//!   flushes them at times the user does not see;
//! - an *unbuffered accessor* ([`TensorAccessor`], [`TensorTcmAccessor`])
//!   reads and writes the memory directly when called.
//!
//! The compatibility matrix (rows already open, columns requested):
//!
//! | open \ new   | reader | writer | unbuffered |
//! |--------------|--------|--------|------------|
//! | reader       |   ok   |   no   |     no     |
//! | writer       |   no   |   no   |     no     |
//! | unbuffered   |   no   |   no   |     ok     |
//!
//! Readers coexist, unbuffered accessors coexist, a writer excludes
//! everything (other writers included), and buffered and unbuffered never
//! mix. On an incompatible acquire, [`Policy::Coherent`] fails it with
//! [`CoherenceError::Incoherent`], [`Policy::IncoherentVerbose`] logs a
//! warning and allows it, and [`Policy::IncoherentQuiet`] allows it silently.
//!
//! Unlike the original, which is single-threaded advisory bookkeeping with
//! plain `int`s, this one stays exact when accessors open and close on many
//! threads at once: see [`CoherencyEnforcer`] for how.
//!
//! [`TensorAccessor`]: crate::accessor::TensorAccessor
//! [`TensorTcmAccessor`]: crate::accessor::TensorTcmAccessor
//! [`TensorReadStreamAccessor`]: crate::accessor::TensorReadStreamAccessor
//! [`TensorWriteStreamAccessor`]: crate::accessor::TensorWriteStreamAccessor

use std::fmt;
use std::mem::{align_of, offset_of, size_of};
use std::sync::atomic::{AtomicI32, AtomicU32, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError, RwLock};

/// What the enforcer does when an acquire would be incoherent with the
/// accessors already open. The values are the seed's `at::Policy` enum.
#[repr(u32)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Policy {
    /// Fail the acquire: the accessor constructor returns an error.
    #[default]
    Coherent = 0,
    /// Log the open counts and a warning, then allow the acquire.
    IncoherentVerbose = 1,
    /// Allow the acquire silently (pure bookkeeping).
    IncoherentQuiet = 2,
}

impl Policy {
    /// The seed's enumerator names, for C-style callers.
    pub const COHERENT: Policy = Policy::Coherent;
    /// The seed's `INCOHERENT_VERBOSE`.
    pub const INCOHERENT_VERBOSE: Policy = Policy::IncoherentVerbose;
    /// The seed's `INCOHERENT_QUIET`.
    pub const INCOHERENT_QUIET: Policy = Policy::IncoherentQuiet;

    /// All policies, in value order.
    pub const ALL: [Policy; 3] = [
        Policy::Coherent,
        Policy::IncoherentVerbose,
        Policy::IncoherentQuiet,
    ];

    /// Decodes a raw `policy_` value; unknown values give `None`.
    pub const fn from_raw(raw: u32) -> Option<Policy> {
        match raw {
            0 => Some(Policy::Coherent),
            1 => Some(Policy::IncoherentVerbose),
            2 => Some(Policy::IncoherentQuiet),
            _ => None,
        }
    }
}

/// The three kinds of tracked accessor, one counter each.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum AccessorKind {
    /// A buffered (streaming) reader.
    BufferedReader,
    /// A buffered (streaming) writer.
    BufferedWriter,
    /// A direct accessor: the indexer and the TCM stager.
    Unbuffered,
}

impl AccessorKind {
    /// All kinds, in field order.
    pub const ALL: [AccessorKind; 3] = [
        AccessorKind::BufferedReader,
        AccessorKind::BufferedWriter,
        AccessorKind::Unbuffered,
    ];

    /// Whether an accessor of kind `self` may open next to one of `open`
    /// under the coherent rules (the seed's matrix, which is symmetric).
    pub const fn compatible_with(self, open: AccessorKind) -> bool {
        matches!(
            (self, open),
            (AccessorKind::BufferedReader, AccessorKind::BufferedReader)
                | (AccessorKind::Unbuffered, AccessorKind::Unbuffered)
        )
    }
}

impl fmt::Display for AccessorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            AccessorKind::BufferedReader => "buffered reader",
            AccessorKind::BufferedWriter => "buffered writer",
            AccessorKind::Unbuffered => "unbuffered accessor",
        })
    }
}

/// A snapshot of the open-accessor counts.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct OpenCounts {
    /// Open buffered readers.
    pub buffered_readers: i32,
    /// Open buffered writers.
    pub buffered_writers: i32,
    /// Open unbuffered accessors.
    pub unbuffered_accessors: i32,
}

impl OpenCounts {
    /// The count of one kind.
    pub const fn get(&self, kind: AccessorKind) -> i32 {
        match kind {
            AccessorKind::BufferedReader => self.buffered_readers,
            AccessorKind::BufferedWriter => self.buffered_writers,
            AccessorKind::Unbuffered => self.unbuffered_accessors,
        }
    }

    /// Whether opening `kind` now would break the compatibility matrix:
    /// the seed's three acquire predicates.
    pub const fn conflicts_with(&self, kind: AccessorKind) -> bool {
        match kind {
            AccessorKind::BufferedReader => {
                self.buffered_writers != 0 || self.unbuffered_accessors != 0
            }
            AccessorKind::BufferedWriter => {
                self.buffered_readers != 0
                    || self.buffered_writers != 0
                    || self.unbuffered_accessors != 0
            }
            AccessorKind::Unbuffered => self.buffered_readers != 0 || self.buffered_writers != 0,
        }
    }
}

impl fmt::Display for OpenCounts {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} buffered reader(s), {} buffered writer(s), {} unbuffered accessor(s)",
            self.buffered_readers, self.buffered_writers, self.unbuffered_accessors
        )
    }
}

/// Why an acquire or a release was refused. The counters are unchanged.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CoherenceError {
    /// The acquire is incompatible with what is open, under [`Policy::Coherent`].
    #[error(
        "incoherent access refused: cannot open a {requested} while {open} are open \
         (policy COHERENT; set INCOHERENT_VERBOSE or INCOHERENT_QUIET to allow it)"
    )]
    Incoherent {
        /// The kind asked for.
        requested: AccessorKind,
        /// What was open.
        open: OpenCounts,
    },
    /// A release with no accessor of that kind open: the count stays at 0.
    #[error("unbalanced release: no {0} is open")]
    Underflow(AccessorKind),
    /// The count of that kind is already `i32::MAX`.
    #[error("too many open {0}s")]
    Overflow(AccessorKind),
}

/// How an acquire that succeeded relates to what was already open.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Admission {
    /// Compatible with every accessor open at the time.
    Coherent,
    /// Incompatible, allowed by an `INCOHERENT_*` policy.
    Incoherent,
}

/// The enforcer embedded in every tensor: exactly the seed's 16-byte
/// `at::CoherencyEnforcer`, `buffered_readers` at +0, `buffered_writers`
/// at +4, `unbuffered_accessors` at +8 (all `i32`) and `policy` (`u32`) at
/// +12, with no vtable and 4-byte alignment, so it can sit at offset 4 of a
/// 32-bit `TensorBase` ([`TensorBase32`]).
///
/// Every method takes `&self`: like the seed's `mutable` member, counting
/// open accessors and changing the policy are not part of the tensor's
/// value, so they work through a shared tensor.
///
/// # Concurrency
///
/// The fields are 4-byte atomics (same size and alignment as the seed's
/// `int`s), so reads never race. An acquire must test all three counters
/// and bump one *as one step*: done as separate atomic operations, two
/// threads can each see the other's counter still at zero and both open
/// (say, a reader and a writer). A single compare-exchange over the packed
/// counters would need a 12- or 16-byte atomic with 8- or 16-byte
/// alignment, which the seed's layout (the enforcer at offset 4 of a 20-byte
/// struct) rules out, and claim-then-validate schemes make two racing,
/// individually valid acquires both fail. So each acquire runs under one of
/// a fixed set of process-wide locks picked by the enforcer's address: at
/// most one acquire per enforcer is deciding at a time, which makes acquires
/// linearisable without adding a byte. Releases only lower a counter, which
/// can never make a concurrent decision wrong, so they are a lock-free
/// compare-exchange loop that refuses to go below zero.
#[repr(C)]
#[derive(Debug)]
pub struct CoherencyEnforcer {
    buffered_readers: AtomicI32,
    buffered_writers: AtomicI32,
    unbuffered_accessors: AtomicI32,
    policy: AtomicU32,
}

/// The plain-data image of a [`CoherencyEnforcer`], with the same layout:
/// what a foreign (C) tensor holds, and what [`CoherencyEnforcer::snapshot`]
/// returns.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct RawCoherencyEnforcer {
    /// Open buffered readers.
    pub buffered_readers: i32,
    /// Open buffered writers.
    pub buffered_writers: i32,
    /// Open unbuffered accessors.
    pub unbuffered_accessors: i32,
    /// The raw policy value.
    pub policy: u32,
}

/// The seed's 32-bit `at::TensorBase`: a 4-byte implementation handle at +0
/// and the enforcer at +4, 20 bytes. A shipped op compiled against that ABI
/// finds the enforcer at `tensor + 4`; getting this wrong would make its
/// accessors count into the wrong 16 bytes of someone else's tensor.
#[repr(C)]
#[derive(Debug, Default)]
pub struct TensorBase32 {
    /// The seed's `impl_` (a 32-bit `TensorImpl*`): opaque here.
    pub impl_handle: u32,
    /// The seed's `mutable CoherencyEnforcer coherency_enforcer_`.
    pub coherency_enforcer: CoherencyEnforcer,
}

// The ABI, checked by the compiler on every target: the enforcer's layout is
// the same on 32- and 64-bit hosts (all 4-byte fields).
const _: () = {
    assert!(size_of::<CoherencyEnforcer>() == 16);
    assert!(align_of::<CoherencyEnforcer>() == 4);
    assert!(offset_of!(CoherencyEnforcer, buffered_readers) == 0);
    assert!(offset_of!(CoherencyEnforcer, buffered_writers) == 4);
    assert!(offset_of!(CoherencyEnforcer, unbuffered_accessors) == 8);
    assert!(offset_of!(CoherencyEnforcer, policy) == 12);
    assert!(size_of::<RawCoherencyEnforcer>() == 16);
    assert!(align_of::<RawCoherencyEnforcer>() == 4);
    assert!(offset_of!(RawCoherencyEnforcer, buffered_readers) == 0);
    assert!(offset_of!(RawCoherencyEnforcer, buffered_writers) == 4);
    assert!(offset_of!(RawCoherencyEnforcer, unbuffered_accessors) == 8);
    assert!(offset_of!(RawCoherencyEnforcer, policy) == 12);
    assert!(size_of::<Policy>() == 4);
    assert!(size_of::<TensorBase32>() == 20);
    assert!(offset_of!(TensorBase32, impl_handle) == 0);
    assert!(offset_of!(TensorBase32, coherency_enforcer) == 4);
};

// The seed's TensorBase is a 32-bit (Xtensa) layout: there `impl_` is a
// native pointer, which is what lets the enforcer sit at +4. Checked when
// building for a 32-bit target (the host test `layout_builds_for_i686`
// does so): a pointer fits the handle, and nothing in the struct needs
// more than 4-byte alignment, so it packs to 20 bytes as on the device.
#[cfg(target_pointer_width = "32")]
const _: () = {
    assert!(size_of::<*const ()>() == size_of::<u32>());
    assert!(size_of::<usize>() == 4);
    assert!(align_of::<TensorBase32>() == 4);
    assert!(size_of::<TensorBase32>() == size_of::<*const ()>() + 16);
    assert!(offset_of!(TensorBase32, coherency_enforcer) == size_of::<*const ()>());
    assert!(align_of::<AtomicI32>() == align_of::<i32>());
    assert!(align_of::<AtomicU32>() == align_of::<u32>());
};

impl Default for CoherencyEnforcer {
    fn default() -> Self {
        CoherencyEnforcer::new()
    }
}

/// Acquires on one enforcer are serialised by one of these locks, picked by
/// its address (see [`CoherencyEnforcer`]'s concurrency notes).
const ACQUIRE_LOCKS: usize = 64;
static ACQUIRE_LOCK: [Mutex<()>; ACQUIRE_LOCKS] = [const { Mutex::new(()) }; ACQUIRE_LOCKS];

impl CoherencyEnforcer {
    /// A fresh enforcer: nothing open, policy COHERENT.
    pub const fn new() -> Self {
        Self::with_policy(Policy::Coherent)
    }

    /// A fresh enforcer with `policy`.
    pub const fn with_policy(policy: Policy) -> Self {
        CoherencyEnforcer {
            buffered_readers: AtomicI32::new(0),
            buffered_writers: AtomicI32::new(0),
            unbuffered_accessors: AtomicI32::new(0),
            policy: AtomicU32::new(policy as u32),
        }
    }

    /// Rebuilds an enforcer from its plain-data image. An unknown policy
    /// value is kept as is and treated as COHERENT (fail safe).
    pub const fn from_raw(raw: RawCoherencyEnforcer) -> Self {
        CoherencyEnforcer {
            buffered_readers: AtomicI32::new(raw.buffered_readers),
            buffered_writers: AtomicI32::new(raw.buffered_writers),
            unbuffered_accessors: AtomicI32::new(raw.unbuffered_accessors),
            policy: AtomicU32::new(raw.policy),
        }
    }

    /// The plain-data image of the current state (each field read once).
    pub fn snapshot(&self) -> RawCoherencyEnforcer {
        let c = self.counts();
        RawCoherencyEnforcer {
            buffered_readers: c.buffered_readers,
            buffered_writers: c.buffered_writers,
            unbuffered_accessors: c.unbuffered_accessors,
            policy: self.policy.load(Ordering::SeqCst),
        }
    }

    /// The current policy (`get_accessor_coherence_policy`).
    pub fn policy(&self) -> Policy {
        Policy::from_raw(self.policy.load(Ordering::SeqCst)).unwrap_or(Policy::Coherent)
    }

    /// Sets the policy through a shared reference
    /// (`set_accessor_coherence_policy` on a const tensor). It applies to
    /// later acquires; accessors already open stay open.
    pub fn set_policy(&self, policy: Policy) {
        self.policy.store(policy as u32, Ordering::SeqCst);
    }

    /// The open counts now.
    pub fn counts(&self) -> OpenCounts {
        OpenCounts {
            buffered_readers: self.buffered_readers.load(Ordering::SeqCst),
            buffered_writers: self.buffered_writers.load(Ordering::SeqCst),
            unbuffered_accessors: self.unbuffered_accessors.load(Ordering::SeqCst),
        }
    }

    fn counter(&self, kind: AccessorKind) -> &AtomicI32 {
        match kind {
            AccessorKind::BufferedReader => &self.buffered_readers,
            AccessorKind::BufferedWriter => &self.buffered_writers,
            AccessorKind::Unbuffered => &self.unbuffered_accessors,
        }
    }

    fn acquire_lock(&self) -> MutexGuard<'static, ()> {
        // The enforcer is 4-byte aligned and 16 bytes long: dropping the low
        // four bits spreads neighbouring enforcers over different locks.
        let slot = (self as *const Self as usize >> 4) % ACQUIRE_LOCKS;
        // Nothing panics while the lock is held, but a poisoned lock still
        // guards nothing but `()`, so it is safe to go on.
        ACQUIRE_LOCK[slot]
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Opens a slot of `kind`, applying the policy if that is incoherent
    /// with what is open. On error nothing changed.
    pub fn acquire(&self, kind: AccessorKind) -> Result<Admission, CoherenceError> {
        let _serialised = self.acquire_lock();
        let open = self.counts();
        let admission = if open.conflicts_with(kind) {
            match self.policy() {
                Policy::Coherent => {
                    return Err(CoherenceError::Incoherent {
                        requested: kind,
                        open,
                    })
                }
                Policy::IncoherentVerbose => {
                    warn(&format!(
                        "Already opened {open} on this tensor; opening a new {kind} \
                         may cause incoherent behaviour."
                    ));
                    Admission::Incoherent
                }
                Policy::IncoherentQuiet => Admission::Incoherent,
            }
        } else {
            Admission::Coherent
        };
        let counter = self.counter(kind);
        // Only acquires raise a counter and they are serialised, so the
        // value read above is still an upper bound here.
        if open.get(kind) == i32::MAX {
            return Err(CoherenceError::Overflow(kind));
        }
        counter.fetch_add(1, Ordering::SeqCst);
        Ok(admission)
    }

    /// Closes a slot of `kind`. Releasing with none open is an error and
    /// leaves the count at zero (it never wraps). Policy-independent.
    pub fn release(&self, kind: AccessorKind) -> Result<(), CoherenceError> {
        self.counter(kind)
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| {
                (n > 0).then(|| n - 1)
            })
            .map(drop)
            .map_err(|_| CoherenceError::Underflow(kind))
    }

    /// The seed's `acquire_buffered_reader`.
    pub fn acquire_buffered_reader(&self) -> Result<Admission, CoherenceError> {
        self.acquire(AccessorKind::BufferedReader)
    }

    /// The seed's `release_buffered_reader`.
    pub fn release_buffered_reader(&self) -> Result<(), CoherenceError> {
        self.release(AccessorKind::BufferedReader)
    }

    /// The seed's `acquire_buffered_writer`.
    pub fn acquire_buffered_writer(&self) -> Result<Admission, CoherenceError> {
        self.acquire(AccessorKind::BufferedWriter)
    }

    /// The seed's `release_buffered_writer`.
    pub fn release_buffered_writer(&self) -> Result<(), CoherenceError> {
        self.release(AccessorKind::BufferedWriter)
    }

    /// The seed's `acquire_unbuffered_accessor`.
    pub fn acquire_unbuffered_accessor(&self) -> Result<Admission, CoherenceError> {
        self.acquire(AccessorKind::Unbuffered)
    }

    /// The seed's `release_unbuffered_accessor`.
    pub fn release_unbuffered_accessor(&self) -> Result<(), CoherenceError> {
        self.release(AccessorKind::Unbuffered)
    }

    /// Acquires a slot released when the returned guard drops: the RAII
    /// form every accessor holds.
    pub fn slot(&self, kind: AccessorKind) -> Result<CoherenceSlot<'_>, CoherenceError> {
        let admission = self.acquire(kind)?;
        Ok(CoherenceSlot {
            enforcer: self,
            kind,
            admission,
        })
    }
}

/// An open slot of one kind on one enforcer; dropping it releases the slot.
#[derive(Debug)]
pub struct CoherenceSlot<'a> {
    enforcer: &'a CoherencyEnforcer,
    kind: AccessorKind,
    admission: Admission,
}

impl CoherenceSlot<'_> {
    /// The kind of slot held.
    pub fn kind(&self) -> AccessorKind {
        self.kind
    }

    /// Whether the slot was opened coherently.
    pub fn admission(&self) -> Admission {
        self.admission
    }

    /// The enforcer the slot is on.
    pub fn enforcer(&self) -> &CoherencyEnforcer {
        self.enforcer
    }

    /// Releases the slot now, reporting an unbalanced release (which only
    /// raw `release_*` calls behind the guard's back can cause).
    pub fn release(self) -> Result<(), CoherenceError> {
        let this = std::mem::ManuallyDrop::new(self);
        this.enforcer.release(this.kind)
    }
}

impl Drop for CoherenceSlot<'_> {
    fn drop(&mut self) {
        // The slot was acquired by this guard and is released once, so the
        // count is at least 1 unless someone released it behind our back
        // with the raw `release_*` calls; report that, never wrap.
        if let Err(e) = self.enforcer.release(self.kind) {
            warn(&e.to_string());
        }
    }
}

/// Where enforcer warnings go: a function, so that tests and embedders can
/// capture them apart from the rest of the library's log. `None` means the
/// library's logger ([`crate::set_logger`]) at warning level.
static WARNING_SINK: RwLock<Option<fn(&str)>> = RwLock::new(None);

/// Routes enforcer warnings to `sink` (`None`: back to the library's logger).
pub fn set_warning_sink(sink: Option<fn(&str)>) {
    *WARNING_SINK.write().unwrap_or_else(PoisonError::into_inner) = sink;
}

fn warn(msg: &str) {
    match *WARNING_SINK.read().unwrap_or_else(PoisonError::into_inner) {
        Some(sink) => sink(msg),
        None => crate::log::log_warn!("{msg}"),
    }
}

#[cfg(test)]
mod tests;
