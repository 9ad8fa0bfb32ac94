//! Model-based property test of the online engine (bumpalo/talc style).
//!
//! Random programs of `malloc` / `free` / `record_stream` / stream progress /
//! `process_events` / `empty_cache` / markers / stat resets / limit changes / injected
//! device failures run against the engine on [`HostMemory`] and against a **reference
//! model** written independently and naively here: every arena is a `Vec` of segments in
//! address order, best fit is a linear scan, coalescing a full pass. After every step:
//!
//! - the engine's full [`DeviceStats`] equal the model's (every field, current, peak,
//!   allocated and freed);
//! - the engine's layout (every arena, every block: offset, size, state) equals the
//!   model's, so addresses are predicted exactly;
//! - the engine's own consistency check passes;
//! - no live or pending block overlaps another (address ranges), and every block's
//!   sentinel bytes, written at allocation, are intact when it is freed and again when
//!   its free completes (pending memory was not handed out meanwhile);
//! - `checkpoint` lists exactly the model's allocated blocks; `restore` (random earlier
//!   checkpoints, also after `empty_cache` gave their granules back, under the memory
//!   limit and injected map failures) frees exactly what is live, maps exactly the
//!   granules the model maps, and re-creates every checkpointed block at its address —
//!   or fails changing nothing but the mapping, as the model does;
//! - at the end, after freeing everything and `empty_cache`: nothing allocated, nothing
//!   reserved, no arena (a checkpointed engine keeps its arenas, empty); after dropping
//!   the engine: nothing mapped or reserved on the device and no event left; and a
//!   recorded trace validates and counts every request.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use stweaver_core::testkit::audit::never_alias;

use proptest::prelude::*;
use stweaver_core::engine::{
    BlockState, Checkpoint, DevicePtr, DeviceStats, Engine, EngineConfig, EngineError, HostMemory,
    MemoryLimit, PoolKind, StatArray,
};
use stweaver_core::{Bytes, DeviceId, EventKind, StreamId};

const G: u64 = 64 << 10;
const ARENA: u64 = 8 << 20;
const CAPACITY: u64 = 1 << 30;

// ---------------------------------------------------------------------- the model

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum St {
    Free,
    Alloc,
    Pending,
    Unmapped,
}

#[derive(Clone, Debug)]
struct Seg {
    off: u64,
    size: u64,
    st: St,
    requested: u64,
    handle: usize,
}

#[derive(Debug)]
struct MArena {
    stream: StreamId,
    kind: PoolKind,
    segs: Vec<Seg>,
}

#[derive(Debug)]
struct Pend {
    handle: usize,
    events: Vec<(StreamId, u64)>,
}

#[derive(Debug)]
struct Model {
    limit: u64,
    arenas: Vec<MArena>,
    stats: DeviceStats,
    /// Streams a block is used on besides its own, with the clock point its use was
    /// sealed at (`record_stream_enqueued`), if it was.
    uses: HashMap<usize, Vec<(StreamId, Option<u64>)>>,
    pending: Vec<Pend>,
    /// stream -> (events recorded, events passed)
    clocks: HashMap<StreamId, (u64, u64)>,
    fail_next_map: bool,
    /// Injected map failures the model saw happen.
    map_failures: u64,
    next_handle: usize,
    /// Handles whose free completed during the current step.
    completed: Vec<usize>,
    /// A checkpoint was taken: arenas are never released.
    keep: bool,
}

/// A checkpointed block in the model: (arena index, offset, size, requested).
type CpBlock = (usize, u64, u64, u64);

/// Why the model's restore failed (changing nothing but the mapping).
#[derive(Debug, PartialEq, Eq)]
enum RestoreFail {
    OutOfMemory,
    MapFailed,
}

fn inc(arr: &mut StatArray, k: usize, n: u64) {
    arr[0].increase(n);
    arr[k].increase(n);
}

fn dec(arr: &mut StatArray, k: usize, n: u64) {
    arr[0].decrease(n);
    arr[k].decrease(n);
}

fn settle_to(arr: &mut StatArray, k: usize, target: u64) {
    let cur = arr[k].current as u64;
    if target > cur {
        inc(arr, k, target - cur);
    } else if target < cur {
        dec(arr, k, cur - target);
    }
}

fn kidx(kind: PoolKind) -> usize {
    match kind {
        PoolKind::Small => 1,
        PoolKind::Large => 2,
    }
}

fn non_releasable(off: u64, size: u64) -> u64 {
    let lo = off.div_ceil(G) * G;
    let hi = (off + size) / G * G;
    size - hi.saturating_sub(lo)
}

impl Model {
    fn new(limit: u64) -> Model {
        Model {
            limit,
            arenas: Vec::new(),
            stats: DeviceStats::default(),
            uses: HashMap::new(),
            pending: Vec::new(),
            clocks: HashMap::new(),
            fail_next_map: false,
            map_failures: 0,
            next_handle: 0,
            completed: Vec::new(),
            keep: false,
        }
    }

    fn arena_of(&self, stream: StreamId, kind: PoolKind) -> Option<usize> {
        self.arenas
            .iter()
            .position(|a| a.stream == stream && a.kind == kind)
    }

    fn find(&self, handle: usize) -> (usize, usize) {
        for (ai, a) in self.arenas.iter().enumerate() {
            for (si, s) in a.segs.iter().enumerate() {
                if matches!(s.st, St::Alloc | St::Pending) && s.handle == handle {
                    return (ai, si);
                }
            }
        }
        panic!("model lost handle {handle}");
    }

