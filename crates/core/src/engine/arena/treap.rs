//! The intrusive treaps threaded through the slab.
//!
//! Two treaps, written once here over the const parameter `A`: the fit treap
//! (`A = false`: children `left`/`right`, key `(size, addr)`) of every arena's free
//! blocks, and the by-address treap (`A = true`: `aleft`/`aright`, key `addr`) of a
//! placement arena's. Both are heap-ordered by the block's `prio` (a hash of its slot,
//! module `slab`), so a treap's shape is fixed by its keys and its slots. Expected
//! O(log n) per operation; no heap allocation (the nodes are the slab's blocks).
//! Which blocks are in which treap, and when: module `free_index`.

use super::{Arenas, Idx, NIL};

impl Arenas {
    #[inline]
    pub(super) fn key(&self, i: Idx) -> (u64, u64) {
        let b = &self.blocks[i as usize];
        (b.size, b.addr)
    }

    #[inline]
    fn tkey<const A: bool>(&self, i: Idx) -> (u64, u64) {
        if A {
            (self.blocks[i as usize].addr, 0)
        } else {
            self.key(i)
        }
    }

    #[inline]
    fn kid<const A: bool>(&self, t: Idx, right: bool) -> Idx {
        let b = &self.blocks[t as usize];
        match (A, right) {
            (false, false) => b.left,
            (false, true) => b.right,
            (true, false) => b.aleft,
            (true, true) => b.aright,
        }
    }

    #[inline]
    fn set_kid<const A: bool>(&mut self, t: Idx, right: bool, v: Idx) {
        let b = &mut self.blocks[t as usize];
        match (A, right) {
            (false, false) => b.left = v,
            (false, true) => b.right = v,
            (true, false) => b.aleft = v,
            (true, true) => b.aright = v,
        }
    }

    /// Splits treap `t` into keys `< key` and keys `>= key`.
    fn split<const A: bool>(&mut self, t: Idx, key: (u64, u64)) -> (Idx, Idx) {
        if t == NIL {
            return (NIL, NIL);
        }
        if self.tkey::<A>(t) < key {
            let (l, r) = self.split::<A>(self.kid::<A>(t, true), key);
            self.set_kid::<A>(t, true, l);
            (t, r)
        } else {
            let (l, r) = self.split::<A>(self.kid::<A>(t, false), key);
            self.set_kid::<A>(t, false, r);
            (l, t)
        }
    }

    /// Joins treaps `a` and `b`, every key of `a` below every key of `b`.
    fn merge<const A: bool>(&mut self, a: Idx, b: Idx) -> Idx {
        if a == NIL {
            return b;
        }
        if b == NIL {
            return a;
        }
        if self.blocks[a as usize].prio > self.blocks[b as usize].prio {
            let r = self.merge::<A>(self.kid::<A>(a, true), b);
            self.set_kid::<A>(a, true, r);
            a
        } else {
            let l = self.merge::<A>(a, self.kid::<A>(b, false));
            self.set_kid::<A>(b, false, l);
            b
        }
    }

    /// Inserts node `n` (children cleared) into treap `t`; returns the new root.
    pub(super) fn insert_rec<const A: bool>(&mut self, t: Idx, n: Idx) -> Idx {
        if t == NIL {
            return n;
        }
        if self.blocks[n as usize].prio > self.blocks[t as usize].prio {
            let (l, r) = self.split::<A>(t, self.tkey::<A>(n));
            self.set_kid::<A>(n, false, l);
            self.set_kid::<A>(n, true, r);
            return n;
        }
        let right = self.tkey::<A>(n) >= self.tkey::<A>(t);
        let c = self.insert_rec::<A>(self.kid::<A>(t, right), n);
        self.set_kid::<A>(t, right, c);
        t
    }

    /// Removes the node with `key` from treap `t`; returns the new root.
    pub(super) fn remove_rec<const A: bool>(&mut self, t: Idx, key: (u64, u64)) -> Idx {
        if t == NIL {
            return NIL;
        }
        let tk = self.tkey::<A>(t);
        if key != tk {
            let right = key > tk;
            let c = self.remove_rec::<A>(self.kid::<A>(t, right), key);
            self.set_kid::<A>(t, right, c);
            t
        } else {
            let (l, r) = (self.kid::<A>(t, false), self.kid::<A>(t, true));
            self.set_kid::<A>(t, false, NIL);
            self.set_kid::<A>(t, true, NIL);
            self.merge::<A>(l, r)
        }
    }

    /// The free block with the greatest address `<= addr` in the treap at `t`, or NIL.
    #[inline]
    pub(super) fn addr_floor(&self, mut t: Idx, addr: u64) -> Idx {
        let mut best = NIL;
        while t != NIL {
            let b = &self.blocks[t as usize];
            if b.addr <= addr {
                best = t;
                t = b.aright;
            } else {
                t = b.aleft;
            }
        }
        best
    }
}
