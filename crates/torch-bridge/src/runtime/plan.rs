//! Plan serving in plan and auto modes: [`PlanStage`], plan mode's install-time plan
//! (read and checked in [`PlanControl::new`], loaded when its device opens), auto mode's
//! background planning thread per device ([`plan_in_background`], with offload under a
//! budget), the switch to the plan at an iteration boundary ([`Core::step`]), the
//! saved-tensor and restore records auto mode plans offload from, and the offload
//! schedule of the plan served. Returns the bridge's `ffi::OffloadItem` (a cxx type).

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use stweaver_core::Plan;
use stweaver_core::engine::PlanOptions as EnginePlanOptions;
use stweaver_core::engine::servable_from_start;
use stweaver_core::engine::{DevicePtr, Engine, SavedKind};
use stweaver_core::plan_file::{read_plan_file, write_plan_file};
use stweaver_core::trace::{EventKind, Trace};
use stweaver_core::trace_file::write_trace_file;
use stweaver_core::units::{AllocId, Bytes, DeviceId};
use stweaver_planner::auto::{
    CLASS_ITERATIONS, RELEARN_ITERATIONS, auto_plan_options, needs_classes, plan_class_recording,
    plan_recording, plan_relearned, plans_at_step, relearns, unknown_iteration,
};
use stweaver_planner::offload::{OffloadOptions, plan_with_budget};
use stweaver_planner::planning::PlanOptions as PlannerOptions;

use super::{Core, Mode, Settings, is_default, lock};
use crate::dist::PlanSource;
use crate::error::{BridgeError, Result};
use crate::ffi::bridge as ffi;
use crate::tracked::Tracked;

/// Where plan serving stands (plan and auto modes).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PlanStage {
    /// Online mode, or trace mode.
    NotPlanning,
    /// Auto: recording iterations.
    Recording,
    /// Auto: the background planner runs.
    Planning,
    /// Auto with the plan gate on ([`Core::set_plan_gate`]): the plans are made and
    /// held, serving stays online, until the caller accepts them or records again
    /// ([`Core::release_held_plan`]).
    Held,
    /// A plan is served (on the devices listed).
    Serving(Vec<i32>),
    /// No plan could be served: serving online. The reason, for the user.
    Fallback(String),
}

/// What auto mode's planning under a budget decided for a device (`info_json`'s
/// `offload`).
#[derive(Debug, Clone)]
pub(super) enum OffloadOutcome {
    /// The plan fits the budget, offloading these tensors per iteration (none when
    /// the run fits without offload).
    Planned {
        budget: u64,
        /// Free bytes of the online arenas that cannot be given back at the switch
        /// (they share a granule with a live block, the recording's `inactive_split`):
        /// planned against `budget - online_held`.
        online_held: u64,
        tensors: usize,
        bytes_per_iteration: u64,
        planned_peak: u64,
        pool_without_offload: u64,
        stalls: usize,
        /// The planned waits per iteration, µs: for copies out before the peak, and
        /// the longest copy back late for its unpack ([`stweaver_planner::offload::OffloadReport`]).
        copy_out_wait_us: f64,
        stall_us: f64,
        /// The link speed the schedule was timed with, GB/s per direction.
        link_gbps: f64,
    },
    /// Planned without offload, and why.
    NotPlanned {
        budget: u64,
        online_held: u64,
        reason: String,
    },
}

impl OffloadOutcome {
    pub(super) fn json(&self) -> serde_json::Value {
        match self {
            OffloadOutcome::Planned {
                budget,
                online_held,
                tensors,
                bytes_per_iteration,
                planned_peak,
                pool_without_offload,
                stalls,
                copy_out_wait_us,
                stall_us,
                link_gbps,
            } => serde_json::json!({
                "planned": true,
                "budget_bytes": budget,
                "online_held_bytes": online_held,
                "tensors": tensors,
                "bytes_per_iteration": bytes_per_iteration,
                "planned_peak": planned_peak,
                "pool_without_offload": pool_without_offload,
                "stalls": stalls,
                "copy_out_wait_us": copy_out_wait_us,
                "stall_us": stall_us,
                "link_gbps": link_gbps,
            }),
            OffloadOutcome::NotPlanned {
                budget,
                online_held,
                reason,
            } => serde_json::json!({
                "planned": false,
                "budget_bytes": budget,
                "online_held_bytes": online_held,
                "reason": reason,
            }),
        }
    }
}

/// A background plan: the plan, and under a budget what offload it carries.
type PlanResult = std::result::Result<(Plan, Option<OffloadOutcome>), String>;

/// A background planning job of auto mode, per device.
struct PlanJob {
    device: i32,
    handle: std::thread::JoinHandle<PlanResult>,
}

