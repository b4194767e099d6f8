// SPDX-License-Identifier: GPL-2.0

//! One open file of `/dev/tdrv<N>`: its buffer handles, its jobs, and the
//! ioctl and mmap entry points.
//!
//! Every handler validates its argument completely before acting: struct
//! size, reserved and padding fields, flags, handles (which only exist in
//! the file that allocated them), channels and `offset + size` ranges.

use kernel::{
    bindings,
    fs::{
        File,
        Kiocb, //
    },
    ioctl::_IOC_NR,
    iov::IovIterDest,
    miscdevice::{
        MiscDevice,
        MiscDeviceRegistration, //
    },
    mm::virt::VmaNew,
    new_mutex,
    seq_file::{
        seq_print,
        SeqFile, //
    },
    page::PAGE_SIZE,
    prelude::*,
    rbtree::{
        RBTree,
        RBTreeNodeReservation, //
    },
    sync::{
        atomic::Relaxed,
        Arc,
        Mutex,
        UniqueArc, //
    },
    uaccess::{
        UserPtr,
        UserSlice, //
    }, //
};

use crate::{
    buffer::Buffer,
    charge::{
        Account,
        Charge, //
    },
    device::{
        client_id,
        raw_device,
        Client,
        TdrvDevice, //
    },
    dmabuf,
    fence::Timeout,
    fence_fd::{
        self,
        InFences,
        OutFence, //
    },
    glue,
    handle::{
        Ref,
        SharedHandleTable,
        Slots, //
    },
    job::{
        JobStatus,
        JobTracker,
        Transfer,
        Transfers, //
    },
    mmap,
    node::DeviceNode,
    range::{
        checked_range,
        overlaps, //
    },
    uapi::{self, *}, //
};

/// Largest descriptor stride `TDRV_IOC_SUBMIT` accepts (room for growth).
const MAX_DESC_SIZE: usize = 256;

/// The page-cache mapping (`f_mapping`) of an open file: every VMA that
/// maps one of its buffers hangs off it.
struct FileMapping(*mut bindings::address_space);

// SAFETY: Only passed to `unmap_mapping_range` while the file is open (see
// `FileState::zap_mappings`); the pointer itself may move between threads.
unsafe impl Send for FileMapping {}
// SAFETY: As above.
unsafe impl Sync for FileMapping {}

/// The writers' side of a file's buffer handles (see [`SharedHandleTable`]) and
/// the bytes they hold (page-rounded), in all and per channel, for the
/// per-file limits and the statistics.
struct Handles {
    slots: Slots,
    /// The file's charges; charged under this lock, so that a limit check
    /// and its charge are one step.
    account: Arc<Account>,
    /// The handles that were exported, with their charge, shared with
    /// their dma-bufs (see `charge.rs`).
    exported: RBTree<u64, Arc<Charge>>,
    /// Handles of buffers imported from foreign dma-bufs.
    imports: usize,
}

/// What an open file owns: its buffer handles and its jobs. The device
/// keeps a reference too (as a [`Client`]), so that unbind can reach the
/// file's mappings and debugfs can show its usage.
#[pin_data]
pub(crate) struct FileState {
    /// Handle lookups take no lock; adding and removing handles hold
    /// `handles`.
    table: SharedHandleTable<Arc<Buffer>>,
    #[pin]
    handles: Mutex<Handles>,
    jobs: Arc<JobTracker>,
    mapping: FileMapping,
    /// Unique id of the open file (fdinfo `drm-client-id`).
    id: u64,
    /// Thread group that opened the file.
    pid: i32,
}

impl Client for FileState {
    fn zap_mappings(&self) {
        // SAFETY: The file is open (it leaves the device's registry only in
        // `release`, and the device holds the registry lock while calling
        // this), so its inode and `f_mapping` are alive.
        // `unmap_mapping_range` with length 0 covers the whole file.
        unsafe { bindings::unmap_mapping_range(self.mapping.0, 0, 0, 1) };
    }

    fn cancel_held_jobs(&self, err: Error) {
        self.jobs.cancel_held(err);
    }

    fn describe(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        let h = self.handles.lock();
        write!(
            f,
            "client {} pid {} buffers {} bytes {}",
            self.id,
            self.pid,
            h.slots.len(),
            h.account.bytes()
        )?;
        for (ch, bytes) in h.account.channel_bytes().enumerate() {
            write!(f, " hbm{ch} {bytes}")?;
        }
        drop(h);
        writeln!(
            f,
            " jobs {} busy_ns {}",
            self.jobs.queued(),
            self.jobs.busy_ns.load(Relaxed)
        )
    }
}

/// Per-open-file private data.
pub(crate) struct TdrvFile {
    device: Arc<TdrvDevice>,
    state: Arc<FileState>,
    /// The file's key in the device's file registry.
    key: u64,
    /// The opener had CAP_SYS_RAWIO: it may learn bus addresses.
    rawio: bool,
}

