//! A small pickle virtual machine for the protocol 2–5 opcodes that `pickle.dump` writes
//! for plain builtin data (dicts, lists, tuples, sets, str, bytes, int, float, bool, None).
//!
//! Why hand-written: `serde-pickle` 1.x fails on any container referenced twice through
//! the memo (PyTorch snapshots share frame dicts and lists), and `pickled`
//! 2.0.0-alpha9, which handles sharing, took 0.91 s and 226 MB to decode
//! `snap_qwenmoe_eager_rcp` (323 k entries) into typed structs on the 2-core dev box,
//! and its serde errors do not say *where* in the document a field is missing. This VM
//! decodes the same file in a fraction of that (figures in `BENCHMARKS.md`), never
//! recurses, and reports every problem with its byte offset.
//!
//! Design: one pass over the bytes, O(opcodes) time. Values are 16-byte `Copy` handles:
//! scalars inline, strings and bytes as ranges into the input (zero copy), containers
//! as indices into arenas (`lists`, `dicts`). A memo entry is such a handle, so a
//! shared frame dict is stored once and referenced many times, and a container that is
//! memoised before it is filled (`EMPTY_DICT MEMOIZE MARK ... SETITEMS`) is filled in
//! place. Memory is O(input): every memo entry, container and item is backed by at
//! least one input byte (memo indices beyond the dense range go to a hash map), and
//! every length read from the input is checked against the bytes that remain before
//! anything is allocated.
//!
//! Unsupported on purpose: `GLOBAL`/`STACK_GLOBAL`/`REDUCE`/`BUILD`/`NEWOBJ` (a snapshot
//! holds builtin types only, and executing constructors is how pickles run code),
//! persistent ids, extension codes, out-of-band buffers and the text opcodes of
//! protocols 0–1. Each is reported as an error naming the opcode.

use std::fmt;

use rustc_hash::FxHashMap;

/// A decoded value. Strings, bytes and big integers point into the input; containers
/// index the arenas of the [`Pickle`] that produced them.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Value {
    None,
    Bool(bool),
    Int(i64),
    /// An integer wider than 64 bits: little-endian two's complement bytes of the input.
    BigInt {
        start: u32,
        len: u32,
    },
    Float(f64),
    Str {
        start: u32,
        len: u32,
    },
    Bytes {
        start: u32,
        len: u32,
    },
    List(u32),
    Tuple(u32),
    Set(u32),
    Dict(u32),
}

impl Value {
    /// Python's name for the value's type, for error messages.
    pub(crate) fn type_name(self) -> &'static str {
        match self {
            Value::None => "None",
            Value::Bool(_) => "bool",
            Value::Int(_) | Value::BigInt { .. } => "int",
            Value::Float(_) => "float",
            Value::Str { .. } => "str",
            Value::Bytes { .. } => "bytes",
            Value::List(_) => "list",
            Value::Tuple(_) => "tuple",
            Value::Set(_) => "set",
            Value::Dict(_) => "dict",
        }
    }
}

/// What went wrong while decoding, and at which byte of the (decompressed) pickle.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("byte {offset}: {kind}")]
pub struct PickleError {
    pub offset: usize,
    pub kind: PickleErrorKind,
}

/// The kinds of malformed pickle this VM reports.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PickleErrorKind {
    #[error("the data ends inside opcode {0}")]
    Truncated(&'static str),
    #[error("the data ends without a STOP opcode")]
    NoStop,
    #[error("unknown opcode 0x{0:02x}")]
    UnknownOpcode(u8),
    #[error(
        "opcode {0} is not supported (a memory snapshot holds only builtin dicts, lists, tuples, strings and numbers)"
    )]
    Unsupported(&'static str),
    #[error("unsupported pickle protocol {0} (expected 2 to 5)")]
    Protocol(u8),
    #[error("{0} needs more values on the stack than there are")]
    StackUnderflow(&'static str),
    #[error("{0} without a preceding MARK")]
    NoMark(&'static str),
    #[error("memo entry {0} is read before it is written")]
    BadMemo(u64),
    #[error("{opcode} applied to a {found}")]
    WrongTarget {
        opcode: &'static str,
        found: &'static str,
    },
    #[error("SETITEMS with an odd number of values")]
    OddSetItems,
    #[error("string is not valid UTF-8")]
    BadUtf8,
    #[error("STOP leaves {0} values on the stack instead of one")]
    StackAtStop(usize),
    #[error("the pickle is larger than 4 GiB, which this reader does not support")]
    TooLarge,
}

/// A decoded pickle: the root value and the arenas its handles point into.
pub(crate) struct Pickle<'a> {
    data: &'a [u8],
    lists: Vec<Vec<Value>>,
    dicts: Vec<Vec<(Value, Value)>>,
    pub(crate) root: Value,
}

impl fmt::Debug for Pickle<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Pickle")
            .field("bytes", &self.data.len())
            .field("lists", &self.lists.len())
            .field("dicts", &self.dicts.len())
            .field("root", &self.root)
            .finish()
    }
}

