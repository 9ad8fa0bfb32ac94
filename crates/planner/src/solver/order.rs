//! Static buffer orderings for the greedy portfolio, and a seeded random source.
//!
//! Keys (all larger-first unless noted), as used by XLA, TFLite, minimalloc and
//! idealloc: size, lifetime length, area (size × length), start (earlier first), and
//! minimalloc's `T` = the largest load of any slot the buffer covers (buffers in the
//! most contended time first: the most constrained ones). Composite orders compare
//! keys lexicographically; perturbed orders multiply the primary key by a seeded
//! random factor in `[1 - a, 1 + a]`. Building an order costs O(n log n).

use super::problem::Problem;

/// A static ordering.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Key {
    /// Size, then length (XLA spatial, TFLite, Inductor).
    SizeLen,
    /// Length, then size (XLA temporal).
    LenSize,
    /// Area, then size.
    Area,
    /// Start (earlier first), then length: allocation order, near-LIFO traces.
    Start,
    /// minimalloc `WAT`: length, area, contention.
    Wat,
    /// minimalloc `TAW`: contention, area, length.
    Taw,
    /// minimalloc `TWA`: contention, length, area.
    Twa,
    /// Contention, then size.
    TSize,
}

impl Key {
    pub const ALL: [Key; 8] = [
        Key::SizeLen,
        Key::LenSize,
        Key::Area,
        Key::Start,
        Key::Wat,
        Key::Taw,
        Key::Twa,
        Key::TSize,
    ];
}

/// Per-buffer quantities the keys are made of.
pub(crate) struct Features {
    pub size: Vec<u64>,
    pub len: Vec<u64>,
    pub start: Vec<u64>,
    /// Max load over the buffer's slots.
    pub contention: Vec<u64>,
}

impl Features {
    /// O(n log T + T): the contention is a range maximum over the load profile.
    pub fn new(p: &Problem) -> Features {
        let load = p.load();
        let table = SparseMax::new(&load);
        let n = p.len();
        let mut contention = Vec::with_capacity(n);
        for i in 0..n {
            let c = p
                .spans(i)
                .iter()
                .map(|s| table.max(s.lo as usize, s.hi as usize))
                .max()
                .unwrap_or(0);
            contention.push(c);
        }
        Features {
            size: p.raw.iter().map(|b| b.size).collect(),
            len: p.raw.iter().map(|b| b.len).collect(),
            start: p.raw.iter().map(|b| b.start).collect(),
            contention,
        }
    }

    fn area(&self, i: usize) -> f64 {
        self.size[i] as f64 * self.len[i] as f64
    }

    /// The key tuple of buffer `i` (compared larger-first), primary scaled by `noise`.
    fn key(&self, k: Key, i: usize, noise: f64) -> [f64; 3] {
        let (s, l, a, t) = (
            self.size[i] as f64,
            self.len[i] as f64,
            self.area(i),
            self.contention[i] as f64,
        );
        let st = -(self.start[i] as f64);
        let mut key = match k {
            Key::SizeLen => [s, l, st],
            Key::LenSize => [l, s, st],
            Key::Area => [a, s, st],
            Key::Start => [st, l, s],
            Key::Wat => [l, a, t],
            Key::Taw => [t, a, l],
            Key::Twa => [t, l, a],
            Key::TSize => [t, s, l],
        };
        if key[0] < 0.0 {
            // Start keys are negative; perturb their magnitude the same way.
            key[0] = -((-key[0]) * noise);
        } else {
            key[0] *= noise;
        }
        key
    }

    /// The buffer order for `key`, perturbed by `amplitude` (0 = exact) with `seed`.
    pub fn order(&self, key: Key, amplitude: f64, seed: u64) -> Vec<u32> {
        let n = self.size.len();
        let mut rng = Rng::new(seed);
        let mut keyed: Vec<([f64; 3], u32)> = (0..n)
            .map(|i| {
                let noise = if amplitude > 0.0 {
                    1.0 + amplitude * (2.0 * rng.unit() - 1.0)
                } else {
                    1.0
                };
                (self.key(key, i, noise), i as u32)
            })
            .collect();
        keyed.sort_unstable_by(|a, b| {
            b.0[0]
                .total_cmp(&a.0[0])
                .then(b.0[1].total_cmp(&a.0[1]))
                .then(b.0[2].total_cmp(&a.0[2]))
                .then(a.1.cmp(&b.1))
        });
        keyed.into_iter().map(|(_, i)| i).collect()
    }
}

/// Range-maximum queries over a fixed array in O(1) after O(T log T) setup.
pub(crate) struct SparseMax {
    levels: Vec<Vec<u64>>,
}

impl SparseMax {
    pub fn new(values: &[u64]) -> SparseMax {
        let mut levels = vec![values.to_vec()];
        let mut width = 1;
        while 2 * width <= values.len() {
            let prev = levels.last().expect("level 0 exists");
            let next: Vec<u64> = (0..=values.len() - 2 * width)
                .map(|i| prev[i].max(prev[i + width]))
                .collect();
            levels.push(next);
            width *= 2;
        }
        SparseMax { levels }
    }

    /// Max over `[lo, hi)`; 0 when empty.
    pub fn max(&self, lo: usize, hi: usize) -> u64 {
        if hi <= lo {
            return 0;
        }
        let k = (usize::BITS - 1 - (hi - lo).leading_zeros()) as usize;
        self.levels[k][lo].max(self.levels[k][hi - (1 << k)])
    }
}

/// SplitMix64: small, fast, seeded, good enough for tie-breaking noise.
#[derive(Debug, Clone)]
pub(crate) struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed ^ 0x9E37_79B9_7F4A_7C15)
    }

    pub fn next_u64(&mut self) -> u64 {
        stweaver_core::splitmix::next(&mut self.0)
    }

    /// Uniform in `[0, 1)`.
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform in `[0, n)`; `n > 0`.
    #[cfg(test)]
    pub fn below(&mut self, n: u64) -> u64 {
        ((self.next_u64() as u128 * n as u128) >> 64) as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::solver::problem::RawBuf;

    #[test]
    fn sparse_max_matches_a_scan() {
        let v: Vec<u64> = (0..37u64).map(|i| (i * 7919) % 101).collect();
        let t = SparseMax::new(&v);
        for lo in 0..v.len() {
            for hi in lo + 1..=v.len() {
                assert_eq!(t.max(lo, hi), *v[lo..hi].iter().max().unwrap());
            }
        }
    }

    #[test]
    fn orders_follow_their_keys() {
        let raw = vec![
            RawBuf {
                start: 0,
                len: 10,
                size: 1,
                align: 1,
            },
            RawBuf {
                start: 2,
                len: 2,
                size: 8,
                align: 1,
            },
            RawBuf {
                start: 1,
                len: 5,
                size: 3,
                align: 1,
            },
        ];
        let p = Problem::build(raw, None);
        let f = Features::new(&p);
        assert_eq!(f.order(Key::SizeLen, 0.0, 0), vec![1, 2, 0]);
        assert_eq!(f.order(Key::LenSize, 0.0, 0), vec![0, 2, 1]);
        assert_eq!(f.order(Key::Start, 0.0, 0), vec![0, 2, 1]);
        assert_eq!(f.order(Key::Area, 0.0, 0), vec![1, 2, 0]);
        // Same seed, same perturbed order.
        assert_eq!(f.order(Key::Area, 0.5, 7), f.order(Key::Area, 0.5, 7));
    }
}
