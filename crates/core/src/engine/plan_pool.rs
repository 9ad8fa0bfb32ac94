//! Plan mode helpers that look at a whole plan once, at load: who uses which part of
//! the pool (streams), and the steady slice of a plan for switching mid-run.
//!
//! # Streams in one pool
//!
//! [`stream_ranges`] lists, per stream of the plan, the union of the pool ranges its
//! requests use (sorted, disjoint), and flags each request whose range meets another
//! stream's union (for an iteration request, another stream's *iteration* requests'
//! union: no prologue request starts after it, so only those can use its range next):
//! its block's free is then stream-deferred (an event recorded on its
//! own stream, the existing `record_stream` machinery), so whichever stream uses the
//! range next cannot start before the work queued on the freeing stream has passed the
//! free. A request no other stream ever plans on is reused in its own stream's order,
//! which needs no event — as in PyTorch's per-stream pools. O(n log n) in the number
//! of requests.
//!
//! # The steady slice
//!
//! [`steady_slice`] keeps a plan's iteration sections only (every class's), for an engine that switches
//! to the plan after serving the first iterations online ([`super::Engine::switch_to_plan`]):
//! the prologue's requests (parameters, optimizer state, the first iterations) were made
//! already and live in the online arenas. The ranges of the pool that no iteration
//! request ever uses — the room the planner kept for persistent tensors, which live
//! through the whole steady state — are squeezed out: with the used ranges'
//! union `U` sorted, every offset `o` moves down by the total length of the gaps of
//! `U` below it. The map is increasing and is a translation on each used range; since
//! no iteration request straddles a gap (a gap is unused at every tick), two requests
//! that were disjoint in address stay disjoint, and those live at the same time never
//! overlap — the slice is as valid as the plan (and is verified again on load). O(n log n).
//!
//! # Plans that would do worse than online
//!
//! [`servable_from_start`] refuses, for plan mode, a plan without an iteration section
//! whose trace had more requests left to dynamic serving than planned (token-dependent
//! shapes: Qwen2-MoE's eager experts, variable sequence lengths). Such a plan is the
//! recorded run's one-shot layout: its dynamic requests take the pool's holes, collide
//! with planned ones and spill into the fallback arena, next to a pool that stays
//! reserved — on the H200, MoE served that way reserved 9.97 GiB against 9.49 GiB
//! online. O(1).

use crate::plan::{ClassSection, Plan, PlannedRequest};
use crate::units::{Bytes, Offset, StreamId};

/// The block length a request takes in the pool: its size rounded up to `align`.
fn len_of(r: &PlannedRequest, align: u64) -> u64 {
    r.size.get().div_ceil(align) * align
}

/// Sorts and merges ranges into a union of disjoint ones.
fn union(mut v: Vec<(u64, u64)>) -> Vec<(u64, u64)> {
    v.sort_unstable();
    let mut out: Vec<(u64, u64)> = Vec::with_capacity(v.len());
    for (lo, hi) in v {
        match out.last_mut() {
            Some(last) if lo <= last.1 => last.1 = last.1.max(hi),
            _ => out.push((lo, hi)),
        }
    }
    out
}

/// Each stream of a plan with the union of its requests' pool ranges.
pub(crate) type StreamRanges = Vec<(StreamId, Vec<(u64, u64)>)>;