    fn coalesce(segs: &mut Vec<Seg>) {
        let mut out: Vec<Seg> = Vec::with_capacity(segs.len());
        for s in segs.drain(..) {
            match out.last_mut() {
                Some(l) if l.st == s.st && matches!(s.st, St::Free | St::Unmapped) => {
                    l.size += s.size
                }
                _ => out.push(s),
            }
        }
        *segs = out;
    }

    fn settle(&mut self) {
        for kind in [PoolKind::Small, PoolKind::Large] {
            let (mut bytes, mut count) = (0, 0);
            for a in self.arenas.iter().filter(|a| a.kind == kind) {
                for s in a.segs.iter().filter(|s| s.st == St::Free) {
                    let nr = non_releasable(s.off, s.size);
                    bytes += nr;
                    count += u64::from(nr > 0);
                }
            }
            let k = kidx(kind);
            settle_to(&mut self.stats.inactive_split_bytes, k, bytes);
            settle_to(&mut self.stats.inactive_split, k, count);
        }
    }

    fn free_block(&mut self, handle: usize) {
        let (ai, si) = self.find(handle);
        let k = kidx(self.arenas[ai].kind);
        let seg = &mut self.arenas[ai].segs[si];
        dec(&mut self.stats.active, k, 1);
        dec(&mut self.stats.active_bytes, k, seg.size);
        dec(&mut self.stats.requested_bytes, k, seg.requested);
        seg.st = St::Free;
        seg.requested = 0;
        Self::coalesce(&mut self.arenas[ai].segs);
        self.uses.remove(&handle);
        self.completed.push(handle);
    }

    fn process(&mut self) {
        let clocks = &self.clocks;
        let (done, keep): (Vec<Pend>, Vec<Pend>) = std::mem::take(&mut self.pending)
            .into_iter()
            .partition(|p| p.events.iter().all(|(s, seq)| clocks[s].1 >= *seq));
        self.pending = keep;
        for p in done {
            self.free_block(p.handle);
        }
        self.settle();
    }

    fn release(&mut self) {
        self.stats.num_sync_all_streams += 1;
        for p in &self.pending {
            for (s, seq) in &p.events {
                let c = self.clocks.get_mut(s).unwrap();
                c.1 = c.1.max(*seq);
            }
        }
        for p in std::mem::take(&mut self.pending) {
            self.free_block(p.handle);
        }
        self.settle();
        let mut any = false;
        for a in &mut self.arenas {
            let k = kidx(a.kind);
            let mut out = Vec::new();
            for s in a.segs.drain(..) {
                // The model's arenas are all online ones, mapped granule by granule:
                // every wholly free granule is a whole unit (the host device refuses a
                // partial unmap, and the harness requires none).
                let (lo, hi) = (s.off.div_ceil(G) * G, (s.off + s.size) / G * G);
                if s.st != St::Free || hi <= lo {
                    out.push(s);
                    continue;
                }
                if lo > s.off {
                    out.push(Seg {
                        size: lo - s.off,
                        ..s.clone()
                    });
                }
                out.push(Seg {
                    off: lo,
                    size: hi - lo,
                    st: St::Unmapped,
                    ..s.clone()
                });
                if s.off + s.size > hi {
                    out.push(Seg {
                        off: hi,
                        size: s.off + s.size - hi,
                        ..s.clone()
                    });
                }
                dec(&mut self.stats.reserved_bytes, k, hi - lo);
                self.stats.num_device_free += 1;
                any = true;
            }
            a.segs = out;
            Self::coalesce(&mut a.segs);
        }
        if any {
            for c in self.clocks.values_mut() {
                c.1 = c.0;
            }
        }
        self.settle();
        let mut i = 0;
        while i < self.arenas.len() && !self.keep {
            let a = &self.arenas[i];
            if a.segs.len() == 1 && a.segs[0].st == St::Unmapped {
                dec(&mut self.stats.segment, kidx(a.kind), 1);
                self.arenas.remove(i);
            } else {
                i += 1;
            }
        }
    }

    /// The run of free and unmapped space holding `need` bytes that needs the fewest
    /// bytes mapped, the lowest on ties, as the (offset, length) ranges to map.
    fn find_run(segs: &[Seg], need: u64) -> Option<Vec<(u64, u64)>> {
        let mut best: Option<Vec<(u64, u64)>> = None;
        let cost = |p: &Vec<(u64, u64)>| p.iter().map(|r| r.1).sum::<u64>();
        for (i, _) in segs
            .iter()
            .enumerate()
            .filter(|(_, s)| s.st == St::Unmapped)
        {
            let start = if i > 0 && segs[i - 1].st == St::Free {
                i - 1
            } else {
                i
            };
            let (mut sum, mut j) = (0, start);
            while j < segs.len() && sum < need && matches!(segs[j].st, St::Free | St::Unmapped) {
                sum += segs[j].size;
                j += 1;
            }
            if sum < need {
                continue;
            }
            let (mut left, mut j, mut plan) = (need, start, Vec::new());
            while left > 0 {
                let s = &segs[j];
                if s.st == St::Free {
                    left -= left.min(s.size);
                } else {
                    let m = (left.div_ceil(G) * G).min(s.size);
                    plan.push((s.off, m));
                    left -= left.min(m);
                }
                j += 1;
            }
            if best.as_ref().is_none_or(|b| cost(&plan) < cost(b)) {
                best = Some(plan);
            }
        }
        best
    }

