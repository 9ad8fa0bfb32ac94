//! Un-offload: the run a trace recorded *with* activation offload would have been
//! without it ([`un_offload`]).
//!
//! # Why
//!
//! Under a memory budget below a run's peak, auto mode records its trace with
//! threshold offload on (recording without offload would run out of memory). In
//! such a trace an offloaded tensor is two allocations: `from`, packed
//! (`SavedPack(from)`) and freed once its copy to host is done, and `into`, the copy
//! back allocated in backward and unpacked (`SavedUnpack(into)`). The offload planner
//! ([`crate::offload`]) only takes allocations with exactly one pack and one unpack as
//! candidates, so it cannot decide again about those tensors. The recorder writes a
//! restore link ([`stweaver_core::Restore`]) for each copy back; this module rewrites
//! every link back into one allocation, so the planner sees the run without offload
//! and chooses the fewest bytes to move.
//!
//! # The rewrite
//!
//! For every link `from -> into`:
//! - `from` lives until `into`'s free: `from`'s own frees (requested and completed,
//!   the copy out) are dropped; unless the program held `from` past `into`'s free (or
//!   never let go of it: a view of a parameter, say), when `from` keeps its own frees and
//!   `into`'s are dropped instead;
//! - `into`'s `Alloc` is dropped, and so is `into` from the allocation table (the
//!   remaining allocations keep their order and are numbered again densely);
//! - `into`'s frees and saved-tensor events (`SavedUnpack(into)`, and a pack of it if
//!   any) become `from`'s.
//!
//! - a saved tensor's free (of any allocation packed or unpacked) completes when it is
//!   requested: in the recording the offloader's copy streams hold the tensors they copy
//!   (`record_stream`), so their frees complete later by timing-dependent amounts, which
//!   makes the recorded iterations differ and the steady state undetectable (measured on
//!   an H100 auto-mode recording at 0.8 x LB); without offload no copy stream holds them.
//!
//! Every other event, and every event's time stamp, stays. The result has no links.
//! It is valid whenever the input is: `from`'s events come before its free, `into`'s
//! after its `Alloc`, and `Trace::validate` puts `from`'s pack before `into`'s
//! `Alloc`; an allocation is in at most one link, so links do not chain.
//!
//! # When
//!
//! [`crate::offload::plan_with_budget`] normalises a trace with links before
//! anything else (the plan's `trace_digest` stays that of the trace it was given).
//! The ordinary [`crate::planning::plan_trace`] plans the trace as recorded, links
//! ignored: without a budget there is nothing to decide about offload, and the run
//! goes on making the requests it recorded.
//!
//! # Cost
//!
//! O(events + allocations + links) time and one copy of the trace.

use stweaver_core::{AllocId, Event, EventKind, Trace, TraceError};

/// Slot of an allocation not in a link.
const NONE: u32 = u32::MAX;

/// The trace without offload (module docs). Validates `trace` first: an invalid trace
/// (its links included) is an error. A trace without links comes back unchanged.
pub fn un_offload(trace: &Trace) -> Result<Trace, TraceError> {
    Ok(un_offload_with_releases(trace)?.0)
}

