//! Address translation and copies: a descriptor's src and dst are device
//! (HBM) addresses or guest physical addresses, depending on its flags.

use crate::layout::Layout;
use crate::layout::Status;
use crate::layout::FLAGS_ALL;
use crate::layout::FLAG_DST_DEV;
use crate::layout::FLAG_SRC_DEV;
use crate::layout::MAX_LEN;
use crate::log::Log;
use crate::shm::Region;
use std::sync::atomic::AtomicU32;
use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering::AcqRel;
use std::sync::atomic::Ordering::Acquire;
use std::sync::Arc;

/// A descriptor as read from the ring.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Desc {
    /// Source address.
    pub src: u64,
    /// Destination address.
    pub dst: u64,
    /// The driver's cookie, copied to the completion.
    pub id: u64,
    /// Bytes to copy.
    pub len: u32,
    /// FLAG_* bits.
    pub flags: u32,
}

/// Where a translated address lies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Loc {
    /// BAR2 offset (inside HBM).
    Bar(u64),
    /// Offset in the guest RAM file.
    Ram(u64),
}

/// 4 GiB: where QEMU's x86 machines put the RAM that does not fit below
/// the PCI hole.
pub const FOUR_GIB: u64 = 1 << 32;
/// QEMU's default `max-ram-below-4g` on the pc machine (3.5 GiB).
pub const PC_MAX_RAM_BELOW_4G: u64 = 0xe000_0000;

/// How many bytes of a `ram_size` guest QEMU's pc (i440fx) machine maps
/// below 4 GiB, given its `max-ram-below-4g` property (QEMU's
/// `pc_init1`): a guest that does not fit below the limit is split at a
/// gigabyte boundary (at most 3 GiB, as every machine type since pc-1.7
/// aligns it), the rest of the file appearing at 4 GiB.
pub fn pc_ram_below_4g(ram_size: u64, max_below_4g: u64) -> u64 {
    let mut low = max_below_4g.min(FOUR_GIB);
    if ram_size >= low && low > 0xc000_0000 {
        low = 0xc000_0000;
    }
    ram_size.min(low)
}

/// Where the guest RAM file appears in guest physical memory: its first
/// `below_4g` bytes at address 0, the rest at 4 GiB (QEMU's x86 layout;
/// the gap is the PCI hole, not RAM).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RamMap {
    /// Bytes of the file mapped at guest physical 0.
    pub below_4g: u64,
    /// Bytes of the file.
    pub len: u64,
}

impl RamMap {
    /// The layout of a `len`-byte guest on QEMU's pc machine with
    /// `max-ram-below-4g` = `max_below_4g`.
    pub fn pc(len: u64, max_below_4g: u64) -> RamMap {
        RamMap {
            below_4g: pc_ram_below_4g(len, max_below_4g),
            len,
        }
    }

    /// The file offset of guest physical `[gpa, gpa + len)`, if all of it
    /// is RAM of one piece.
    pub fn offset(&self, gpa: u64, len: u64) -> Option<u64> {
        let end = gpa.checked_add(len)?;
        if end <= self.below_4g {
            return Some(gpa);
        }
        let above = self.len - self.below_4g;
        let off = gpa.checked_sub(FOUR_GIB)?;
        (end - FOUR_GIB <= above).then_some(self.below_4g + off)
    }
}

/// Everything a DMA engine can reach: HBM inside BAR2 and guest RAM.
pub struct Memory {
    /// The whole of BAR2.
    pub bar: Arc<Region>,
    /// BAR2 offset of HBM.
    pub hbm_offset: u64,
    /// Bytes of HBM.
    pub hbm_size: u64,
    /// Guest RAM, if the simulator was given the file.
    pub ram: Option<Arc<Region>>,
    /// Where the file lies in guest physical memory.
    pub ram_map: RamMap,
    /// The big copies in flight through it, on all queues.
    pub big_copies: Overlap,
}