    fn map_range(segs: &mut Vec<Seg>, off: u64, m: u64) {
        let i = segs.iter().position(|s| s.off == off).unwrap();
        assert_eq!(segs[i].st, St::Unmapped);
        let s = segs[i].clone();
        segs[i] = Seg {
            size: m,
            st: St::Free,
            ..s.clone()
        };
        if m < s.size {
            segs.insert(
                i + 1,
                Seg {
                    off: off + m,
                    size: s.size - m,
                    ..s
                },
            );
        }
    }

    fn malloc(&mut self, size: u64, stream: StreamId) -> Option<usize> {
        let rounded = size.div_ceil(512) * 512;
        let kind = PoolKind::of(rounded);
        let k = kidx(kind);
        if !self.pending.is_empty() {
            self.process();
        }
        let mut retried = false;
        loop {
            let Some(a) = self.arena_of(stream, kind) else {
                self.arenas.push(MArena {
                    stream,
                    kind,
                    segs: vec![Seg {
                        off: 0,
                        size: ARENA,
                        st: St::Unmapped,
                        requested: 0,
                        handle: 0,
                    }],
                });
                inc(&mut self.stats.segment, k, 1);
                continue;
            };
            let best_in = |segs: &[Seg]| {
                segs.iter()
                    .enumerate()
                    .filter(|(_, s)| s.st == St::Free && s.size >= rounded)
                    .min_by_key(|(_, s)| (s.size, s.off))
                    .map(|(i, _)| i)
            };
            // A small request that does not fit its arena takes a free block of the
            // stream's large arena (counted there) before its own arena grows.
            let (a, k, best) = match best_in(&self.arenas[a].segs) {
                Some(i) => (a, k, Some(i)),
                None => match (kind, self.arena_of(stream, PoolKind::Large)) {
                    (PoolKind::Small, Some(la)) => match best_in(&self.arenas[la].segs) {
                        Some(i) => (la, kidx(PoolKind::Large), Some(i)),
                        None => (a, k, None),
                    },
                    _ => (a, k, None),
                },
            };
            let segs = &mut self.arenas[a].segs;
            if let Some(i) = best {
                let h = self.next_handle;
                self.next_handle += 1;
                let s = segs[i].clone();
                segs[i] = Seg {
                    size: rounded,
                    st: St::Alloc,
                    requested: size,
                    handle: h,
                    ..s.clone()
                };
                if s.size > rounded {
                    segs.insert(
                        i + 1,
                        Seg {
                            off: s.off + rounded,
                            size: s.size - rounded,
                            ..s
                        },
                    );
                }
                let st = &mut self.stats;
                inc(&mut st.allocation, k, 1);
                inc(&mut st.allocated_bytes, k, rounded);
                inc(&mut st.active, k, 1);
                inc(&mut st.active_bytes, k, rounded);
                inc(&mut st.requested_bytes, k, size);
                self.uses.insert(h, Vec::new());
                self.settle();
                return Some(h);
            }
            let refused = match Self::find_run(segs, rounded) {
                None => true,
                Some(plan) => {
                    let needed: u64 = plan.iter().map(|p| p.1).sum();
                    let reserved = self.stats.reserved_bytes[0].current as u64;
                    if needed > self.limit.saturating_sub(reserved) {
                        true
                    } else {
                        let mut failed = false;
                        for (off, m) in plan {
                            if self.fail_next_map {
                                self.fail_next_map = false;
                                self.map_failures += 1;
                                failed = true;
                                continue;
                            }
                            Self::map_range(&mut self.arenas[a].segs, off, m);
                            inc(&mut self.stats.reserved_bytes, k, m);
                            self.stats.num_device_alloc += 1;
                        }
                        Self::coalesce(&mut self.arenas[a].segs);
                        self.settle();
                        failed
                    }
                }
            };
            if !refused {
                continue;
            }
            if !retried {
                retried = true;
                self.release();
                self.stats.num_alloc_retries += 1;
                continue;
            }
            self.stats.num_ooms += 1;
            return None;
        }
    }

    fn free(&mut self, handle: usize) {
        let (ai, si) = self.find(handle);
        let k = kidx(self.arenas[ai].kind);
        let size = self.arenas[ai].segs[si].size;
        dec(&mut self.stats.allocation, k, 1);
        dec(&mut self.stats.allocated_bytes, k, size);
        let uses = self.uses.get(&handle).cloned().unwrap_or_default();
        if uses.is_empty() {
            self.free_block(handle);
            self.settle();
            return;
        }
        self.arenas[ai].segs[si].st = St::Pending;
        let mut events = Vec::new();
        for (s, sealed) in uses {
            let seq = match sealed {
                Some(seq) => seq,
                None => {
                    let c = self.clocks.entry(s).or_insert((0, 0));
                    c.0 += 1;
                    c.0
                }
            };
            events.push((s, seq));
        }
        self.pending.push(Pend { handle, events });
    }