/// Per stream, in order of first appearance, the union of its requests' pool ranges;
/// and for the prologue then the iteration requests (class 0, then the extra classes in
/// order; any class's range may be used next by any class), whether their range meets another
/// stream's union (module docs).
pub(crate) fn stream_ranges(plan: &Plan) -> (StreamRanges, Vec<bool>) {
    let reqs: Vec<&PlannedRequest> = plan.prologue.iter().chain(plan.class_requests()).collect();
    let mut per: Vec<(StreamId, Vec<(u64, u64)>)> = Vec::new();
    for r in &reqs {
        let range = (r.offset.get(), r.offset.get() + len_of(r, 512));
        match per.iter_mut().find(|(s, _)| *s == r.stream) {
            Some((_, v)) => v.push(range),
            None => per.push((r.stream, vec![range])),
        }
    }
    let per: StreamRanges = per.into_iter().map(|(s, v)| (s, union(v))).collect();
    // An iteration request's range is used next, on another stream, only by another
    // stream's iteration requests (every prologue request starts before the iteration
    // section does); a prologue request's by anything of another stream.
    let mut iter_per: Vec<(StreamId, Vec<(u64, u64)>)> = Vec::new();
    for r in plan.class_requests() {
        let range = (r.offset.get(), r.offset.get() + len_of(r, 512));
        match iter_per.iter_mut().find(|(s, _)| *s == r.stream) {
            Some((_, v)) => v.push(range),
            None => iter_per.push((r.stream, vec![range])),
        }
    }
    let iter_per: StreamRanges = iter_per.into_iter().map(|(s, v)| (s, union(v))).collect();
    let meets_other = |unions: &StreamRanges, r: &PlannedRequest| {
        let (lo, hi) = (r.offset.get(), r.offset.get() + len_of(r, 512));
        unions.iter().any(|(s, u)| {
            let i = u.partition_point(|&(a, _)| a < hi);
            *s != r.stream && i > 0 && u[i - 1].1 > lo
        })
    };
    let cross = if per.len() < 2 {
        vec![false; reqs.len()]
    } else {
        let n_pro = plan.prologue.len();
        reqs.iter()
            .enumerate()
            .map(|(k, r)| meets_other(if k < n_pro { &per } else { &iter_per }, r))
            .collect()
    };
    (per, cross)
}

/// Whether plan mode should serve `plan` from the start (module docs, plans that
/// would do worse than online); the error says why not.
pub fn servable_from_start(plan: &Plan) -> Result<(), String> {
    let planned = plan.prologue.len() as u64;
    if plan.iteration.is_empty() && plan.dynamic.requests > planned {
        return Err(format!(
            "the plan has no iteration section and its trace left {} requests to dynamic \
             serving against {planned} planned (shapes that do not repeat): serving it \
             would reserve more than online allocation",
            plan.dynamic.requests
        ));
    }
    Ok(())
}

