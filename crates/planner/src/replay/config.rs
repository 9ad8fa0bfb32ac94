//! `PYTORCH_CUDA_ALLOC_CONF` / `PYTORCH_ALLOC_CONF` settings of the PyTorch 2.11 CUDA
//! caching allocator, and the two size functions every allocation goes through.
//!
//! Syntax (research `pytorch-allocator-2.11.md` §5.2): `key:value,key2:[a:b,>:c]`,
//! spaces ignored. Keys that change placement are modelled: `expandable_segments`,
//! `max_split_size_mb`, `max_non_split_rounding_mb`, `large_segment_size_mb`,
//! `roundup_power2_divisions` (integer or `[MiB:div,...,>:div]` list),
//! `garbage_collection_threshold` and `per_process_memory_fraction`. `backend` is parsed
//! (`native` or `cudaMallocAsync`; the replay refuses the latter). Host-side and
//! locking keys (`pinned_*`, `release_lock_on_cudamalloc`,
//! `graph_capture_record_stream_reuse`) are validated and otherwise ignored: they do not
//! move device memory. Any other key is an error, as in PyTorch.
//!
//! Validation follows PyTorch: `large_segment_size_mb > 10`; `max_split_size_mb` and
//! `max_non_split_rounding_mb` `>= large_segment_size_mb` (keys are read with
//! `large_segment_size_mb` first, whatever their order); divisions 0 or powers of two;
//! list boundaries powers of two; `garbage_collection_threshold` in (0, 1);
//! `per_process_memory_fraction` in [0, 1]; booleans exactly `True`/`False`.
//!
//! [`AllocatorConfig::round_size`] is §6.2 and [`AllocatorConfig::allocation_size`] is
//! §6.3; both are O(1).

use std::fmt;

use stweaver_core::Bytes;

/// One MiB.
pub const MIB: u64 = 1 << 20;
/// `kMinBlockSize`: every block is a multiple of this.
pub const MIN_BLOCK_SIZE: u64 = 512;
/// `kSmallSize`: requests up to this (rounded) size use the small pool.
pub const SMALL_SIZE: u64 = MIB;
/// `kSmallBuffer`: the small pool's segment (and expandable page) size.
pub const SMALL_BUFFER: u64 = 2 * MIB;
/// `kMinLargeAlloc`: large requests below this get a `large_segment_size` segment.
pub const MIN_LARGE_ALLOC: u64 = 10 * MIB;
/// `kRoundLarge`: larger requests get a segment rounded up to this.
pub const ROUND_LARGE: u64 = 2 * MIB;
/// Default `large_segment_size` (`kLargeBuffer`).
pub const DEFAULT_LARGE_SEGMENT: u64 = 20 * MIB;
/// Number of `roundup_power2_divisions` intervals (1 MiB .. 64 GiB).
pub const ROUNDUP_INTERVALS: usize = 16;

/// Which allocator backend the settings select.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Backend {
    /// The caching allocator (what the replay models).
    #[default]
    Native,
    /// `cudaMallocAsync` (not modelled).
    CudaMallocAsync,
}

/// Settings of the PyTorch 2.11 caching allocator that change where memory goes.
#[derive(Debug, Clone, PartialEq)]
pub struct AllocatorConfig {
    /// `expandable_segments:True`.
    pub expandable_segments: bool,
    /// `max_split_size_mb`; `None` = unlimited (PyTorch's `SIZE_MAX`, `-1` in snapshots).
    pub max_split_size: Option<Bytes>,
    /// `max_non_split_rounding_mb` (default: `large_segment_size`).
    pub max_non_split_rounding: Bytes,
    /// `large_segment_size_mb` (default 20 MiB): segment size for 1–10 MiB requests and
    /// the large pool's expandable page.
    pub large_segment_size: Bytes,
    /// `roundup_power2_divisions` per interval: index `i` covers `[2^i MiB, 2^(i+1) MiB)`
    /// (index 0 also everything below 1 MiB, index 15 everything above). 0 = off.
    pub roundup_power2_divisions: [u32; ROUNDUP_INTERVALS],
    /// `garbage_collection_threshold` (only active with a memory fraction < 1).
    pub garbage_collection_threshold: Option<f64>,
    /// `per_process_memory_fraction` (1.0 = none).
    pub per_process_memory_fraction: Option<f64>,
    /// `backend`.
    pub backend: Backend,
}