/// Tells the copies that ran alone from those that overlapped another,
/// for the time split of big descriptors (`make bench`, figure 9s): a
/// copy alone has the host's cores to itself, so its rate is the host's
/// own copy rate, which copies sharing the cores with other queues'
/// copies (figure 9's concurrent jobs) do not show.
#[derive(Default)]
pub struct Overlap {
    /// Copies in flight.
    active: AtomicU32,
    /// Copies begun so far.
    begun: AtomicU64,
}

/// A copy [`Overlap::begin`] counted, until [`Overlap::end`].
pub struct InFlight {
    alone: bool,
    nth: u64,
}

impl Overlap {
    /// A copy begins.
    pub fn begin(&self) -> InFlight {
        // AcqRel: the two counters of overlapping copies are ordered, so
        // that of two overlapping copies at least the later sees the
        // other (in `active` at its begin) or the earlier sees it (in
        // `begun` at its end).
        let alone = self.active.fetch_add(1, AcqRel) == 0;
        let nth = self.begun.fetch_add(1, AcqRel) + 1;
        InFlight { alone, nth }
    }

    /// The copy ends: whether it ran alone (no other copy in flight when
    /// it began, and none begun since).
    pub fn end(&self, c: InFlight) -> bool {
        let alone = c.alone && self.begun.load(Acquire) == c.nth;
        self.active.fetch_sub(1, AcqRel);
        alone
    }
}

impl Memory {
    /// The memory of a device with layout `l` over `bar`, with guest RAM
    /// laid out as QEMU's pc machine does by default.
    pub fn new(bar: Arc<Region>, l: &Layout, ram: Option<Arc<Region>>) -> Memory {
        Self::with_max_ram_below_4g(bar, l, ram, PC_MAX_RAM_BELOW_4G)
    }

    /// [`new`](Self::new) for a pc machine whose `max-ram-below-4g` is
    /// `max_below_4g`.
    pub fn with_max_ram_below_4g(
        bar: Arc<Region>,
        l: &Layout,
        ram: Option<Arc<Region>>,
        max_below_4g: u64,
    ) -> Memory {
        assert!(
            bar.len() as u64 >= l.bar_size,
            "BAR2 smaller than its layout"
        );
        let len = ram.as_ref().map_or(0, |r| r.len() as u64);
        Memory {
            bar,
            hbm_offset: l.hbm_offset,
            hbm_size: l.hbm_size,
            ram,
            ram_map: RamMap::pc(len, max_below_4g),
            big_copies: Overlap::default(),
        }
    }

    /// Translates `[addr, addr + len)`, a device address if `dev`, else a
    /// guest physical address; BadAddr if any byte lies outside.
    pub fn translate(&self, addr: u64, len: u64, dev: bool) -> Result<Loc, Status> {
        let end = addr.checked_add(len).ok_or(Status::BadAddr)?;
        if dev {
            if end > self.hbm_size {
                return Err(Status::BadAddr);
            }
            Ok(Loc::Bar(self.hbm_offset + addr))
        } else {
            match &self.ram {
                Some(_) => self
                    .ram_map
                    .offset(addr, len)
                    .map(Loc::Ram)
                    .ok_or(Status::BadAddr),
                None => Err(Status::BadAddr),
            }
        }
    }

    /// Checks a descriptor and translates both of its ranges.
    pub fn check(&self, d: &Desc) -> Result<(Loc, Loc), Status> {
        if d.flags & !FLAGS_ALL != 0 || d.len == 0 || d.len > MAX_LEN {
            return Err(Status::BadDesc);
        }
        let len = u64::from(d.len);
        let src = self.translate(d.src, len, d.flags & FLAG_SRC_DEV != 0)?;
        let dst = self.translate(d.dst, len, d.flags & FLAG_DST_DEV != 0)?;
        Ok((src, dst))
    }

    fn region(&self, l: Loc) -> (&Region, u64) {
        match l {
            Loc::Bar(o) => (&self.bar, o),
            Loc::Ram(o) => (self.ram.as_ref().expect("translated to RAM without RAM"), o),
        }
    }

