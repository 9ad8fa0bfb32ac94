//! `stweaver verify PLAN [--trace T]`: check a plan file, and that it belongs to and
//! covers a trace ([`plan_file`]).
//!
//! `stweaver verify --solution Y.csv [--instance X.csv]`: check a CSV solution with
//! the independent checker (any tool's output in minimalloc's format will do).
//!
//! The solution file restates every buffer (`id,lower,upper,size,offset`). With
//! `--instance`, every buffer of the instance must appear in the solution with the
//! same lifetime and size (matched by id), so a solution cannot drop or alter buffers.

mod plan_file;

use std::collections::HashMap;
use std::path::PathBuf;

use anyhow::{Result, bail};
use stweaver_core::{Bytes, Offset};
use stweaver_planner::solver::{self, Solution, csv};

#[derive(clap::Args, Debug)]
pub struct VerifyArgs {
    /// A plan file to check (the plan verifier runs on load).
    #[arg(value_name = "PLAN", required_unless_present = "solution")]
    pub plan: Option<PathBuf>,
    /// With PLAN: the snapshot or trace file it must belong to (device, trace digest)
    /// and cover (every planned allocation has exactly its request).
    #[arg(long, value_name = "FILE", requires = "plan")]
    pub trace: Option<PathBuf>,
    /// With --trace: the device whose trace to check (default: the plan's).
    #[arg(long, value_name = "N", requires = "trace")]
    pub device: Option<i32>,
    /// The solution: a CSV with `id,lower,upper,size,offset` columns.
    #[arg(long, value_name = "FILE", conflicts_with = "plan")]
    pub solution: Option<PathBuf>,
    /// The instance the solution claims to solve (matched by id).
    #[arg(long, value_name = "FILE")]
    pub instance: Option<PathBuf>,
    /// Circular clock with this period (as `plan --period`).
    #[arg(long, value_name = "L")]
    pub period: Option<u64>,
}

pub fn run(args: VerifyArgs) -> Result<()> {
    if let Some(plan) = &args.plan {
        return plan_file::run(plan, args.trace.as_deref(), args.device);
    }
    let Some(solution) = &args.solution else {
        bail!("give a plan file to check, or --solution FILE for a CSV solution");
    };
    let sol = csv::read_solution(solution)?;
    let name = solution.display().to_string();
    let mut instance = sol.csv.instance.clone();
    instance.period = args.period;
    let mut offsets = sol.offsets.clone();
    let mut ids = sol.csv.ids.clone();
    if let Some(path) = &args.instance {
        let inst = csv::read_instance(path)?;
        let by_id: HashMap<&str, usize> = sol
            .csv
            .ids
            .iter()
            .enumerate()
            .map(|(i, id)| (id.as_str(), i))
            .collect();
        if inst.ids.len() != sol.csv.ids.len() {
            bail!(
                "{name}: has {} buffers, the instance {} has {}",
                sol.csv.ids.len(),
                path.display(),
                inst.ids.len()
            );
        }
        offsets = Vec::with_capacity(inst.ids.len());
        for (k, id) in inst.ids.iter().enumerate() {
            let Some(&j) = by_id.get(id.as_str()) else {
                bail!(
                    "{name}: buffer `{id}` ({}:{}) is missing",
                    path.display(),
                    inst.lines[k]
                );
            };
            let (a, b) = (inst.instance.buffers[k], sol.csv.instance.buffers[j]);
            if (a.lower, a.upper, a.size) != (b.lower, b.upper, b.size) {
                bail!(
                    "{name}:{}: buffer `{id}` is [{}, {}) x {} here but [{}, {}) x {} in {}:{}",
                    sol.csv.lines[j],
                    b.lower,
                    b.upper,
                    b.size.get(),
                    a.lower,
                    a.upper,
                    a.size.get(),
                    path.display(),
                    inst.lines[k]
                );
            }
            offsets.push(sol.offsets[j]);
        }
        instance = inst.instance;
        instance.period = args.period;
        ids = inst.ids;
    }
    let peak = peak(&instance, &offsets);
    let solution = Solution { offsets, peak };
    match solver::check_solution(&instance, &solution) {
        Ok(()) => {
            let lb = solver::lower_bound(&instance);
            println!(
                "{name}: valid; {} buffers, peak {} = {:.5}×LB (LB {})",
                instance.len(),
                peak.get(),
                peak.ratio(lb),
                lb.get()
            );
            Ok(())
        }
        Err(errors) => {
            for e in &errors {
                match e {
                    solver::SolutionError::Overlap { first, second, .. } => {
                        let id = |i: usize| ids.get(i).map_or("?", String::as_str);
                        eprintln!("{name}: {e} (ids `{}` and `{}`)", id(*first), id(*second));
                    }
                    _ => eprintln!("{name}: {e}"),
                }
            }
            bail!("{name}: invalid ({} problem(s) shown)", errors.len())
        }
    }
}

fn peak(instance: &solver::Instance, offsets: &[Offset]) -> Bytes {
    Bytes(
        instance
            .buffers
            .iter()
            .zip(offsets)
            .map(|(b, o)| o.0.saturating_add(b.size.0))
            .max()
            .unwrap_or(0),
    )
}