impl Default for AllocatorConfig {
    fn default() -> Self {
        AllocatorConfig {
            expandable_segments: false,
            max_split_size: None,
            max_non_split_rounding: Bytes(DEFAULT_LARGE_SEGMENT),
            large_segment_size: Bytes(DEFAULT_LARGE_SEGMENT),
            roundup_power2_divisions: [0; ROUNDUP_INTERVALS],
            garbage_collection_threshold: None,
            per_process_memory_fraction: None,
            backend: Backend::Native,
        }
    }
}

/// A malformed allocator settings string.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    #[error("allocator config `{input}`: unknown key `{key}`")]
    UnknownKey { input: String, key: String },
    #[error("allocator config `{input}`: expected {expected} at token {position}, found `{found}`")]
    Syntax {
        input: String,
        expected: &'static str,
        position: usize,
        found: String,
    },
    #[error("allocator config `{input}`: bad value `{value}` for `{key}`: {reason}")]
    BadValue {
        input: String,
        key: String,
        value: String,
        reason: String,
    },
}

/// Splits on `,` `:` `[` `]`, dropping spaces (PyTorch's `ConfigTokenizer`).
fn tokenize(s: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut buf = String::new();
    for c in s.chars() {
        match c {
            ',' | ':' | '[' | ']' => {
                if !buf.is_empty() {
                    out.push(std::mem::take(&mut buf));
                }
                out.push(c.to_string());
            }
            ' ' => {}
            _ => buf.push(c),
        }
    }
    if !buf.is_empty() {
        out.push(buf);
    }
    out
}

struct Parser<'a> {
    input: &'a str,
    tokens: Vec<String>,
}

impl Parser<'_> {
    fn tok(&self, i: usize) -> &str {
        self.tokens.get(i).map(String::as_str).unwrap_or("<end>")
    }

    fn expect(&self, i: usize, what: &'static str) -> Result<(), ConfigError> {
        if self.tok(i) == what {
            Ok(())
        } else {
            Err(ConfigError::Syntax {
                input: self.input.to_string(),
                expected: what,
                position: i,
                found: self.tok(i).to_string(),
            })
        }
    }

    fn bad(&self, key: &str, value: &str, reason: impl Into<String>) -> ConfigError {
        ConfigError::BadValue {
            input: self.input.to_string(),
            key: key.to_string(),
            value: value.to_string(),
            reason: reason.into(),
        }
    }

    fn value_token(&self, i: usize, key: &str) -> Result<&str, ConfigError> {
        let v = self.tok(i);
        if matches!(v, "<end>" | "," | ":" | "[" | "]") {
            return Err(self.bad(key, v, "a value is missing"));
        }
        Ok(v)
    }

    fn uint(&self, i: usize, key: &str) -> Result<u64, ConfigError> {
        let v = self.value_token(i, key)?;
        v.parse::<u64>()
            .map_err(|_| self.bad(key, v, "expected a non-negative integer"))
    }

    fn float(&self, i: usize, key: &str) -> Result<f64, ConfigError> {
        let v = self.value_token(i, key)?;
        v.parse::<f64>()
            .ok()
            .filter(|f| f.is_finite())
            .ok_or_else(|| self.bad(key, v, "expected a number"))
    }

    fn boolean(&self, i: usize, key: &str) -> Result<bool, ConfigError> {
        match self.value_token(i, key)? {
            "True" => Ok(true),
            "False" => Ok(false),
            v => Err(self.bad(key, v, "expected `True` or `False`")),
        }
    }

    /// Index of the last token of the value starting at `i` (a word, or a `[...]` list).
    fn skip_value(&self, i: usize) -> usize {
        if self.tok(i) == "[" {
            let mut j = i;
            while j < self.tokens.len() && self.tokens[j] != "]" {
                j += 1;
            }
            j
        } else {
            i
        }
    }
}