/// [`un_offload`], and for each allocation of the result (by `AllocId`) whose recording
/// offloaded it, where forward let go of it: the index, in the result's events, of the
/// first event after the dropped `FreeRequested` of its `from`. The program held the
/// tensor until then (the next layer reading it, say), so offloading it frees its device
/// memory no earlier, however soon its copy is done ([`crate::offload`]). `None`: not
/// offloaded in the recording (no such point known).
pub fn un_offload_with_releases(trace: &Trace) -> Result<(Trace, Vec<Option<usize>>), TraceError> {
    trace.validate()?;
    if trace.restores.is_empty() {
        return Ok((trace.clone(), vec![None; trace.allocations.len()]));
    }
    let n = trace.allocations.len();
    // For `into`: its `from`. For `from`: marked in `is_from`.
    let mut from_of: Vec<u32> = vec![NONE; n];
    let mut is_from: Vec<bool> = vec![false; n];
    for r in &trace.restores {
        from_of[r.into.index()] = r.from.0;
        is_from[r.from.index()] = true;
    }
    // Dense new ids of the kept allocations; an `into` takes its `from`'s.
    let mut new_id: Vec<u32> = vec![NONE; n];
    let mut allocations = Vec::with_capacity(n - trace.restores.len());
    for (i, a) in trace.allocations.iter().enumerate() {
        if from_of[i] == NONE {
            new_id[i] = allocations.len() as u32;
            allocations.push(*a);
        }
    }
    for (i, &f) in from_of.iter().enumerate() {
        if f != NONE {
            new_id[i] = new_id[f as usize];
        }
    }
    let id = |a: AllocId| AllocId(new_id[a.index()]);
    let linked_into = |a: AllocId| from_of[a.index()] != NONE;
    // A `from` the program held past its copy back's free (or never freed) outlives it:
    // the merged allocation ends with `from`'s free, and `into`'s frees go instead.
    let mut first_free: Vec<usize> = vec![usize::MAX; n];
    for (k, e) in trace.events.iter().enumerate() {
        if let EventKind::FreeRequested(a) | EventKind::FreeCompleted(a) = e.kind {
            first_free[a.index()] = first_free[a.index()].min(k);
        }
    }
    let mut outlives: Vec<bool> = vec![false; n];
    for r in &trace.restores {
        outlives[r.from.index()] = first_free[r.from.index()] == usize::MAX
            || first_free[r.from.index()] > first_free[r.into.index()];
    }
    let dropped_free = |a: AllocId| {
        let f = from_of[a.index()];
        (is_from[a.index()] && !outlives[a.index()]) || (f != NONE && outlives[f as usize])
    };
    // Saved tensors (packed or unpacked) whose free completes after it is requested: in
    // the run without offload their free completes at once (see the module docs).
    // (Deferred: other events between the requested and the completed free.)
    let mut saved_deferred: Vec<bool> = vec![false; allocations.len()];
    let mut saved: Vec<bool> = vec![false; allocations.len()];
    let mut requested_at: Vec<usize> = vec![usize::MAX; allocations.len()];
    for (k, e) in trace.events.iter().enumerate() {
        match e.kind {
            EventKind::SavedPack(a) | EventKind::SavedUnpack(a) => saved[id(a).index()] = true,
            EventKind::FreeRequested(a) if !dropped_free(a) => requested_at[id(a).index()] = k,
            EventKind::FreeCompleted(a) if !dropped_free(a) => {
                let n = id(a).index();
                saved_deferred[n] = requested_at[n].checked_add(1).is_some_and(|r| k > r);
            }
            _ => {}
        }
    }
    for (d, s) in saved_deferred.iter_mut().zip(&saved) {
        *d &= *s;
    }
    let mut events = Vec::with_capacity(trace.events.len());
    // A `from` never freed: the program never let go of it (`usize::MAX`: after the end).
    let mut released: Vec<Option<usize>> = vec![None; allocations.len()];
    for r in &trace.restores {
        released[id(r.from).index()] = Some(usize::MAX);
    }
    for e in &trace.events {
        let kind = match e.kind {
            EventKind::Alloc(a) if linked_into(a) => continue,
            EventKind::FreeRequested(a) if dropped_free(a) => {
                if is_from[a.index()] {
                    released[id(a).index()] = Some(events.len());
                }
                continue;
            }
            EventKind::FreeCompleted(a) if dropped_free(a) => continue,
            EventKind::FreeCompleted(a) if saved_deferred[id(a).index()] => continue,
            EventKind::FreeRequested(a) if saved_deferred[id(a).index()] => {
                for kind in [
                    EventKind::FreeRequested(id(a)),
                    EventKind::FreeCompleted(id(a)),
                ] {
                    events.push(Event {
                        kind,
                        time_us: e.time_us,
                    });
                }
                continue;
            }
            k => k.map_alloc(id),
        };
        events.push(Event {
            kind,
            time_us: e.time_us,
        });
    }
    let out = Trace {
        device: trace.device,
        allocations,
        events,
        labels: trace.labels.clone(),
        restores: Vec::new(),
    };
    debug_assert_eq!(out.validate(), Ok(()));
    Ok((out, released))
}

