//! Pause / resume with addresses kept (issue #17): give the physical memory behind the
//! tagged blocks back to the device while their virtual addresses stay reserved, so
//! every pointer (tensor, captured CUDA graph) stays valid; resume maps fresh memory at
//! the same addresses and restores the contents. What RL frameworks (SGLang, NeMo-RL via
//! `torch_memory_saver`) need between rollout and training.
//!
//! # Tags
//!
//! Every allocation carries the engine's *current tag* ([`Engine::set_tag`], a `u32`;
//! 0 = untagged, never paused) at the time it is made. [`Engine::pause`] with `Some(t)`
//! pauses the blocks of tag `t`; with `None`, every tagged block (tags ≠ 0), as
//! `torch_memory_saver.pause()` does. Each pause is a *set*, resumed by the same key:
//! pausing a tag that is paused (or anything while `None` is paused, or `None` while
//! anything is) is [`PauseError::AlreadyPaused`]; resuming what is not paused,
//! [`PauseError::NotPaused`]; `resume(None)` resumes every set.
//!
//! # Pause
//!
//! 1. Refuse while a plan is served ([`PauseError::PlanServed`]: the plan pool maps whole
//!    first-touched ranges shared by planned blocks of every tag, and its cursor would
//!    place requests on paused ranges; unload the plan first).
//! 2. Release cached memory as `empty_cache` does (every pending free completes after its
//!    events, every wholly free unit is unmapped): the only free memory left is what
//!    shares a unit with a live block. Not in an engine with
//!    [`EngineConfig::keep_cache`] (a CUDA graph's private pool, whose free memory may be
//!    a captured graph's scratch): there wholly free units stay mapped, and the free
//!    parts of paused groups are mapped again at resume.
//! 3. Synchronise the device (queued kernels may still write the tensors).
//! 4. Locked: split every arena's mapped units into *groups* (runs of units joined by a
//!    live block straddling their boundary, `arena::pause`). A group holding a live block
//!    of the key is paused whole; if it also holds a block of another tag (or untagged)
//!    the pause is refused naming the unit ([`PauseError::MixedUnit`]): units are the
//!    granule in online arenas, so tensors of different tags sharing a 2 MiB granule
//!    cannot be paused apart (allocate them in separate regions, or with
//!    `STWEAVER`'s large pool, which never shares a granule between small requests of
//!    different tags only by chance). A group with a pending free, or being (un)mapped by
//!    another thread, is [`PauseError::Busy`]. Nothing has changed when it refuses.
//!    Accepted groups are marked `Paused` (blocks and the free parts of their units) and
//!    their units leave the unit map; `reserved_bytes` drops by their size at once and the
//!    bytes count as being mapped until unmapped (so the memory limit stays conservative).
//! 5. Unlocked: when `keep`, give each paused group one host buffer (see *Host memory*)
//!    and copy its live blocks' bytes into it ([`DeviceMemory::copy_to_host`], one copy
//!    per run of address-contiguous blocks), then unmap each unit (one `unmap` per unit).
//!    A failed copy changes nothing (groups un-paused, nothing unmapped); a failed unmap
//!    maps the group's already-unmapped units back, restores their bytes and un-pauses
//!    it; the pause then returns the error with the other groups paused.
//!
//! A paused live block stays in the pointer map and counts as allocated
//! (`allocated_bytes`, `active_bytes`, `requested_bytes` unchanged: the tensor exists);
//! [`Engine::free`] and [`Engine::record_stream`] of it are [`EngineError::Paused`]. Its
//! memory and the free parts of its units count in [`Engine::paused_bytes`], not in
//! `reserved_bytes` (`num_device_free` counts the unmaps). New allocations never land in
//! paused ranges: paused blocks are neither free nor unmapped, so best fit, growth,
//! release and checkpoint claims all pass them by.
//!
//! # Resume
//!
//! Checks that the paused bytes fit the memory limit beside what is reserved and being
//! mapped ([`PauseError::OverLimit`], everything stays paused), then, unlocked, maps each
//! unit again at its address (one `map` per unit, as before: invariant 9) and copies the
//! saved bytes back ([`DeviceMemory::copy_from_host`], one copy per run), and, locked,
//! un-marks the blocks (fillers become free memory again, coalesced) and puts the host
//! buffers in the cache of the resumed key. A refused map or copy unmaps what this resume
//! mapped and leaves everything paused (contents still in their buffers).
//!
//! # Host memory
//!
//! Kept contents live in host buffers from [`DeviceMemory::alloc_host`]: page-locked
//! memory on CUDA (`cuMemHostAlloc`), which the device copies to and from at the link's
//! speed (about 50 GB/s on an H100) where fresh pageable memory, page-faulted in during the
//! copy and staged by the driver, ran at 1.3 GB/s (pause) and 5.7 GB/s (resume). Pinning
//! memory is itself slow (the kernel locks every page), and the colocated-RL use pauses and
//! resumes the same tag hundreds of times, so buffers are **reused**:
//!
//! - A pause takes one buffer per paused group, sized to the group's live bytes, first
//!   from the engine's cache of the same key (`Some(tag)` and `None` are separate keys):
//!   the smallest cached buffer that holds the bytes and is at most twice their size;
//!   otherwise it allocates one. Cached buffers of the key that the pause did not use are
//!   freed (the key's blocks changed), so a key's cache never outgrows its last pause.
//! - A resume puts the buffers of the resumed sets in the cache of their keys, not freed.
//! - So the host memory held is, per key, the live bytes of its last kept-contents pause
//!   (in use while paused, cached after resume), about the bytes the key's tensors occupy
//!   on the device. It is freed by [`Engine::release_host_buffers`] (the cache; buffers of
//!   sets paused now stay with them) or when the engine is dropped. Not by
//!   [`Engine::empty_cache`], nor by the release a pause makes: frameworks empty the device
//!   cache between pause cycles, and pinning again would cost more than the copy saves.
//! - When the device cannot allocate a buffer (host out of page-lockable memory) the group
//!   is saved to pageable memory instead ([`HostBuffer::pageable`]): slower, never a
//!   failed pause. Such a buffer is dropped at resume, not cached (the next pause tries
//!   the device again). [`PauseReport::fallbacks`] and [`HostBackup::fallbacks`] count them.
//! - [`Engine::host_backup`] tells the bytes held (in use, cached, page-locked), the
//!   buffers allocated and the fallbacks. A pause in flight counts its buffers once it
//!   is recorded (not while it copies); a resume in flight counts them until it ends.
//!
//! # Cost
//!
//! Pause: one `empty_cache`, one device synchronisation, O(blocks · log units + units)
//! to find the groups, one host buffer per group (from the cache after the key's first
//! pause), one device→host copy per run of contiguous paused live blocks (their bytes)
//! and one unmap per unit. Resume: one map per unit and one host→device copy per run.
//! Nothing on the malloc/free hot path but the tag store at allocation.
//!
//! Checkpoints ([`Engine::checkpoint`]) hold `Allocated` blocks only: a paused block is
//! not in one, and a restore over a paused range fails rather than alias.
//!
//! [`EngineConfig::keep_cache`]: super::EngineConfig::keep_cache