/// A round of learning's plan: the merged plan, `None` when nothing was new, or why
/// none was made.
type RelearnResult = std::result::Result<Option<Plan>, String>;

/// Auto mode learning after its switch to a plan per class
/// (`stweaver_planner::auto`, module docs): per device the plan per class served and
/// its plan counts at the last step; the round's recording and planning.
#[derive(Default)]
struct Relearn {
    /// Per device: the plan per class served, and (hits, misses) at the last step.
    served: Vec<(i32, Plan, (u64, u64))>,
    /// The step the round's recording started at.
    from: Option<u64>,
    /// The round's planners, per device.
    jobs: Vec<(i32, std::thread::JoinHandle<RelearnResult>)>,
    /// Rounds started.
    rounds: u32,
}

pub(super) struct PlanControl {
    stage: PlanStage,
    /// Plan mode: the plan read at install (verified on read).
    file_plan: Option<Arc<Plan>>,
    /// Plan mode: where it came from (per-rank, shared by all ranks).
    pub(super) source: Option<PlanSource>,
    jobs: Vec<PlanJob>,
    /// Engines to empty once, one iteration after they switched to a plan.
    settle: Vec<i32>,
    /// Auto: hold finished plans for the caller's decision ([`PlanStage::Held`]).
    gate: bool,
    /// The held plans, per device.
    held: Vec<(i32, Plan)>,
    /// Auto: the plans served before [`Core::record_again`], kept for
    /// [`Core::serve_kept_plan`].
    kept: Vec<(i32, Plan)>,
    /// Auto: the step at which the current recording started (0: at install; the step
    /// of [`Core::release_held_plan`]'s new recording): it plans `auto_iterations`
    /// iterations later.
    record_from: u64,
    /// Auto: the current recording is the second one, for a plan per iteration class
    /// (the first one's plan had no iteration section: `stweaver_planner::auto`, module
    /// docs); it plans [`CLASS_ITERATIONS`] iterations after `record_from`.
    classes: bool,
    /// Auto mode under a budget: the link speed (GB/s per direction) and the device time
    /// of an iteration (µs) to time the offload schedule with, instead of
    /// [`stweaver_planner::offload::DEFAULT_LINK_GBPS`] and the trace's host clock
    /// ([`Core::set_offload_timing`]).
    timing: (Option<f64>, Option<f64>),
    /// Auto: learning the classes first seen after the switch.
    relearn: Relearn,
}

impl PlanControl {
    /// Where plan serving starts for `settings`: auto mode records; plan mode reads
    /// and checks its plan file now (a bad one means online serving).
    pub(super) fn new(settings: &Settings) -> PlanControl {
        let mut control = PlanControl {
            stage: PlanStage::NotPlanning,
            file_plan: None,
            source: None,
            jobs: Vec::new(),
            settle: Vec::new(),
            gate: false,
            held: Vec::new(),
            kept: Vec::new(),
            record_from: 0,
            classes: false,
            timing: (None, None),
            relearn: Relearn::default(),
        };
        match settings.mode {
            Mode::Auto => control.stage = PlanStage::Recording,
            Mode::Plan => {
                // A bad plan never stops training: it is reported and serving is online
                // (invariant 3). The file is verified once, here.
                // Under torchrun, a plan named for another rank is refused (crate::dist).
                let source = settings
                    .plan_source()
                    .unwrap_or_else(|| PlanSource::Own(PathBuf::new()));
                if let Some(why) = source.refusal() {
                    control.stage = PlanStage::Fallback(why);
                } else {
                    match read_plan_file(source.path()) {
                        // A one-shot plan of shapes that do not repeat would reserve more
                        // than online serving (plan_pool::servable_from_start).
                        Ok(plan) => match servable_from_start(&plan) {
                            Ok(()) => control.file_plan = Some(Arc::new(plan)),
                            Err(why) => {
                                let why = format!("{}: {why}", source.path().display());
                                eprintln!("stweaver: warning: plan refused, serving online: {why}");
                                control.stage = PlanStage::Fallback(why);
                            }
                        },
                        Err(e) => control.stage = PlanStage::Fallback(e.to_string()),
                    }
                }
                control.source = Some(source);
            }
            Mode::Online | Mode::Trace => {}
        }
        control
    }
}

