//! Several GPUs (`torchrun`) on host memory: per-rank file names, per-rank / shared plans,
//! and the refusal of another rank's or another device's plan (module `stweaver_torch::dist`).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use stweaver_core::engine::HostMemory;
use stweaver_core::plan_file::{read_plan_file, write_plan_file};
use stweaver_core::trace_file::read_trace_file;
use stweaver_core::units::Bytes;
use stweaver_planner::planning::{PlanOptions, plan_trace};
use stweaver_torch::dist::RankInfo;
use stweaver_torch::ffi::bridge::PoolId;
use stweaver_torch::tracked::BridgeDevice;
use stweaver_torch::{Core, Runtime, Settings};

const MIB: usize = 1 << 20;
const S0: usize = 0x10;
const DEFAULT: PoolId = PoolId {
    first: 0,
    second: 0,
};

fn rank(r: u32) -> Option<RankInfo> {
    Some(RankInfo {
        rank: r,
        local_rank: r,
        world_size: 2,
    })
}

/// A runtime over two host devices as rank `r` (None: a single process).
fn runtime(mode: &str, plan: &Path, trace: &Path, r: Option<RankInfo>) -> Runtime {
    let devs: Vec<Arc<HostMemory>> = (0..2)
        .map(|_| {
            Arc::new(HostMemory::new(
                Bytes(256 * MIB as u64),
                Bytes(2 * MIB as u64),
            ))
        })
        .collect();
    let factory = Box::new(move |d: i32| Ok(devs[d as usize].clone() as Arc<dyn BridgeDevice>));
    let s = |p: &Path| p.to_str().unwrap().to_string();
    let settings = Settings::parse(mode, &s(plan), &s(trace))
        .unwrap()
        .with_rank(r);
    let rt = Runtime::with_core(Core::new(settings, factory));
    rt.init(2).unwrap();
    rt
}

fn iteration(rt: &Runtime, device: i32) {
    let mut live = Vec::new();
    for s in [4 * MIB, 1000, 3 * MIB, 64 * 1024] {
        live.push(rt.malloc(device, s, S0, DEFAULT).unwrap());
    }
    for p in live.drain(..).rev() {
        rt.free(p).unwrap();
    }
}