impl AllocatorConfig {
    /// Parses a `PYTORCH_CUDA_ALLOC_CONF`-style string. The empty string gives the
    /// defaults. O(length).
    pub fn parse(input: &str) -> Result<AllocatorConfig, ConfigError> {
        let p = Parser {
            input,
            tokens: tokenize(input),
        };
        let mut cfg = AllocatorConfig::default();
        // Pass 1: large_segment_size_mb, which the other checks depend on.
        let mut i = 0;
        while i < p.tokens.len() {
            if p.tokens[i] == "large_segment_size_mb" {
                p.expect(i + 1, ":")?;
                let mb = p.uint(i + 2, "large_segment_size_mb")?;
                if mb <= MIN_LARGE_ALLOC / MIB {
                    return Err(p.bad(
                        "large_segment_size_mb",
                        &mb.to_string(),
                        format!("must be > {}", MIN_LARGE_ALLOC / MIB),
                    ));
                }
                cfg.large_segment_size = Bytes(mb_to_bytes(mb));
                i += 2;
            }
            i += 1;
        }
        cfg.max_non_split_rounding = cfg.large_segment_size;
        let large_mb = cfg.large_segment_size.get() / MIB;

        // Pass 2: everything, strictly.
        let mut i = 0;
        while i < p.tokens.len() {
            let key = p.tok(i).to_string();
            if matches!(key.as_str(), "," | ":" | "[" | "]") {
                return Err(ConfigError::Syntax {
                    input: input.to_string(),
                    expected: "a key",
                    position: i,
                    found: key,
                });
            }
            p.expect(i + 1, ":")?;
            let v = i + 2;
            let last = match key.as_str() {
                "large_segment_size_mb" => v, // pass 1
                "max_split_size_mb" | "max_non_split_rounding_mb" => {
                    let mb = p.uint(v, &key)?;
                    if mb < large_mb {
                        return Err(p.bad(
                            &key,
                            &mb.to_string(),
                            format!("must be >= large_segment_size_mb ({large_mb})"),
                        ));
                    }
                    let b = Bytes(mb_to_bytes(mb));
                    if key == "max_split_size_mb" {
                        cfg.max_split_size = Some(b);
                    } else {
                        cfg.max_non_split_rounding = b;
                    }
                    v
                }
                "garbage_collection_threshold" => {
                    let f = p.float(v, &key)?;
                    if !(f > 0.0 && f < 1.0) {
                        return Err(p.bad(&key, p.tok(v), "must be in (0.0, 1.0)"));
                    }
                    cfg.garbage_collection_threshold = Some(f);
                    v
                }
                "per_process_memory_fraction" => {
                    let f = p.float(v, &key)?;
                    if !(0.0..=1.0).contains(&f) {
                        return Err(p.bad(&key, p.tok(v), "must be in [0.0, 1.0]"));
                    }
                    cfg.per_process_memory_fraction = (f < 1.0).then_some(f);
                    v
                }
                "roundup_power2_divisions" => parse_divisions(&p, v, &mut cfg)?,
                "expandable_segments" => {
                    cfg.expandable_segments = p.boolean(v, &key)?;
                    v
                }
                "backend" => {
                    cfg.backend = match p.value_token(v, &key)? {
                        "native" => Backend::Native,
                        "cudaMallocAsync" => Backend::CudaMallocAsync,
                        other => {
                            return Err(p.bad(
                                &key,
                                other,
                                "expected `native` or `cudaMallocAsync`",
                            ));
                        }
                    };
                    v
                }
                "release_lock_on_cudamalloc"
                | "pinned_use_cuda_host_register"
                | "pinned_use_background_threads"
                | "graph_capture_record_stream_reuse" => {
                    p.boolean(v, &key)?;
                    v
                }
                "pinned_num_register_threads" => {
                    let n = p.uint(v, &key)?;
                    if !n.is_power_of_two() {
                        return Err(p.bad(&key, p.tok(v), "must be a power of two"));
                    }
                    v
                }
                "pinned_reserve_segment_size_mb"
                | "pinned_max_round_threshold_mb"
                | "pinned_max_cached_size_mb" => {
                    p.uint(v, &key)?;
                    v
                }
                _ => {
                    return Err(ConfigError::UnknownKey {
                        input: input.to_string(),
                        key,
                    });
                }
            };
            let last = p.skip_value(last);
            i = last + 1;
            if i < p.tokens.len() {
                p.expect(i, ",")?;
                i += 1;
                if i == p.tokens.len() {
                    return Err(ConfigError::Syntax {
                        input: input.to_string(),
                        expected: "a key after `,`",
                        position: i,
                        found: "<end>".to_string(),
                    });
                }
            }
        }
        Ok(cfg)
    }

