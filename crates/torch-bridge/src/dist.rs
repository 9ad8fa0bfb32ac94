//! Several GPUs: per-rank file names and which plan a rank serves (`torchrun`).
//!
//! Under `torchrun` every rank is its own process with its own allocator; the runtime
//! never talks to other ranks (no collective inside the allocator, so no rank can wait on
//! another). What ranks need is that their files do not collide and that no rank serves
//! another rank's plan by mistake:
//!
//! - **Rank.** [`RankInfo::from_env`] reads torchrun's `RANK`, `LOCAL_RANK` and
//!   `WORLD_SIZE`; a run is *distributed* when `WORLD_SIZE > 1` and `RANK` is set.
//! - **Output names** (trace mode, and the files auto mode keeps): `{rank}` and
//!   `{local_rank}` in the path are replaced ([`expand`]; 0 outside torchrun); without a
//!   placeholder a distributed run inserts `.rank{R}` before the extension
//!   (`trace.stwt` → `trace.rank1.stwt`). The rank's *home* device (the first device it
//!   allocates on, `torch.cuda.set_device(local_rank)` in practice) gets that name, any
//!   other device `.cudaN` on top ([`device_path`]); outside torchrun device 0 gets the
//!   name as given and device N `.cudaN` (unchanged).
//! - **Plan files** ([`resolve_plan`]): a path with a placeholder, or a file named for
//!   this rank (`plan.rank1.stwp`), is *this rank's* plan; a name that carries another
//!   rank (`plan.rank0.stwp` on rank 1) is refused (the rank trains online); a plain
//!   name is used as this rank's plan when `plan.rank{R}.stwp` exists next to it, and
//!   otherwise as a plan **shared** by all ranks.
//! - **Devices.** A rank's own plan must have been made for the device the rank
//!   allocates on; otherwise it is refused with a warning. A shared plan is served on
//!   each rank's home device whatever device it was recorded on (ranks with identical
//!   patterns on different GPUs): the match is checked request by request by the plan
//!   cursor, and whatever a rank does differently is served online, so sharing is never
//!   unsafe; it only saves memory on ranks whose pattern is the plan's.
//!
//! The rank is carried by the file name only: the plan and trace formats keep their
//! device ordinal (checked on load) and gain no field.

use std::path::{Path, PathBuf};

/// This process's place in a `torchrun` job.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RankInfo {
    pub rank: u32,
    pub local_rank: u32,
    pub world_size: u32,
}

impl RankInfo {
    /// Reads `RANK`, `LOCAL_RANK` (default `RANK`) and `WORLD_SIZE` through `get`;
    /// `Ok(None)` when the run is not distributed (no `RANK`, or `WORLD_SIZE` absent or 1).
    pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> Result<Option<RankInfo>, String> {
        let num = |name: &str| -> Result<Option<u32>, String> {
            match get(name) {
                None => Ok(None),
                Some(v) if v.trim().is_empty() => Ok(None),
                Some(v) => v
                    .trim()
                    .parse::<u32>()
                    .map(Some)
                    .map_err(|_| format!("{name}={v:?} is not a non-negative integer")),
            }
        };
        let world_size = num("WORLD_SIZE")?.unwrap_or(1);
        let Some(rank) = num("RANK")? else {
            return Ok(None);
        };
        if world_size <= 1 {
            return Ok(None);
        }
        if rank >= world_size {
            return Err(format!("RANK={rank} is not below WORLD_SIZE={world_size}"));
        }
        let local_rank = num("LOCAL_RANK")?.unwrap_or(rank);
        Ok(Some(RankInfo {
            rank,
            local_rank,
            world_size,
        }))
    }

    /// [`RankInfo::from_vars`] over the process environment.
    pub fn from_env() -> Result<Option<RankInfo>, String> {
        Self::from_vars(|k| std::env::var(k).ok())
    }
}

const PLACEHOLDERS: [&str; 2] = ["{rank}", "{local_rank}"];

/// Whether `p` contains `{rank}` or `{local_rank}`.
pub fn has_placeholder(p: &Path) -> bool {
    let s = p.to_string_lossy();
    PLACEHOLDERS.iter().any(|ph| s.contains(ph))
}

/// `p` with `{rank}` / `{local_rank}` replaced (0 outside torchrun).
pub fn expand(p: &Path, rank: Option<&RankInfo>) -> PathBuf {
    if !has_placeholder(p) {
        return p.to_path_buf();
    }
    let (r, l) = rank.map_or((0, 0), |r| (r.rank, r.local_rank));
    let s = p
        .to_string_lossy()
        .replace("{local_rank}", &l.to_string())
        .replace("{rank}", &r.to_string());
    PathBuf::from(s)
}