impl<'a> Pickle<'a> {
    /// The items of a list, tuple or set handle.
    pub(crate) fn seq(&self, v: Value) -> Option<&[Value]> {
        match v {
            Value::List(i) | Value::Tuple(i) | Value::Set(i) => {
                self.lists.get(i as usize).map(|l| l.as_slice())
            }
            _ => None,
        }
    }

    /// The (key, value) pairs of a dict handle, in insertion order.
    pub(crate) fn dict(&self, v: Value) -> Option<&[(Value, Value)]> {
        match v {
            Value::Dict(i) => self.dicts.get(i as usize).map(|d| d.as_slice()),
            _ => None,
        }
    }

    /// The raw bytes of a `str` value (UTF-8 as written, not re-validated).
    pub(crate) fn str_bytes(&self, v: Value) -> Option<&'a [u8]> {
        match v {
            Value::Str { start, len } => self.data.get(start as usize..(start + len) as usize),
            _ => None,
        }
    }

    /// A `str` value as text; `None` for other types, `Some(Err)` for invalid UTF-8
    /// (Python can write lone surrogates with `surrogatepass`).
    pub(crate) fn str(&self, v: Value) -> Option<Result<&'a str, std::str::Utf8Error>> {
        self.str_bytes(v).map(std::str::from_utf8)
    }

    /// Looks up a `str` key in a dict (linear: snapshot dicts have a handful of keys).
    /// Later duplicates win, as in Python.
    pub(crate) fn get(&self, dict: &[(Value, Value)], key: &str) -> Option<Value> {
        dict.iter()
            .rev()
            .find(|(k, _)| self.str_bytes(*k) == Some(key.as_bytes()))
            .map(|(_, v)| *v)
    }

    /// An integer as `i64`, if it is one and fits (bools count, as in Python).
    pub(crate) fn as_i64(&self, v: Value) -> Option<i64> {
        match v {
            Value::Int(i) => Some(i),
            Value::Bool(b) => Some(i64::from(b)),
            Value::BigInt { start, len } => {
                let bytes = self.data.get(start as usize..(start + len) as usize)?;
                let negative = bytes.last().is_some_and(|b| b & 0x80 != 0);
                let fill = if negative { 0xff } else { 0x00 };
                // Strip redundant sign-extension bytes, keeping one sign byte's worth.
                let mut end = bytes.len();
                while end > 1 && bytes[end - 1] == fill && (bytes[end - 2] & 0x80 != 0) == negative
                {
                    end -= 1;
                }
                (end <= 8).then(|| sign_extend(&bytes[..end]))
            }
            _ => None,
        }
    }

    /// A non-negative integer as `u64` (covers addresses and stream handles ≥ 2^63).
    pub(crate) fn as_u64(&self, v: Value) -> Option<u64> {
        match v {
            Value::Int(i) => u64::try_from(i).ok(),
            Value::Bool(b) => Some(u64::from(b)),
            Value::BigInt { start, len } => {
                let bytes = self.data.get(start as usize..(start + len) as usize)?;
                if bytes.last().is_some_and(|b| b & 0x80 != 0) {
                    return None; // negative
                }
                let mut end = bytes.len();
                while end > 0 && bytes[end - 1] == 0 {
                    end -= 1;
                }
                if end > 8 {
                    return None;
                }
                let mut buf = [0u8; 8];
                buf[..end].copy_from_slice(&bytes[..end]);
                Some(u64::from_le_bytes(buf))
            }
            _ => None,
        }
    }

    /// A number as `f64` (ints convert, as in Python arithmetic).
    pub(crate) fn as_f64(&self, v: Value) -> Option<f64> {
        match v {
            Value::Float(f) => Some(f),
            other => self.as_i64(other).map(|i| i as f64),
        }
    }
}

/// Little-endian two's complement, at most 8 bytes, sign-extended to `i64`.
fn sign_extend(bytes: &[u8]) -> i64 {
    debug_assert!(bytes.len() <= 8);
    if bytes.is_empty() {
        return 0;
    }
    let negative = bytes[bytes.len() - 1] & 0x80 != 0;
    let mut buf = if negative { [0xffu8; 8] } else { [0u8; 8] };
    buf[..bytes.len()].copy_from_slice(bytes);
    i64::from_le_bytes(buf)
}

/// Called with the byte offset reached, about once per MiB of input.
pub(crate) type ParseProgress<'p> = &'p mut dyn FnMut(usize);