/// Auto mode's background planning of one device's recorded trace. Without a budget
/// (`budget` `None`): the ordinary plan. Under one, `(limit, online_held)`, when the
/// trace has saved packs: [`plan_with_budget`] (which plans the run without the
/// recording's own offload) for `limit - online_held`: the online arenas keep their
/// free bytes that share a granule with a live block (parameters, optimizer state)
/// mapped beside the plan's pool after the switch, so the plan may not count on them
/// (125-184 MB on GPT-2 XL under 0.8 x LB, BENCHMARKS.md session 14; the plan gave
/// itself up at the limit in its first iteration before, and still did in two of seven
/// runs since, after conflicts). A refusal (a budget below the minimum, ...) falls back
/// to the ordinary plan, the outcome saying why.
fn plan_in_background(
    trace: &Trace,
    opts: &PlannerOptions,
    budget: Option<(u64, u64)>,
    has_packs: bool,
    (link_gbps, iteration_us): (Option<f64>, Option<f64>),
) -> PlanResult {
    let plain = |trace: &Trace| plan_recording(trace, opts);
    let Some((budget, online_held)) = budget else {
        return plain(trace).map(|p| (p, None));
    };
    let target = budget.saturating_sub(online_held);
    if !has_packs {
        let plan = plain(trace)?;
        let outcome = (plan.pool_size.get() > target).then(|| OffloadOutcome::NotPlanned {
            budget,
            online_held,
            reason: format!(
                "no offload planned: the plan needs {} over the budget {} (less {} the online arenas keep mapped), and the recording has no saved tensors (enable stweaver._offload while recording)",
                plan.pool_size,
                Bytes(budget),
                Bytes(online_held)
            ),
        });
        return Ok((plan, outcome));
    }
    let mut o = OffloadOptions::new(Bytes(target));
    o.plan = opts.clone();
    if let Some(g) = link_gbps {
        o.link_gbps = g;
    }
    if iteration_us.is_some() {
        o.iteration_us = iteration_us;
    }
    match plan_with_budget(trace, &o) {
        Ok(b) => {
            let r = &b.offload;
            let outcome = OffloadOutcome::Planned {
                budget,
                online_held,
                tensors: r.tensors,
                bytes_per_iteration: r.bytes_per_iteration.get(),
                planned_peak: r.planned_peak.get(),
                pool_without_offload: r.pool_without_offload.get(),
                stalls: r.stalls,
                copy_out_wait_us: r.copy_out_wait_us,
                stall_us: r.stall_us,
                link_gbps: r.link_gbps,
            };
            Ok((b.outcome.plan, Some(outcome)))
        }
        Err(err) => {
            let reason = format!(
                "no offload planned under the budget {} (less {} the online arenas keep mapped): {err}; planning without offload",
                Bytes(budget),
                Bytes(online_held)
            );
            let plan = plain(trace).map_err(|e| format!("{reason}, which failed too: {e}"))?;
            Ok((
                plan,
                Some(OffloadOutcome::NotPlanned {
                    budget,
                    online_held,
                    reason,
                }),
            ))
        }
    }
}

/// Lowers the calling thread's scheduling priority to niceness `nice` (0: unchanged). On
/// Linux `setpriority(PRIO_PROCESS, tid)` applies to that one thread; best effort: a
/// refusal leaves the thread at normal priority. Elsewhere nothing.
fn lower_thread_priority(nice: i32) {
    if nice <= 0 {
        return;
    }
    #[cfg(target_os = "linux")]
    // Safety: gettid and setpriority take and return plain integers and touch no memory
    // of this process; only the calling thread's niceness changes.
    unsafe {
        let tid = libc::gettid();
        let _ = libc::setpriority(libc::PRIO_PROCESS, tid as libc::id_t, nice);
    }
}

/// The free bytes of `e`'s arenas that no release can give back (they share a granule
/// with a live block; PyTorch's non-releasable `inactive_split_bytes`), now.
fn online_held(e: &Engine<Tracked>) -> Result<u64> {
    Ok(e.stats()?.inactive_split_bytes[0].current.max(0) as u64)
}