    fn record_stream(&mut self, handle: usize, stream: StreamId) {
        let (ai, _) = self.find(handle);
        if self.arenas[ai].stream != stream {
            let u = self.uses.get_mut(&handle).unwrap();
            match u.iter_mut().find(|(s, _)| *s == stream) {
                Some(e) => e.1 = None, // more work may follow: a seal is dropped
                None => u.push((stream, None)),
            }
        }
    }

    /// `record_stream_enqueued`: an event recorded on `stream` now, which the free waits for.
    fn record_stream_enqueued(&mut self, handle: usize, stream: StreamId) {
        let (ai, _) = self.find(handle);
        if self.arenas[ai].stream != stream {
            let c = self.clocks.entry(stream).or_insert((0, 0));
            c.0 += 1;
            let seq = c.0;
            let u = self.uses.get_mut(&handle).unwrap();
            match u.iter_mut().find(|(s, _)| *s == stream) {
                Some(e) => e.1 = Some(seq),
                None => u.push((stream, Some(seq))),
            }
        }
    }

    /// The allocated blocks; arenas are kept from now on.
    fn checkpoint(&mut self) -> Vec<CpBlock> {
        self.keep = true;
        let mut out = Vec::new();
        for (ai, a) in self.arenas.iter().enumerate() {
            for s in a.segs.iter().filter(|s| s.st == St::Alloc) {
                out.push((ai, s.off, s.size, s.requested));
            }
        }
        out
    }

    /// Restores `cp` (in the engine's address order): maps the unmapped granules the
    /// checkpointed ranges cover, frees every allocated block (waiting for every stream
    /// once if any of them or an earlier free needs it), re-creates the checkpointed
    /// blocks. Returns (freed handles, created handles).
    fn restore(&mut self, cp: &[CpBlock]) -> Result<(Vec<usize>, Vec<usize>), RestoreFail> {
        // 1. The unmapped pieces of the granules covering each range, each piece carved
        //    once (later ranges sharing a granule find it taken).
        let mut pieces: Vec<(usize, u64, u64)> = Vec::new();
        let mut carved_to: HashMap<usize, u64> = HashMap::new();
        for &(ai, off, size, _) in cp {
            let lo = (off / G * G).max(carved_to.get(&ai).copied().unwrap_or(0));
            let hi = (off + size).div_ceil(G) * G;
            for s in self.arenas[ai].segs.iter().filter(|s| s.st == St::Unmapped) {
                let (a, z) = (s.off.max(lo), (s.off + s.size).min(hi));
                if a < z {
                    pieces.push((ai, a, z - a));
                }
            }
            carved_to.insert(ai, hi.max(carved_to.get(&ai).copied().unwrap_or(0)));
        }
        if !pieces.is_empty() {
            let total: u64 = pieces.iter().map(|p| p.2).sum();
            if self.stats.reserved_bytes[0].current as u64 + total > self.limit {
                return Err(RestoreFail::OutOfMemory);
            }
            let mut failed = false;
            for &(ai, off, len) in &pieces {
                if self.fail_next_map {
                    self.fail_next_map = false;
                    self.map_failures += 1;
                    failed = true;
                    continue;
                }
                let segs = &mut self.arenas[ai].segs;
                let i = segs
                    .iter()
                    .position(|s| {
                        s.st == St::Unmapped && s.off <= off && off + len <= s.off + s.size
                    })
                    .unwrap();
                let s = segs[i].clone();
                let mut repl = Vec::new();
                if s.off < off {
                    repl.push(Seg {
                        size: off - s.off,
                        ..s.clone()
                    });
                }
                repl.push(Seg {
                    off,
                    size: len,
                    st: St::Free,
                    ..s.clone()
                });
                if off + len < s.off + s.size {
                    repl.push(Seg {
                        off: off + len,
                        size: s.off + s.size - off - len,
                        ..s
                    });
                }
                segs.splice(i..=i, repl);
                let k = kidx(self.arenas[ai].kind);
                inc(&mut self.stats.reserved_bytes, k, len);
                self.stats.num_device_alloc += 1;
            }
            for a in &mut self.arenas {
                Self::coalesce(&mut a.segs);
            }
            self.settle();
            if failed {
                return Err(RestoreFail::MapFailed);
            }
        }
        // 2. Free everything allocated.
        let allocated: Vec<usize> = self
            .arenas
            .iter()
            .flat_map(|a| a.segs.iter())
            .filter(|s| s.st == St::Alloc)
            .map(|s| s.handle)
            .collect();
        let (waiting, at_once): (Vec<usize>, Vec<usize>) = allocated
            .iter()
            .partition(|&h| self.uses.get(h).is_some_and(|u| !u.is_empty()));
        let sync = !waiting.is_empty() || !self.pending.is_empty();
        for &h in &allocated {
            let (ai, si) = self.find(h);
            let k = kidx(self.arenas[ai].kind);
            let size = self.arenas[ai].segs[si].size;
            dec(&mut self.stats.allocation, k, 1);
            dec(&mut self.stats.allocated_bytes, k, size);
        }
        for &h in &at_once {
            self.free_block(h);
        }
        self.settle();
        if sync {
            self.stats.num_sync_all_streams += 1;
            for c in self.clocks.values_mut() {
                c.1 = c.0;
            }
            for &h in &waiting {
                self.free_block(h);
            }
            for p in std::mem::take(&mut self.pending) {
                self.free_block(p.handle);
            }
            self.settle();
        }
        // 3. Re-create the checkpointed blocks.
        let mut created = Vec::new();
        for &(ai, off, size, requested) in cp {
            let k = kidx(self.arenas[ai].kind);
            let segs = &mut self.arenas[ai].segs;
            let i = segs
                .iter()
                .position(|s| s.st == St::Free && s.off <= off && off + size <= s.off + s.size)
                .expect("a checkpointed range is free after the frees");
            let h = self.next_handle;
            self.next_handle += 1;
            let s = segs[i].clone();
            let mut repl = Vec::new();
            if s.off < off {
                repl.push(Seg {
                    size: off - s.off,
                    ..s.clone()
                });
            }
            repl.push(Seg {
                off,
                size,
                st: St::Alloc,
                requested,
                handle: h,
            });
            if off + size < s.off + s.size {
                repl.push(Seg {
                    off: off + size,
                    size: s.off + s.size - off - size,
                    ..s
                });
            }
            segs.splice(i..=i, repl);
            let st = &mut self.stats;
            inc(&mut st.allocation, k, 1);
            inc(&mut st.allocated_bytes, k, size);
            inc(&mut st.active, k, 1);
            inc(&mut st.active_bytes, k, size);
            inc(&mut st.requested_bytes, k, requested);
            self.uses.insert(h, Vec::new());
            self.settle();
            created.push(h);
        }
        Ok((allocated, created))
    }

