//! Install settings: [`Settings`] (the serving [`Mode`], trace and plan paths, the
//! `torchrun` rank) and their parsing from `install(mode, plan, trace)` and the
//! `STWEAVER_*` environment variables.

use std::path::{Path, PathBuf};

use stweaver_core::engine::POOL_UNIT;
use stweaver_planner::auto::{RELEASE_AT_PEAK, RELEASE_CHURN};

use crate::budget::Budget;
use crate::dist::{self, PlanSource, RankInfo};
use crate::error::{BridgeError, Result};

#[cfg(doc)]
use stweaver_core::engine::{EngineConfig, PlanOptions as EnginePlanOptions};
#[cfg(doc)]
use stweaver_planner::planning::PlanOptions as PlannerOptions;

/// How the runtime serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Online best fit only.
    Online,
    /// Online, recording every request of the default pools into a trace.
    Trace,
    /// Serving a plan file (online for what it does not foresee).
    Plan,
    /// Online while recording the first iterations, then planning them in the
    /// background and serving the plan from an iteration boundary on.
    Auto,
}

/// Iterations `auto` records before it plans, unless `STWEAVER_AUTO_ITERATIONS` says (one
/// constant with the engine replay's auto mode: `stweaver_planner::auto`).
pub use stweaver_planner::auto::DEFAULT_AUTO_ITERATIONS;

/// Validated install settings.
#[derive(Debug, Clone, PartialEq)]
pub struct Settings {
    pub mode: Mode,
    /// Trace mode: where the trace goes; auto: where the recorded trace is kept (optional);
    /// plan mode: where the served run's requests are recorded (optional, diagnostics).
    /// Device 0's path; other devices get `.cudaN` before the extension.
    pub trace_path: Option<PathBuf>,
    /// Plan mode: the plan to serve; auto: where the plan made is kept (optional).
    pub plan_path: Option<PathBuf>,
    /// Auto mode: iterations recorded before planning.
    pub auto_iterations: u64,
    /// Under `torchrun` (`WORLD_SIZE` > 1): this process's rank; file names carry it
    /// (module [`crate::dist`]).
    pub rank: Option<RankInfo>,
    /// `STWEAVER_RELEASE_AT_PEAK` (default on; `0` turns it off):
    /// [`EngineConfig::release_before_new_peak`]. It trades a device synchronisation
    /// each time an online arena would set a new reserved peak for a lower peak (on the
    /// H200, Qwen2-MoE online 97.58 -> 98.69 %, variable lengths 92.60 -> 95.12 %).
    pub release_at_peak: bool,
    /// `STWEAVER_RELEASE_CHURN` (default 3; `0`: never), online mode only:
    /// [`EngineConfig::release_churn_iterations`]. A loop served online that gives holes
    /// back before a new peak in every iteration and maps them again in the next stops
    /// giving them back after that many in a row (on the H100 a Llama loop served online
    /// ran 1.29x the native step with ~5 synchronisations per iteration, and native's
    /// step with 3; [`RELEASE_CHURN`] says why not in auto mode).
    pub release_churn: u32,
    /// `STWEAVER_POOL_UNIT_MIB` (default 64; `0`: whole ranges):
    /// [`EngineConfig::pool_unit`], the largest piece of a first-touched range the plan
    /// pool maps as one physical allocation.
    pub pool_unit_mib: u64,
    /// `STWEAVER_PLAN_WAIT` (default on; `0` turns it off):
    /// [`EnginePlanOptions::wait_for_pending_frees`]. A planned request whose range only
    /// frees pending on other streams hold makes its stream wait for their events
    /// instead of being served elsewhere (streams running behind the host: DDP, FSDP).
    pub plan_wait: bool,
    /// `STWEAVER_SHARE_STREAMS` (default off): auto mode plans with
    /// [`PlannerOptions::share_streams`] (one joint solve; streams reuse each other's
    /// ranges, waiting on the device for the earlier stream's work).
    pub share_streams: bool,
    /// `STWEAVER_BUDGET` (`16GiB`, `0.8`, bytes; `stweaver.install(budget=...)` sets
    /// it): at most this much device memory, over every pool of the device. With
    /// `set_per_process_memory_fraction` too, the smaller limit holds
    /// ([`crate::budget::effective_limit`]).
    pub budget: Option<Budget>,
    /// `STWEAVER_PLAN_THREADS` (default 1; 0: every core): the threads of auto mode's
    /// background planning (the solver's portfolio), so that planning beside a training
    /// run takes at most one core from it by default (issue #18: background planning
    /// must not slow training).
    pub plan_threads: usize,
    /// `STWEAVER_PLAN_NICE` (default 10, 0 to 19; 0 leaves it): the niceness auto mode's
    /// planning threads run at (Linux, per thread), so that the training's own host
    /// threads come first when the cores are busy.
    pub plan_nice: i32,
    /// `STWEAVER_TIME_CALLS` (default off): time every `malloc` and `free` on the host
    /// ([`crate::runtime::Core::call_times`]; two clock reads per call).
    pub time_calls: bool,
}