impl Core {
    /// Plan mode: serves the install-time plan on the device it was made for. Under
    /// torchrun the rank's home device decides: a rank's own plan made for another
    /// device is refused (with a warning), a shared plan is served there (crate::dist).
    pub(super) fn serve_file_plan(&self, device: i32, e: &Engine<Tracked>) {
        let mut pc = lock(&self.plan);
        let Some(mut plan) = pc.file_plan.clone() else {
            return;
        };
        if plan.device != DeviceId(device) {
            let Some(rank) = self.settings.rank else {
                return; // a single process may open its plan's device later
            };
            if self.home() != Some(device) || pc.stage != PlanStage::NotPlanning {
                return;
            }
            let path = pc
                .source
                .as_ref()
                .map(|s| s.path().display().to_string())
                .unwrap_or_default();
            if matches!(pc.source, Some(PlanSource::Shared(_))) {
                lock(&self.notes).push(format!(
                    "rank {}: serving the shared plan {path} (recorded on {}) on cuda:{device}",
                    rank.rank, plan.device
                ));
                let mut p = (*plan).clone();
                p.device = DeviceId(device);
                plan = Arc::new(p);
            } else {
                let why = format!(
                    "rank {}: {path} was made for {} but this rank allocates on cuda:{device}: \
                     refused, this rank trains online",
                    rank.rank, plan.device
                );
                eprintln!("stweaver: warning: {why}");
                pc.stage = PlanStage::Fallback(why);
                pc.file_plan = None;
                return;
            }
        }
        match e.load_plan(&plan, self.plan_options()) {
            Ok(()) => {
                if let Ok(slot) = self.slot(device) {
                    *lock(&slot.offload) = plan.offload.clone();
                }
                pc.stage = PlanStage::Serving(vec![device]);
            }
            Err(err) => pc.stage = PlanStage::Fallback(format!("cuda:{device}: {err}")),
        }
    }

    /// How the engines serve a plan (install settings).
    fn plan_options(&self) -> EnginePlanOptions {
        EnginePlanOptions {
            wait_for_pending_frees: self.settings.plan_wait,
            ..EnginePlanOptions::default()
        }
    }

    /// Plan bookkeeping at an iteration boundary: releases the online cache one iteration
    /// after a switch to a plan; in auto mode, starts planning after the recorded
    /// iterations and switches to the plan once it is ready.
    pub(super) fn plan_step(&self, n: u64) -> Result<()> {
        let mut pc = lock(&self.plan);
        for d in std::mem::take(&mut pc.settle) {
            // The previous iteration's online blocks are gone: give their memory back.
            if let Some(e) = self.slot(d)?.default.get() {
                e.empty_cache()?;
            }
        }
        if self.settings.mode != Mode::Auto {
            return Ok(());
        }
        match pc.stage {
            PlanStage::Recording
                if plans_at_step(
                    n.saturating_sub(pc.record_from),
                    if pc.classes {
                        CLASS_ITERATIONS
                    } else {
                        self.settings.auto_iterations
                    },
                ) =>
            {
                let classes = pc.classes;
                let share_streams = self.settings.share_streams;
                let (plan_threads, plan_nice) =
                    (self.settings.plan_threads, self.settings.plan_nice);
                let timing = pc.timing;
                let mut jobs = Vec::new();
                for slot in self.slots()? {
                    let Some(e) = slot.default.get() else {
                        continue;
                    };
                    let Some(trace) = e.take_trace()? else {
                        continue;
                    };
                    if let Some(path) = self.settings.trace_path_on(slot.ordinal, self.home())
                        && let Err(err) = write_trace_file(&path, &trace)
                    {
                        lock(&self.notes).push(err.to_string());
                    }
                    // Under a budget, with saved tensors recorded: plan the fewest
                    // bytes of offload that fit the device's limit (budget and memory
                    // fraction), from the run without the recording's own offload
                    // (restore links, `un_offload`).
                    let budget = match self.settings.budget {
                        Some(_) => Some((slot.budget.limit(), online_held(e)?)),
                        None => None,
                    };
                    let has_packs = trace
                        .events
                        .iter()
                        .any(|e| matches!(e.kind, EventKind::SavedPack(_)));
                    let handle = std::thread::Builder::new()
                        .name(format!("stweaver-plan-cuda{}", slot.ordinal))
                        .spawn(move || {
                            // Beside the training run: low priority, few threads.
                            lower_thread_priority(plan_nice);
                            // The greedy stage alone (auto_plan_options), the settings
                            // the engine replay's auto mode plans with too.
                            let mut opts = auto_plan_options(share_streams);
                            opts.solve.threads = plan_threads;
                            if classes {
                                // A plan per iteration class (without offload).
                                return plan_class_recording(&trace, &opts).map(|p| (p, None));
                            }
                            plan_in_background(&trace, &opts, budget, has_packs, timing)
                        })
                        .map_err(|e| {
                            BridgeError::Settings(format!("cannot start the planner: {e}"))
                        })?;
                    jobs.push(PlanJob {
                        device: slot.ordinal,
                        handle,
                    });
                }
                pc.stage = if jobs.is_empty() {
                    PlanStage::Fallback("no allocation was recorded to plan".into())
                } else {
                    PlanStage::Planning
                };
                pc.jobs = jobs;
            }
            PlanStage::Planning if pc.jobs.iter().all(|j| j.handle.is_finished()) => {
                let mut plans = Vec::new();
                let mut errors = Vec::new();
                // A device whose recording needs more than its budget and got no offload
                // schedule (`OffloadOutcome::NotPlanned`).
                let mut over_budget = false;
                for job in std::mem::take(&mut pc.jobs) {
                    let d = job.device;
                    let plan = match job.handle.join() {
                        Ok(Ok((plan, outcome))) => {
                            if let Some(OffloadOutcome::NotPlanned { reason, .. }) = &outcome {
                                lock(&self.notes).push(format!("cuda:{d}: {reason}"));
                                over_budget = true;
                            }
                            *lock(&self.slot(d)?.offload_outcome) = outcome;
                            plan
                        }
                        Ok(Err(e)) => {
                            errors.push(format!("cuda:{d}: planning failed: {e}"));
                            continue;
                        }
                        Err(_) => {
                            errors.push(format!("cuda:{d}: the planner panicked"));
                            continue;
                        }
                    };
                    if let Some(path) = self.settings.plan_path_on(d, self.home())
                        && let Err(err) = write_plan_file(&path, &plan)
                    {
                        lock(&self.notes).push(err.to_string());
                    }
                    plans.push((d, plan));
                }
                // No class recording for a run over its budget: a plan per class has no
                // offload and needs at least the recording's peak of live bytes, so it
                // cannot fit either. (The plan without offload of a recording made with
                // threshold offload has no single repeating iteration anyway: its copies'
                // frees come at timing-dependent points. On the H100, GPT-2 XL at 0.7 x LB
                // spent 41 recorded iterations, ~0.9 s each, on such a class recording
                // before auto recompute's next round.) The plan is held or refused as
                // usual, and auto recompute reads the outcome.
                if !pc.classes
                    && !over_budget
                    && errors.is_empty()
                    && !plans.is_empty()
                    && plans.iter().all(|(_, p)| needs_classes(p))
                {
                    // No single repeating iteration: record again, from this step, for
                    // a plan per iteration class (stweaver_planner::auto, module docs).
                    for (d, _) in &plans {
                        if let Some(e) = self.slot(*d)?.default.get() {
                            e.start_trace()?;
                        }
                    }
                    lock(&self.notes).push(format!(
                        "no single repeating iteration in the recording: recording {CLASS_ITERATIONS} more iterations for a plan per iteration class"
                    ));
                    pc.classes = true;
                    pc.record_from = n;
                    pc.stage = PlanStage::Recording;
                    return Ok(());
                }
                if pc.gate && !plans.is_empty() {
                    lock(&self.notes).extend(errors);
                    pc.held = plans;
                    pc.stage = PlanStage::Held;
                } else {
                    self.switch_to_plans(&mut pc, plans, errors)?;
                }
            }
            PlanStage::Serving(_) if !pc.relearn.served.is_empty() => {
                self.relearn_step(&mut pc, n)?;
            }
            _ => {}
        }
        Ok(())
    }