use super::arena::{PausedGroup, UnitGroup};
use super::device::{DeviceError, DeviceMemory, DevicePtr, HostBuffer};
use super::stats::{self, PoolKind};
use super::{BlockState, Engine, EngineError, State};
use crate::units::Bytes;

/// Why a pause or resume was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PauseError {
    #[error("tag 0 means untagged and cannot be paused")]
    Untagged,
    #[error("{} is already paused", key_name(*.0))]
    AlreadyPaused(Option<u32>),
    #[error("{} is not paused", key_name(*.0))]
    NotPaused(Option<u32>),
    #[error("a plan is served: unload it before pausing")]
    PlanServed,
    #[error(
        "mapped unit {addr} + {size} holds blocks of tag {tag} and of tag {other} \
         (0: untagged): they cannot be paused apart"
    )]
    MixedUnit {
        addr: DevicePtr,
        size: Bytes,
        tag: u32,
        other: u32,
    },
    #[error("mapped unit {addr} + {size} is busy (a pending free or a mapping in flight)")]
    Busy { addr: DevicePtr, size: Bytes },
    #[error(
        "resuming {needed} would pass the memory limit {limit} ({reserved} reserved): \
         everything stays paused"
    )]
    OverLimit {
        needed: Bytes,
        reserved: Bytes,
        limit: Bytes,
    },
}

