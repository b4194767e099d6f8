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
    /// Offset in the guest RAM file (= guest physical address).
    Ram(u64),
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
}

impl Memory {
    /// The memory of a device with layout `l` over `bar`.
    pub fn new(bar: Arc<Region>, l: &Layout, ram: Option<Arc<Region>>) -> Memory {
        assert!(
            bar.len() as u64 >= l.bar_size,
            "BAR2 smaller than its layout"
        );
        Memory {
            bar,
            hbm_offset: l.hbm_offset,
            hbm_size: l.hbm_size,
            ram,
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
                Some(r) if end <= r.len() as u64 => Ok(Loc::Ram(addr)),
                _ => Err(Status::BadAddr),
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