fn info(rt: &Runtime) -> serde_json::Value {
    serde_json::from_str(&rt.info_json().unwrap()).unwrap()
}

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("stweaver-dist-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Records a trace as rank `r` on device `r` and plans it into `plan`.
fn make_plan(dir: &Path, r: u32, plan: &Path) {
    let trace = dir.join(format!("make{r}.stwt"));
    let rt = runtime("trace", Path::new(""), &trace, rank(r));
    for _ in 0..4 {
        iteration(&rt, r as i32);
        rt.step().unwrap();
    }
    let written = rt.flush_trace().unwrap();
    let expected = dir.join(format!("make{r}.rank{r}.stwt"));
    assert_eq!(written, vec![expected.display().to_string()]);
    let t = read_trace_file(&expected).unwrap();
    let p = plan_trace(&t, &PlanOptions::default()).unwrap().plan;
    assert_eq!(p.device.0, r as i32);
    write_plan_file(plan, &p).unwrap();
}

#[test]
fn traces_are_named_per_rank_and_per_device() {
    let dir = tmp("names");
    // Rank 1 allocates on cuda:1 (its home device), then a little on cuda:0.
    let rt = runtime("trace", Path::new(""), &dir.join("t.stwt"), rank(1));
    iteration(&rt, 1);
    rt.step().unwrap();
    iteration(&rt, 0);
    let mut written = rt.flush_trace().unwrap();
    written.sort();
    assert_eq!(
        written,
        vec![
            dir.join("t.rank1.cuda0.stwt").display().to_string(),
            dir.join("t.rank1.stwt").display().to_string(),
        ]
    );
    assert_eq!(
        read_trace_file(&dir.join("t.rank1.stwt")).unwrap().device.0,
        1
    );
    let i = info(&rt);
    assert_eq!(i["rank"]["rank"], 1);
    assert_eq!(i["home_device"], 1);

    // A placeholder names the file itself.
    let rt = runtime(
        "trace",
        Path::new(""),
        &dir.join("r{rank}-l{local_rank}.stwt"),
        rank(1),
    );
    iteration(&rt, 1);
    assert_eq!(
        rt.flush_trace().unwrap(),
        vec![dir.join("r1-l1.stwt").display().to_string()]
    );
    // Outside torchrun, nothing changes.
    let rt = runtime("trace", Path::new(""), &dir.join("t.stwt"), None);
    iteration(&rt, 0);
    assert_eq!(
        rt.flush_trace().unwrap(),
        vec![dir.join("t.stwt").display().to_string()]
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn auto_mode_keeps_per_rank_files() {
    let dir = tmp("auto");
    let rt = runtime("auto", &dir.join("p.stwp"), &dir.join("t.stwt"), rank(1));
    let mut steps = 0;
    while rt.mode().unwrap() != "auto (plan)" {
        iteration(&rt, 1);
        rt.step().unwrap();
        steps += 1;
        assert!(
            !rt.mode().unwrap().starts_with("auto (online"),
            "{}",
            rt.mode().unwrap()
        );
        std::thread::sleep(std::time::Duration::from_millis(5));
        assert!(steps < 500, "never switched");
    }
    assert!(dir.join("t.rank1.stwt").is_file());
    let p = read_plan_file(&dir.join("p.rank1.stwp")).unwrap();
    assert_eq!(p.device.0, 1);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn plans_are_per_rank_shared_or_refused() {
    let dir = tmp("plans");
    let p0 = dir.join("p.rank0.stwp");
    make_plan(&dir, 0, &p0);
    let none = Path::new("");

    // Rank 0 given the plain name finds its own file and serves it.
    let rt = runtime("plan", &dir.join("p.stwp"), none, rank(0));
    iteration(&rt, 0);
    assert_eq!(rt.mode().unwrap(), "plan");
    assert_eq!(info(&rt)["plan_file"]["path"], p0.display().to_string());
    assert_eq!(info(&rt)["plan_file"]["shared"], false);

    // Rank 1 given rank 0's file by name: refused at install, trains online.
    let rt = runtime("plan", &p0, none, rank(1));
    let m = rt.mode().unwrap();
    assert!(
        m.starts_with("online (plan rejected") && m.contains("rank 0's plan"),
        "{m}"
    );
    iteration(&rt, 1);
    assert!(rt.mode().unwrap().starts_with("online"));

    // Rank 1's own file (a placeholder) made on cuda:0 while rank 1 allocates on cuda:1:
    // refused at its first allocation.
    let wrong = dir.join("q.1.stwp");
    std::fs::copy(&p0, &wrong).unwrap();
    let rt = runtime("plan", &dir.join("q.{rank}.stwp"), none, rank(1));
    assert!(
        rt.mode().unwrap().starts_with("plan"),
        "{}",
        rt.mode().unwrap()
    );
    iteration(&rt, 1);
    let m = rt.mode().unwrap();
    assert!(
        m.starts_with("online (plan rejected") && m.contains("cuda:1"),
        "{m}"
    );
    assert!(m.contains("was made for"), "{m}");

    // A plan without a rank in its name and no per-rank sibling is shared: rank 1 serves
    // rank 0's plan on cuda:1.
    let shared = dir.join("shared.stwp");
    std::fs::copy(&p0, &shared).unwrap();
    let rt = runtime("plan", &shared, none, rank(1));
    for _ in 0..3 {
        iteration(&rt, 1);
        rt.step().unwrap();
    }
    assert_eq!(rt.mode().unwrap(), "plan");
    let i = info(&rt);
    assert_eq!(i["plan_file"]["shared"], true);
    assert!(i["devices"][1]["plan"]["hits"].as_u64().unwrap() > 0, "{i}");
    assert!(
        i["notes"][0].as_str().unwrap().contains("shared plan"),
        "{i}"
    );

    // Outside torchrun a plan for another device waits for its device (unchanged).
    let rt = runtime("plan", &p0, none, None);
    iteration(&rt, 1);
    assert_eq!(rt.mode().unwrap(), "plan (waiting for its device)");
    iteration(&rt, 0);
    assert_eq!(rt.mode().unwrap(), "plan");
    std::fs::remove_dir_all(&dir).unwrap();
}