/// An ioctl's handler.
type Handler = fn(&TdrvFile, &ArgBuf) -> Result;

/// Every ioctl at its request number: one lookup per call instead of a
/// compare per ioctl. (VERSION is answered before the table is consulted,
/// even after unbind.)
const IOCTLS: [(u32, Handler); 17] = [
    (IOC_VERSION, TdrvFile::version),
    (IOC_CHANNEL_INFO, TdrvFile::channel_info),
    (IOC_ALLOC, TdrvFile::alloc),
    (IOC_FREE, TdrvFile::free),
    (IOC_BUF_INFO, TdrvFile::buf_info),
    (IOC_COPY_IN, TdrvFile::copy_in),
    (IOC_COPY_OUT, TdrvFile::copy_out),
    (IOC_MEMSET, TdrvFile::memset),
    (IOC_COPY, TdrvFile::copy),
    (IOC_SUBMIT, TdrvFile::submit),
    (IOC_JOB_WAIT, TdrvFile::job_wait),
    (IOC_FENCE_WAIT, TdrvFile::fence_wait),
    (IOC_COMPLETION_WAIT, TdrvFile::completion_wait),
    (IOC_COMPLETION_RESET, TdrvFile::completion_reset),
    (IOC_EXPORT, TdrvFile::export),
    (IOC_IMPORT, TdrvFile::import),
    (IOC_JOB_NOTIFY, TdrvFile::job_notify),
];

// Each entry sits at its own request number.
const _: () = {
    let mut i = 0;
    while i < IOCTLS.len() {
        assert!(_IOC_NR(IOCTLS[i].0) as usize == i);
        i += 1;
    }
};

#[vtable]
impl MiscDevice for TdrvFile {
    type Ptr = Pin<KBox<Self>>;

    fn open(file: &File, misc: &MiscDeviceRegistration<Self>) -> Result<Pin<KBox<Self>>> {
        let device = DeviceNode::from_registration(misc).device.clone();
        if !device.is_bound() {
            return Err(ENODEV);
        }
        let account = Account::new(device.channels.count())?;
        let jobs = JobTracker::new(device.limits.events, device.events.clone())?;
        let key = client_id();
        let state = Arc::pin_init(
            try_pin_init!(FileState {
                table: SharedHandleTable::new(),
                handles <- new_mutex!(
                    Handles {
                        slots: Slots::new(),
                        account,
                        exported: RBTree::new(),
                        imports: 0,
                    },
                    "FileState::handles"
                ),
                jobs,
                // SAFETY: `file` is a valid file being opened; `f_mapping`
                // is set before `open` is called.
                mapping: FileMapping(unsafe { (*file.as_ptr()).f_mapping }),
                id: key,
                pid: kernel::current!().tgid_nr_ns(None),
            }),
            GFP_KERNEL_ACCOUNT,
        )?;
        device.add_file(key, state.clone())?;
        // SAFETY: `file` is being opened.
        unsafe { glue::file_allow_nowait(file.as_ptr()) };
        let tdrv_file = KBox::pin(
            TdrvFile {
                device: device.clone(),
                state,
                key,
                rawio: glue::capable_rawio(),
            },
            GFP_KERNEL_ACCOUNT,
        );
        if tdrv_file.is_err() {
            device.remove_file(key);
        }
        Ok(tdrv_file?)
    }

    /// Completion events (`TDRV_IOC_JOB_NOTIFY`): see `event.rs`.
    fn read_iter(kiocb: Kiocb<'_, Self::Ptr>, iov: &mut IovIterDest<'_>) -> Result<usize> {
        // SAFETY: `kiocb` is the valid kiocb of this read.
        let wait = unsafe { glue::kiocb_wait(kiocb.as_raw()) };
        kiocb.file().state.jobs.read_events(iov, wait)
    }

    fn release(me: Pin<KBox<TdrvFile>>, _file: &File) {
        me.device.remove_file(me.key);
        // The file's jobs go first: queued ones end with ECANCELED now and
        // a running one stops at its next piece, so their buffers (and
        // channel bytes) come back at once, not when the queue drains.
        // Held jobs (waiting for in-fences) first, so that the dispatch
        // work hands nothing more to the engine; then the engine's.
        me.state.jobs.close();
        me.state.jobs.cancel_held(ecanceled());
        me.device.engine().cancel(&me.state.jobs);
        // No in-fence callback can queue the dispatch work any more.
        me.state.jobs.flush_dispatch();
        // Emptying the table releases the file's buffer references (outside
        // the lock: that may free DMA memory). Buffers still used by
        // mappings (which also hold this file, so not here) or by a job
        // still running live on until it stops.
        let slots = me.state.handles.lock().slots.slot_count();
        for slot in 0..slots {
            let buf = {
                let mut h = me.state.handles.lock();
                me.state.table.remove_slot(&mut h.slots, slot)
            };
            if let Some(buf) = buf {
                let arc = (*buf).clone();
                drop(buf);
                Buffer::drop_unlocked(arc);
            }
        }
    }