    /// Auto mode serving a plan per class, at step `n`: learns the classes first seen
    /// after the switch (`stweaver_planner::auto`, module docs, learning after the
    /// switch). Switches to a finished round's merged plans; else ends a round's
    /// recording and plans it in the background; else starts a round when the last
    /// iteration was of a class the plan does not know.
    fn relearn_step(&self, pc: &mut PlanControl, n: u64) -> Result<()> {
        let opts = self.plan_options();
        if !pc.relearn.jobs.is_empty() {
            if !pc.relearn.jobs.iter().all(|(_, h)| h.is_finished()) {
                return Ok(());
            }
            for (d, handle) in std::mem::take(&mut pc.relearn.jobs) {
                let note = match handle.join() {
                    Ok(Ok(Some(merged))) => self.switch_to_merged(pc, d, merged, opts)?,
                    Ok(Ok(None)) => format!(
                        "cuda:{d}: no iteration class the plan lacks in the {RELEARN_ITERATIONS} iterations recorded: the plan stays"
                    ),
                    Ok(Err(e)) => {
                        format!("cuda:{d}: learning iteration classes failed, the plan stays: {e}")
                    }
                    Err(_) => format!("cuda:{d}: the planner panicked, the plan stays"),
                };
                lock(&self.notes).push(note);
            }
            return Ok(());
        }
        if let Some(from) = pc.relearn.from {
            if !plans_at_step(n.saturating_sub(from), RELEARN_ITERATIONS) {
                return Ok(());
            }
            pc.relearn.from = None;
            pc.relearn.rounds += 1;
            let share_streams = self.settings.share_streams;
            let (plan_threads, plan_nice) = (self.settings.plan_threads, self.settings.plan_nice);
            for (d, served, _) in &pc.relearn.served {
                let Some(e) = self.slot(*d)?.default.get() else {
                    continue;
                };
                let Some(trace) = e.take_trace()? else {
                    continue;
                };
                let served = served.clone();
                let handle = std::thread::Builder::new()
                    .name(format!("stweaver-relearn-cuda{d}"))
                    .spawn(move || {
                        lower_thread_priority(plan_nice);
                        let mut opts = auto_plan_options(share_streams);
                        opts.solve.threads = plan_threads;
                        plan_relearned(&served, &trace, &opts)
                    })
                    .map_err(|e| BridgeError::Settings(format!("cannot start the planner: {e}")))?;
                pc.relearn.jobs.push((*d, handle));
            }
            return Ok(());
        }
        let rounds = pc.relearn.rounds;
        let mut unknown = false;
        for (d, served, last) in pc.relearn.served.iter_mut() {
            let Some(e) = self.slot(*d)?.default.get() else {
                continue;
            };
            if e.plan_abandoned()?.is_some() {
                continue;
            }
            let st = e.plan_stats()?.unwrap_or_default();
            let counts = (st.hits, st.unplanned + st.conflicts);
            let (dh, dm) = (
                counts.0.saturating_sub(last.0),
                counts.1.saturating_sub(last.1),
            );
            *last = counts;
            unknown |= unknown_iteration(dh, dm) && relearns(served, rounds);
        }
        if unknown {
            for (d, _, _) in &pc.relearn.served {
                if let Some(e) = self.slot(*d)?.default.get() {
                    e.start_trace()?;
                }
            }
            pc.relearn.from = Some(n);
            lock(&self.notes).push(format!(
                "step {n}: an iteration of a class the plan does not know: recording {RELEARN_ITERATIONS} iterations to learn it"
            ));
        }
        Ok(())
    }