    fn pass_next(&mut self, stream: StreamId) {
        let c = self.clocks.entry(stream).or_insert((0, 0));
        if c.1 < c.0 {
            c.1 += 1;
        }
    }

    fn pass_all(&mut self, stream: StreamId) {
        let c = self.clocks.entry(stream).or_insert((0, 0));
        c.1 = c.0;
    }
}

// ---------------------------------------------------------------------- programs

#[derive(Clone, Debug)]
enum Op {
    Alloc { size: u64, stream: u8 },
    Free { pick: usize },
    RecordStream { pick: usize, stream: u8 },
    RecordStreamEnqueued { pick: usize, stream: u8 },
    PassNext { stream: u8 },
    PassAll { stream: u8 },
    ProcessEvents,
    EmptyCache,
    Mark,
    ResetPeaks,
    ResetAccumulated,
    SetLimit { mib: u64 },
    FailNextMap,
    Checkpoint,
    Restore { pick: usize },
}

fn size() -> impl Strategy<Value = u64> {
    prop_oneof![
        6 => 1u64..=8192,
        3 => 8192u64..=(256 << 10),
        2 => (256u64 << 10)..=(2560 << 10),
    ]
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        30 => (size(), 0u8..3).prop_map(|(size, stream)| Op::Alloc { size, stream }),
        20 => any::<usize>().prop_map(|pick| Op::Free { pick }),
        6 => (any::<usize>(), 0u8..4).prop_map(|(pick, stream)| Op::RecordStream { pick, stream }),
        4 => (any::<usize>(), 0u8..4).prop_map(|(pick, stream)| Op::RecordStreamEnqueued { pick, stream }),
        4 => (0u8..4).prop_map(|stream| Op::PassNext { stream }),
        2 => (0u8..4).prop_map(|stream| Op::PassAll { stream }),
        2 => Just(Op::ProcessEvents),
        2 => Just(Op::EmptyCache),
        1 => Just(Op::Mark),
        1 => Just(Op::ResetPeaks),
        1 => Just(Op::ResetAccumulated),
        1 => (2u64..=48).prop_map(|mib| Op::SetLimit { mib }),
        1 => Just(Op::FailNextMap),
        2 => Just(Op::Checkpoint),
        2 => any::<usize>().prop_map(|pick| Op::Restore { pick }),
    ]
}

/// A block the harness holds: live, or freed and pending.
#[derive(Debug, Clone, Copy)]
struct Held {
    handle: usize,
    len: u64,
    byte: u8,
}

struct Harness {
    host: Arc<HostMemory>,
    engine: Engine<Arc<HostMemory>>,
    model: Model,
    /// Live (not yet freed) allocations: handle -> ptr.
    live: Vec<(usize, u64)>,
    /// Every block not yet returned (live or pending), by address.
    held: BTreeMap<u64, Held>,
    ptr_of: HashMap<usize, u64>,
    allocs: usize,
    frees: usize,
    completions: usize,
    /// Checkpoints taken (the last few): the engine's and the model's.
    checkpoints: Vec<(Checkpoint, Vec<CpBlock>)>,
    restores: usize,
    failed_restores: usize,
}

fn stream(s: u8) -> StreamId {
    StreamId(100 + u64::from(s))
}

impl Harness {
    fn new(limit_mib: u64, trace: bool) -> Harness {
        let host = Arc::new(HostMemory::new(Bytes(CAPACITY), Bytes(G)));
        let engine = Engine::new(
            host.clone(),
            EngineConfig {
                device: DeviceId(0),
                limit: MemoryLimit::Bytes(Bytes(limit_mib << 20)),
                arena_size: Some(Bytes(ARENA)),
                record_trace: trace,
                ..EngineConfig::default()
            },
        )
        .unwrap();
        Harness {
            host,
            engine,
            model: Model::new(limit_mib << 20),
            live: Vec::new(),
            held: BTreeMap::new(),
            ptr_of: HashMap::new(),
            allocs: 0,
            frees: 0,
            completions: 0,
            checkpoints: Vec::new(),
            restores: 0,
            failed_restores: 0,
        }
    }