/// Decodes one pickle. The first opcode must be `PROTO` 2–5 (what `pickle.dump` has
/// written by default since Python 3.0); data after `STOP` is ignored, as Python does.
pub(crate) fn parse<'a>(
    data: &'a [u8],
    progress: ParseProgress<'_>,
) -> Result<Pickle<'a>, PickleError> {
    if u32::try_from(data.len()).is_err() {
        return Err(PickleError {
            offset: 0,
            kind: PickleErrorKind::TooLarge,
        });
    }
    Vm {
        data,
        pos: 0,
        stack: Vec::with_capacity(64),
        marks: Vec::with_capacity(16),
        memo: Vec::new(),
        sparse_memo: FxHashMap::default(),
        memo_count: 0,
        lists: Vec::new(),
        dicts: Vec::new(),
    }
    .run(progress)
}

struct Vm<'a> {
    data: &'a [u8],
    pos: usize,
    stack: Vec<Value>,
    /// Stack heights at each MARK.
    marks: Vec<usize>,
    /// Memo entries 0..n (what `MEMOIZE` and sequential `PUT`s produce).
    memo: Vec<Option<Value>>,
    /// Memo entries at indices beyond the dense part (hand-written pickles only); kept
    /// apart so that one large index cannot make us allocate a huge vector.
    sparse_memo: FxHashMap<u64, Value>,
    /// Distinct memo indices written: `MEMOIZE` writes at this index, like CPython's
    /// `len(memo)`.
    memo_count: u64,
    lists: Vec<Vec<Value>>,
    dicts: Vec<Vec<(Value, Value)>>,
}

// Opcodes (CPython `Lib/pickle.py`).
mod op {
    pub const MARK: u8 = b'(';
    pub const STOP: u8 = b'.';
    pub const POP: u8 = b'0';
    pub const POP_MARK: u8 = b'1';
    pub const DUP: u8 = b'2';
    pub const FLOAT: u8 = b'F';
    pub const INT: u8 = b'I';
    pub const BININT: u8 = b'J';
    pub const BININT1: u8 = b'K';
    pub const LONG: u8 = b'L';
    pub const BININT2: u8 = b'M';
    pub const NONE: u8 = b'N';
    pub const PERSID: u8 = b'P';
    pub const BINPERSID: u8 = b'Q';
    pub const REDUCE: u8 = b'R';
    pub const STRING: u8 = b'S';
    pub const BINSTRING: u8 = b'T';
    pub const SHORT_BINSTRING: u8 = b'U';
    pub const UNICODE: u8 = b'V';
    pub const BINUNICODE: u8 = b'X';
    pub const APPEND: u8 = b'a';
    pub const BUILD: u8 = b'b';
    pub const GLOBAL: u8 = b'c';
    pub const DICT: u8 = b'd';
    pub const EMPTY_DICT: u8 = b'}';
    pub const APPENDS: u8 = b'e';
    pub const GET: u8 = b'g';
    pub const BINGET: u8 = b'h';
    pub const INST: u8 = b'i';
    pub const LONG_BINGET: u8 = b'j';
    pub const LIST: u8 = b'l';
    pub const EMPTY_LIST: u8 = b']';
    pub const OBJ: u8 = b'o';
    pub const PUT: u8 = b'p';
    pub const BINPUT: u8 = b'q';
    pub const LONG_BINPUT: u8 = b'r';
    pub const SETITEM: u8 = b's';
    pub const TUPLE: u8 = b't';
    pub const EMPTY_TUPLE: u8 = b')';
    pub const SETITEMS: u8 = b'u';
    pub const BINFLOAT: u8 = b'G';
    pub const PROTO: u8 = 0x80;
    pub const NEWOBJ: u8 = 0x81;
    pub const EXT1: u8 = 0x82;
    pub const EXT2: u8 = 0x83;
    pub const EXT4: u8 = 0x84;
    pub const TUPLE1: u8 = 0x85;
    pub const TUPLE2: u8 = 0x86;
    pub const TUPLE3: u8 = 0x87;
    pub const NEWTRUE: u8 = 0x88;
    pub const NEWFALSE: u8 = 0x89;
    pub const LONG1: u8 = 0x8a;
    pub const LONG4: u8 = 0x8b;
    pub const BINBYTES: u8 = b'B';
    pub const SHORT_BINBYTES: u8 = b'C';
    pub const SHORT_BINUNICODE: u8 = 0x8c;
    pub const BINUNICODE8: u8 = 0x8d;
    pub const BINBYTES8: u8 = 0x8e;
    pub const EMPTY_SET: u8 = 0x8f;
    pub const ADDITEMS: u8 = 0x90;
    pub const FROZENSET: u8 = 0x91;
    pub const NEWOBJ_EX: u8 = 0x92;
    pub const STACK_GLOBAL: u8 = 0x93;
    pub const MEMOIZE: u8 = 0x94;
    pub const FRAME: u8 = 0x95;
    pub const BYTEARRAY8: u8 = 0x96;
    pub const NEXT_BUFFER: u8 = 0x97;
    pub const READONLY_BUFFER: u8 = 0x98;
}