/// Auto mode's planning threads by default (`STWEAVER_PLAN_THREADS`).
pub const DEFAULT_PLAN_THREADS: usize = 1;
/// Auto mode's planning threads' niceness by default (`STWEAVER_PLAN_NICE`).
pub const DEFAULT_PLAN_NICE: i32 = 10;

/// An integer environment setting in `range`: `default` when unset or empty.
fn env_int(name: &str, default: i64, range: std::ops::RangeInclusive<i64>) -> Result<i64> {
    match std::env::var(name) {
        Ok(v) if !v.trim().is_empty() => match v.trim().parse::<i64>() {
            Ok(n) if range.contains(&n) => Ok(n),
            _ => Err(BridgeError::Settings(format!(
                "{name}={v:?} is not an integer from {} to {}",
                range.start(),
                range.end()
            ))),
        },
        _ => Ok(default),
    }
}

/// A boolean environment setting: `default` when unset; the same words as the Python
/// side's `parse_bool`.
fn env_bool(name: &str, default: bool) -> Result<bool> {
    match std::env::var(name) {
        Ok(v) => match v.trim().to_ascii_lowercase().as_str() {
            "1" | "true" | "yes" | "on" => Ok(true),
            "0" | "false" | "no" | "off" => Ok(false),
            _ => Err(BridgeError::Settings(format!(
                "{name}={v:?} is not a boolean (use 1/0, true/false, yes/no, on/off)"
            ))),
        },
        Err(_) => Ok(default),
    }
}

impl Settings {
    /// Parses `install(mode, plan, trace)` arguments ("" = not given).
    /// `STWEAVER_AUTO_ITERATIONS` (a positive integer) sets `auto_iterations`.
    pub fn parse(mode: &str, plan: &str, trace: &str) -> Result<Settings> {
        let bad = |m: String| Err(BridgeError::Settings(m));
        let path = |s: &str| (!s.is_empty()).then(|| PathBuf::from(s));
        let auto_iterations = match std::env::var("STWEAVER_AUTO_ITERATIONS") {
            Ok(v) => match v.trim().parse::<u64>() {
                Ok(n) if n > 0 => n,
                _ => {
                    return bad(format!(
                        "STWEAVER_AUTO_ITERATIONS={v:?} is not a positive integer"
                    ));
                }
            },
            Err(_) => DEFAULT_AUTO_ITERATIONS,
        };
        let rank = RankInfo::from_env().map_err(BridgeError::Settings)?;
        let release_at_peak = env_bool("STWEAVER_RELEASE_AT_PEAK", RELEASE_AT_PEAK)?;
        let release_churn = env_int(
            "STWEAVER_RELEASE_CHURN",
            i64::from(RELEASE_CHURN),
            0..=1_000_000,
        )? as u32;
        let pool_unit_mib = env_int(
            "STWEAVER_POOL_UNIT_MIB",
            (POOL_UNIT >> 20) as i64,
            0..=1 << 20,
        )? as u64;
        let plan_wait = env_bool("STWEAVER_PLAN_WAIT", true)?;
        let share_streams = env_bool("STWEAVER_SHARE_STREAMS", false)?;
        let time_calls = env_bool("STWEAVER_TIME_CALLS", false)?;
        let plan_threads = env_int(
            "STWEAVER_PLAN_THREADS",
            DEFAULT_PLAN_THREADS as i64,
            0..=4096,
        )? as usize;
        let plan_nice = env_int("STWEAVER_PLAN_NICE", i64::from(DEFAULT_PLAN_NICE), 0..=19)? as i32;
        let budget = match std::env::var("STWEAVER_BUDGET") {
            Ok(v) if !v.trim().is_empty() => Some(
                Budget::parse(&v)
                    .map_err(|e| BridgeError::Settings(format!("STWEAVER_BUDGET: {e}")))?,
            ),
            _ => None,
        };
        let settings = |mode| Settings {
            mode,
            trace_path: path(trace),
            plan_path: path(plan),
            auto_iterations,
            rank,
            release_at_peak,
            release_churn,
            pool_unit_mib,
            plan_wait,
            share_streams,
            budget,
            plan_threads,
            plan_nice,
            time_calls,
        };
        match mode {
            "online" => {
                if !plan.is_empty() || !trace.is_empty() {
                    return bad(format!(
                        "mode \"online\" takes no plan or trace file (got plan={plan:?}, \
                         trace={trace:?}); use mode \"trace\" to record one"
                    ));
                }
                Ok(settings(Mode::Online))
            }
            "trace" => {
                if trace.is_empty() {
                    return bad("mode \"trace\" needs a trace file path".into());
                }
                if !plan.is_empty() {
                    return bad(format!(
                        "mode \"trace\" records a trace and serves online; it takes no plan \
                         (got {plan:?})"
                    ));
                }
                Ok(settings(Mode::Trace))
            }
            "plan" => {
                if plan.is_empty() {
                    return bad("mode \"plan\" needs a plan file path".into());
                }
                // A trace path in plan mode records the served run: the requests as the
                // plan saw them, to replay on the CPU against the same plan (why it
                // conflicted or was given up, `stweaver replay`).
                Ok(settings(Mode::Plan))
            }
            "auto" => Ok(settings(Mode::Auto)),
            other => bad(format!(
                "unknown mode {other:?}: expected \"online\", \"trace\", \"plan\" or \"auto\""
            )),
        }
    }