    fn ioctl(me: Pin<&TdrvFile>, _file: &File, cmd: u32, arg: usize) -> Result<isize> {
        let arg = ArgBuf::new(cmd, arg);
        let m = |known| ArgBuf::matches(cmd, known);
        if m(IOC_VERSION) {
            // Works after unbind too: it tells the caller what it talks to.
            return me.version(&arg).map(|()| 0);
        }
        if !me.device.is_bound() {
            return Err(ENODEV);
        }
        // No active guard here: each handler holds one only around the
        // sections that use the bus device or buffer memory, never while
        // waiting or touching user memory, so unbind is never held up by a
        // blocked caller.
        // The table is indexed by request number (0..=0x0F, in uapi order).
        let Some(&(known, handler)) = IOCTLS.get(_IOC_NR(cmd) as usize) else {
            return Err(ENOTTY);
        };
        let r = if m(known) { handler(&me, &arg) } else { Err(ENOTTY) };
        r.map(|()| 0)
    }

    /// `/proc/<pid>/fdinfo/<fd>`: the keys of the kernel's
    /// drm-usage-stats that apply (HBM channels are the memory regions,
    /// all of it resident; the copy engine's busy time for this file), and
    /// tdrv's own.
    fn show_fdinfo(me: Pin<&TdrvFile>, m: &SeqFile, _file: &File) {
        let st = &me.state;
        seq_print!(m, "drm-driver:\ttdrv\n");
        seq_print!(m, "drm-client-id:\t{}\n", st.id);
        {
            let h = st.handles.lock();
            for (ch, bytes) in h.account.channel_bytes().enumerate() {
                seq_print!(m, "drm-total-hbm{}:\t{}\n", ch, bytes);
                seq_print!(m, "drm-resident-hbm{}:\t{}\n", ch, bytes);
            }
            seq_print!(m, "tdrv-buffers:\t{}\n", h.slots.len());
        }
        seq_print!(m, "drm-engine-copy:\t{} ns\n", st.jobs.busy_ns.load(Relaxed));
        seq_print!(m, "tdrv-device:\t{}\n", me.device.name());
        seq_print!(m, "tdrv-jobs-queued:\t{}\n", st.jobs.queued());
    }

    fn mmap(me: Pin<&TdrvFile>, _file: &File, vma: &VmaNew) -> Result {
        let _active = me.device.enter()?;
        // SAFETY: `vma` is being set up under the mmap write lock; reading
        // and then clearing its page offset is part of that set-up.
        let pgoff = unsafe { (*vma.as_ptr()).vm_pgoff };
        let buf = me.buffer(pgoff as u64)?;
        // SAFETY: As above. Fault offsets are then page indices in the
        // buffer (see `mmap.rs`).
        unsafe { (*vma.as_ptr()).vm_pgoff = 0 };
        mmap::map_buffer(buf, vma)
    }
}

/// The end of a synchronous write of `len` bytes of `buf` (COPY_IN,
/// MEMSET, COPY) with outcome `r`, under its `cpu_begin`: a write that
/// wrote bytes clears the error latch (an empty one writes nothing); one
/// the device's DMA failed part-way (TDRV_DEVICE_SIM: EIO for a failed
/// descriptor, ETIMEDOUT from the watchdog) left the bytes undefined and
/// latches its errno, as a failed job does, so that every user of the
/// buffer (other files, importers) learns it. Other errors (EFAULT,
/// EINTR, ENODEV) keep the latch as it was.
fn end_sync_write(buf: &Buffer, r: &Result, len: usize) {
    match r {
        Ok(()) if len > 0 => buf.fence.clear_error(),
        Err(e) if *e == EIO || *e == ETIMEDOUT => buf.fence.latch_error(e.to_errno()),
        _ => {}
    }
}

impl TdrvFile {
    /// Looks up a buffer of this file: ENOENT for anything else. Takes no
    /// lock.
    fn buffer(&self, handle: u64) -> Result<Arc<Buffer>> {
        let buf = self.state.table.get(handle).ok_or(ENOENT)?;
        Ok(Arc::clone(&buf))
    }

    /// Bus addresses are for CAP_SYS_RAWIO openers only; others see 0.
    fn visible_dma_addr(&self, buf: &Buffer) -> u64 {
        if self.rawio {
            buf.dma_addr()
        } else {
            0
        }
    }