fn key_name(key: Option<u32>) -> String {
    match key {
        Some(t) => format!("tag {t}"),
        None => "every tag".to_string(),
    }
}

/// What a pause (or resume) moved.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PauseReport {
    /// Live blocks paused (resumed).
    pub blocks: usize,
    /// Mapped units unmapped (mapped again).
    pub units: usize,
    /// Physical bytes given back (mapped again).
    pub bytes: Bytes,
    /// Bytes copied to (from) the host.
    pub copied: Bytes,
    /// Of `copied`, bytes copied through page-locked host memory.
    pub pinned: Bytes,
    /// Pause: groups whose host buffer could not be allocated by the device
    /// ([`DeviceMemory::alloc_host`] failed) and were saved to pageable memory instead.
    pub fallbacks: usize,
    /// Pause: host buffers allocated; the others came from the engine's cache.
    pub host_allocs: usize,
}

impl PauseReport {
    fn count(&mut self, g: &Group, blocks: usize) {
        self.blocks += blocks;
        self.units += g.paused.units.len();
        self.bytes = Bytes(self.bytes.get() + g.bytes());
        if let Some(s) = &g.saved {
            self.copied = Bytes(self.copied.get() + s.bytes());
            if s.buf.is_pinned() {
                self.pinned = Bytes(self.pinned.get() + s.bytes());
            }
        }
    }
}

/// Host memory held for kept contents ([`Engine::host_backup`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HostBackup {
    /// Bytes of host buffers holding paused contents now.
    pub in_use: Bytes,
    /// Bytes of host buffers kept idle for the next pause of their key.
    pub cached: Bytes,
    /// Of `in_use + cached`, page-locked bytes.
    pub pinned: Bytes,
    /// Host buffers allocated so far ([`DeviceMemory::alloc_host`] calls that succeeded).
    pub allocations: u64,
    /// Groups saved to pageable memory so far because [`DeviceMemory::alloc_host`] failed.
    pub fallbacks: u64,
}

/// The saved contents of one paused group: one host buffer, and where each run of
/// contiguous live bytes sits in it.
#[derive(Debug)]
struct Saved {
    buf: HostBuffer,
    /// (device address, offset in `buf`, length) of each run, by address.
    runs: Vec<(u64, usize, usize)>,
    /// Pageable memory taken because the device's `alloc_host` failed: dropped at
    /// resume rather than cached.
    fallback: bool,
}

impl Saved {
    fn bytes(&self) -> u64 {
        self.runs.iter().map(|r| r.2 as u64).sum()
    }
}

/// One paused group with its pool and the saved bytes of its live blocks.
#[derive(Debug)]
struct Group {
    paused: PausedGroup,
    kind: PoolKind,
    saved: Option<Saved>,
}

impl Group {
    fn bytes(&self) -> u64 {
        self.paused.hi - self.paused.lo
    }
}