    /// Device `d`'s engine gives its plan per class up and serves `merged` (the classes
    /// learned added) from this boundary; should the engine refuse it, the plan it
    /// served before. The note for the user.
    fn switch_to_merged(
        &self,
        pc: &mut PlanControl,
        d: i32,
        merged: Plan,
        opts: EnginePlanOptions,
    ) -> Result<String> {
        let Some(e) = self.slot(d)?.default.get() else {
            return Ok(format!("cuda:{d}: no engine to serve the learned classes"));
        };
        let Some(entry) = pc.relearn.served.iter_mut().find(|(x, _, _)| *x == d) else {
            return Ok(format!("cuda:{d}: no plan per class served"));
        };
        let before = entry.1.class_count();
        e.unload_plan()?;
        let note = match e.switch_to_plan(&merged, opts) {
            Ok(()) => {
                let note = format!(
                    "cuda:{d}: learned {} iteration class(es) first seen after the switch: serving a plan of {} classes",
                    merged.class_count() - before,
                    merged.class_count()
                );
                entry.1 = merged;
                note
            }
            // The plan served before, again; should that be refused too (the memory limit),
            // the run goes on online (invariant 3: a plan never stops training).
            Err(err) => match e.switch_to_plan(&entry.1, opts) {
                Ok(()) => format!(
                    "cuda:{d}: the plan with the learned classes was refused ({err}): the plan stays"
                ),
                Err(again) => format!(
                    "cuda:{d}: the plan with the learned classes was refused ({err}), and the plan served before too ({again}): serving online"
                ),
            },
        };
        entry.2 = (0, 0);
        pc.settle.push(d);
        Ok(note)
    }

    /// Auto mode's switch, at an iteration boundary: each device's default engine
    /// serves its plan from here on; serving stays online (a fallback) where none could.
    fn switch_to_plans(
        &self,
        pc: &mut PlanControl,
        plans: Vec<(i32, Plan)>,
        mut errors: Vec<String>,
    ) -> Result<()> {
        let mut serving = Vec::new();
        for (d, plan) in plans {
            let Some(e) = self.slot(d)?.default.get() else {
                continue;
            };
            // The engine serves the plan's steady iteration from here on (the prologue
            // already ran online; the persistent tensors' room is squeezed out of the
            // pool) and releases the online cache first, so the pool replaces it instead
            // of adding to it. step() marked the iteration.
            match e.switch_to_plan(&plan, self.plan_options()) {
                Ok(()) => {
                    *lock(&self.slot(d)?.offload) = plan.offload.clone();
                    serving.push(d);
                    pc.settle.push(d);
                    // The plan keeps learning (relearn_step).
                    pc.relearn.served.push((d, plan, (0, 0)));
                }
                Err(err) => errors.push(format!("cuda:{d}: {err}")),
            }
        }
        if serving.is_empty() {
            pc.stage = PlanStage::Fallback(errors.join("; "));
        } else {
            lock(&self.notes).extend(errors);
            pc.stage = PlanStage::Serving(serving);
        }
        Ok(())
    }