    /// Forgets the blocks whose frees the model completed this step.
    fn retire_completed(&mut self) -> Result<(), TestCaseError> {
        for h in std::mem::take(&mut self.model.completed) {
            let p = self.ptr_of.remove(&h).unwrap();
            let held = self.held.remove(&p).unwrap();
            prop_assert_eq!(held.handle, h);
            self.completions += 1;
        }
        Ok(())
    }

    /// Checks the sentinel of every freed block still pending: nobody was handed its
    /// memory while other streams may use it.
    fn check_pending(&self) -> Result<(), TestCaseError> {
        for p in &self.model.pending {
            let ptr = self.ptr_of[&p.handle];
            let held = self.held[&ptr];
            let ok = self
                .host
                .check(DevicePtr(ptr), Bytes(held.len), held.byte)
                .unwrap();
            prop_assert!(
                ok,
                "sentinel of pending handle {} at {:#x} overwritten",
                p.handle,
                ptr
            );
        }
        Ok(())
    }

    /// Holds `[p, p + len)` for model handle `h` (a new or a re-created block): no held
    /// block overlaps it (invariant 1, never alias), and it is filled with `h`'s sentinel.
    fn hold(&mut self, h: usize, p: u64, len: u64, what: &str) -> Result<(), TestCaseError> {
        if let Err((q, other)) = never_alias(&self.held, |h| h.len, p, len) {
            prop_assert!(
                false,
                "{} {:#x}+{:#x} overlaps held block {:#x}+{:#x}",
                what,
                p,
                len,
                q,
                other.len
            );
        }
        let byte = (h % 255 + 1) as u8;
        self.host.fill(DevicePtr(p), Bytes(len), byte).unwrap();
        self.held.insert(
            p,
            Held {
                handle: h,
                len,
                byte,
            },
        );
        self.ptr_of.insert(h, p);
        self.live.push((h, p));
        self.allocs += 1;
        Ok(())
    }

    fn step(&mut self, op: &Op) -> Result<(), TestCaseError> {
        self.check_pending()?;
        match *op {
            Op::Alloc { size, stream: s } => {
                let want = self.model.malloc(size, stream(s));
                let got = self.engine.malloc(Bytes(size), stream(s));
                self.retire_completed()?;
                match (want, got) {
                    (Some(h), Ok(ptr)) => {
                        let p = ptr.get();
                        let len = size.div_ceil(512) * 512;
                        prop_assert_eq!(p % 512, 0);
                        self.hold(h, p, len, "new block")?;
                    }
                    (None, Err(EngineError::OutOfMemory { requested, .. })) => {
                        prop_assert_eq!(requested, Bytes(size));
                    }
                    (w, g) => prop_assert!(false, "model {:?}, engine {:?}", w, g),
                }
            }
            Op::Free { pick } if !self.live.is_empty() => {
                let (h, p) = self.live.swap_remove(pick % self.live.len());
                let held = self.held[&p];
                let ok = self
                    .host
                    .check(DevicePtr(p), Bytes(held.len), held.byte)
                    .unwrap();
                prop_assert!(ok, "sentinel of live handle {} at {:#x} overwritten", h, p);
                self.model.free(h);
                self.engine.free(DevicePtr(p)).unwrap();
                self.frees += 1;
                self.retire_completed()?;
                // A second free is an error and changes nothing.
                let again = self.engine.free(DevicePtr(p));
                prop_assert!(matches!(
                    again,
                    Err(EngineError::UnknownPointer(_) | EngineError::AlreadyFreed(_))
                ));
            }
            Op::Free { .. } => {
                let bogus = DevicePtr(0xdead_0000);
                prop_assert_eq!(
                    self.engine.free(bogus),
                    Err(EngineError::UnknownPointer(bogus))
                );
            }
            Op::RecordStream { pick, stream: s } if !self.live.is_empty() => {
                let (h, p) = self.live[pick % self.live.len()];
                self.model.record_stream(h, stream(s));
                self.engine.record_stream(DevicePtr(p), stream(s)).unwrap();
            }
            Op::RecordStream { .. } => {}
            Op::RecordStreamEnqueued { pick, stream: s } if !self.live.is_empty() => {
                let (h, p) = self.live[pick % self.live.len()];
                self.model.record_stream_enqueued(h, stream(s));
                self.engine
                    .record_stream_enqueued(DevicePtr(p), stream(s))
                    .unwrap();
            }
            Op::RecordStreamEnqueued { .. } => {}
            Op::PassNext { stream: s } => {
                self.model.pass_next(stream(s));
                self.host.events().pass_next(stream(s));
            }
            Op::PassAll { stream: s } => {
                self.model.pass_all(stream(s));
                self.host.events().pass_all(stream(s));
            }
            Op::ProcessEvents => {
                if !self.model.pending.is_empty() {
                    self.model.process();
                }
                self.engine.process_events().unwrap();
                self.retire_completed()?;
            }
            Op::EmptyCache => {
                self.model.release();
                self.engine.empty_cache().unwrap();
                self.retire_completed()?;
            }
            Op::Mark => self.engine.mark_iteration().unwrap(),
            Op::ResetPeaks => {
                self.model.stats.reset_peak();
                self.engine.reset_peak_stats().unwrap();
            }
            Op::ResetAccumulated => {
                self.model.stats.reset_accumulated();
                self.engine.reset_accumulated_stats().unwrap();
            }
            Op::SetLimit { mib } => {
                self.model.limit = mib << 20;
                self.engine
                    .set_memory_limit(MemoryLimit::Bytes(Bytes(mib << 20)))
                    .unwrap();
            }
            Op::FailNextMap => {
                self.model.fail_next_map = true;
                self.host.fail_map_in(1);
            }
            Op::Checkpoint => {
                let cp = self.engine.checkpoint().unwrap();
                let mut want = self.model.checkpoint();
                let mut got = self.to_model_blocks(&cp);
                let in_engine_order = got.clone();
                got.sort();
                want.sort();
                prop_assert_eq!(got, want, "checkpoint lists the allocated blocks");
                if self.checkpoints.len() == 3 {
                    self.checkpoints.remove(0);
                }
                self.checkpoints.push((cp, in_engine_order));
            }
            Op::Restore { .. } if self.checkpoints.is_empty() => {}
            Op::Restore { pick } => {
                let (cp, mcp) = self.checkpoints[pick % self.checkpoints.len()].clone();
                for &(h, p) in &self.live {
                    let held = self.held[&p];
                    let ok = self
                        .host
                        .check(DevicePtr(p), Bytes(held.len), held.byte)
                        .unwrap();
                    prop_assert!(ok, "sentinel of live handle {} at {:#x} overwritten", h, p);
                }
                let want = self.model.restore(&mcp);
                let got = self.engine.restore(&cp);
                match (want, got) {
                    (Ok((freed, created)), Ok(r)) => {
                        let mut want_freed: Vec<u64> =
                            freed.iter().map(|h| self.ptr_of[h]).collect();
                        want_freed.sort();
                        let got_freed: Vec<u64> = r.freed.iter().map(|b| b.addr.get()).collect();
                        prop_assert_eq!(got_freed, want_freed, "restore frees what is live");
                        prop_assert_eq!(freed.len(), self.live.len());
                        self.frees += freed.len();
                        self.live.clear();
                        self.retire_completed()?;
                        prop_assert!(self.held.is_empty(), "pending blocks left: {:?}", self.held);
                        let got: Vec<(u64, u64, u64)> = r
                            .created
                            .iter()
                            .map(|b| (b.addr.get(), b.size.get(), b.requested.get()))
                            .collect();
                        let want: Vec<(u64, u64, u64)> = cp
                            .blocks()
                            .iter()
                            .map(|b| (b.addr.get(), b.size.get(), b.requested.get()))
                            .collect();
                        prop_assert_eq!(got, want, "restore re-creates the checkpoint");
                        for (b, h) in r.created.iter().zip(created) {
                            self.hold(h, b.addr.get(), b.size.get(), "re-created block")?;
                        }
                        self.restores += 1;
                    }
                    (Err(RestoreFail::OutOfMemory), Err(EngineError::OutOfMemory { .. }))
                    | (Err(RestoreFail::MapFailed), Err(EngineError::Device(_))) => {
                        self.failed_restores += 1;
                    }
                    (w, g) => prop_assert!(false, "restore: model {:?}, engine {:?}", w, g),
                }
            }
        }
        self.compare()
    }