/// Names of the opcodes this VM refuses, for the error message.
fn unsupported_name(code: u8) -> Option<&'static str> {
    Some(match code {
        op::FLOAT => "FLOAT",
        op::INT => "INT",
        op::LONG => "LONG",
        op::PERSID => "PERSID",
        op::BINPERSID => "BINPERSID",
        op::REDUCE => "REDUCE",
        op::STRING => "STRING",
        op::UNICODE => "UNICODE",
        op::BUILD => "BUILD",
        op::GLOBAL => "GLOBAL",
        op::GET => "GET",
        op::INST => "INST",
        op::OBJ => "OBJ",
        op::PUT => "PUT",
        op::NEWOBJ => "NEWOBJ",
        op::EXT1 => "EXT1",
        op::EXT2 => "EXT2",
        op::EXT4 => "EXT4",
        op::NEWOBJ_EX => "NEWOBJ_EX",
        op::STACK_GLOBAL => "STACK_GLOBAL",
        op::NEXT_BUFFER => "NEXT_BUFFER",
        op::READONLY_BUFFER => "READONLY_BUFFER",
        _ => return None,
    })
}

/// Progress is reported every this many bytes of input.
const PROGRESS_STEP: usize = 1 << 20;

impl<'a> Vm<'a> {
    fn err(&self, offset: usize, kind: PickleErrorKind) -> PickleError {
        PickleError { offset, kind }
    }