    /// Executes descriptor `d`: the completion status and bytes done.
    /// A host failure is logged to `log`.
    pub fn execute(&self, d: &Desc, log: &Log) -> (Status, u32) {
        let (src, dst) = match self.check(d) {
            Ok(v) => v,
            Err(s) => return (s, 0),
        };
        let (sr, so) = self.region(src);
        let (dr, doff) = self.region(dst);
        match dr.copy_from(doff, sr, so, u64::from(d.len)) {
            Ok(()) => (Status::Ok, d.len),
            Err(e) => {
                // Bounds were checked, so this is the host failing (e.g.
                // tmpfs out of space): report it as an address error.
                log.line(format_args!("tdrv-sim: copy of {d:?} failed: {e}"));
                (Status::BadAddr, 0)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::Config;
    use crate::layout::FLAG_IRQ;

    fn small() -> (Layout, Memory) {
        let l = Config {
            channels: 2,
            channel_size: 2 << 20,
            ..Config::default()
        }
        .layout()
        .unwrap();
        let bar = Arc::new(Region::heap(l.bar_size as usize));
        let ram = Arc::new(Region::heap(1 << 20));
        let m = Memory::new(bar, &l, Some(ram));
        (l, m)
    }

    #[test]
    fn only_a_copy_that_met_no_other_counts_as_alone() {
        let o = Overlap::default();
        // Alone.
        let a = o.begin();
        assert!(o.end(a));
        // Two overlapping copies, whichever ends first: neither.
        let a = o.begin();
        let b = o.begin();
        assert!(!o.end(a));
        let c = o.begin();
        assert!(!o.end(b));
        // `c` began while `b` ran.
        assert!(!o.end(c));
        // One begun while another ran, which ends before it: still not.
        let a = o.begin();
        let b = o.begin();
        assert!(!o.end(b));
        assert!(!o.end(a));
        // And alone again once all are done.
        let a = o.begin();
        assert!(o.end(a));
    }

    #[test]
    fn translation_of_hbm_and_guest_ram() {
        let (l, m) = small();
        assert_eq!(m.translate(0, 1, true), Ok(Loc::Bar(l.hbm_offset)));
        // The last byte of the last channel.
        assert_eq!(
            m.translate((4 << 20) - 1, 1, true),
            Ok(Loc::Bar(l.hbm_offset + (4 << 20) - 1))
        );
        assert_eq!(m.translate((4 << 20) - 1, 2, true), Err(Status::BadAddr));
        assert_eq!(m.translate(4 << 20, 1, true), Err(Status::BadAddr));
        assert_eq!(m.translate(u64::MAX, 2, true), Err(Status::BadAddr));
        assert_eq!(m.translate(0x1234, 16, false), Ok(Loc::Ram(0x1234)));
        assert_eq!(
            m.translate((1 << 20) - 16, 16, false),
            Ok(Loc::Ram((1 << 20) - 16))
        );
        assert_eq!(m.translate((1 << 20) - 16, 17, false), Err(Status::BadAddr));
        assert_eq!(m.translate(u64::MAX - 3, 8, false), Err(Status::BadAddr));
    }

    #[test]
    fn pc_machine_splits_ram_like_qemu() {
        const G: u64 = 1 << 30;
        let d = PC_MAX_RAM_BELOW_4G;
        // Below the limit: all of it at 0.
        assert_eq!(pc_ram_below_4g(G, d), G);
        assert_eq!(pc_ram_below_4g(2 * G, d), 2 * G);
        assert_eq!(pc_ram_below_4g(3 * G + G / 4, d), 3 * G + G / 4);
        // At or above 3.5 GiB: split at 3 GiB.
        assert_eq!(pc_ram_below_4g(d, d), 3 * G);
        assert_eq!(pc_ram_below_4g(4 * G, d), 3 * G);
        assert_eq!(pc_ram_below_4g(6 * G, d), 3 * G);
        // max-ram-below-4g=2G: split at 2 GiB.
        assert_eq!(pc_ram_below_4g(6 * G, 2 * G), 2 * G);
        assert_eq!(pc_ram_below_4g(G, 2 * G), G);
    }

    #[test]
    fn ram_above_4g_translates_to_the_rest_of_the_file() {
        const G: u64 = 1 << 30;
        // A 6 GiB guest: file [0, 3G) at 0, [3G, 6G) at 4G.
        let m = RamMap::pc(6 * G, PC_MAX_RAM_BELOW_4G);
        assert_eq!(m.below_4g, 3 * G);
        assert_eq!(m.offset(0, 4096), Some(0));
        assert_eq!(m.offset(3 * G - 4096, 4096), Some(3 * G - 4096));
        // The PCI hole is not RAM, nor is anything that touches it.
        assert_eq!(m.offset(3 * G - 4096, 4097), None);
        assert_eq!(m.offset(3 * G, 1), None);
        assert_eq!(m.offset(FOUR_GIB - 1, 1), None);
        // A range straddling 4 GiB starts in the hole.
        assert_eq!(m.offset(FOUR_GIB - 4096, 8192), None);
        // Above 4 GiB: offset 3 GiB onwards.
        assert_eq!(m.offset(FOUR_GIB, 4096), Some(3 * G));
        assert_eq!(m.offset(FOUR_GIB + 0x1234, 16), Some(3 * G + 0x1234));
        assert_eq!(m.offset(7 * G - 4096, 4096), Some(6 * G - 4096));
        // Past the end of RAM.
        assert_eq!(m.offset(7 * G - 4096, 4097), None);
        assert_eq!(m.offset(7 * G, 1), None);
        assert_eq!(m.offset(u64::MAX - 3, 8), None);
        // A 4 GiB guest: 1 GiB above 4 GiB.
        let m = RamMap::pc(4 * G, PC_MAX_RAM_BELOW_4G);
        assert_eq!(m.offset(FOUR_GIB + G - 1, 1), Some(4 * G - 1));
        assert_eq!(m.offset(FOUR_GIB + G, 1), None);
        // A 1 GiB guest: nothing above 4 GiB, and nothing past 1 GiB.
        let m = RamMap::pc(G, PC_MAX_RAM_BELOW_4G);
        assert_eq!(m.offset(G - 1, 1), Some(G - 1));
        assert_eq!(m.offset(G, 1), None);
        assert_eq!(m.offset(FOUR_GIB, 1), None);
    }

    #[test]
    fn copies_reach_the_file_offset_of_ram_above_4g() {
        // A small stand-in for a split guest: 1 MiB of file, the first
        // 512 KiB at 0 and the rest at 4 GiB.
        let (l, m) = small();
        let ram = m.ram.clone().unwrap();
        let m = Memory::with_max_ram_below_4g(m.bar.clone(), &l, Some(ram.clone()), 512 << 10);
        assert_eq!(
            m.ram_map,
            RamMap {
                below_4g: 512 << 10,
                len: 1 << 20
            }
        );
        ram.write_bytes((512 << 10) + 100, b"high");
        let log = crate::log::stderr();
        let d = Desc {
            src: FOUR_GIB + 100,
            dst: 8,
            id: 0,
            len: 4,
            flags: FLAG_DST_DEV,
        };
        assert_eq!(m.execute(&d, &log), (Status::Ok, 4));
        assert_eq!(m.bar.read_bytes(l.hbm_offset + 8, 4), b"high");
        // Guest physical 100 is file offset 100, not the high data.
        assert_eq!(m.execute(&Desc { src: 100, ..d }, &log), (Status::Ok, 4));
        assert_ne!(m.bar.read_bytes(l.hbm_offset + 8, 4), b"high");
        // Into the hole: refused, nothing copied.
        let to_hole = Desc {
            src: 8,
            dst: 512 << 10,
            flags: FLAG_SRC_DEV,
            ..d
        };
        assert_eq!(m.execute(&to_hole, &log), (Status::BadAddr, 0));
        // Device to high RAM lands at the file offset.
        let out = Desc {
            src: 8,
            dst: FOUR_GIB + 200,
            flags: FLAG_SRC_DEV,
            ..d
        };
        m.bar.write_bytes(l.hbm_offset + 8, b"back");
        assert_eq!(m.execute(&out, &log), (Status::Ok, 4));
        assert_eq!(ram.read_bytes((512 << 10) + 200, 4), b"back");
    }

    #[test]
    fn no_guest_ram_means_every_host_address_is_bad() {
        let (l, m) = small();
        let m = Memory::new(m.bar.clone(), &l, None);
        assert_eq!(m.translate(0, 1, false), Err(Status::BadAddr));
        assert_eq!(m.translate(0, 1, true), Ok(Loc::Bar(l.hbm_offset)));
    }

    #[test]
    fn bad_flags_and_lengths_are_bad_desc() {
        let (_, m) = small();
        let ok = Desc {
            src: 0,
            dst: 4096,
            id: 1,
            len: 4096,
            flags: FLAG_SRC_DEV | FLAG_DST_DEV | FLAG_IRQ,
        };
        assert!(m.check(&ok).is_ok());
        for d in [
            Desc { len: 0, ..ok },
            Desc {
                len: MAX_LEN + 1,
                ..ok
            },
            Desc {
                flags: 1 << 3,
                ..ok
            },
            Desc {
                flags: 1 << 31 | FLAG_SRC_DEV,
                ..ok
            },
        ] {
            assert_eq!(m.check(&d), Err(Status::BadDesc), "{d:?}");
            assert_eq!(m.execute(&d, &crate::log::stderr()), (Status::BadDesc, 0));
        }
        // BadDesc wins over a bad address.
        let d = Desc {
            src: u64::MAX,
            len: 0,
            ..ok
        };
        assert_eq!(m.check(&d), Err(Status::BadDesc));
        // The largest length is fine where it fits.
        let d = Desc {
            src: 0,
            dst: 0,
            len: MAX_LEN,
            flags: 0,
            ..ok
        };
        assert_eq!(m.check(&d), Err(Status::BadAddr));
    }

    #[test]
    fn copies_in_every_direction() {
        let (l, m) = small();
        let ram = m.ram.clone().unwrap();
        ram.write_bytes(100, b"host data");
        let run = |src, dst, flags| {
            m.execute(
                &Desc {
                    src,
                    dst,
                    id: 0,
                    len: 9,
                    flags,
                },
                &crate::log::stderr(),
            )
        };
        // host -> device
        assert_eq!(run(100, 5000, FLAG_DST_DEV), (Status::Ok, 9));
        assert_eq!(m.bar.read_bytes(l.hbm_offset + 5000, 9), b"host data");
        // device -> device, across channels
        assert_eq!(
            run(5000, (2 << 20) + 8, FLAG_SRC_DEV | FLAG_DST_DEV),
            (Status::Ok, 9)
        );
        assert_eq!(
            m.bar.read_bytes(l.hbm_offset + (2 << 20) + 8, 9),
            b"host data"
        );
        // device -> host
        assert_eq!(run((2 << 20) + 8, 7000, FLAG_SRC_DEV), (Status::Ok, 9));
        assert_eq!(ram.read_bytes(7000, 9), b"host data");
        // host -> host
        assert_eq!(run(7000, 9000, 0), (Status::Ok, 9));
        assert_eq!(ram.read_bytes(9000, 9), b"host data");
        // A bad destination copies nothing.
        assert_eq!(run(100, 1 << 20, 0), (Status::BadAddr, 0));
        assert_eq!(run(100, 4 << 20, FLAG_DST_DEV), (Status::BadAddr, 0));
    }
}