/// The runs of contiguous bytes of `blocks` ((address, size) each), with their offsets
/// in one buffer of all of them, and that buffer's length.
fn runs_of(blocks: &[(u64, u64)]) -> (Vec<(u64, usize, usize)>, usize) {
    let mut sorted = blocks.to_vec();
    sorted.sort_unstable();
    let mut runs: Vec<(u64, usize, usize)> = Vec::new();
    let mut total = 0usize;
    for (addr, size) in sorted {
        let size = size as usize;
        match runs.last_mut() {
            Some(r) if r.0 + r.2 as u64 == addr => r.2 += size,
            _ => runs.push((addr, total, size)),
        }
        total += size;
    }
    (runs, total)
}

/// The smallest of `cached` that holds `need` bytes without wasting more than as much
/// again, taken out.
fn take_fit(cached: &mut Vec<HostBuffer>, need: usize) -> Option<HostBuffer> {
    let at = cached
        .iter()
        .enumerate()
        .filter(|(_, b)| b.len() >= need && b.len() / 2 <= need)
        .min_by_key(|(_, b)| b.len())
        .map(|(i, _)| i)?;
    Some(cached.swap_remove(at))
}

/// One pause ([`Engine::pause`]) still in force.
#[derive(Debug)]
struct PausedSet {
    key: Option<u32>,
    groups: Vec<Group>,
}

/// The engine's pause state (in `State`).
#[derive(Debug, Default)]
pub(super) struct Pauses {
    /// The tag of allocations made from now on.
    pub tag: u32,
    sets: Vec<PausedSet>,
    /// Keys and bytes of the sets a resume in flight has taken out (still paused).
    resuming: Vec<Option<u32>>,
    resuming_bytes: u64,
    /// Host bytes (all, page-locked) of the sets a resume in flight has taken out.
    resuming_host: (u64, u64),
    /// Host buffers of resumed kept-contents pauses, by pause key, for the key's next
    /// pause (module documentation, "Host memory").
    host_cache: Vec<(Option<u32>, Vec<HostBuffer>)>,
    host_allocs: u64,
    host_fallbacks: u64,
}

impl Pauses {
    fn keys(&self) -> impl Iterator<Item = Option<u32>> + '_ {
        self.sets
            .iter()
            .map(|s| s.key)
            .chain(self.resuming.iter().copied())
    }

    fn bytes(&self) -> u64 {
        let set_bytes: u64 = self
            .sets
            .iter()
            .flat_map(|s| &s.groups)
            .map(Group::bytes)
            .sum();
        set_bytes + self.resuming_bytes
    }

    /// The cached host buffers of `key`, taken out (empty if none).
    fn take_cache(&mut self, key: Option<u32>) -> Vec<HostBuffer> {
        match self.host_cache.iter().position(|c| c.0 == key) {
            Some(at) => self.host_cache.swap_remove(at).1,
            None => Vec::new(),
        }
    }

    /// Keeps `saved`'s buffer for the next pause of `key` (a fallback buffer is handed
    /// back to be dropped instead).
    fn stash(&mut self, key: Option<u32>, saved: Saved) -> Option<HostBuffer> {
        if saved.fallback {
            return Some(saved.buf);
        }
        match self.host_cache.iter_mut().find(|c| c.0 == key) {
            Some(c) => c.1.push(saved.buf),
            None => self.host_cache.push((key, vec![saved.buf])),
        }
        None
    }

    fn host_backup(&self) -> HostBackup {
        let (mut in_use, mut pinned) = self.resuming_host;
        for s in self
            .sets
            .iter()
            .flat_map(|s| &s.groups)
            .flat_map(|g| &g.saved)
        {
            in_use += s.buf.len() as u64;
            if s.buf.is_pinned() {
                pinned += s.buf.len() as u64;
            }
        }
        let mut cached = 0;
        for b in self.host_cache.iter().flat_map(|c| &c.1) {
            cached += b.len() as u64;
            if b.is_pinned() {
                pinned += b.len() as u64;
            }
        }
        HostBackup {
            in_use: Bytes(in_use),
            cached: Bytes(cached),
            pinned: Bytes(pinned),
            allocations: self.host_allocs,
            fallbacks: self.host_fallbacks,
        }
    }
}