/// `p` with `.{tag}` inserted before its extension (`a/t.stwt` → `a/t.{tag}.stwt`).
fn with_tag(p: &Path, tag: &str) -> PathBuf {
    let stem = p
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    let name = match p.extension() {
        Some(ext) => format!("{stem}.{tag}.{}", ext.to_string_lossy()),
        None => format!("{stem}.{tag}"),
    };
    p.with_file_name(name)
}

/// `p` with `.rank{rank}` before its extension.
pub fn rank_path(p: &Path, rank: u32) -> PathBuf {
    with_tag(p, &format!("rank{rank}"))
}

/// The rank a file name names: a dot-separated part `rank<digits>` of the file name
/// (`plan.rank3.stwp` → 3).
pub fn rank_in_name(p: &Path) -> Option<u32> {
    let name = p.file_name()?.to_string_lossy().into_owned();
    name.split('.').find_map(|part| {
        let digits = part.strip_prefix("rank")?;
        if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        digits.parse().ok()
    })
}

/// The file this rank writes for the path the user gave (before the device suffix).
pub fn output_path(p: &Path, rank: Option<&RankInfo>) -> PathBuf {
    if has_placeholder(p) {
        return expand(p, rank);
    }
    match rank {
        Some(r) if rank_in_name(p).is_none() => rank_path(p, r.rank),
        _ => p.to_path_buf(),
    }
}

/// The file of device `d`: `p` itself on the home device (device 0 when `home` is
/// `None`), `.cuda{d}` inserted otherwise.
pub fn device_path(p: &Path, d: i32, home: Option<i32>) -> PathBuf {
    if d == home.unwrap_or(0) {
        p.to_path_buf()
    } else {
        with_tag(p, &format!("cuda{d}"))
    }
}

/// Which plan a rank serves in plan mode.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PlanSource {
    /// This rank's own plan (or, outside torchrun, the file given): its device must be
    /// the device it is served on.
    Own(PathBuf),
    /// One plan for every rank (a plain name with no `.rank{R}` sibling): served on each
    /// rank's home device.
    Shared(PathBuf),
    /// The file's name says it is rank `rank`'s plan, and this is another rank.
    OtherRank { path: PathBuf, rank: u32, me: u32 },
}

impl PlanSource {
    pub fn path(&self) -> &Path {
        match self {
            PlanSource::Own(p) | PlanSource::Shared(p) | PlanSource::OtherRank { path: p, .. } => p,
        }
    }

    /// Why the plan is refused (`OtherRank`), for the user.
    pub fn refusal(&self) -> Option<String> {
        match self {
            PlanSource::OtherRank { path, rank, me } => Some(format!(
                "{} is rank {rank}'s plan (its name says so) and this is rank {me}: refused, \
                 this rank trains online (give each rank its own plan with {{rank}} in the \
                 path, or a plan without a rank in its name to share one)",
                path.display()
            )),
            _ => None,
        }
    }
}