/// The iteration section of `plan` alone, with the pool ranges no iteration request
/// uses squeezed out (module docs). An error says why there is nothing to switch to.
pub fn steady_slice(plan: &Plan) -> Result<Plan, String> {
    if plan.iteration.is_empty() {
        return Err("the plan has no iteration section: nothing to switch to mid-run".into());
    }
    let align = plan.alignment.get().max(512);
    if !align.is_power_of_two() {
        return Err(format!(
            "alignment {} is not a power of two",
            plan.alignment
        ));
    }
    let used = union(
        plan.class_requests()
            .map(|r| {
                (
                    r.offset.get(),
                    r.offset.get().saturating_add(len_of(r, align)),
                )
            })
            .collect(),
    );
    // For each used range, the bytes of gaps below it.
    let mut below = Vec::with_capacity(used.len());
    let (mut gap, mut end) = (0u64, 0u64);
    for &(lo, hi) in &used {
        gap += lo - end;
        below.push(gap);
        end = hi;
    }
    let moved = |reqs: &[PlannedRequest]| -> Vec<PlannedRequest> {
        reqs.iter()
            .map(|r| {
                let o = r.offset.get();
                let i = used.partition_point(|&(lo, _)| lo <= o) - 1;
                PlannedRequest {
                    offset: Offset(o - below[i]),
                    ..*r
                }
            })
            .collect()
    };
    Ok(Plan {
        pool_size: Bytes(end - gap),
        prologue: Vec::new(),
        prologue_len: 0,
        iteration: moved(&plan.iteration),
        extra_classes: plan
            .extra_classes
            .iter()
            .map(|c| ClassSection {
                requests: moved(&c.requests),
                len: c.len,
            })
            .collect(),
        ..plan.clone()
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::NEVER_FREED;
    use crate::units::DeviceId;
    use crate::verify::verify_plan;

    use crate::testkit::planned_on as req;

    #[test]
    fn the_slice_squeezes_out_the_persistent_room_and_stays_valid() {
        // Parameters at [0, 4096) and [6144, 7168), never freed; the iteration uses
        // [4096, 6144) and [7168, 9216).
        let plan = Plan {
            device: DeviceId(0),
            alignment: Bytes(512),
            pool_size: Bytes(9216),
            prologue: vec![
                req(4096, 0, 0, NEVER_FREED, 0),
                req(1000, 6144, 1, NEVER_FREED, 0),
            ],
            prologue_len: 2,
            iteration: vec![
                req(2048, 4096, 0, 3, 0),
                req(1500, 7168, 1, 2, 0),
                req(2000, 7168, 2, 5, 0), // crosses into the next iteration
            ],
            iteration_len: 4,
            ..Plan::default()
        };
        verify_plan(&plan).unwrap();
        let s = steady_slice(&plan).unwrap();
        assert!(s.prologue.is_empty());
        let offs: Vec<u64> = s.iteration.iter().map(|r| r.offset.get()).collect();
        assert_eq!(offs, [0, 2048, 2048]);
        assert_eq!(s.pool_size, Bytes(4096));
        verify_plan(&s).unwrap();
        let empty = Plan {
            iteration: vec![],
            iteration_len: 0,
            ..plan
        };
        assert!(steady_slice(&empty).is_err());
    }

    #[test]
    fn one_shot_plans_mostly_left_to_dynamic_serving_are_not_served_from_the_start() {
        let one_shot = |dynamic: u64| Plan {
            device: DeviceId(0),
            alignment: Bytes(512),
            pool_size: Bytes(4096),
            prologue: vec![req(1024, 0, 0, 2, 0), req(1024, 1024, 1, 3, 0)],
            prologue_len: 4,
            dynamic: crate::plan::DynamicSummary {
                requests: dynamic,
                peak_bytes: Bytes(4096),
            },
            ..Plan::default()
        };
        // As many dynamic requests as planned: still served.
        assert_eq!(servable_from_start(&one_shot(2)), Ok(()));
        let err = servable_from_start(&one_shot(3)).unwrap_err();
        assert!(
            err.contains("3 requests to dynamic serving against 2 planned"),
            "{err}"
        );
        // A plan with a steady iteration is served whatever its dynamic share.
        let steady = Plan {
            iteration: vec![req(512, 2048, 0, 1, 0)],
            iteration_len: 2,
            ..one_shot(1000)
        };
        assert_eq!(servable_from_start(&steady), Ok(()));
    }

    #[test]
    fn requests_sharing_range_with_another_stream_are_flagged() {
        let plan = Plan {
            device: DeviceId(0),
            alignment: Bytes(512),
            pool_size: Bytes(8192),
            prologue: vec![req(1024, 0, 0, 1, 1)],
            prologue_len: 2,
            iteration: vec![
                req(1024, 0, 0, 1, 2),    // stream 2 reuses stream 1's range
                req(1000, 4096, 1, 2, 2), // stream 2 only
                req(512, 1024, 2, 3, 1),  // stream 1 only
            ],
            iteration_len: 3,
            ..Plan::default()
        };
        let (per, cross) = stream_ranges(&plan);
        assert_eq!(
            per,
            [
                (StreamId(1), vec![(0, 1536)]),
                (StreamId(2), vec![(0, 1024), (4096, 5120)])
            ]
        );
        // The prologue request is used next by stream 2; stream 2's iteration request
        // at [0, 1024) only ever by stream 2's own next copy (no prologue request comes
        // after it), so its free needs no event.
        assert_eq!(cross, [true, false, false, false]);
        let single = Plan {
            iteration: plan
                .iteration
                .iter()
                .map(|r| PlannedRequest {
                    stream: StreamId(1),
                    ..*r
                })
                .collect(),
            ..plan
        };
        assert_eq!(stream_ranges(&single).1, [false; 4]);
    }
}