#[cfg(test)]
mod tests {
    use super::*;
    use stweaver_core::{Allocation, Bytes, DeviceId, Restore, StreamId};

    fn alloc(size: u64, preexisting: bool) -> Allocation {
        Allocation {
            size: Bytes(size),
            stream: StreamId(0),
            addr: 0,
            preexisting,
        }
    }

    fn trace(allocs: Vec<Allocation>, kinds: &[EventKind], restores: &[(u32, u32)]) -> Trace {
        Trace {
            device: DeviceId(0),
            allocations: allocs,
            events: kinds
                .iter()
                .enumerate()
                .map(|(i, &kind)| Event {
                    kind,
                    time_us: 10 * i as u64 + 1,
                })
                .collect(),
            labels: vec![],
            restores: restores
                .iter()
                .map(|&(f, t)| Restore {
                    from: AllocId(f),
                    into: AllocId(t),
                })
                .collect(),
        }
    }

    use EventKind::SavedUnpack as Unpack;
    use EventKind::{Alloc, FreeCompleted as Done, FreeRequested as Free, SavedPack as Pack};

    #[test]
    fn a_link_becomes_one_allocation_with_the_times_kept() {
        let (a, x, b) = (AllocId(0), AllocId(1), AllocId(2));
        let t = trace(
            vec![alloc(64, false), alloc(8, false), alloc(64, false)],
            &[
                Alloc(a),
                Pack(a),
                Free(a),
                Done(a),
                Alloc(x),
                Free(x),
                Alloc(b),
                Unpack(b),
                Free(b),
                Done(b),
            ],
            &[(0, 2)],
        );
        let u = un_offload(&t).unwrap();
        u.validate().unwrap();
        assert_eq!(u.allocations, vec![alloc(64, false), alloc(8, false)]);
        assert!(u.restores.is_empty());
        let (a, x) = (AllocId(0), AllocId(1));
        let kinds: Vec<_> = u.events.iter().map(|e| e.kind).collect();
        assert_eq!(
            kinds,
            vec![
                Alloc(a),
                Pack(a),
                Alloc(x),
                Free(x),
                Unpack(a),
                Free(a),
                Done(a)
            ]
        );
        let times: Vec<_> = u.events.iter().map(|e| e.time_us).collect();
        assert_eq!(times, vec![1, 11, 41, 51, 71, 81, 91]);
        // The peak without offload: both live at once; with it, one at a time.
        assert_eq!(u.lower_bound().bytes, Bytes(72));
        assert_eq!(t.lower_bound().bytes, Bytes(64));
    }

    #[test]
    fn a_saved_tensors_deferred_free_completes_when_requested() {
        // `s` is saved (packed, unpacked) and its free completes two events after it is
        // requested (a copy stream held it); `o` is not saved and keeps its deferral. A
        // link makes the trace one with offload.
        let (s, o, f, i) = (AllocId(0), AllocId(1), AllocId(2), AllocId(3));
        let t = trace(
            vec![
                alloc(64, false),
                alloc(64, false),
                alloc(8, false),
                alloc(8, false),
            ],
            &[
                Alloc(s),
                Alloc(o),
                Pack(s),
                Alloc(f),
                Pack(f),
                Free(f),
                Alloc(i),
                Unpack(i),
                Unpack(s),
                Free(s),
                Free(o),
                Free(i),
                Done(s),
                Done(o),
            ],
            &[(2, 3)],
        );
        let u = un_offload(&t).unwrap();
        u.validate().unwrap();
        let kinds: Vec<_> = u.events.iter().map(|e| e.kind).collect();
        let (s, o, f) = (AllocId(0), AllocId(1), AllocId(2));
        assert_eq!(
            kinds,
            vec![
                Alloc(s),
                Alloc(o),
                Pack(s),
                Alloc(f),
                Pack(f),
                Unpack(f),
                Unpack(s),
                Free(s),
                Done(s),
                Free(o),
                Free(f),
                Done(o),
            ]
        );
    }