/// Host bytes (all, page-locked) of the buffers of `sets`.
fn host_of(sets: &[PausedSet]) -> (u64, u64) {
    let mut out = (0, 0);
    for s in sets.iter().flat_map(|s| &s.groups).flat_map(|g| &g.saved) {
        out.0 += s.buf.len() as u64;
        if s.buf.is_pinned() {
            out.1 += s.buf.len() as u64;
        }
    }
    out
}

fn matches(key: Option<u32>, tag: u32) -> bool {
    match key {
        Some(t) => tag == t,
        None => tag != 0,
    }
}

impl<D: DeviceMemory> Engine<D> {
    /// Sets the tag of allocations made from now on (0: untagged). O(1).
    pub fn set_tag(&self, tag: u32) -> Result<(), EngineError> {
        self.lock()?.pauses.tag = tag;
        Ok(())
    }

    /// The tag allocations get now.
    pub fn tag(&self) -> Result<u32, EngineError> {
        Ok(self.lock()?.pauses.tag)
    }

    /// Bytes of address space whose physical memory is paused now (not in
    /// `reserved_bytes`).
    pub fn paused_bytes(&self) -> Result<Bytes, EngineError> {
        Ok(Bytes(self.lock()?.pauses.bytes()))
    }

    /// The host memory held for kept contents: in use by paused sets, and cached for
    /// the next pause (module documentation, "Host memory").
    pub fn host_backup(&self) -> Result<HostBackup, EngineError> {
        Ok(self.lock()?.pauses.host_backup())
    }

    /// Frees every cached host buffer (those of resumed pauses, kept for the next
    /// pause of their key); the buffers of sets paused now stay. Returns the bytes
    /// freed. Not part of [`Engine::empty_cache`]: frameworks empty the device cache
    /// between pause cycles, and a page-locked buffer costs more to allocate again than
    /// the copy it speeds up.
    pub fn release_host_buffers(&self) -> Result<Bytes, EngineError> {
        let cache = std::mem::take(&mut self.lock()?.pauses.host_cache);
        let freed: u64 = cache
            .iter()
            .flat_map(|c| &c.1)
            .map(|b| b.len() as u64)
            .sum();
        drop(cache); // unlocked: freeing page-locked memory can take a while
        Ok(Bytes(freed))
    }

    /// The keys paused now (`None`: every tag), in pause order.
    pub fn paused_tags(&self) -> Result<Vec<Option<u32>>, EngineError> {
        Ok(self.lock()?.pauses.keys().collect())
    }