    /// True for PyTorch's defaults (what an empty conf string gives).
    pub fn is_default(&self) -> bool {
        *self == AllocatorConfig::default()
    }

    /// The division count for a size (§6.2): interval `max(0, floor(log2 n) - 20)`,
    /// capped at 15.
    pub fn divisions_for(&self, n: u64) -> u32 {
        if n == 0 {
            return self.roundup_power2_divisions[0];
        }
        let log = 63 - n.leading_zeros() as usize;
        let idx = log.saturating_sub(20).min(ROUNDUP_INTERVALS - 1);
        self.roundup_power2_divisions[idx]
    }

    /// `round_size(n)` (§6.2): at least 512, a multiple of 512, or the next power-of-two
    /// division when `roundup_power2_divisions` applies.
    pub fn round_size(&self, n: Bytes) -> Bytes {
        let n = n.get();
        if n < MIN_BLOCK_SIZE {
            return Bytes(MIN_BLOCK_SIZE);
        }
        let d = u64::from(self.divisions_for(n));
        if d > 1 && n > MIN_BLOCK_SIZE * d {
            return Bytes(roundup_power2_next_division(n, d));
        }
        Bytes(n.div_ceil(MIN_BLOCK_SIZE) * MIN_BLOCK_SIZE)
    }

    /// `get_allocation_size(size)` (§6.3) of a rounded size: the cudaMalloc size of a new
    /// segment for it.
    pub fn allocation_size(&self, size: Bytes) -> Bytes {
        let s = size.get();
        if s <= SMALL_SIZE {
            Bytes(SMALL_BUFFER)
        } else if s < MIN_LARGE_ALLOC {
            self.large_segment_size
        } else {
            Bytes(s.div_ceil(ROUND_LARGE) * ROUND_LARGE)
        }
    }

    /// `max_split_size` in bytes (`u64::MAX` when unlimited).
    pub fn max_split(&self) -> u64 {
        self.max_split_size.map_or(u64::MAX, Bytes::get)
    }

    /// A short human label: `native (default)`, `expandable_segments:True`, ...
    pub fn label(&self) -> String {
        if self.is_default() {
            "native (default)".to_string()
        } else {
            self.to_string()
        }
    }
}

impl AllocatorConfig {
    /// The configuration a snapshot's `allocator_settings` describe (§4.2): the raw
    /// `PYTORCH_CUDA_ALLOC_CONF` string is parsed (it alone carries
    /// `large_segment_size_mb` and `max_non_split_rounding_mb`), then the decoded fields
    /// override it, since they are what the allocator actually used (settings can change
    /// at run time).
    pub fn from_snapshot_settings(
        settings: &crate::snapshot::AllocatorSettings,
    ) -> Result<AllocatorConfig, ConfigError> {
        let mut cfg = AllocatorConfig::parse(&settings.alloc_conf)?;
        if !settings.present {
            return Ok(cfg);
        }
        cfg.expandable_segments = settings.expandable_segments;
        cfg.max_split_size = settings.max_split_size;
        cfg.garbage_collection_threshold = (settings.garbage_collection_threshold > 0.0)
            .then_some(settings.garbage_collection_threshold);
        if !settings.roundup_power2_divisions.is_empty() {
            let mut table = [0u32; ROUNDUP_INTERVALS];
            for r in &settings.roundup_power2_divisions {
                let mib = (r.interval_start.get() / MIB).max(1);
                let idx = (63 - mib.leading_zeros() as usize).min(ROUNDUP_INTERVALS - 1);
                table[idx] = u32::try_from(r.divisions).map_err(|_| ConfigError::BadValue {
                    input: settings.alloc_conf.clone(),
                    key: "roundup_power2_divisions".into(),
                    value: r.divisions.to_string(),
                    reason: "too large".into(),
                })?;
            }
            cfg.roundup_power2_divisions = table;
        }
        Ok(cfg)
    }
}