    /// Auto mode: with the gate on, a finished plan is held ([`PlanStage::Held`], mode
    /// "auto (plan held)", its offload outcome in `info_json`) instead of served, until
    /// [`Core::release_held_plan`]. For a caller that may change the model first (the
    /// offloader recomputing blocks when the plan predicts copy waits).
    pub fn set_plan_gate(&self, on: bool) {
        lock(&self.plan).gate = on;
    }

    /// Auto mode under a budget: time the next plans' offload schedules with this link
    /// speed (GB/s per direction) and this device time per iteration (µs; forward is its
    /// [`stweaver_planner::offload::DEFAULT_FORWARD_SHARE`]), both measured by the
    /// caller, instead of the default link and the recording's host clock (which its
    /// threshold offload slows). 0 keeps a value as it is; negative or not finite: an
    /// error.
    pub fn set_offload_timing(&self, link_gbps: f64, iteration_us: f64) -> Result<()> {
        let check = |v: f64, what: &str| {
            if v.is_finite() && v >= 0.0 {
                Ok((v > 0.0).then_some(v))
            } else {
                Err(BridgeError::Settings(format!(
                    "the offload {what} must be a positive number (0: unchanged), got {v}"
                )))
            }
        };
        let g = check(link_gbps, "link speed (GB/s)")?;
        let t = check(iteration_us, "iteration time (us)")?;
        let mut pc = lock(&self.plan);
        pc.timing = (g.or(pc.timing.0), t.or(pc.timing.1));
        Ok(())
    }

    /// The held plans ([`Core::set_plan_gate`]): `accept` serves them now (call it at an
    /// iteration boundary, right after `step`, as auto's own switch happens); else they
    /// are dropped and auto mode records again from here, planning `auto_iterations`
    /// iterations later (the live blocks become the new trace's preexisting
    /// allocations). An error when no plan is held.
    pub fn release_held_plan(&self, accept: bool) -> Result<()> {
        let mut pc = lock(&self.plan);
        if pc.stage != PlanStage::Held {
            return Err(BridgeError::Settings(format!(
                "no plan is held (auto mode with the plan gate on holds one once planned; now: {:?})",
                pc.stage
            )));
        }
        let plans = std::mem::take(&mut pc.held);
        if accept {
            return self.switch_to_plans(&mut pc, plans, Vec::new());
        }
        drop(plans);
        self.record_from_here(&mut pc)
    }

    /// Auto mode records again from this boundary (no plan served): every default
    /// engine records (its live blocks the new trace's preexisting allocations), no
    /// offload outcome is left, and planning comes `auto_iterations` iterations later.
    fn record_from_here(&self, pc: &mut PlanControl) -> Result<()> {
        for slot in self.slots()? {
            if let Some(e) = slot.default.get() {
                *lock(&slot.offload_outcome) = None;
                e.start_trace()?;
            }
        }
        pc.record_from = self.iterations.load(Ordering::Acquire);
        pc.classes = false;
        pc.stage = PlanStage::Recording;
        Ok(())
    }

    /// Auto mode serving a plan: stops serving it at this boundary (call it right after
    /// `step`) and records again, planning `auto_iterations` iterations later (held for
    /// the caller when the gate is on, as after [`Core::release_held_plan`]`(false)`).
    /// The plans served until now are kept: [`Core::serve_kept_plan`] serves them again
    /// without a new recording (the caller's A/B of two programs: the offloader trying
    /// more recomputed blocks against a plan that moves bytes). Blocks placed by the
    /// plan stay where they are until freed; its pool's free memory is given back at
    /// once ([`stweaver_core::engine::Engine::unload_plan`]). An error when no plan is
    /// served.
    pub fn record_again(&self) -> Result<()> {
        let mut pc = lock(&self.plan);
        if !matches!(pc.stage, PlanStage::Serving(_)) {
            return Err(BridgeError::Settings(format!(
                "record_again: no plan is served (auto mode serves one after its switch; now: {:?})",
                pc.stage
            )));
        }
        pc.kept = self.stop_serving(&mut pc)?;
        self.record_from_here(&mut pc)
    }

    /// Every default engine stops serving its plan (if one is served) and drops a
    /// recording in progress (a round of learning's, abandoned with its planners); no
    /// offload schedule or outcome is left. Returns the plans served until now.
    fn stop_serving(&self, pc: &mut PlanControl) -> Result<Vec<(i32, Plan)>> {
        for slot in self.slots()? {
            if let Some(e) = slot.default.get() {
                e.unload_plan()?;
                lock(&slot.offload).clear();
                *lock(&slot.offload_outcome) = None;
                let _ = e.take_trace();
            }
        }
        pc.relearn.from = None;
        pc.relearn.jobs.clear();
        Ok(std::mem::take(&mut pc.relearn.served)
            .into_iter()
            .map(|(d, plan, _)| (d, plan))
            .collect())
    }