    /// Pauses the blocks of `tag` (`None`: every tagged block), keeping their contents
    /// on the host when `keep` (module documentation).
    pub fn pause(&self, tag: Option<u32>, keep: bool) -> Result<PauseReport, EngineError> {
        self.pause_check(&*self.lock()?, tag)?;
        if !self.keep_cache {
            self.release(None)?;
        }
        self.dev.synchronize()?;
        let mut st = self.lock()?;
        self.pause_check(&st, tag)?;
        // Find and check every group before changing anything.
        let mut chosen: Vec<(u32, UnitGroup, u32, PoolKind)> = Vec::new();
        for a in st.arenas.arena_ids() {
            let kind = st.arenas.arena(a).map_or(PoolKind::Large, |x| x.kind);
            for g in st.arenas.unit_groups(a) {
                let (addr, size) = (DevicePtr(g.lo), Bytes(g.hi - g.lo));
                let mut anchor = None;
                let mut other = None;
                let mut busy = false;
                for &i in &g.blocks {
                    let b = st.arenas.block(i);
                    match b.state {
                        BlockState::Free => {}
                        BlockState::Allocated if matches(tag, b.tag) => {
                            anchor.get_or_insert((i, b.tag));
                        }
                        BlockState::Allocated => {
                            other.get_or_insert(b.tag);
                        }
                        _ => busy = true,
                    }
                }
                let Some((anchor, t)) = anchor else {
                    continue;
                };
                if let Some(other) = other {
                    return Err(PauseError::MixedUnit {
                        addr,
                        size,
                        tag: t,
                        other,
                    }
                    .into());
                }
                if busy {
                    return Err(PauseError::Busy { addr, size }.into());
                }
                chosen.push((a, g, anchor, kind));
            }
        }
        let mut groups: Vec<Group> = Vec::with_capacity(chosen.len());
        for (a, g, anchor, kind) in chosen {
            match st.arenas.pause_group(a, g.lo, g.hi, anchor) {
                Ok(paused) => groups.push(Group {
                    paused,
                    kind,
                    saved: None,
                }),
                Err(e) => {
                    for g in &groups {
                        st.arenas.resume_group(&g.paused);
                    }
                    st.settle_inactive();
                    return Err(e.into());
                }
            }
        }
        let total: u64 = groups.iter().map(Group::bytes).sum();
        for g in &groups {
            stats::decrease(&mut st.stats.reserved_bytes, g.kind, g.bytes());
        }
        st.mapping += total;
        st.settle_inactive();
        // Keep the arenas' view of the live blocks to copy (addresses and sizes).
        let live: Vec<Vec<(u64, u64)>> = groups
            .iter()
            .map(|g| {
                g.paused
                    .blocks
                    .iter()
                    .map(|&i| st.arenas.block(i))
                    .filter(|b| b.requested > 0)
                    .map(|b| (b.addr, b.size))
                    .collect()
            })
            .collect();
        let mut cached = if keep {
            st.pauses.take_cache(tag)
        } else {
            Vec::new()
        };
        drop(st);

        // One host buffer per group: a cached one of this key that fits, else a new one
        // from the device, else (host out of page-locked memory) pageable memory.
        let (mut allocs, mut fallbacks) = (0usize, 0usize);
        if keep {
            for (g, blocks) in groups.iter_mut().zip(&live) {
                let (runs, need) = runs_of(blocks);
                if need == 0 {
                    continue;
                }
                let mut fallback = false;
                let buf = match take_fit(&mut cached, need) {
                    Some(b) => b,
                    None => match self.dev.alloc_host(Bytes(need as u64)) {
                        Ok(b) if b.len() >= need => {
                            allocs += 1;
                            b
                        }
                        _ => {
                            fallback = true;
                            fallbacks += 1;
                            HostBuffer::pageable(need)
                        }
                    },
                };
                g.saved = Some(Saved {
                    buf,
                    runs,
                    fallback,
                });
            }
        }
        // Cached buffers this pause did not use: the key's blocks changed, free them.
        drop(cached);

        // Copies (all before any unmap: a failure changes nothing).
        let mut copy_err = None;
        'copy: for g in groups.iter_mut() {
            let Some(Saved { buf, runs, .. }) = g.saved.as_mut() else {
                continue;
            };
            let out = buf.as_mut_slice();
            for &(addr, off, len) in runs.iter() {
                if let Err(e) = self
                    .dev
                    .copy_to_host(DevicePtr(addr), &mut out[off..off + len])
                {
                    copy_err = Some(e);
                    break 'copy;
                }
            }
        }
        let mut failed: Vec<(usize, DeviceError)> = Vec::new();
        if copy_err.is_none() {
            for (k, g) in groups.iter().enumerate() {
                for (done, &(s, e)) in g.paused.units.iter().enumerate() {
                    if let Err(err) = self.dev.unmap(DevicePtr(s), Bytes(e - s)) {
                        // Back as it was: the units unmapped so far, mapped and filled again.
                        let back = self.map_and_restore(&g.paused.units[..done], g.saved.as_ref());
                        failed.push((k, back.err().unwrap_or(err)));
                        break;
                    }
                }
            }
        }