    #[test]
    fn a_preexisting_offloaded_allocation_and_no_links() {
        let (p, b) = (AllocId(0), AllocId(1));
        let t = trace(
            vec![alloc(32, true), alloc(32, false)],
            &[Pack(p), Done(p), Alloc(b), Unpack(b)],
            &[(0, 1)],
        );
        let u = un_offload(&t).unwrap();
        assert_eq!(u.allocations, vec![alloc(32, true)]);
        let kinds: Vec<_> = u.events.iter().map(|e| e.kind).collect();
        assert_eq!(kinds, vec![Pack(p), Unpack(p)]);
        let plain = trace(vec![alloc(32, false)], &[Alloc(p), Free(p)], &[]);
        assert_eq!(un_offload(&plain).unwrap(), plain);
    }

    #[test]
    fn a_bad_link_is_an_error() {
        let (a, b) = (AllocId(0), AllocId(1));
        let t = trace(
            vec![alloc(64, false), alloc(64, false)],
            &[Alloc(a), Alloc(b), Pack(a), Free(a), Unpack(b)],
            &[(0, 1)],
        );
        assert!(matches!(
            un_offload(&t),
            Err(TraceError::RestoreOrder {
                problem: "is not packed",
                ..
            })
        ));
    }

    #[test]
    fn a_tensor_held_past_its_copy_back_is_released_where_the_program_let_go() {
        // a is packed, its copy back b made while the program still holds a; a's free
        // (the program letting go) comes after b's unpack.
        let (a, b, c) = (AllocId(0), AllocId(1), AllocId(2));
        let t = trace(
            vec![alloc(64, false), alloc(64, false), alloc(8, false)],
            &[
                Alloc(a),
                Pack(a),
                Alloc(b),
                Unpack(b),
                Alloc(c),
                Free(a),
                Free(b),
                Free(c),
            ],
            &[(0, 1)],
        );
        let (u, rel) = un_offload_with_releases(&t).unwrap();
        let kinds: Vec<_> = u.events.iter().map(|e| e.kind).collect();
        let c2 = AllocId(1);
        assert_eq!(
            kinds,
            vec![Alloc(a), Pack(a), Unpack(a), Alloc(c2), Free(a), Free(c2)]
        );
        // Released at the event after its dropped free: that of b, now a's.
        assert_eq!(rel, vec![Some(4), None]);
        // Never freed (a view of a parameter, offloaded every iteration): never released,
        // and the merged allocation lives on, so that later packs of it stay valid.
        let never = trace(
            vec![alloc(64, false), alloc(64, false), alloc(64, false)],
            &[
                Alloc(a),
                Pack(a),
                Alloc(b),
                Unpack(b),
                Free(b),
                Pack(a),
                Alloc(c),
                Free(c),
            ],
            &[(0, 1)],
        );
        let (u, rel) = un_offload_with_releases(&never).unwrap();
        u.validate().unwrap();
        let kinds: Vec<_> = u.events.iter().map(|e| e.kind).collect();
        assert_eq!(
            kinds,
            vec![Alloc(a), Pack(a), Unpack(a), Pack(a), Alloc(c2), Free(c2)]
        );
        assert_eq!(rel, vec![Some(usize::MAX), None]);
    }
}