    /// The engine's checkpoint as model blocks (arena index, offset, size, requested),
    /// in the engine's order.
    fn to_model_blocks(&self, cp: &Checkpoint) -> Vec<CpBlock> {
        let snap = self.engine.snapshot().unwrap();
        cp.blocks()
            .iter()
            .map(|b| {
                let seg = snap
                    .iter()
                    .find(|s| s.base <= b.addr && b.addr.get() < s.base.get() + s.len.get())
                    .expect("checkpointed block inside an arena");
                let ai = self.model.arena_of(seg.stream, seg.pool).unwrap();
                (
                    ai,
                    b.addr.get() - seg.base.get(),
                    b.size.get(),
                    b.requested.get(),
                )
            })
            .collect()
    }

    fn compare(&self) -> Result<(), TestCaseError> {
        self.engine
            .check_invariants()
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert_eq!(self.engine.stats().unwrap(), self.model.stats);
        let snap = self.engine.snapshot().unwrap();
        prop_assert_eq!(snap.len(), self.model.arenas.len());
        for seg in &snap {
            let a = self.model.arena_of(seg.stream, seg.pool).unwrap();
            let got: Vec<(u64, u64, St)> = seg
                .blocks
                .iter()
                .map(|b| {
                    let st = match b.state {
                        BlockState::Free => St::Free,
                        BlockState::Allocated => St::Alloc,
                        BlockState::PendingFree => St::Pending,
                        BlockState::Unmapped => St::Unmapped,
                        other => panic!("block left {other:?}"),
                    };
                    (b.addr.get() - seg.base.get(), b.size.get(), st)
                })
                .collect();
            let want: Vec<(u64, u64, St)> = self.model.arenas[a]
                .segs
                .iter()
                .map(|s| (s.off, s.size, s.st))
                .collect();
            prop_assert_eq!(got, want, "arena {:?}/{:?}", seg.stream, seg.pool);
        }
        Ok(())
    }
}