/// Plan mode: the plan file this rank serves, for the path the user gave (see the
/// module docs). `exists` tells whether a file exists (the file system in production).
pub fn resolve_plan(
    p: &Path,
    rank: Option<&RankInfo>,
    exists: impl Fn(&Path) -> bool,
) -> PlanSource {
    if has_placeholder(p) {
        return PlanSource::Own(expand(p, rank));
    }
    let Some(r) = rank else {
        return PlanSource::Own(p.to_path_buf());
    };
    if let Some(k) = rank_in_name(p) {
        return if k == r.rank {
            PlanSource::Own(p.to_path_buf())
        } else {
            PlanSource::OtherRank {
                path: p.to_path_buf(),
                rank: k,
                me: r.rank,
            }
        };
    }
    let mine = rank_path(p, r.rank);
    if exists(&mine) {
        PlanSource::Own(mine)
    } else {
        PlanSource::Shared(p.to_path_buf())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vars<'a>(kv: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |k| kv.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string())
    }

    const R1: RankInfo = RankInfo {
        rank: 1,
        local_rank: 1,
        world_size: 2,
    };

    #[test]
    fn rank_comes_from_torchrun_variables() {
        assert_eq!(RankInfo::from_vars(vars(&[])), Ok(None));
        assert_eq!(
            RankInfo::from_vars(vars(&[("RANK", "0"), ("WORLD_SIZE", "1")])),
            Ok(None),
            "a world of one is not distributed"
        );
        assert_eq!(RankInfo::from_vars(vars(&[("WORLD_SIZE", "4")])), Ok(None));
        assert_eq!(
            RankInfo::from_vars(vars(&[
                ("RANK", "5"),
                ("LOCAL_RANK", "1"),
                ("WORLD_SIZE", "8")
            ])),
            Ok(Some(RankInfo {
                rank: 5,
                local_rank: 1,
                world_size: 8
            }))
        );
        assert_eq!(
            RankInfo::from_vars(vars(&[("RANK", "1"), ("WORLD_SIZE", "2")])),
            Ok(Some(R1)),
            "LOCAL_RANK defaults to RANK"
        );
        assert!(RankInfo::from_vars(vars(&[("RANK", "x"), ("WORLD_SIZE", "2")])).is_err());
        assert!(RankInfo::from_vars(vars(&[("RANK", "2"), ("WORLD_SIZE", "2")])).is_err());
    }

    #[test]
    fn placeholders_are_replaced() {
        let r = RankInfo {
            rank: 3,
            local_rank: 1,
            world_size: 4,
        };
        assert_eq!(
            expand(Path::new("/o/t_{rank}_{local_rank}.stwt"), Some(&r)),
            PathBuf::from("/o/t_3_1.stwt")
        );
        assert_eq!(
            expand(Path::new("/o/r{rank}/t.stwt"), None),
            PathBuf::from("/o/r0/t.stwt")
        );
        assert_eq!(
            output_path(Path::new("/o/t-{rank}.stwt"), Some(&r)),
            PathBuf::from("/o/t-3.stwt")
        );
    }

    #[test]
    fn distributed_outputs_carry_the_rank() {
        assert_eq!(
            output_path(Path::new("/o/t.stwt"), Some(&R1)),
            PathBuf::from("/o/t.rank1.stwt")
        );
        assert_eq!(
            output_path(Path::new("/o/t"), Some(&R1)),
            PathBuf::from("/o/t.rank1")
        );
        assert_eq!(
            output_path(Path::new("/o/t.stwt"), None),
            PathBuf::from("/o/t.stwt")
        );
        // The home device keeps the rank's name; another device gets `.cudaN` on top.
        let p = output_path(Path::new("/o/t.stwt"), Some(&R1));
        assert_eq!(
            device_path(&p, 1, Some(1)),
            PathBuf::from("/o/t.rank1.stwt")
        );
        assert_eq!(
            device_path(&p, 0, Some(1)),
            PathBuf::from("/o/t.rank1.cuda0.stwt")
        );
        // Outside torchrun: unchanged (device 0 plain, others `.cudaN`).
        assert_eq!(
            device_path(Path::new("t.stwt"), 0, None),
            PathBuf::from("t.stwt")
        );
        assert_eq!(
            device_path(Path::new("t.stwt"), 2, None),
            PathBuf::from("t.cuda2.stwt")
        );
    }

    #[test]
    fn rank_is_read_from_names() {
        assert_eq!(rank_in_name(Path::new("/a/plan.rank12.stwp")), Some(12));
        assert_eq!(
            rank_in_name(Path::new("/rank3/plan.stwp")),
            None,
            "folders do not count"
        );
        assert_eq!(rank_in_name(Path::new("plan.ranks.stwp")), None);
        assert_eq!(rank_in_name(Path::new("frank1.stwp")), None);
        assert_eq!(rank_in_name(Path::new("plan.stwp")), None);
    }

    #[test]
    fn plans_resolve_per_rank_shared_or_refused() {
        let none = |_: &Path| false;
        let all = |_: &Path| true;
        // Outside torchrun: the file given.
        assert_eq!(
            resolve_plan(Path::new("p.stwp"), None, none),
            PlanSource::Own("p.stwp".into())
        );
        // A placeholder: this rank's file.
        assert_eq!(
            resolve_plan(Path::new("p.{rank}.stwp"), Some(&R1), none),
            PlanSource::Own("p.1.stwp".into())
        );
        // A plain name with a per-rank sibling: the sibling.
        assert_eq!(
            resolve_plan(Path::new("d/p.stwp"), Some(&R1), all),
            PlanSource::Own("d/p.rank1.stwp".into())
        );
        // A plain name alone: shared by all ranks.
        assert_eq!(
            resolve_plan(Path::new("d/p.stwp"), Some(&R1), none),
            PlanSource::Shared("d/p.stwp".into())
        );
        // Named for this rank / another rank.
        assert_eq!(
            resolve_plan(Path::new("p.rank1.stwp"), Some(&R1), none),
            PlanSource::Own("p.rank1.stwp".into())
        );
        let other = resolve_plan(Path::new("p.rank0.stwp"), Some(&R1), all);
        assert_eq!(
            other,
            PlanSource::OtherRank {
                path: "p.rank0.stwp".into(),
                rank: 0,
                me: 1
            }
        );
        let why = other.refusal().unwrap();
        assert!(
            why.contains("rank 0's plan") && why.contains("this is rank 1"),
            "{why}"
        );
        assert!(PlanSource::Own("x".into()).refusal().is_none());
    }
}