    /// Serves the plans [`Core::record_again`] kept, at this boundary (right after
    /// `step`), whatever auto mode is doing: a plan served now is unloaded, a held one
    /// dropped, a recording or planning round abandoned (its planner's result is
    /// ignored). The caller must run the program those plans were made for again (the
    /// same recomputed blocks). An error when none is kept.
    pub fn serve_kept_plan(&self) -> Result<()> {
        let mut pc = lock(&self.plan);
        if pc.kept.is_empty() {
            return Err(BridgeError::Settings(
                "serve_kept_plan: no plan is kept (record_again keeps the plan it stops serving)"
                    .into(),
            ));
        }
        let plans = std::mem::take(&mut pc.kept);
        self.stop_serving(&mut pc)?;
        // A held plan or a recording's planners, abandoned.
        pc.held.clear();
        pc.jobs.clear();
        self.switch_to_plans(&mut pc, plans, Vec::new())
    }

    /// The default engine of the allocation starting at `ptr`, if any (private pools
    /// record nothing).
    fn recording_engine(&self, ptr: usize) -> Result<Option<&Engine<Tracked>>> {
        if ptr == 0 {
            return Ok(None);
        }
        let Some(owner) = self.shared.owner_of(ptr as u64) else {
            return Ok(None);
        };
        if !is_default(owner.pool) {
            return Ok(None);
        }
        Ok(self.slot(owner.device)?.default.get())
    }

    /// Records a saved-tensor pack or unpack for the allocation starting at `ptr` (the
    /// default pool's recorder; private pools record nothing). The allocation's trace
    /// id, `None` when nothing was recorded: not recording, `ptr` 0, or no live
    /// allocation starts there.
    pub fn record_saved(&self, ptr: usize, pack: bool) -> Result<Option<AllocId>> {
        let Some(e) = self.recording_engine(ptr)? else {
            return Ok(None);
        };
        let kind = if pack {
            SavedKind::Pack
        } else {
            SavedKind::Unpack
        };
        Ok(e.record_saved(DevicePtr(ptr as u64), kind)?)
    }

    /// Records a restore link: the allocation starting at `ptr` is the copy back of the
    /// offloaded allocation `from` (the id [`Core::record_saved`] returned for its
    /// pack, on the same device). False when nothing was recorded: `from` negative or
    /// too large, `ptr` 0 or not a live default-pool allocation, not recording, or a
    /// link the trace would refuse ([`Engine::record_restore`]).
    pub fn record_restore(&self, ptr: usize, from: i64) -> Result<bool> {
        let Ok(from) = u32::try_from(from) else {
            return Ok(false);
        };
        let Some(e) = self.recording_engine(ptr)? else {
            return Ok(false);
        };
        Ok(e.record_restore(DevicePtr(ptr as u64), AllocId(from))?)
    }

    /// The offload schedule of the plan `device` serves (empty when none).
    /// The offload schedule of the plan `device` serves: empty when none is, and before
    /// CUDA's lazy initialisation (no plan can be served yet).
    pub fn offload_schedule(&self, device: i32) -> Result<Vec<ffi::OffloadItem>> {
        if self.devices.get().is_none() {
            return Ok(Vec::new());
        }
        Ok(lock(&self.slot(device)?.offload)
            .iter()
            .map(|o| ffi::OffloadItem {
                pack: o.pack,
                unpack: o.unpack,
                prefetch_after_unpack: o.prefetch_after_unpack.map_or(-1, i64::from),
                bytes: o.bytes.get(),
            })
            .collect())
    }

    /// Where plan serving stands.
    pub fn plan_stage(&self) -> PlanStage {
        lock(&self.plan).stage.clone()
    }
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    /// The calling thread's niceness.
    fn here() -> i32 {
        // Safety: plain integers in and out; no memory is touched.
        unsafe { libc::getpriority(libc::PRIO_PROCESS, libc::gettid() as libc::id_t) }
    }

    #[test]
    fn a_planning_thread_lowers_its_own_priority_only() {
        let before = here();
        let planning = std::thread::spawn(move || {
            super::lower_thread_priority(10);
            here()
        })
        .join()
        .unwrap();
        // 10, or more if the process already ran nicer (lowering niceness needs privilege).
        assert!(
            planning >= 10.max(before),
            "{planning} (this thread {before})"
        );
        assert_eq!(here(), before, "the calling thread keeps its priority");
    }
}