fn run_program(limit_mib: u64, trace: bool, ops: &[Op]) -> Result<(), TestCaseError> {
    let mut h = Harness::new(limit_mib, trace);
    for op in ops {
        h.step(op)?;
    }
    // Free everything, give everything back.
    while !h.live.is_empty() {
        h.step(&Op::Free { pick: 0 })?;
    }
    h.step(&Op::EmptyCache)?;
    prop_assert!(h.held.is_empty(), "blocks never returned: {:?}", h.held);
    let s = h.engine.stats().unwrap();
    for (name, arr) in [
        ("allocated_bytes", s.allocated_bytes),
        ("active_bytes", s.active_bytes),
        ("requested_bytes", s.requested_bytes),
        ("reserved_bytes", s.reserved_bytes),
        ("inactive_split_bytes", s.inactive_split_bytes),
    ] {
        prop_assert_eq!(arr[0].current, 0, "{} left over", name);
    }
    prop_assert_eq!(h.host.mapped_bytes(), Bytes(0));
    prop_assert_eq!(
        h.host.counters().partial_unmaps,
        0,
        "part of a mapping unmapped"
    );
    // A checkpointed engine keeps its (empty) arenas; otherwise none is left.
    let kept = if h.model.keep {
        h.model.arenas.len()
    } else {
        0
    };
    prop_assert_eq!(s.segment[0].current, kept as i64);
    prop_assert_eq!(h.host.reservations(), kept);
    if trace {
        let t = h.engine.take_trace().unwrap().unwrap();
        if !t.events.is_empty() {
            t.validate()
                .map_err(|e| TestCaseError::fail(e.to_string()))?;
        }
        let count = |f: fn(&EventKind) -> bool| t.events.iter().filter(|e| f(&e.kind)).count();
        prop_assert_eq!(count(|k| matches!(k, EventKind::Alloc(_))), h.allocs);
        prop_assert_eq!(count(|k| matches!(k, EventKind::FreeRequested(_))), h.frees);
        prop_assert_eq!(
            count(|k| matches!(k, EventKind::FreeCompleted(_))),
            h.completions
        );
        let marks = ops.iter().filter(|o| matches!(o, Op::Mark)).count();
        prop_assert_eq!(count(|k| matches!(k, EventKind::Marker { .. })), marks);
    } else {
        prop_assert!(h.engine.take_trace().unwrap().is_none());
    }
    let host = h.host.clone();
    drop(h);
    prop_assert_eq!(host.events().live_events(), 0);
    prop_assert_eq!(host.reservations(), 0);
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn engine_matches_reference_model(
        limit_mib in prop_oneof![Just(4u64), Just(12), Just(64)],
        trace in any::<bool>(),
        ops in proptest::collection::vec(op(), 1..160),
    ) {
        run_program(limit_mib, trace, &ops)?;
    }
}

/// A hand-written program through the model: cross-stream free, OOM retry, release.
#[test]
fn scripted_program() {
    let s = |size, stream| Op::Alloc { size, stream };
    let ops = vec![
        s(3000, 0),
        s(2 << 20, 0),
        s(100, 1),
        Op::RecordStream { pick: 0, stream: 2 },
        Op::RecordStream { pick: 0, stream: 3 },
        Op::Free { pick: 0 },
        s(3000, 0),
        Op::PassNext { stream: 2 },
        Op::ProcessEvents,
        Op::PassNext { stream: 3 },
        s(512, 0),
        s(3 << 20, 0),
        s(3 << 20, 0),
        Op::FailNextMap,
        s(1 << 20, 2),
        Op::EmptyCache,
    ];
    run_program(4, true, &ops).unwrap();
}

/// The program generator reaches every path the model checks: out-of-memory with and
/// without a successful retry, deferred frees completed by stream progress and by
/// release, injected map failures, unmapping, both pools.
#[test]
fn generated_programs_cover_the_interesting_paths() {
    use proptest::strategy::ValueTree;
    use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};
    let mut runner = TestRunner::new_with_rng(
        Config::default(),
        TestRng::from_seed(RngAlgorithm::ChaCha, &[7; 32]),
    );
    let program = (
        prop_oneof![Just(4u64), Just(12), Just(64)],
        proptest::collection::vec(op(), 1..160),
    );
    let mut totals = [0i64; 11];
    for _ in 0..150 {
        let (limit, ops) = program.new_tree(&mut runner).unwrap().current();
        let mut h = Harness::new(limit, false);
        let mut deferred = 0;
        for op in &ops {
            let before = h.model.pending.len();
            h.step(op).unwrap();
            deferred += usize::from(h.model.pending.len() > before);
        }
        let s = h.engine.stats().unwrap();
        for (t, v) in totals.iter_mut().zip([
            s.num_ooms,
            s.num_alloc_retries - s.num_ooms,
            deferred as i64,
            s.num_device_free,
            s.num_device_alloc,
            s.allocation[1].allocated,
            s.allocation[2].allocated,
            s.inactive_split_bytes[0].peak,
            h.model.map_failures as i64,
            h.restores as i64,
            h.failed_restores as i64,
        ]) {
            *t += v;
        }
    }
    let names = [
        "ooms",
        "successful retries",
        "deferred frees",
        "unmaps",
        "maps",
        "small allocs",
        "large allocs",
        "non-releasable peaks",
        "injected map failures",
        "checkpoint restores",
        "refused restores (limit or map failure)",
    ];
    for (n, t) in names.iter().zip(totals) {
        eprintln!("{n}: {t}");
        assert!(t > 0, "no program reached {n}");
    }
}