    fn version(&self, arg: &ArgBuf) -> Result {
        // Output only: whatever the caller's struct holds is ignored.
        arg.check_size::<Version>()?;
        let d = &self.device;
        let irq = if d.kind == DEVICE_SOFT { 0 } else { FEAT_IRQ };
        let fence_fd = if fence_fd::supported() {
            FEAT_FENCE_FD
        } else {
            0
        };
        arg.write(&Version {
            abi_major: ABI_MAJOR,
            abi_minor: ABI_MINOR,
            features: FEAT_MMAP
                | FEAT_SUBMIT
                | FEAT_COMPLETION
                | FEAT_ERROR_LATCH
                | FEAT_DMABUF
                | FEAT_BUF_ID
                | FEAT_EVENTS
                | FEAT_IMPLICIT_SYNC
                | FEAT_SUBMIT_NOTIFY
                | irq
                | fence_fd,
            device_kind: d.kind,
            num_channels: d.channels.count(),
            max_buffer_size: MAX_BUFFER_SIZE,
            reserved: [0; 4],
        })
    }

    fn channel_info(&self, arg: &ArgBuf) -> Result {
        let a: ChannelInfo = arg.read()?;
        if a.pad != 0 || any_nonzero(&a.reserved) {
            return Err(EINVAL);
        }
        let s = self.device.channels.stats(a.channel)?;
        arg.write(&ChannelInfo {
            channel: a.channel,
            pad: 0,
            limit_bytes: s.limit,
            used_bytes: s.used,
            peak_bytes: s.peak,
            buffers: s.buffers,
            failed_allocs: s.failed,
            reserved: [0; 2],
        })
    }

    fn alloc(&self, arg: &ArgBuf) -> Result {
        let a: Alloc = arg.read()?;
        if a.flags != 0
            || a.handle != 0
            || a.dma_addr != 0
            || a.mmap_offset != 0
            || any_nonzero(&a.reserved)
        {
            return Err(EINVAL);
        }
        if a.size == 0 || a.size > MAX_BUFFER_SIZE {
            return Err(EINVAL);
        }
        if a.channel >= self.device.channels.count() {
            return Err(EINVAL);
        }
        let limits = &self.device.limits;
        let charge = a.size.next_multiple_of(PAGE_SIZE as u64);
        {
            let h = self.state.handles.lock();
            if h.slots.len() >= limits.handles || h.account.bytes() + charge > limits.bytes {
                return Err(ENOSPC);
            }
        }
        let buf = {
            let active = self.device.enter()?;
            let dev = self.device.bound_device(&active);
            Buffer::new(&self.device, dev, a.size as usize, a.channel)?
        };
        let dma_addr = self.visible_dma_addr(&buf);
        let handle = {
            let mut h = self.state.handles.lock();
            // Checked again: another thread of this file may have allocated
            // meanwhile (the allocation itself is not done under the lock).
            if h.slots.len() >= limits.handles || h.account.bytes() + charge > limits.bytes {
                return Err(ENOSPC);
            }
            let channel = buf.channel();
            let handle = self.state.table.insert(&mut h.slots, buf)?;
            h.account.charge(channel, charge);
            handle
        };
        let out = Alloc {
            handle,
            dma_addr,
            mmap_offset: mmap::offset_of_handle(handle),
            ..a
        };
        if let Err(e) = arg.write(&out) {
            // The caller cannot learn the handle: do not leak the buffer.
            drop(self.remove_handle(handle));
            return Err(e);
        }
        Ok(())
    }

    /// Adds `buf` (allocated or imported) to the table under the file's
    /// limits; ENOSPC if they would be exceeded.
    fn add_handle(&self, buf: Arc<Buffer>) -> Result<u64> {
        let limits = &self.device.limits;
        let charge = buf.charged();
        let foreign = buf.is_foreign();
        let mut h = self.state.handles.lock();
        if h.slots.len() >= limits.handles
            || h.account.bytes() + charge > limits.bytes
            || (foreign && h.imports >= limits.imports)
        {
            return Err(ENOSPC);
        }
        let channel = buf.channel();
        let handle = self.state.table.insert(&mut h.slots, buf)?;
        h.account.charge(channel, charge);
        if foreign {
            h.imports += 1;
        }
        Ok(handle)
    }

    fn export(&self, arg: &ArgBuf) -> Result {
        let a: Export = arg.read()?;
        if a.flags != 0 || a.fd != 0 || a.pad != 0 || a.pad2 != 0 || any_nonzero(&a.reserved) {
            return Err(EINVAL);
        }
        let buf = self.buffer(a.handle)?;
        let charge = self.export_charge(a.handle, &buf)?;
        let pending = {
            // Exports of a device being unbound could escape its sweep.
            let _active = self.device.enter()?;
            dmabuf::export(buf, charge)?
        };
        // The fd becomes visible only once the caller can learn it.
        arg.write(&Export {
            fd: pending.fd(),
            ..a
        })?;
        pending.install();
        Ok(())
    }