        let mut st = self.lock()?;
        st.mapping -= total;
        let undo: Vec<usize> = match copy_err {
            Some(_) => (0..groups.len()).collect(),
            None => failed.iter().map(|f| f.0).collect(),
        };
        let mut dropped: Vec<HostBuffer> = Vec::new();
        for &k in undo.iter().rev() {
            let mut g = groups.remove(k);
            st.arenas.resume_group(&g.paused);
            stats::increase(&mut st.stats.reserved_bytes, g.kind, g.bytes());
            // Its buffer stays for the next pause of the key.
            if let Some(s) = g.saved.take() {
                dropped.extend(st.pauses.stash(tag, s));
            }
        }
        let mut report = PauseReport {
            fallbacks,
            host_allocs: allocs,
            ..PauseReport::default()
        };
        st.pauses.host_allocs += allocs as u64;
        st.pauses.host_fallbacks += fallbacks as u64;
        for g in &groups {
            let blocks = g
                .paused
                .blocks
                .iter()
                .filter(|&&i| st.arenas.block(i).requested > 0)
                .count();
            report.count(g, blocks);
        }
        st.stats.num_device_free += report.units as i64;
        // Recorded even with nothing in it (a pause of a tag with no memory resumes
        // fine); not after a failed copy, which paused nothing.
        if copy_err.is_none() {
            st.pauses.sets.push(PausedSet { key: tag, groups });
        }
        st.settle_inactive();
        drop(st);
        drop(dropped);
        if let Some(e) = copy_err.or(failed.into_iter().next().map(|f| f.1)) {
            return Err(e.into());
        }
        Ok(report)
    }

    fn pause_check(&self, st: &State, tag: Option<u32>) -> Result<(), EngineError> {
        if tag == Some(0) {
            return Err(PauseError::Untagged.into());
        }
        if st.plan.is_some() {
            return Err(PauseError::PlanServed.into());
        }
        let clash = st
            .pauses
            .keys()
            .any(|k| tag.is_none() || k.is_none() || k == tag);
        if clash {
            return Err(PauseError::AlreadyPaused(tag).into());
        }
        Ok(())
    }

    /// Resumes the pause of `tag` (`None`: every pause in force): the same addresses,
    /// fresh physical memory, the saved contents (module documentation).
    pub fn resume(&self, tag: Option<u32>) -> Result<PauseReport, EngineError> {
        let mut st = self.lock()?;
        let (sets, rest): (Vec<PausedSet>, Vec<PausedSet>) = std::mem::take(&mut st.pauses.sets)
            .into_iter()
            .partition(|s| tag.is_none() || s.key == tag);
        st.pauses.sets = rest;
        if sets.is_empty() {
            return Err(PauseError::NotPaused(tag).into());
        }
        let needed: u64 = sets.iter().flat_map(|s| &s.groups).map(Group::bytes).sum();
        let reserved = st.stats.reserved_bytes[0].current as u64 + st.mapping;
        if reserved.saturating_add(needed) > st.limit {
            let limit = st.limit;
            st.pauses.sets.extend(sets);
            return Err(PauseError::OverLimit {
                needed: Bytes(needed),
                reserved: Bytes(reserved),
                limit: Bytes(limit),
            }
            .into());
        }
        st.mapping += needed;
        st.pauses.resuming.extend(sets.iter().map(|s| s.key));
        st.pauses.resuming_bytes += needed;
        let host = host_of(&sets);
        st.pauses.resuming_host.0 += host.0;
        st.pauses.resuming_host.1 += host.1;
        let ours = sets;
        drop(st);

        let groups: Vec<&Group> = ours.iter().flat_map(|s| &s.groups).collect();
        let mut err = None;
        let mut done = 0;
        for g in &groups {
            if let Err(e) = self.map_and_restore(&g.paused.units, g.saved.as_ref()) {
                err = Some(e);
                break;
            }
            done += 1;
        }
        if err.is_some() {
            // Back to paused: unmap what this resume mapped (contents are still saved).
            for g in &groups[..done] {
                for &(s, e) in &g.paused.units {
                    let _ = self.dev.unmap(DevicePtr(s), Bytes(e - s));
                }
            }
        }

        let mut st = self.lock()?;
        st.mapping -= needed;
        st.pauses.resuming_bytes -= needed;
        st.pauses.resuming_host.0 -= host.0;
        st.pauses.resuming_host.1 -= host.1;
        for s in &ours {
            if let Some(at) = st.pauses.resuming.iter().position(|&k| k == s.key) {
                st.pauses.resuming.remove(at);
            }
        }
        if let Some(e) = err {
            st.pauses.sets.extend(ours);
            return Err(e.into());
        }
        let mut report = PauseReport::default();
        for g in groups {
            st.arenas.resume_group(&g.paused);
            stats::increase(&mut st.stats.reserved_bytes, g.kind, g.bytes());
            let blocks = g
                .paused
                .blocks
                .iter()
                .filter(|&&i| st.arenas.block(i).state == BlockState::Allocated)
                .count();
            report.count(g, blocks);
        }
        st.stats.num_device_alloc += report.units as i64;
        // The host buffers stay (cached) for the next pause of their key.
        let mut dropped: Vec<HostBuffer> = Vec::new();
        for set in ours {
            for g in set.groups {
                if let Some(s) = g.saved {
                    dropped.extend(st.pauses.stash(set.key, s));
                }
            }
        }
        st.settle_inactive();
        drop(st);
        drop(dropped);
        Ok(report)
    }

    /// Maps `units` (one device call each) and copies `saved` back; on failure unmaps
    /// what it mapped. Called with the lock released.
    fn map_and_restore(
        &self,
        units: &[(u64, u64)],
        saved: Option<&Saved>,
    ) -> Result<(), DeviceError> {
        let undo = |n: usize| {
            for &(s, e) in &units[..n] {
                let _ = self.dev.unmap(DevicePtr(s), Bytes(e - s));
            }
        };
        for (n, &(s, e)) in units.iter().enumerate() {
            if let Err(err) = self.dev.map(DevicePtr(s), Bytes(e - s)) {
                undo(n);
                return Err(err);
            }
        }
        let Some(saved) = saved else {
            return Ok(());
        };
        let data = saved.buf.as_slice();
        for &(addr, off, len) in &saved.runs {
            if let Err(err) = self
                .dev
                .copy_from_host(DevicePtr(addr), &data[off..off + len])
            {
                undo(units.len());
                return Err(err);
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn contiguous_blocks_make_one_run_and_offsets_follow_each_other() {
        let (runs, total) = runs_of(&[(300, 50), (100, 100), (200, 100), (500, 8)]);
        assert_eq!(runs, vec![(100, 0, 250), (500, 250, 8)]);
        assert_eq!(total, 258);
        assert_eq!(runs_of(&[]), (vec![], 0));
    }

    #[test]
    fn a_cached_buffer_fits_when_large_enough_and_at_most_twice_the_need() {
        let mut cached: Vec<HostBuffer> = [100, 40, 64, 1000]
            .iter()
            .map(|&n| HostBuffer::pageable(n))
            .collect();
        assert_eq!(take_fit(&mut cached, 50).map(|b| b.len()), Some(64));
        assert_eq!(take_fit(&mut cached, 50).map(|b| b.len()), Some(100));
        assert!(
            take_fit(&mut cached, 50).is_none(),
            "1000 wastes too much, 40 is short"
        );
        assert_eq!(take_fit(&mut cached, 40).map(|b| b.len()), Some(40));
        assert_eq!(take_fit(&mut cached, 600).map(|b| b.len()), Some(1000));
        assert!(cached.is_empty());
    }
}