fn mb_to_bytes(mb: u64) -> u64 {
    mb.saturating_mul(MIB)
}

/// `roundup_power2_next_division(n, d)` (§6.2); `d` a power of two >= 2.
fn roundup_power2_next_division(n: u64, d: u64) -> u64 {
    if n.is_power_of_two() {
        return n;
    }
    let floor = 1u64 << (63 - n.leading_zeros());
    let step = floor >> d.trailing_zeros();
    if step == 0 {
        return floor << 1;
    }
    let r = n & !(step - 1);
    if r == n { n } else { r + step }
}

/// Parses the value of `roundup_power2_divisions` starting at token `v`; returns the
/// index of its last token.
fn parse_divisions(
    p: &Parser<'_>,
    v: usize,
    cfg: &mut AllocatorConfig,
) -> Result<usize, ConfigError> {
    const KEY: &str = "roundup_power2_divisions";
    let check_div = |i: usize| -> Result<u32, ConfigError> {
        let d = p.uint(i, KEY)?;
        if d != 0 && !d.is_power_of_two() {
            return Err(p.bad(KEY, p.tok(i), "divisions must be 0 or a power of two"));
        }
        u32::try_from(d).map_err(|_| p.bad(KEY, p.tok(i), "too large"))
    };
    let mut table = [0u32; ROUNDUP_INTERVALS];
    if p.tok(v) != "[" {
        let d = check_div(v)?;
        if d == 0 {
            return Err(p.bad(KEY, p.tok(v), "divisions must be a power of two"));
        }
        cfg.roundup_power2_divisions = [d; ROUNDUP_INTERVALS];
        return Ok(v);
    }
    let mut i = v + 1;
    let mut first = true;
    let mut last_index = 0usize;
    loop {
        if p.tok(i) == "]" {
            break;
        }
        let bound = p.value_token(i, KEY)?.to_string();
        p.expect(i + 1, ":")?;
        let d = check_div(i + 2)?;
        if bound == ">" {
            for slot in table.iter_mut().skip(last_index + 1) {
                *slot = d;
            }
        } else {
            let b: u64 = bound.parse().map_err(|_| {
                p.bad(
                    KEY,
                    &bound,
                    "interval boundary must be an integer (MiB) or `>`",
                )
            })?;
            if !b.is_power_of_two() {
                return Err(p.bad(KEY, &bound, "interval boundaries must be powers of two"));
            }
            let idx = (63 - b.leading_zeros() as usize).min(ROUNDUP_INTERVALS - 1);
            if first {
                for slot in table.iter_mut().take(idx) {
                    *slot = d;
                }
                first = false;
            }
            table[idx] = d;
            last_index = idx;
        }
        i += 3;
        match p.tok(i) {
            "]" => break,
            "," => i += 1,
            _ => {
                return Err(ConfigError::Syntax {
                    input: p.input.to_string(),
                    expected: "`,` or `]`",
                    position: i,
                    found: p.tok(i).to_string(),
                });
            }
        }
    }
    cfg.roundup_power2_divisions = table;
    Ok(i)
}

impl fmt::Display for AllocatorConfig {
    /// The canonical conf string (empty for the defaults); parses back to `self`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut parts: Vec<String> = Vec::new();
        if self.backend == Backend::CudaMallocAsync {
            parts.push("backend:cudaMallocAsync".into());
        }
        if self.expandable_segments {
            parts.push("expandable_segments:True".into());
        }
        if self.large_segment_size.get() != DEFAULT_LARGE_SEGMENT {
            parts.push(format!(
                "large_segment_size_mb:{}",
                self.large_segment_size.get() / MIB
            ));
        }
        if let Some(m) = self.max_split_size {
            parts.push(format!("max_split_size_mb:{}", m.get() / MIB));
        }
        if self.max_non_split_rounding != self.large_segment_size {
            parts.push(format!(
                "max_non_split_rounding_mb:{}",
                self.max_non_split_rounding.get() / MIB
            ));
        }
        let t = &self.roundup_power2_divisions;
        if t.iter().all(|&d| d == t[0]) {
            if t[0] != 0 {
                parts.push(format!("roundup_power2_divisions:{}", t[0]));
            }
        } else {
            let list: Vec<String> = t
                .iter()
                .enumerate()
                .map(|(i, d)| format!("{}:{d}", 1u64 << i))
                .collect();
            parts.push(format!("roundup_power2_divisions:[{}]", list.join(",")));
        }
        if let Some(g) = self.garbage_collection_threshold {
            parts.push(format!("garbage_collection_threshold:{g}"));
        }
        if let Some(fr) = self.per_process_memory_fraction {
            parts.push(format!("per_process_memory_fraction:{fr}"));
        }
        f.write_str(&parts.join(","))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_is_default_and_round_trips() {
        let c = AllocatorConfig::parse("").unwrap();
        assert!(c.is_default());
        assert_eq!(c.to_string(), "");
        let s = "expandable_segments:True,max_split_size_mb:256,roundup_power2_divisions:4";
        let c = AllocatorConfig::parse(s).unwrap();
        assert!(c.expandable_segments);
        assert_eq!(c.max_split_size, Some(Bytes(256 * MIB)));
        assert_eq!(c.roundup_power2_divisions, [4; 16]);
        assert_eq!(AllocatorConfig::parse(&c.to_string()).unwrap(), c);
    }