    /// The charge of `handle` (whose buffer is `buf`), shared with the
    /// dma-bufs exported from it: taken over from the file's account at
    /// the first export. ENOENT if the handle was freed meanwhile.
    fn export_charge(&self, handle: u64, buf: &Arc<Buffer>) -> Result<Arc<Charge>> {
        // Allocated first: nothing fails once the charge is taken over.
        let node = RBTreeNodeReservation::new(GFP_KERNEL_ACCOUNT)?;
        let slot = UniqueArc::new_uninit(GFP_KERNEL_ACCOUNT)?;
        let mut h = self.state.handles.lock();
        // FREE, which holds the lock too, may have taken the handle (and a
        // new buffer its number) since `buf` was looked up.
        match self.state.table.get(handle) {
            Some(cur) if Arc::ptr_eq(&*cur, buf) => {}
            _ => return Err(ENOENT),
        }
        if let Some(shared) = h.exported.get(&handle) {
            return Ok(shared.clone());
        }
        let shared = Charge::adopt(slot, h.account.clone(), buf.channel(), buf.charged());
        // (No node was there: the lookup above found none.)
        drop(h.exported.insert(node.into_node(handle, shared.clone())));
        Ok(shared)
    }

    fn import(&self, arg: &ArgBuf) -> Result {
        let a: Import = arg.read()?;
        if a.flags != 0
            || a.pad != 0
            || a.handle != 0
            || a.size != 0
            || a.mmap_offset != 0
            || any_nonzero(&a.reserved)
        {
            return Err(EINVAL);
        }
        let looked_up = dmabuf::lookup(a.fd)?;
        // Device memory of another tdrv device: its buffer moves the bytes
        // that this device's CPU paths cannot reach (see `Buffer::import`).
        let peer = match &looked_up {
            dmabuf::Lookup::Own(buf, _) if buf.on_device() => Some(buf.clone()),
            _ => None,
        };
        let buf = match looked_up {
            dmabuf::Lookup::Own(buf, _) if Arc::ptr_eq(buf.device(), &self.device) => buf,
            dmabuf::Lookup::Own(buf, _)
                if buf.on_device() && !(self.device.engine().does_dma() && self.device.engine().revocable_imports()) =>
            {
                // Another device's memory behind its BAR, and an engine
                // that copies with the CPU (or whose imports cannot be
                // revoked, as peer-to-peer memory must be): no
                // peer-to-peer path (refused before vmap, whose failure
                // the dma-buf core would WARN about).
                dmabuf::log_no_p2p();
                return Err(crate::uapi::eopnotsupp());
            }
            dmabuf::Lookup::Own(buf, _) if !buf.device().is_bound() => return Err(ENODEV),
            // Another tdrv device's export: mapped like a foreign dma-buf
            // (zero-copy, see `dmabuf.rs`); its device memory
            // peer-to-peer, where the exporter finds a path.
            dmabuf::Lookup::Own(_, foreign) | dmabuf::Lookup::Foreign(foreign) => {
                if a.channel >= self.device.channels.count() {
                    return Err(EINVAL);
                }
                // Refused before the dma-buf is mapped (checked again when
                // the handle is added).
                if self.state.handles.lock().imports >= self.device.limits.imports {
                    return Err(ENOSPC);
                }
                // Counted before the guard: at the limit, this waits for
                // queued releases (which unbind also waits for).
                let slot = self.device.imports.reserve()?;
                let active = self.device.enter()?;
                let dev = raw_device(self.device.bound_device(&active)).cast();
                let engine = self.device.engine();
                // Revocable where the engine ends its accesses in bounded
                // time (see `dmabuf.rs`, "Revocation of imports").
                let owner = engine.revocable_imports().then(|| self.device.clone());
                // SAFETY: `dev` is the bound device; the active guard keeps
                // it bound until the buffer is registered, and unbind
                // releases every registered buffer's import before the
                // device goes away.
                let import =
                    unsafe { dmabuf::Import::new(foreign, dev, engine.does_dma(), owner, slot, peer.is_some())? };
                Buffer::import(&self.device, &active, import, a.channel, peer)?
            }
        };
        let size = buf.size() as u64;
        let channel = buf.channel();
        let handle = self.add_handle(buf)?;
        let out = Import {
            channel,
            handle,
            size,
            mmap_offset: mmap::offset_of_handle(handle),
            ..a
        };
        if let Err(e) = arg.write(&out) {
            drop(self.remove_handle(handle));
            return Err(e);
        }
        Ok(())
    }