    /// These settings with `budget` (what `STWEAVER_BUDGET` sets).
    pub fn with_budget(mut self, budget: Option<Budget>) -> Settings {
        self.budget = budget;
        self
    }

    /// These settings as rank `rank` of a `torchrun` job (`None`: a single process).
    pub fn with_rank(mut self, rank: Option<RankInfo>) -> Settings {
        self.rank = rank;
        self
    }

    /// The trace file of device `d` (outside torchrun; see [`Settings::trace_path_on`]).
    pub fn trace_path_for(&self, d: i32) -> Option<PathBuf> {
        self.trace_path_on(d, None)
    }

    /// Auto mode: the plan file of device `d` (outside torchrun).
    pub fn plan_path_for(&self, d: i32) -> Option<PathBuf> {
        self.plan_path_on(d, None)
    }

    /// The trace file of device `d` when the rank's home device is `home`: the rank in
    /// the name under torchrun, `.cudaN` for a device other than the home device
    /// (device 0 outside torchrun). See [`crate::dist`].
    pub fn trace_path_on(&self, d: i32, home: Option<i32>) -> Option<PathBuf> {
        Some(self.output_on(self.trace_path.as_ref()?, d, home))
    }

    /// Auto mode: the plan file kept for device `d` (as [`Settings::trace_path_on`]).
    pub fn plan_path_on(&self, d: i32, home: Option<i32>) -> Option<PathBuf> {
        Some(self.output_on(self.plan_path.as_ref()?, d, home))
    }

    fn output_on(&self, p: &Path, d: i32, home: Option<i32>) -> PathBuf {
        let p = dist::output_path(p, self.rank.as_ref());
        dist::device_path(&p, d, home.filter(|_| self.rank.is_some()))
    }

    /// Plan mode: the plan file this process serves (per rank under torchrun).
    pub fn plan_source(&self) -> Option<PlanSource> {
        let p = self.plan_path.as_ref()?;
        Some(dist::resolve_plan(p, self.rank.as_ref(), Path::is_file))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn integer_settings_take_their_range_or_say_what_is_wrong() {
        let name = "STWEAVER_TEST_ENV_INT_ONLY_HERE";
        assert_eq!(env_int(name, 7, 0..=19).unwrap(), 7);
        for (v, want) in [
            ("3", Some(3)),
            (" 19 ", Some(19)),
            ("", Some(7)),
            ("20", None),
            ("-1", None),
            ("x", None),
        ] {
            // Safety: no other test reads or writes this variable (its name is this
            // test's alone), so no other thread sees the environment change.
            unsafe { std::env::set_var(name, v) };
            let got = env_int(name, 7, 0..=19);
            match want {
                Some(n) => assert_eq!(got.unwrap(), n, "{v:?}"),
                None => assert!(
                    got.unwrap_err().to_string().contains("from 0 to 19"),
                    "{v:?}"
                ),
            }
        }
        // Safety: as above.
        unsafe { std::env::remove_var(name) };
    }

    #[test]
    fn planning_beside_training_takes_one_thread_at_low_priority_by_default() {
        let s = Settings::parse("auto", "", "").unwrap();
        if std::env::var_os("STWEAVER_PLAN_THREADS").is_none() {
            assert_eq!(s.plan_threads, DEFAULT_PLAN_THREADS);
        }
        if std::env::var_os("STWEAVER_PLAN_NICE").is_none() {
            assert_eq!(s.plan_nice, DEFAULT_PLAN_NICE);
        }
        assert_eq!((DEFAULT_PLAN_THREADS, DEFAULT_PLAN_NICE), (1, 10));
        if std::env::var_os("STWEAVER_POOL_UNIT_MIB").is_none() {
            assert_eq!(s.pool_unit_mib << 20, POOL_UNIT, "64 MiB pieces by default");
        }
    }

    #[test]
    fn a_churning_online_loop_stops_releasing_after_three_iterations_by_default() {
        let s = Settings::parse("online", "", "").unwrap();
        if std::env::var_os("STWEAVER_RELEASE_CHURN").is_none() {
            assert_eq!(s.release_churn, RELEASE_CHURN);
        }
        assert_eq!(RELEASE_CHURN, 3);
    }
}