    #[test]
    fn list_form_fills_below_first_and_after_last() {
        let c =
            AllocatorConfig::parse("roundup_power2_divisions:[256:1,512:2,1024:4,>:8]").unwrap();
        let mut want = [8u32; 16];
        want[..8].fill(1);
        want[8] = 1;
        want[9] = 2;
        want[10] = 4;
        assert_eq!(c.roundup_power2_divisions, want);
        assert_eq!(AllocatorConfig::parse(&c.to_string()).unwrap(), c);
        // Spaces are ignored; `>` alone fills from index 1 (last_index starts at 0).
        let c = AllocatorConfig::parse(" roundup_power2_divisions : [ > : 2 ] ").unwrap();
        assert_eq!(c.roundup_power2_divisions[0], 0);
        assert_eq!(c.roundup_power2_divisions[1..], [2u32; 15]);
    }

    #[test]
    fn large_segment_is_read_first_and_bounds_max_split() {
        let c = AllocatorConfig::parse("max_split_size_mb:64,large_segment_size_mb:64").unwrap();
        assert_eq!(c.large_segment_size, Bytes(64 * MIB));
        assert_eq!(c.max_non_split_rounding, Bytes(64 * MIB));
        let e =
            AllocatorConfig::parse("max_split_size_mb:32,large_segment_size_mb:64").unwrap_err();
        assert!(
            e.to_string()
                .contains("must be >= large_segment_size_mb (64)"),
            "{e}"
        );
        let e = AllocatorConfig::parse("large_segment_size_mb:10").unwrap_err();
        assert!(e.to_string().contains("must be > 10"), "{e}");
    }

    #[test]
    fn errors_name_the_problem() {
        let e = AllocatorConfig::parse("expandable_segment:True").unwrap_err();
        assert!(
            matches!(e, ConfigError::UnknownKey { ref key, .. } if key == "expandable_segment")
        );
        let e = AllocatorConfig::parse("expandable_segments:true").unwrap_err();
        assert!(e.to_string().contains("expected `True` or `False`"), "{e}");
        let e = AllocatorConfig::parse("roundup_power2_divisions:3").unwrap_err();
        assert!(e.to_string().contains("power of two"), "{e}");
        let e = AllocatorConfig::parse("roundup_power2_divisions:[3:4]").unwrap_err();
        assert!(
            e.to_string().contains("boundaries must be powers of two"),
            "{e}"
        );
        let e = AllocatorConfig::parse("garbage_collection_threshold:1.5").unwrap_err();
        assert!(e.to_string().contains("(0.0, 1.0)"), "{e}");
        let e = AllocatorConfig::parse("max_split_size_mb:abc").unwrap_err();
        assert!(e.to_string().contains("non-negative integer"), "{e}");
        let e = AllocatorConfig::parse("max_split_size_mb").unwrap_err();
        assert!(
            matches!(e, ConfigError::Syntax { expected: ":", .. }),
            "{e}"
        );
        let e = AllocatorConfig::parse("expandable_segments:True,").unwrap_err();
        assert!(matches!(e, ConfigError::Syntax { .. }), "{e}");
        let e =
            AllocatorConfig::parse("expandable_segments:True;max_split_size_mb:20").unwrap_err();
        assert!(e.to_string().contains("expandable_segments"), "{e}");
        let e = AllocatorConfig::parse("backend:cudaMalloc").unwrap_err();
        assert!(e.to_string().contains("cudaMallocAsync"), "{e}");
        let e = AllocatorConfig::parse("roundup_power2_divisions:[1:2 ").unwrap_err();
        assert!(e.to_string().contains("`,` or `]`"), "{e}");
        assert!(
            AllocatorConfig::parse("pinned_num_register_threads:8,release_lock_on_cudamalloc:True")
                .is_ok()
        );
    }