    /// Removes `handle` from the table; the caller drops the buffer outside
    /// the lock (that may free DMA memory). Its charge goes with it, unless
    /// dma-bufs exported from it still hold the memory: then with the last
    /// of them.
    fn remove_handle(&self, handle: u64) -> Option<Ref<'_, Arc<Buffer>>> {
        let mut h = self.state.handles.lock();
        let buf = self.state.table.remove(&mut h.slots, handle)?;
        match h.exported.remove(&handle) {
            Some(shared) => drop(shared),
            None => h.account.uncharge(buf.channel(), buf.charged()),
        }
        if buf.is_foreign() {
            h.imports -= 1;
        }
        Some(buf)
    }

    fn free(&self, arg: &ArgBuf) -> Result {
        let a: Free = arg.read()?;
        if a.reserved != 0 {
            return Err(EINVAL);
        }
        let buf = self.remove_handle(a.handle).ok_or(ENOENT)?;
        let arc = (*buf).clone();
        drop(buf);
        Buffer::drop_unlocked(arc);
        Ok(())
    }

    /// BUF_INFO is the cheapest query of a buffer, so it does the least:
    /// for a caller of this ABI's struct size it copies the struct in a
    /// word at a time and copies out only the words of the out fields, in
    /// one user-access section each (see `glue::get_user_words`); the
    /// handle lookup takes no lock. Other sizes take the general path, with
    /// the same result.
    fn buf_info(&self, arg: &ArgBuf) -> Result {
        // Words 1..10 are `size` to `buf_id`: all the out fields, and
        // `pad` and `pad2`, which were zero and are written as zero.
        const OUT: core::ops::Range<usize> = 1..10;
        const _: () = assert!(
            core::mem::offset_of!(BufInfo, size) == OUT.start * 8
                && core::mem::offset_of!(BufInfo, buf_id) == OUT.end * 8 - 8
                && core::mem::size_of::<BufInfo>() == OUT.end * 8
        );
        let a: BufInfo = arg.read_fast()?;
        // (`error` and `buf_id` are output only: a reused struct may carry
        // them.)
        if a.pad != 0 || a.pad2 != 0 {
            return Err(EINVAL);
        }
        let out = {
            let buf = self.state.table.get(a.handle).ok_or(ENOENT)?;
            let c = buf.fence.counts();
            BufInfo {
                handle: a.handle,
                size: buf.size() as u64,
                dma_addr: self.visible_dma_addr(&buf),
                mmap_offset: mmap::offset_of_handle(a.handle),
                pending_reads: c.reads,
                pending_writes: c.writes,
                completion_count: c.completions,
                channel: buf.channel(),
                pad: 0,
                error: c.error,
                pad2: 0,
                buf_id: buf.id(),
            }
        };
        // The caller's `handle` and `reserved` already hold what the
        // general path would write.
        arg.write_fast(&out, OUT)
    }

    /// Validates a transfer argument and returns its buffer and range.
    fn xfer(&self, arg: &ArgBuf) -> Result<(Arc<Buffer>, Xfer)> {
        let a: Xfer = arg.read()?;
        if any_nonzero(&a.reserved) {
            return Err(EINVAL);
        }
        let buf = self.buffer(a.handle)?;
        // A revoked import has no memory: ENODEV before its error latch
        // (a job it ended may have latched one) is reported.
        if buf.revoked() {
            return Err(ENODEV);
        }
        Ok((buf, a))
    }

    fn copy_in(&self, arg: &ArgBuf) -> Result {
        let (buf, a) = self.xfer(arg)?;
        let range = checked_range(a.offset, a.size, buf.size())?;
        // Writing the buffer: wait for every pending device access, and
        // keep jobs off the buffer until the copy is done.
        buf.fence.cpu_begin(FENCE_ALL)?;
        let r = buf.copy_from_user(range, UserPtr::from_addr(a.user_ptr as usize));
        end_sync_write(&buf, &r, range.len);
        buf.fence.cpu_end();
        r
    }

    fn copy_out(&self, arg: &ArgBuf) -> Result {
        let (buf, a) = self.xfer(arg)?;
        let range = checked_range(a.offset, a.size, buf.size())?;
        // Reading the buffer: wait for pending device writes only; EIO if
        // a failed job left its bytes undefined.
        buf.fence.cpu_begin(FENCE_WRITES)?;
        let r = buf
            .fence
            .check_error()
            .and_then(|()| buf.copy_to_user(range, UserPtr::from_addr(a.user_ptr as usize)));
        buf.fence.cpu_end();
        r
    }

    fn memset(&self, arg: &ArgBuf) -> Result {
        let a: Memset = arg.read()?;
        if a.pad != 0 || any_nonzero(&a.reserved) || a.value > 0xff {
            return Err(EINVAL);
        }
        let buf = self.buffer(a.handle)?;
        let range = checked_range(a.offset, a.size, buf.size())?;
        buf.fence.cpu_begin(FENCE_ALL)?;
        let r = buf.fill(range, a.value as u8);
        end_sync_write(&buf, &r, range.len);
        buf.fence.cpu_end();
        r
    }

    /// Resolves one copy descriptor: both handles, the same-channel rule
    /// (EXDEV, the seed's "Tensors must be allocated on same HBM") and both
    /// ranges.
    fn transfer(&self, d: &CopyDesc) -> Result<Transfer> {
        if d.size == 0 {
            return Err(EINVAL);
        }
        let src = self.buffer(d.src_handle)?;
        let dst = self.buffer(d.dst_handle)?;
        if src.channel() != dst.channel() {
            return Err(EXDEV);
        }
        let src_range = checked_range(d.src_offset, d.size, src.size())?;
        let dst_range = checked_range(d.dst_offset, d.size, dst.size())?;
        // Overlapping ranges of one buffer are refused: the edu engine
        // moves bytes a chunk at a time and could not match memmove.
        if Arc::ptr_eq(&src, &dst) && overlaps(src_range, dst_range) {
            return Err(EINVAL);
        }
        Ok(Transfer {
            src,
            src_range,
            dst,
            dst_offset: dst_range.start,
        })
    }

    fn copy(&self, arg: &ArgBuf) -> Result {
        let a: uapi::Copy = arg.read()?;
        if any_nonzero(&a.reserved) {
            return Err(EINVAL);
        }
        let t = self.transfer(&a.desc)?;
        // As in `xfer`.
        if t.src.revoked() || t.dst.revoked() {
            return Err(ENODEV);
        }
        // A read of the source and a write of the destination, with jobs
        // kept off both until the copy is done.
        t.src.fence.cpu_begin(FENCE_WRITES)?;
        if let Err(e) = t.dst.fence.cpu_begin(FENCE_ALL) {
            t.src.fence.cpu_end();
            return Err(e);
        }
        // A latched source fails the copy before it writes anything: the
        // destination keeps its bytes and its latch.
        let r = t.src.fence.check_error().and_then(|()| {
            let r = t.dst.copy_from_ioctl(t.dst_offset, &t.src, t.src_range);
            end_sync_write(&t.dst, &r, t.src_range.len);
            r
        });
        t.dst.fence.cpu_end();
        t.src.fence.cpu_end();
        r
    }

    fn submit(&self, arg: &ArgBuf) -> Result {
        // (`out_fence` is output only: a reused struct may carry one.)
        let a: Submit = arg.read_fast()?;
        let notify = a.flags & SUBMIT_NOTIFY != 0;
        if a.flags & !(SUBMIT_OUT_FENCE | SUBMIT_NOTIFY) != 0
            || a.pad != 0
            || a.job_id != 0
            || any_nonzero(&a.reserved)
            || (!notify && a.user_data != 0)
        {
            return Err(EINVAL);
        }
        // A caller whose struct ends before `user_data` (ABI 1.2-1.5)
        // asks for an event it cannot have told us anything about.
        if notify
            && !arg.reaches(core::mem::offset_of!(Submit, user_data) + core::mem::size_of::<u64>())
        {
            return Err(EINVAL);
        }
        if a.desc_count == 0 || a.desc_count > MAX_JOB_DESCS {
            return Err(EINVAL);
        }
        if a.in_fence_count > MAX_IN_FENCES || (a.in_fence_count == 0 && a.in_fences != 0) {
            return Err(EINVAL);
        }
        let stride = a.desc_size as usize;
        let ours = core::mem::size_of::<CopyDesc>();
        if stride < ours || stride > MAX_DESC_SIZE {
            return Err(EINVAL);
        }
        let want_out = a.flags & SUBMIT_OUT_FENCE != 0;
        // The out-fence fd is reported in `out_fence`: a caller whose
        // struct ends before it (ABI 1.0/1.1, 48 bytes) could never learn
        // the fd, which would stay open in its table.
        if want_out
            && !arg.reaches(
                core::mem::offset_of!(Submit, out_fence) + core::mem::size_of::<i32>(),
            )
        {
            return Err(EINVAL);
        }
        if (want_out || a.in_fence_count > 0) && !fence_fd::supported() {
            return Err(eopnotsupp());
        }
        let count = a.desc_count as usize;
        // Bounded by MAX_JOB_DESCS * MAX_DESC_SIZE: no overflow.
        let mut reader =
            UserSlice::new(UserPtr::from_addr(a.descs as usize), count * stride).reader();
        let mut transfers = Transfers::with_capacity(count, GFP_KERNEL_ACCOUNT)?;
        let mut bytes: u64 = 0;
        for _ in 0..count {
            let d: CopyDesc = if count == 1 && stride == ours {
                // The common one-copy job: a word at a time.
                glue::get_user_words(a.descs as usize)?
            } else {
                reader.read()?
            };
            if stride > ours {
                // Growth rule for descriptors: unknown trailing bytes are
                // zero.
                let mut tail = [0u8; MAX_DESC_SIZE];
                let extra = &mut tail[..stride - ours];
                reader.read_slice(extra)?;
                if extra.iter().any(|b| *b != 0) {
                    return Err(E2BIG);
                }
            }
            let t = self.transfer(&d)?;
            bytes += t.src_range.len as u64;
            if bytes > MAX_JOB_BYTES {
                return Err(EINVAL);
            }
            transfers.push(t, GFP_KERNEL_ACCOUNT)?;
        }
        let in_fences = if a.in_fence_count > 0 {
            let mut fds = [0i32; MAX_IN_FENCES as usize];
            let fds = &mut fds[..a.in_fence_count as usize];
            let mut reader = UserSlice::new(
                UserPtr::from_addr(a.in_fences as usize),
                core::mem::size_of_val(fds),
            )
            .reader();
            for fd in fds.iter_mut() {
                *fd = reader.read()?;
            }
            Some(InFences::from_fds(fds)?)
        } else {
            None
        };
        // The out-fence's fd is reserved (and its sync_file made) before
        // the job is queued, so that nothing can fail after it, except
        // writing the result back.
        let (out_fence, fd) = if want_out {
            let fence = OutFence::new(Arc::as_ptr(&self.device).cast())?;
            let fd = fence.reserve_fd()?;
            (Some(fence), Some(fd))
        } else {
            (None, None)
        };
        let job_id = self.state.jobs.submit(
            &self.device,
            transfers,
            &self.device.limits,
            in_fences,
            out_fence,
            notify.then_some(a.user_data),
        )?;
        // Words 3..8 are `job_id` to `out_fence`; the others, and the
        // rest of those, hold what the caller passed.
        const OUT: core::ops::Range<usize> = 3..8;
        const _: () = assert!(
            core::mem::offset_of!(Submit, job_id) == OUT.start * 8
                && core::mem::offset_of!(Submit, out_fence) + 4 == OUT.end * 8
                && core::mem::offset_of!(Submit, user_data) == OUT.end * 8
        );
        let out = Submit {
            job_id,
            out_fence: fd.as_ref().map_or(-1, |fd| fd.fd()),
            ..a
        };
        arg.write_fast(&out, OUT)?;
        if let Some(fd) = fd {
            fd.install();
        }
        Ok(())
    }

    fn job_notify(&self, arg: &ArgBuf) -> Result {
        let a: JobNotify = arg.read()?;
        if any_nonzero(&a.reserved) {
            return Err(EINVAL);
        }
        self.state.jobs.notify(a.job_id, a.user_data)
    }

    /// The `poll` file operation (see `node.rs`).
    ///
    /// # Safety
    ///
    /// `file` is this file, and `pt` the poll table of the call.
    pub(crate) unsafe fn poll(
        &self,
        file: *mut bindings::file,
        pt: *mut bindings::poll_table_struct,
    ) -> bindings::__poll_t {
        // SAFETY: The caller's guarantee; the tracker lives in `state`,
        // which outlives the file's release.
        unsafe { self.state.jobs.poll(file, pt) }
    }

    fn job_wait(&self, arg: &ArgBuf) -> Result {
        let a: JobWait = arg.read()?;
        if a.state != 0 || a.status != 0 || any_nonzero(&a.reserved) {
            return Err(EINVAL);
        }
        let (state, status) = match self
            .state
            .jobs
            .wait(a.job_id, Timeout::from_us(a.timeout_us))?
        {
            JobStatus::Pending => (JOB_PENDING, 0),
            JobStatus::Done(errno) => (JOB_DONE, errno),
        };
        arg.write(&JobWait { state, status, ..a })
    }

    /// Counts a wait and its timeout in the device statistics.
    fn note_wait<T>(&self, r: &Result<T>) {
        self.device.stats.waits.add(1, Relaxed);
        if matches!(r, Err(e) if *e == ETIMEDOUT) {
            self.device.stats.wait_timeouts.add(1, Relaxed);
        }
    }

    fn fence_wait(&self, arg: &ArgBuf) -> Result {
        let a: FenceWait = arg.read()?;
        if a.pad != 0 || any_nonzero(&a.reserved) || a.kind == 0 || a.kind & !FENCE_ALL != 0 {
            return Err(EINVAL);
        }
        let buf = self.buffer(a.handle)?;
        let r = buf
            .fence
            .wait_idle(a.kind, Timeout::from_us(a.timeout_us))
            .and_then(|()| buf.fence.check_error());
        self.note_wait(&r);
        r
    }

    fn completion_wait(&self, arg: &ArgBuf) -> Result {
        let a: CompletionWait = arg.read_fast()?;
        if a.count != 0 || any_nonzero(&a.reserved) {
            return Err(EINVAL);
        }
        let buf = self.buffer(a.handle)?;
        let r = buf
            .fence
            .wait_until(Timeout::from_us(a.timeout_us), |c| {
                c.completions >= a.expected
            })
            .map(|c| c.completions)
            .map_err(|(e, _)| e);
        self.note_wait(&r);
        // Word 3 is `count`; the others hold what the caller passed.
        const OUT: core::ops::Range<usize> = 3..4;
        const _: () = assert!(core::mem::offset_of!(CompletionWait, count) == OUT.start * 8);
        arg.write_fast(&CompletionWait { count: r?, ..a }, OUT)
    }

    fn completion_reset(&self, arg: &ArgBuf) -> Result {
        let a: CompletionReset = arg.read()?;
        if a.reserved != 0 {
            return Err(EINVAL);
        }
        self.buffer(a.handle)?.fence.reset_completions();
        Ok(())
    }
}

// The mmap length check rounds to pages; make sure that is the unit the
// handle cookie uses too.
const _: () = assert!(PAGE_SIZE == 1 << kernel::page::PAGE_SHIFT);