    /// The next `n` bytes of opcode `name`'s argument.
    #[inline]
    fn take(&mut self, n: usize, name: &'static str) -> Result<&'a [u8], PickleError> {
        let data: &'a [u8] = self.data;
        match data.get(self.pos..).and_then(|rest| rest.get(..n)) {
            Some(s) => {
                self.pos += n;
                Ok(s)
            }
            None => Err(self.err(self.pos, PickleErrorKind::Truncated(name))),
        }
    }

    #[inline]
    fn take_array<const N: usize>(&mut self, name: &'static str) -> Result<[u8; N], PickleError> {
        let s = self.take(N, name)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    /// A length-prefixed payload: returns (start, len) of the payload within `data`.
    #[inline]
    fn payload(&mut self, len: u64, name: &'static str) -> Result<(u32, u32), PickleError> {
        let start = self.pos;
        let n =
            usize::try_from(len).map_err(|_| self.err(start, PickleErrorKind::Truncated(name)))?;
        self.take(n, name)?;
        // `parse` checked that the whole input is below 4 GiB.
        Ok((start as u32, n as u32))
    }

    #[inline]
    fn pop(&mut self, name: &'static str, at: usize) -> Result<Value, PickleError> {
        self.stack
            .pop()
            .ok_or_else(|| self.err(at, PickleErrorKind::StackUnderflow(name)))
    }

    #[inline]
    fn pop_mark(&mut self, name: &'static str, at: usize) -> Result<usize, PickleError> {
        let mark = self
            .marks
            .pop()
            .ok_or_else(|| self.err(at, PickleErrorKind::NoMark(name)))?;
        if mark > self.stack.len() {
            // Values below the mark were popped since it was set.
            return Err(self.err(at, PickleErrorKind::StackUnderflow(name)));
        }
        Ok(mark)
    }

    fn new_list(&mut self, items: Vec<Value>) -> u32 {
        self.lists.push(items);
        (self.lists.len() - 1) as u32
    }

    fn memo_get(&mut self, idx: u64, at: usize) -> Result<(), PickleError> {
        let dense = usize::try_from(idx)
            .ok()
            .and_then(|i| self.memo.get(i).copied().flatten());
        match dense.or_else(|| self.sparse_memo.get(&idx).copied()) {
            Some(v) => {
                self.stack.push(v);
                Ok(())
            }
            None => Err(self.err(at, PickleErrorKind::BadMemo(idx))),
        }
    }

    fn memo_put(&mut self, idx: u64, at: usize, name: &'static str) -> Result<(), PickleError> {
        let top = *self
            .stack
            .last()
            .ok_or_else(|| self.err(at, PickleErrorKind::StackUnderflow(name)))?;
        let dense_len = self.memo.len() as u64;
        let new = if idx < dense_len {
            self.memo[idx as usize].replace(top).is_none()
        } else if idx == dense_len {
            self.memo.push(Some(top));
            self.sparse_memo.remove(&idx).is_none()
        } else {
            self.sparse_memo.insert(idx, top).is_none()
        };
        self.memo_count += u64::from(new);
        Ok(())
    }

    fn push_bigint(&mut self, start: u32, len: u32) {
        let bytes = &self.data[start as usize..(start + len) as usize];
        if bytes.len() <= 8 {
            self.stack.push(Value::Int(sign_extend(bytes)));
        } else {
            self.stack.push(Value::BigInt { start, len });
        }
    }

    fn run(mut self, progress: ParseProgress<'_>) -> Result<Pickle<'a>, PickleError> {
        // The protocol header.
        match self.data.first() {
            Some(&op::PROTO) => {
                self.pos = 1;
                let [v] = self.take_array::<1>("PROTO")?;
                if !(2..=5).contains(&v) {
                    return Err(self.err(1, PickleErrorKind::Protocol(v)));
                }
            }
            Some(_) => return Err(self.err(0, PickleErrorKind::Unsupported("protocol 0/1 header"))),
            None => return Err(self.err(0, PickleErrorKind::Truncated("PROTO"))),
        }
        let mut next_progress = PROGRESS_STEP;
        loop {
            if self.pos >= next_progress {
                progress(self.pos);
                next_progress = self.pos + PROGRESS_STEP;
            }
            let at = self.pos;
            let Some(&code) = self.data.get(at) else {
                return Err(self.err(at, PickleErrorKind::NoStop));
            };
            self.pos += 1;
            match code {
                op::STOP => {
                    if self.stack.len() != 1 {
                        return Err(self.err(at, PickleErrorKind::StackAtStop(self.stack.len())));
                    }
                    let root = self.stack[0];
                    progress(self.data.len());
                    return Ok(Pickle {
                        data: self.data,
                        lists: self.lists,
                        dicts: self.dicts,
                        root,
                    });
                }
                op::PROTO => {
                    let [v] = self.take_array::<1>("PROTO")?;
                    if !(2..=5).contains(&v) {
                        return Err(self.err(at, PickleErrorKind::Protocol(v)));
                    }
                }
                op::FRAME => {
                    // Framing only groups opcodes for buffered reads; the whole input
                    // is in memory, so the frame length is skipped.
                    self.take(8, "FRAME")?;
                }
                op::MARK => self.marks.push(self.stack.len()),
                op::POP => {
                    // POP of an empty stack with a pending mark pops the mark (CPython).
                    if self.marks.last() == Some(&self.stack.len()) {
                        self.marks.pop();
                    } else {
                        self.pop("POP", at)?;
                    }
                }
                op::POP_MARK => {
                    let mark = self.pop_mark("POP_MARK", at)?;
                    self.stack.truncate(mark);
                }
                op::DUP => {
                    let top = *self
                        .stack
                        .last()
                        .ok_or_else(|| self.err(at, PickleErrorKind::StackUnderflow("DUP")))?;
                    self.stack.push(top);
                }
                op::NONE => self.stack.push(Value::None),
                op::NEWTRUE => self.stack.push(Value::Bool(true)),
                op::NEWFALSE => self.stack.push(Value::Bool(false)),
                op::BININT => {
                    let b = self.take_array::<4>("BININT")?;
                    self.stack
                        .push(Value::Int(i64::from(i32::from_le_bytes(b))));
                }
                op::BININT1 => {
                    let [b] = self.take_array::<1>("BININT1")?;
                    self.stack.push(Value::Int(i64::from(b)));
                }
                op::BININT2 => {
                    let b = self.take_array::<2>("BININT2")?;
                    self.stack
                        .push(Value::Int(i64::from(u16::from_le_bytes(b))));
                }
                op::LONG1 => {
                    let [n] = self.take_array::<1>("LONG1")?;
                    let (start, len) = self.payload(u64::from(n), "LONG1")?;
                    self.push_bigint(start, len);
                }
                op::LONG4 => {
                    let n = i32::from_le_bytes(self.take_array::<4>("LONG4")?);
                    let n = u64::try_from(n)
                        .map_err(|_| self.err(at, PickleErrorKind::Truncated("LONG4")))?;
                    let (start, len) = self.payload(n, "LONG4")?;
                    self.push_bigint(start, len);
                }
                op::BINFLOAT => {
                    let b = self.take_array::<8>("BINFLOAT")?;
                    self.stack.push(Value::Float(f64::from_be_bytes(b)));
                }
                op::SHORT_BINUNICODE => {
                    let [n] = self.take_array::<1>("SHORT_BINUNICODE")?;
                    let (start, len) = self.payload(u64::from(n), "SHORT_BINUNICODE")?;
                    self.stack.push(Value::Str { start, len });
                }
                op::BINUNICODE => {
                    let n = u32::from_le_bytes(self.take_array::<4>("BINUNICODE")?);
                    let (start, len) = self.payload(u64::from(n), "BINUNICODE")?;
                    self.stack.push(Value::Str { start, len });
                }
                op::BINUNICODE8 => {
                    let n = u64::from_le_bytes(self.take_array::<8>("BINUNICODE8")?);
                    let (start, len) = self.payload(n, "BINUNICODE8")?;
                    self.stack.push(Value::Str { start, len });
                }
                op::SHORT_BINBYTES | op::SHORT_BINSTRING => {
                    let [n] = self.take_array::<1>("SHORT_BINBYTES")?;
                    let (start, len) = self.payload(u64::from(n), "SHORT_BINBYTES")?;
                    self.stack.push(Value::Bytes { start, len });
                }
                op::BINBYTES | op::BINSTRING => {
                    let n = u32::from_le_bytes(self.take_array::<4>("BINBYTES")?);
                    let (start, len) = self.payload(u64::from(n), "BINBYTES")?;
                    self.stack.push(Value::Bytes { start, len });
                }
                op::BINBYTES8 | op::BYTEARRAY8 => {
                    let n = u64::from_le_bytes(self.take_array::<8>("BINBYTES8")?);
                    let (start, len) = self.payload(n, "BINBYTES8")?;
                    self.stack.push(Value::Bytes { start, len });
                }
                op::EMPTY_LIST => {
                    let id = self.new_list(Vec::new());
                    self.stack.push(Value::List(id));
                }
                op::LIST => {
                    let mark = self.pop_mark("LIST", at)?;
                    let items = self.stack.split_off(mark);
                    let id = self.new_list(items);
                    self.stack.push(Value::List(id));
                }
                op::APPEND => {
                    let v = self.pop("APPEND", at)?;
                    match self.stack.last() {
                        Some(Value::List(id)) => self.lists[*id as usize].push(v),
                        Some(other) => {
                            return Err(self.err(
                                at,
                                PickleErrorKind::WrongTarget {
                                    opcode: "APPEND",
                                    found: other.type_name(),
                                },
                            ));
                        }
                        None => {
                            return Err(self.err(at, PickleErrorKind::StackUnderflow("APPEND")));
                        }
                    }
                }
                op::APPENDS | op::ADDITEMS => {
                    let name = if code == op::APPENDS {
                        "APPENDS"
                    } else {
                        "ADDITEMS"
                    };
                    let mark = self.pop_mark(name, at)?;
                    let target = match mark.checked_sub(1).map(|i| self.stack[i]) {
                        Some(Value::List(id)) if code == op::APPENDS => id,
                        Some(Value::Set(id)) if code == op::ADDITEMS => id,
                        Some(other) => {
                            return Err(self.err(
                                at,
                                PickleErrorKind::WrongTarget {
                                    opcode: name,
                                    found: other.type_name(),
                                },
                            ));
                        }
                        None => return Err(self.err(at, PickleErrorKind::StackUnderflow(name))),
                    };
                    let list = &mut self.lists[target as usize];
                    list.extend(self.stack.drain(mark..));
                }
                op::EMPTY_TUPLE => {
                    let id = self.new_list(Vec::new());
                    self.stack.push(Value::Tuple(id));
                }
                op::TUPLE => {
                    let mark = self.pop_mark("TUPLE", at)?;
                    let items = self.stack.split_off(mark);
                    let id = self.new_list(items);
                    self.stack.push(Value::Tuple(id));
                }
                op::TUPLE1 | op::TUPLE2 | op::TUPLE3 => {
                    let n = usize::from(code - op::TUPLE1 + 1);
                    if self.stack.len() < n {
                        return Err(self.err(at, PickleErrorKind::StackUnderflow("TUPLEn")));
                    }
                    let items = self.stack.split_off(self.stack.len() - n);
                    let id = self.new_list(items);
                    self.stack.push(Value::Tuple(id));
                }
                op::EMPTY_SET => {
                    let id = self.new_list(Vec::new());
                    self.stack.push(Value::Set(id));
                }
                op::FROZENSET => {
                    let mark = self.pop_mark("FROZENSET", at)?;
                    let items = self.stack.split_off(mark);
                    let id = self.new_list(items);
                    self.stack.push(Value::Set(id));
                }
                op::EMPTY_DICT => {
                    self.dicts.push(Vec::new());
                    self.stack.push(Value::Dict((self.dicts.len() - 1) as u32));
                }
                op::DICT => {
                    let mark = self.pop_mark("DICT", at)?;
                    if !(self.stack.len() - mark).is_multiple_of(2) {
                        return Err(self.err(at, PickleErrorKind::OddSetItems));
                    }
                    let mut items = Vec::with_capacity((self.stack.len() - mark) / 2);
                    let mut it = self.stack.drain(mark..);
                    while let (Some(k), Some(v)) = (it.next(), it.next()) {
                        items.push((k, v));
                    }
                    drop(it);
                    self.dicts.push(items);
                    self.stack.push(Value::Dict((self.dicts.len() - 1) as u32));
                }
                op::SETITEM => {
                    let v = self.pop("SETITEM", at)?;
                    let k = self.pop("SETITEM", at)?;
                    match self.stack.last() {
                        Some(Value::Dict(id)) => self.dicts[*id as usize].push((k, v)),
                        Some(other) => {
                            return Err(self.err(
                                at,
                                PickleErrorKind::WrongTarget {
                                    opcode: "SETITEM",
                                    found: other.type_name(),
                                },
                            ));
                        }
                        None => {
                            return Err(self.err(at, PickleErrorKind::StackUnderflow("SETITEM")));
                        }
                    }
                }
                op::SETITEMS => {
                    let mark = self.pop_mark("SETITEMS", at)?;
                    let target = match mark.checked_sub(1).map(|i| self.stack[i]) {
                        Some(Value::Dict(id)) => id,
                        Some(other) => {
                            return Err(self.err(
                                at,
                                PickleErrorKind::WrongTarget {
                                    opcode: "SETITEMS",
                                    found: other.type_name(),
                                },
                            ));
                        }
                        None => {
                            return Err(self.err(at, PickleErrorKind::StackUnderflow("SETITEMS")));
                        }
                    };
                    if !(self.stack.len() - mark).is_multiple_of(2) {
                        return Err(self.err(at, PickleErrorKind::OddSetItems));
                    }
                    let dict = &mut self.dicts[target as usize];
                    dict.reserve((self.stack.len() - mark) / 2);
                    let mut it = self.stack.drain(mark..);
                    while let (Some(k), Some(v)) = (it.next(), it.next()) {
                        dict.push((k, v));
                    }
                }
                op::BINGET => {
                    let [i] = self.take_array::<1>("BINGET")?;
                    self.memo_get(u64::from(i), at)?;
                }
                op::LONG_BINGET => {
                    let i = u32::from_le_bytes(self.take_array::<4>("LONG_BINGET")?);
                    self.memo_get(u64::from(i), at)?;
                }
                op::BINPUT => {
                    let [i] = self.take_array::<1>("BINPUT")?;
                    self.memo_put(u64::from(i), at, "BINPUT")?;
                }
                op::LONG_BINPUT => {
                    let i = u32::from_le_bytes(self.take_array::<4>("LONG_BINPUT")?);
                    self.memo_put(u64::from(i), at, "LONG_BINPUT")?;
                }
                op::MEMOIZE => {
                    self.memo_put(self.memo_count, at, "MEMOIZE")?;
                }
                other => {
                    let kind = match unsupported_name(other) {
                        Some(name) => PickleErrorKind::Unsupported(name),
                        None => PickleErrorKind::UnknownOpcode(other),
                    };
                    return Err(self.err(at, kind));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse_ok(data: &[u8]) -> Pickle<'_> {
        parse(data, &mut |_| {}).expect("valid pickle")
    }

    fn parse_err(data: &[u8]) -> PickleError {
        parse(data, &mut |_| {}).expect_err("invalid pickle")
    }

    // Bytes below were produced by CPython 3.11 `pickle.dumps(obj, protocol=N)`.

    #[test]
    fn decodes_shared_dicts_through_the_memo() {
        // f = {'a': 1}; pickle.dumps([f, f], protocol=4)
        let data =
            b"\x80\x04\x95\x10\x00\x00\x00\x00\x00\x00\x00]\x94(}\x94\x8c\x01a\x94K\x01sh\x01e.";
        let p = parse_ok(data);
        let items = p.seq(p.root).unwrap();
        assert_eq!(items.len(), 2);
        assert_eq!(items[0], items[1], "the same dict handle twice");
        let d = p.dict(items[0]).unwrap();
        assert_eq!(p.get(d, "a"), Some(Value::Int(1)));
    }

    #[test]
    fn protocol_2_bytes_go_through_a_refused_global() {
        // pickle.dumps((None, True, -5, 300, 70000, 2**64, -(2**70), 1.5, 'hé', b'xy'), protocol=2)
        let data = b"\x80\x02(N\x88J\xfb\xff\xff\xffM,\x01Jp\x11\x01\x00\x8a\t\x00\x00\x00\x00\x00\x00\x00\x00\x01\x8a\t\x00\x00\x00\x00\x00\x00\x00\x00\xc0G?\xf8\x00\x00\x00\x00\x00\x00X\x03\x00\x00\x00h\xc3\xa9q\x00c_codecs\nencode\nq\x01X\x02\x00\x00\x00xyq\x02X\x06\x00\x00\x00latin1q\x03\x86q\x04Rq\x05tq\x06.";
        // Protocol 2 writes bytes through a GLOBAL (`_codecs.encode`), which is refused
        // with the opcode's name and offset.
        let e = parse_err(data);
        assert_eq!(e.kind, PickleErrorKind::Unsupported("GLOBAL"));
        assert_eq!(e.offset, 59);
    }

    #[test]
    fn decodes_scalars_protocol_4() {
        // pickle.dumps((None, True, -5, 300, 70000, 2**64, -(2**70), 1.5, 'hé', b'xy', 2**63), protocol=4)
        let data = b"\x80\x04\x95H\x00\x00\x00\x00\x00\x00\x00(N\x88J\xfb\xff\xff\xffM,\x01Jp\x11\x01\x00\x8a\t\x00\x00\x00\x00\x00\x00\x00\x00\x01\x8a\t\x00\x00\x00\x00\x00\x00\x00\x00\xc0G?\xf8\x00\x00\x00\x00\x00\x00\x8c\x03h\xc3\xa9\x94C\x02xy\x94\x8a\t\x00\x00\x00\x00\x00\x00\x00\x80\x00t\x94.";
        let p = parse_ok(data);
        let t = p.seq(p.root).unwrap();
        assert_eq!(t.len(), 11);
        assert_eq!(t[0], Value::None);
        assert_eq!(t[1], Value::Bool(true));
        assert_eq!(p.as_i64(t[2]), Some(-5));
        assert_eq!(p.as_u64(t[2]), None);
        assert_eq!(p.as_i64(t[3]), Some(300));
        assert_eq!(p.as_i64(t[4]), Some(70000));
        assert_eq!(p.as_u64(t[5]), None, "2**64 does not fit");
        assert_eq!(t[5].type_name(), "int");
        assert_eq!(p.as_i64(t[6]), None, "-(2**70) does not fit");
        assert_eq!(p.as_f64(t[7]), Some(1.5));
        assert_eq!(p.str(t[8]).unwrap().unwrap(), "hé");
        assert_eq!(t[9].type_name(), "bytes");
        assert_eq!(p.as_u64(t[10]), Some(1 << 63));
        assert_eq!(p.as_i64(t[10]), None);
    }

    #[test]
    fn reports_truncation_and_garbage_with_offsets() {
        let data =
            b"\x80\x04\x95\x10\x00\x00\x00\x00\x00\x00\x00]\x94(}\x94\x8c\x01a\x94K\x01sh\x01e.";
        for cut in 0..data.len() {
            let e = parse_err(&data[..cut]);
            assert!(e.offset <= cut, "{e} for cut {cut}");
        }
        let e = parse_err(b"\x80\x04\xff.");
        assert_eq!(e.kind, PickleErrorKind::UnknownOpcode(0xff));
        assert_eq!(e.offset, 2);
        let e = parse_err(b"\x80\x09N.");
        assert_eq!(e.kind, PickleErrorKind::Protocol(9));
        let e = parse_err(b"\x80\x04h\x05.");
        assert_eq!(e.kind, PickleErrorKind::BadMemo(5));
        let e = parse_err(b"\x80\x04NN.");
        assert_eq!(e.kind, PickleErrorKind::StackAtStop(2));
        let e = parse_err(b"\x80\x04Ne.");
        assert_eq!(e.kind, PickleErrorKind::NoMark("APPENDS"));
        let e = parse_err(b"\x80\x04N(Nu.");
        assert_eq!(
            e.kind,
            PickleErrorKind::WrongTarget {
                opcode: "SETITEMS",
                found: "None"
            }
        );
        let e = parse_err(b"\x80\x04cos\nsystem\n.");
        assert_eq!(e.kind, PickleErrorKind::Unsupported("GLOBAL"));
        let e = parse_err(b"\x80\x04r\xff\xff\xff\xff.");
        assert_eq!(e.kind, PickleErrorKind::StackUnderflow("LONG_BINPUT"));
        // A huge memo index is legal (and stored sparsely, not in a 2^32-entry vector).
        let p = parse_ok(b"\x80\x04Nr\xff\xff\xff\xff0j\xff\xff\xff\xff.");
        assert_eq!(p.root, Value::None);
    }

    #[test]
    fn big_lengths_are_checked_before_allocating() {
        // BINUNICODE8 claiming 2^63 bytes.
        let e = parse_err(b"\x80\x04\x8d\x00\x00\x00\x00\x00\x00\x00\x80");
        assert_eq!(e.kind, PickleErrorKind::Truncated("BINUNICODE8"));
    }
}
