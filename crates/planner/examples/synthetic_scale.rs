//! Scale check for the offline solver: a seeded synthetic training trace of N buffers
//! (default 1,000,000), solved, checked by the independent checker, and reported.
//!
//! The trace imitates training: persistent parameters and optimizer state, then
//! iterations of `layers` forward steps (each keeps a few activations alive until its
//! backward step and frees some temporaries at once) followed by the backward steps in
//! reverse (gradients and temporaries), with a handful of distinct sizes and a seeded
//! jitter in which sizes a layer uses.
//!
//! ```sh
//! cargo build --release -p stweaver-planner --example synthetic_scale
//! /usr/bin/time -v target/release/examples/synthetic_scale [N] [SEED] [BUDGET_S]
//! ```

use std::time::{Duration, Instant};

use stweaver_core::Bytes;
use stweaver_planner::solver::{
    Buffer, Instance, SolveOptions, check_solution, lower_bound, solve,
};

/// A small seeded generator ([`stweaver_core::splitmix`]), enough for size jitter.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        stweaver_core::splitmix::next(&mut self.0)
    }
    fn pick<T: Copy>(&mut self, xs: &[T]) -> T {
        xs[(self.next() % xs.len() as u64) as usize]
    }
}

/// Builds the synthetic instance with `n` buffers.
fn synthetic(n: usize, seed: u64) -> Instance {
    const MIB: u64 = 1 << 20;
    let act_sizes = [16 * MIB, 32 * MIB, 64 * MIB];
    let tmp_sizes = [2 * MIB, 8 * MIB, 16 * MIB, 48 * MIB];
    let layers = 48u64;
    let mut rng = Rng(seed);
    let mut t = 0u64;
    let mut out = Vec::with_capacity(n);
    // Persistent: parameters, gradients and two optimizer moments per layer; the
    // lifetimes are closed later at `end`.
    let persistent = (layers * 4) as usize;
    for _ in 0..persistent {
        out.push(Buffer::new(
            t,
            0,
            Bytes(rng.pick(&[24 * MIB, 48 * MIB, 96 * MIB])),
        ));
        t += 1;
    }
    while out.len() < n {
        // Forward: per layer, 3 activations kept for backward, 2 temporaries.
        let mut kept: Vec<(u64, Bytes)> = Vec::new();
        for _ in 0..layers {
            for _ in 0..3 {
                kept.push((t, Bytes(rng.pick(&act_sizes))));
                t += 1;
            }
            for _ in 0..2 {
                let s = Bytes(rng.pick(&tmp_sizes));
                out.push(Buffer::new(t, t + 2, s));
                t += 2;
            }
        }
        // Backward: layers in reverse; each frees its activations after a temporary.
        for _ in 0..layers {
            let s = Bytes(rng.pick(&tmp_sizes));
            out.push(Buffer::new(t, t + 3, s));
            t += 1;
            for _ in 0..3 {
                if let Some((start, size)) = kept.pop() {
                    t += 1;
                    out.push(Buffer::new(start, t, size));
                }
            }
            t += 2;
        }
        t += 1;
    }
    out.truncate(n.max(persistent));
    for b in out.iter_mut().take(persistent) {
        b.upper = t + 1;
    }
    let buffers = out.into_iter().map(|b| b.with_align(Bytes(512))).collect();
    Instance {
        buffers,
        period: None,
    }
}

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let n: usize = args
        .first()
        .map(|s| s.parse())
        .transpose()?
        .unwrap_or(1_000_000);
    let seed: u64 = args.get(1).map(|s| s.parse()).transpose()?.unwrap_or(1);
    let budget: f64 = args.get(2).map(|s| s.parse()).transpose()?.unwrap_or(8.0);

    let t0 = Instant::now();
    let instance = synthetic(n, seed);
    let generate = t0.elapsed();
    let lb = lower_bound(&instance);
    let options = SolveOptions {
        seed,
        threads: 0,
        time_budget: Some(Duration::from_secs_f64(budget)),
        ..SolveOptions::default()
    };
    let t1 = Instant::now();
    let solution = solve(&instance, &options)?;
    let solve_time = t1.elapsed();
    let t2 = Instant::now();
    let checked = check_solution(&instance, &solution);
    let check_time = t2.elapsed();
    if let Err(errors) = &checked {
        anyhow::bail!(
            "the independent checker refused the solution: {:?}",
            errors.first()
        );
    }
    println!(
        "n {} | LB {} | peak {} | peak/LB {:.5} | generate {:.2} s | solve {:.2} s (budget {budget} s) | check {:.2} s",
        instance.buffers.len(),
        lb.get(),
        solution.peak.get(),
        solution.peak.ratio(lb),
        generate.as_secs_f64(),
        solve_time.as_secs_f64(),
        check_time.as_secs_f64(),
    );
    Ok(())
}