    #[test]
    fn round_size_matches_pytorch() {
        let c = AllocatorConfig::default();
        assert_eq!(c.round_size(Bytes(1)), Bytes(512));
        assert_eq!(c.round_size(Bytes(512)), Bytes(512));
        assert_eq!(c.round_size(Bytes(513)), Bytes(1024));
        assert_eq!(c.round_size(Bytes(3 * MIB + 1)), Bytes(3 * MIB + 512));
        let c = AllocatorConfig::parse("roundup_power2_divisions:4").unwrap();
        // 1.2 MiB with 4 divisions of [1, 2) MiB: steps of 256 KiB -> 1.25 MiB.
        assert_eq!(c.round_size(Bytes(1_258_291)), Bytes(1_310_720));
        assert_eq!(c.round_size(Bytes(4 * MIB)), Bytes(4 * MIB));
        assert_eq!(c.round_size(Bytes(5 * MIB + 1)), Bytes(6 * MIB));
        // Below 512*d the divisions do not apply.
        assert_eq!(c.round_size(Bytes(1500)), Bytes(1536));
        // step == 0: tiny sizes with huge divisions go to the next power of two.
        assert_eq!(roundup_power2_next_division(3000, 4096), 4096);
    }

    #[test]
    fn snapshot_settings_override_the_conf_string() {
        use crate::snapshot::{AllocatorSettings, RoundupDivisions};
        let mut s = AllocatorSettings {
            present: true,
            alloc_conf: "large_segment_size_mb:32,expandable_segments:True".into(),
            expandable_segments: false,
            max_split_size: Some(Bytes(64 * MIB)),
            roundup_power2_divisions: (0..16)
                .map(|i| RoundupDivisions {
                    interval_start: Bytes(MIB << i),
                    divisions: if i == 3 { 8 } else { 0 },
                })
                .collect(),
            garbage_collection_threshold: 0.0,
        };
        let c = AllocatorConfig::from_snapshot_settings(&s).unwrap();
        assert_eq!(c.large_segment_size, Bytes(32 * MIB));
        assert!(!c.expandable_segments);
        assert_eq!(c.max_split_size, Some(Bytes(64 * MIB)));
        assert_eq!(c.divisions_for(9 * MIB), 8);
        assert_eq!(c.divisions_for(5 * MIB), 0);
        assert_eq!(c.garbage_collection_threshold, None);
        s.alloc_conf = "bogus:1".into();
        assert!(AllocatorConfig::from_snapshot_settings(&s).is_err());
        let absent = AllocatorSettings::default();
        assert!(
            AllocatorConfig::from_snapshot_settings(&absent)
                .unwrap()
                .is_default()
        );
    }

    #[test]
    fn allocation_sizes() {
        let c = AllocatorConfig::default();
        assert_eq!(c.allocation_size(Bytes(MIB)), Bytes(2 * MIB));
        assert_eq!(c.allocation_size(Bytes(MIB + 512)), Bytes(20 * MIB));
        assert_eq!(c.allocation_size(Bytes(10 * MIB - 512)), Bytes(20 * MIB));
        assert_eq!(c.allocation_size(Bytes(10 * MIB)), Bytes(10 * MIB));
        assert_eq!(c.allocation_size(Bytes(11 * MIB)), Bytes(12 * MIB));
        let c = AllocatorConfig::parse("large_segment_size_mb:64").unwrap();
        assert_eq!(c.allocation_size(Bytes(5 * MIB)), Bytes(64 * MIB));
    }
}
